import dataclasses
import json
from pathlib import Path
from typing import get_args

import pytest
import yaml

from tinylm.config import (
    GenerationConfig,
    ModelConfig,
    RunConfig,
    SampleConfig,
    TokenizerType,
    WordOOV,
    apply_updates,
    build_config,
    check_config,
    config_from_dict,
    diff_configs,
    parse_overrides,
    preset_names,
    read_config,
)
from tinylm.errors import TinyLMError
from tinylm.studies.study_config import load_study_config
from tinylm.studies.tinystories import ExperimentsConfig, load_experiment_config
from tinylm.tokenizers import TOKENIZER_TYPES
from tinylm.tokenizers.word import WordTokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_are_typed_and_nested(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  d_model: 64\ntrain:\n  lr: 0.01\n")
    cfg = build_config(
        path,
        [
            "model.n_layers=3",
            "train.max_minutes=1.5",
            "train.compile=true",
            'sample.prompts=["a", "b"]',
            "model.d_attn=none",
        ],
    )
    assert cfg.model.d_model == 64 and cfg.model.n_layers == 3
    assert cfg.train.lr == 0.01 and cfg.train.max_minutes == 1.5 and cfg.train.compile is True
    assert cfg.sample.prompts == ["a", "b"] and cfg.model.d_attn is None


def test_toml_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nd_model = 48\n")
    assert build_config(path).model.d_model == 48


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.d_modle=3", "unknown config key model.d_modle"),
        ("nosuch.key=1", "unknown config key nosuch"),
        ("model.d_model=big", "expects an integer"),
        ("train.compile=maybe", "expects true/false"),
        ("train.lr=fast", "expects a number"),
    ],
)
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


def test_the_token_budget_preset_is_the_hour_recipe_without_its_clock():
    hour, budget = build_config("tinystories-cpu-1h"), build_config("tinystories-cpu-25m")
    assert budget.train.max_tokens == 25_000_000 and budget.train.max_minutes is None
    assert budget.train.schedule_clock == "steps" and budget.out_dir == "runs/tinystories-cpu-25m"
    changed = {k for k in diff_configs(hour.to_dict(), budget.to_dict())}
    assert changed == {"out_dir", "train.max_tokens", "train.max_minutes", "train.schedule_clock"}


def test_the_reference_recipes_differ_from_the_hour_recipe_only_where_its_ablation_chose():
    r2, r3, current = (build_config(f"tinystories-cpu-1h{s}") for s in ("-r2", "-r3", ""))
    assert (r2.tokenizer.vocab_size, r2.model.value_embeddings, r2.model.n_layers) == (2048, "none", 6)
    assert set(diff_configs(r2.to_dict(), r3.to_dict())) == {
        "out_dir",
        "tokenizer.vocab_size",
        "model.value_embeddings",
    }
    assert set(diff_configs(r2.to_dict(), current.to_dict())) == {"out_dir", "tokenizer.vocab_size", "model.n_layers"}
    assert (current.tokenizer.vocab_size, current.model.n_layers) == (4096, 8)


def test_extends_merges_a_file_over_its_parent_and_refuses_itself(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text("extends: demo\nmodel:\n  d_model: 96\n")
    cfg, demo = build_config(child), build_config("demo")
    assert cfg.model.d_model == 96 and cfg.model.n_layers == demo.model.n_layers
    child.write_text("extends: child\n")
    with pytest.raises(TinyLMError, match="extends must name another preset or file"):
        build_config(child)


def test_diff_configs_names_keys():
    assert diff_configs({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == ["a.c"]


def test_closed_choices_and_ranges_name_the_key_the_value_and_the_allowed_ones():
    with pytest.raises(TinyLMError, match=r"^train\.schedule='cosin' is not one of cosine, linear, constant$"):
        build_config("demo", ["train.schedule=cosin"])
    with pytest.raises(TinyLMError, match=r"^model\.dropout must be in \[0, 1\) \(got 1\.0\)$"):
        build_config(None, ["model.dropout=1"])
    with pytest.raises(TinyLMError, match=r"^sample\.top_p must be in \(0, 1\] \(got 0\.0\)$"):
        build_config(None, ["sample.top_p=0"])
    with pytest.raises(TinyLMError, match=r"^data\.valid_fraction and data\.test_fraction .* sum to less than 1"):
        build_config(None, ["data.valid_fraction=0.6", "data.test_fraction=0.4"])


def test_a_config_built_in_code_is_checked_like_a_loaded_one():
    cfg = RunConfig()
    cfg.train.optimizer = "sgd"
    with pytest.raises(TinyLMError, match="train.optimizer='sgd' is not one of adamw, muon"):
        check_config(cfg)
    cfg = RunConfig()
    cfg.sample.min_new_tokens = 500
    with pytest.raises(TinyLMError, match=r"^sample\.min_new_tokens must be between 0 and max_new_tokens"):
        check_config(cfg)


def test_saved_configs_load_back_and_old_sample_sections_still_load():
    cfg = build_config("demo", ['sample.stop_strings=["THE END"]', "sample.stop_ids=[3]"])
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again == cfg and again.sample.stop_strings == ("THE END",) and again.sample.stop_ids == (3,)
    old = config_from_dict(
        {
            "sample": {
                "prompts": ["Once"],
                "max_new_tokens": 20,
                "temperature": 0.7,
                "top_k": 40,
                "top_p": None,
                "seed": 5,
            }
        }
    )
    gen = old.sample.generation(stop_ids=(3,))
    assert isinstance(gen, GenerationConfig) and not isinstance(gen, SampleConfig)
    assert (gen.max_new_tokens, gen.temperature, gen.top_k, gen.seed, gen.stop_ids) == (20, 0.7, 40, 5, (3,))


def test_every_run_config_default_passes_its_own_checks():
    check_config(RunConfig())
    for name in preset_names():
        raw = read_config(name)
        if "experiments" in raw or not set(raw) <= {f.name for f in dataclasses.fields(RunConfig)}:
            continue  # a study's preset: its own loader checks it
        check_config(build_config(name))


def test_every_preset_loads_with_its_own_loader():
    for name in preset_names():
        raw = read_config(name)
        if "experiments" in raw:
            load_experiment_config(name)
        elif set(raw) <= {f.name for f in dataclasses.fields(RunConfig)}:
            build_config(name)
        else:
            load_study_config(name)


def test_the_run_configs_committed_in_docs_load():
    configs = sorted((ROOT / "docs" / "results").rglob("config*.yaml"))
    assert configs, "docs/results holds the assignment's run config"
    for path in configs:
        config_from_dict(yaml.safe_load(path.read_text(encoding="utf-8")))
    for path in sorted((ROOT / "docs" / "results").rglob("experiments.json")):
        exp = ExperimentsConfig()
        apply_updates(exp, json.loads(path.read_text(encoding="utf-8"))["experiments"], prefix="experiments.")
        check_config(exp, "experiments.")


def test_each_closed_choice_is_declared_once_in_the_schema():
    assert set(get_args(TokenizerType)) == set(TOKENIZER_TYPES)
    with pytest.raises(TinyLMError, match=f"word oov 'drop' is not one of {', '.join(get_args(WordOOV))}$"):
        WordTokenizer(oov="drop")
