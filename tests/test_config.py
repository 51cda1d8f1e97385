import pytest

from tinylm.config import ModelConfig, build_config, diff_configs, parse_overrides
from tinylm.errors import TinyLMError


def test_overrides_are_typed_and_nested(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  d_model: 64\ntrain:\n  lr: 0.01\n")
    cfg = build_config(path, ["model.n_layers=3", "train.max_minutes=1.5", "train.compile=true",
                              "sample.prompts=[\"a\", \"b\"]", "model.d_attn=none"])
    assert cfg.model.d_model == 64 and cfg.model.n_layers == 3
    assert cfg.train.lr == 0.01 and cfg.train.max_minutes == 1.5 and cfg.train.compile is True
    assert cfg.sample.prompts == ["a", "b"] and cfg.model.d_attn is None


def test_toml_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nd_model = 48\n")
    assert build_config(path).model.d_model == 48


@pytest.mark.parametrize("override, message", [
    ("model.d_modle=3", "unknown config key model.d_modle"),
    ("nosuch.key=1", "unknown config key nosuch"),
    ("model.d_model=big", "expects an integer"),
    ("train.compile=maybe", "expects true/false"),
    ("train.lr=fast", "expects a number"),
])
def test_bad_keys_and_types_are_named(override, message):
    with pytest.raises(TinyLMError, match=message):
        build_config(None, [override])


def test_override_syntax():
    with pytest.raises(TinyLMError, match="section.key=value"):
        parse_overrides(["model.d_model"])


def test_heads_must_divide_attention_width():
    with pytest.raises(TinyLMError, match="does not divide the attention width 300.*d_attn.*304"):
        ModelConfig(vocab_size=10, d_model=300, n_heads=8).resolved()
    cfg = ModelConfig(vocab_size=10, d_model=300, n_heads=8, d_attn=304).resolved()
    assert cfg.d_attn == 304 and cfg.d_ff == 1200 and cfg.n_kv_heads == 8


def test_seed_baseline_preset_loads():
    cfg = build_config("tinystories")
    m = cfg.model
    assert (m.context_length, m.n_layers, m.n_heads, m.d_model, m.d_attn) == (64, 3, 8, 300, 304)
    m.vocab_size = 100
    m.resolved()


def test_diff_configs_names_keys():
    assert diff_configs({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == ["a.c"]
