"""The experiment runner end to end on a tiny corpus the test writes: every part's file, the
report, the cache (a re-run skips finished parts), and the config handling."""

from __future__ import annotations

import csv
import dataclasses
import json

import numpy as np
import pytest
from conftest import make_stories

from tinylm.cli import main
from tinylm.errors import TinyLMError
from tinylm.studies.tinystories import PARTS, column_config, head_patterns, load_experiment_config
from tinylm.studies.tradeoffs import accumulation_variants, first_stories

CONFIG = """
out_dir: runs/should-be-overridden
data: {source: tinystories, train: MISSING.txt, valid: MISSING.txt, batching: stories}
tokenizer: {type: word, vocab_size: 300, lowercase: true}
model: {context_length: 32, n_layers: 2, n_heads: 2, d_model: 32, d_ff: 64, tie_weights: false}
train: {batch_size: 8, max_steps: 500, eval_interval: 10, eval_batches: 2, warmup_steps: 2, lr: 3.0e-3, threads: 1,
        progress: false}
sample: {prompts: ["Once upon a time", "The dog"], max_new_tokens: 12}
experiments:
  bleu_samples: 6
  prompt_tokens: 5
  max_continuation: 10
  bleu_selection: first       # the too-short first story is always among them
  temperatures: [0.7, 1.2]
  beam_widths: [2]
  decoding_prompts: ["Once, there was a boy named Tim.", "The dog"]
  kv_new_tokens: [12, 40]     # 5 + 40 tokens: past the context of 32
  kv_prompt_tokens: 4
  kv_repeats: 1
  kv_batch: 3
  generation_table_stories: 2
  embedding_micro_batches: 4
  accum_steps: [1, 2]
  accum_micro_batch: 4
  tradeoff_stories: 16
  tradeoff_micro_batches: 2
  attention_texts:
    - "Tom had a red ball."
    - "the dog ran fast and the cat ran fast and the dog ran fast and the cat ran fast and the dog ran fast and the
      cat ran fast and the dog ran fast and the cat ran fast"
  sample_temperatures: [0.7, 1.0]
quick:
  train: {max_steps: 20}
"""


@pytest.fixture
def corpus(tmp_path):
    stories = make_stories(80)
    train, valid = tmp_path / "train.txt", tmp_path / "valid.txt"
    train.write_text("".join(f"{s}\n<|endoftext|>\n" for s in stories[:70]), encoding="utf-8")
    valid.write_text("".join(f"{s}\n<|endoftext|>\n" for s in ["The end.", *stories[70:]]), encoding="utf-8")
    config = tmp_path / "exp.yaml"
    config.write_text(CONFIG)
    return config, [f"data.train={train}", f"data.valid={valid}"]


def test_config_quick_section_and_overrides(corpus):
    config, data = corpus
    cfg, exp = load_experiment_config(config, [*data, "experiments.bleu_samples=3"], quick=True)
    assert cfg.train.max_steps == 20 and cfg.data.train.endswith("train.txt")
    assert exp.bleu_samples == 3 and exp.temperatures == [0.7, 1.2]
    assert load_experiment_config(config, data)[0].train.max_steps == 500
    with pytest.raises(TinyLMError, match="unknown config key experiments.bleu_sample"):
        load_experiment_config(config, ["experiments.bleu_sample=3"])
    with pytest.raises(TinyLMError, match=r"accum_steps \[3\] are not multiples of the smallest, 2"):
        load_experiment_config(config, ["experiments.accum_steps=[2,3,4]"])
    with pytest.raises(TinyLMError, match="experiments.bleu_selection='last' is not one of random, first"):
        load_experiment_config(config, ["experiments.bleu_selection=last"])
    with pytest.raises(TinyLMError, match=r"experiments.accum_steps must be >= 1 \(got 0\)"):
        load_experiment_config(config, ["experiments.accum_steps=[0]"])


def test_the_decoding_section(corpus, tmp_path):
    config, data = corpus
    exp = load_experiment_config(config, [*data, "experiments.decoding.temperature=0.5"])[1]
    assert (exp.decoding.temperature, exp.decoding.top_k) == (0.5, 50)
    section = tmp_path / "section.yaml"
    section.write_text("experiments: {decoding: {temperature: 0.85, top_k: 40}, bleu_samples: 7}\n")
    exp = load_experiment_config(section, [*data, "experiments.decoding.top_k=null"])[1]
    assert (exp.decoding.temperature, exp.decoding.top_k, exp.bleu_samples) == (0.85, None, 7)
    with pytest.raises(TinyLMError, match="experiments.decoding.top_k must be >= 1"):
        load_experiment_config(config, [*data, "experiments.decoding.top_k=0"])


@pytest.mark.slow
def test_runner_writes_every_part_and_resumes_from_cache(corpus, tmp_path, capsys):
    config, data = corpus
    run = tmp_path / "run"
    assert main(["experiments", "--config", str(config), "--quick", "--out", str(run), *data]) == 0
    manifest = json.loads((run / "experiments.json").read_text())
    assert set(manifest["parts"]) == set(PARTS)
    assert all(not s.startswith("failed") for s in manifest["parts"].values()), manifest["parts"]

    # BLEU: one sample was too short for the 5-token prompt; its CSVs have the protocol's columns
    bleu = json.loads((run / "bleu.json").read_text())
    assert bleu["samples"] == 6 and bleu["skipped_too_short"] == 1
    rows = list(csv.DictReader(open(run / "bleu_samples_T0.7.csv", encoding="utf-8")))
    assert list(rows[0]) == [
        "prompt",
        "reference_continuation",
        "hypothesis_continuation",
        "per_sample_ppl",
        "sentence_bleu4",
    ]
    assert len(rows) == 6 and all(float(r["per_sample_ppl"]) > 1 for r in rows)
    assert [s["name"] for s in bleu["settings"]] == ["T0.7", "T1.2"]

    dec = json.loads((run / "decoding.json").read_text())
    beam, blocked = dec["settings"][-2:]
    assert (beam["name"], blocked["name"]) == ("beam2", "beam2_no_repeat3") and "bleu4" in beam
    # the per-sample CSVs lie beside decoding.json; the examples are their first rows, every setting side by side
    names = [s["name"] for s in dec["settings"]]
    assert (
        all((run / f"decoding_samples_{n}.csv").is_file() for n in names)
        and beam["csv"] == "decoding_samples_beam2.csv"
    )
    beam_rows = list(csv.DictReader(open(run / "decoding_samples_beam2.csv", encoding="utf-8")))
    # the examples: the first row of each distinct prompt (the 6 samples open 4 ways), every setting side by side
    first_of = {}
    for i, r in enumerate(beam_rows):
        first_of.setdefault(r["prompt"], i)
    assert len(first_of) == 4 and [e["prompt"] for e in dec["examples"]] == list(first_of)
    assert set(names) <= set(dec["examples"][0])
    assert [e["prompt"] for e in dec["prompt_examples"]] == ["Once, there was a boy named Tim.", "The dog"]
    assert all(isinstance(e[n], str) for e in dec["prompt_examples"] for n in names)
    for row in csv.DictReader(open(run / "decoding_samples_beam2_no_repeat3.csv", encoding="utf-8")):
        words = row["hypothesis_continuation"].split()
        trigrams = list(zip(words, words[1:], words[2:]))
        assert len(trigrams) == len(set(trigrams)), words  # the blocked beam repeats no 3-gram
    assert [e["beam2"]["text"] for e in dec["examples"]] == [
        beam_rows[i]["hypothesis_continuation"] for i in first_of.values()
    ]
    kv_rows = json.loads((run / "kv_cache.json").read_text())["rows"]
    assert [(r["decoding"], r["total_tokens"], r["beyond_context"]) for r in kv_rows] == [
        ("greedy", 17, False),
        ("greedy", 45, True),
        ("top-k 50, T=0.8", 17, False),
        ("top-k 50, T=0.8", 45, True),
    ]
    assert kv_rows[1]["cache_slots"] == 32  # the cache never outgrows the context: the window slides
    kv = kv_rows[0]
    assert kv["new_tokens"] == 12 and kv["same_tokens"] and kv["prompt_tokens"] == 4 + 1  # kv_prompt_tokens + <sos>
    # rates are the batch's 3 x 12 new tokens over the logged times (one repeat), the speed-up their ratio
    assert kv["batch"] == 3 and kv["cache_tokens_per_s"] == pytest.approx(36 / kv["cache_seconds"][0])
    assert kv["nocache_tokens_per_s"] == pytest.approx(36 / kv["nocache_seconds"][0])
    assert kv["speedup"] == pytest.approx(kv["cache_tokens_per_s"] / kv["nocache_tokens_per_s"])
    # keys + values: 2 x layers x batch x heads x slots x head width x 4 bytes
    assert kv["cache_bytes"] == 2 * 2 * 3 * 2 * (5 + 12) * 16 * 4
    gens = json.loads((run / "generations.json").read_text())["table"]
    assert len(gens["rows"]) == 2 and gens["temperatures"] == ["T=0.7", "T=1"]
    assert all(r["ground_truth"] and "T=0.7" in r for r in gens["rows"])
    emb = json.loads((run / "embedding_init.json").read_text())
    assert [r["name"] for r in emb["rows"]] == ["fasttext_frozen", "fasttext_finetuned", "random_init"]
    assert emb["rows"][0]["coverage"] > 0.9 and emb["rows"][2]["coverage"] is None
    ck = json.loads((run / "checkpointing.json").read_text())["rows"]
    assert [r["checkpoint_impl"] for r in ck] == [None, "tinylm", "torch"]
    assert ck[1]["final_train_loss"] == pytest.approx(ck[0]["final_train_loss"], rel=1e-5)
    tk = json.loads((run / "tokenizers.json").read_text())["rows"]
    assert [r["oov"] for r in tk] == ["unk", "bpe"] and tk[1]["unk_rate"] < tk[0]["unk_rate"]
    assert tk[1]["stories_restored"] == 1.0 and tk[0]["vocab_size"] < tk[1]["vocab_size"]
    for png in ("accumulation.png", "checkpointing.png", "decoding.png", "embedding_init.png"):
        assert (run / png).stat().st_size > 10_000, png
    # 16 stories in micro-batches of 4: k=1 makes 4 updates an epoch, k=2 makes 2 at equal tokens; at
    # equal updates k=1 makes k=2's 2 updates on half an epoch; every whole epoch's time is measured
    acc = json.loads((run / "accumulation.json").read_text())
    assert acc["train_stories"] == 16 and acc["all_train_stories"] == 70
    assert [
        (r["comparison"], r["accum_steps"], r["epochs"], r["optimizer_steps"], r["micro_batches"]) for r in acc["rows"]
    ] == [("equal tokens", 1, 1, 4, 4), ("both", 2, 1, 2, 4), ("equal updates", 1, 0.5, 2, 2)]
    whole = acc["rows"][:2]
    assert all(len(r["epoch_seconds_each"]) == r["epochs"] and r["epoch_seconds"] > 0 for r in whole)
    assert acc["start"]["from"].startswith("checkpoints/") and acc["start"]["val_loss"] > 0
    att = json.loads((run / "attention.json").read_text())["texts"]
    assert att[0]["max_row_sum_error"] < 1e-5 and att[0]["max_weight_above_diagonal"] == 0.0
    assert (run / att[0]["html"]).is_file() and all((run / p).is_file() for p in att[0]["pngs"])
    assert "longer than the model's context" in att[1]["missing"]  # the too-long sentence is reported
    assert (run / "curves.png").is_file()

    md = (run / "report.md").read_text()
    assert "| equal updates | 1 | 4 | 0.5 | 2 |" in md and "sliding window" in md and "sentence BLEU-4" in md
    assert "| prompt | real continuation | sample_T0.8_k50 | greedy | beam2 | beam2_no_repeat3 |" in md
    assert "| prompt | sample_T0.8_k50 | greedy | beam2 | beam2_no_repeat3 |" in md  # the reports' own prompts
    for heading in (
        "## Configuration",
        "## Training",
        "## BLEU and perplexity",
        "## Example generations",
        "## Decoding comparison",
        "## KV cache",
        "## Gradient accumulation",
        "## Gradient checkpointing",
        "## Token embeddings: FastText vs random initialisation",
        "| prompt | ground truth |",
        "## Out-of-vocabulary words: <unk> or BPE pieces",
        "## Beside the reports",
        "## Attention maps",
        "## Machine",
    ):
        assert heading in md, heading
    assert f"{bleu['settings'][0]['bleu4']:.4f}" in md  # the report's numbers are the files' numbers
    assert "INCOMPLETE REPORT" in md and "attention map for" in md  # the too-long text is a missing part
    assert (run / "report.html").read_text().count("data:image/png;base64,") >= 3

    # a second run finds every part cached
    capsys.readouterr()
    assert main(["experiments", "--config", str(config), "--quick", "--out", str(run), *data]) == 0
    again = json.loads((run / "experiments.json").read_text())["parts"]
    assert set(again.values()) == {"cached"}
    # a changed protocol setting re-runs the parts that depend on it, not the baseline
    assert (
        main(
            [
                "experiments",
                "--config",
                str(config),
                "--quick",
                "--out",
                str(run),
                *data,
                "experiments.bleu_samples=4",
                "--only",
                "bleu",
            ]
        )
        == 0
    )
    again = json.loads((run / "experiments.json").read_text())["parts"]
    assert again["baseline"] == "cached" and again["bleu"] == "done" and again["kv_cache"] == "stale"
    assert json.loads((run / "bleu.json").read_text())["samples"] == 4


def test_accumulation_variants_pair_equal_tokens_with_equal_updates():
    variants = accumulation_variants([1, 2, 4, 8], epochs=1)
    assert [(v.name, v.accum, v.epochs, v.comparison, v.updates_of) for v in variants] == [
        ("tokens_k1", 1, 1, "equal tokens", None),
        ("tokens_k2", 2, 1, "equal tokens", None),
        ("tokens_k4", 4, 1, "equal tokens", None),
        ("tokens_k8", 8, 1, "both", None),
        ("updates_k1", 1, 1, "equal updates", 8),
        ("updates_k2", 2, 1, "equal updates", 8),
        ("updates_k4", 4, 1, "equal updates", 8),
    ]


def test_equal_updates_runs_make_the_largest_accumulations_updates_on_k_over_its_share_of_tokens(tmp_path):
    import numpy as np

    from tinylm.config import RunConfig
    from tinylm.data.prepare import PreparedData
    from tinylm.data.tokens import TokenSplit
    from tinylm.studies.tradeoffs import Tradeoffs, _tradeoff_config

    split = TokenSplit("train", np.arange(64 * 33 + 1) % 50, np.array([0, 64 * 33 + 1]), n_bytes=9, n_words=9)
    prepared = PreparedData(tokenizer=None, tokenizer_path=tmp_path, splits={"train": split, "valid": split}, report={})
    cfg = RunConfig()
    cfg.data.batching, cfg.model.context_length, cfg.train.batch_size = "packed", 64, 2  # 33 windows an epoch
    tradeoffs = Tradeoffs(
        cfg, prepared, tmp_path, micro_batches=8, repeats=1, threads=1, init_from="ckpt", lr_scale=0.5
    )
    configs = {v.name: _tradeoff_config(tradeoffs, v) for v in accumulation_variants([1, 2, 4, 8], epochs=2)}
    # equal tokens: 2 epochs of 16 micro-batches (the 33rd window is dropped), k times fewer updates
    assert [configs[f"tokens_k{k}"].train.max_steps for k in (1, 2, 4, 8)] == [32, 16, 8, 4]
    assert [configs[f"tokens_k{k}"].train.epochs for k in (1, 2, 4, 8)] == [2, 2, 2, 2]
    # equal updates: k=8's 4 updates each, not whole epochs (k / 8 of the tokens)
    assert [configs[f"updates_k{k}"].train.max_steps for k in (1, 2, 4)] == [4, 4, 4]
    assert all(configs[f"updates_k{k}"].train.epochs is None for k in (1, 2, 4))
    continued = configs["tokens_k1"].train
    assert continued.init_from == "ckpt" and continued.warmup_steps == 3 and continued.ema_decay == 0
    assert (continued.lr, continued.min_lr, continued.muon_lr) == (
        cfg.train.lr / 2,
        cfg.train.min_lr / 2,
        cfg.train.muon_lr / 2,
    )


def test_first_stories_keeps_whole_stories_and_their_share_of_bytes(tmp_path):
    import numpy as np

    from tinylm.data.prepare import PreparedData
    from tinylm.data.tokens import TokenSplit

    split = TokenSplit("train", np.arange(10, dtype=np.uint16), np.array([0, 3, 7, 10]), n_bytes=100, n_words=20)
    prepared = PreparedData(tokenizer=None, tokenizer_path=tmp_path, splits={"train": split, "valid": split}, report={})
    head = first_stories(prepared, 2).splits["train"]
    assert head.n_docs == 2 and head.ids.tolist() == list(range(7)) and (head.n_bytes, head.n_words) == (70, 14)
    assert first_stories(prepared, 2).splits["valid"] is split and first_stories(prepared, 3) is prepared


def test_tradeoff_runs_warm_up_like_the_run_but_at_most_half_their_steps(corpus, tmp_path):
    from tinylm.studies.tradeoffs import Tradeoffs, Variant, _tradeoff_config

    config, data = corpus
    cfg = load_experiment_config(config, [*data, "train.warmup_steps=100"])[0]
    short = _tradeoff_config(Tradeoffs(cfg, None, tmp_path, 40, 1, 1), Variant("x", accum=2))
    assert (short.train.max_steps, short.train.warmup_steps, short.train.grad_accum_steps) == (20, 10, 2)
    cfg.train.warmup_steps = 3
    assert _tradeoff_config(Tradeoffs(cfg, None, tmp_path, 40, 1, 1), Variant("x")).train.warmup_steps == 3


def test_missing_data_file_is_a_clear_error(corpus, tmp_path, capsys):
    config, _ = corpus
    assert (
        main(
            [
                "experiments",
                "--config",
                str(config),
                "--quick",
                "--out",
                str(tmp_path / "r"),
                f"data.train={tmp_path / 'nope.txt'}",
                f"data.valid={tmp_path / 'nope.txt'}",
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err


def test_the_shipped_assignment_config_loads():
    path = "tinystories-assignment"
    cfg, exp = load_experiment_config(path, ["data.train=a.txt", "data.valid=b.txt"])
    assert (cfg.model.n_layers, cfg.model.n_heads, cfg.model.d_model, cfg.model.context_length) == (3, 8, 300, 224)
    assert (cfg.train.epochs, cfg.train.batch_size, exp.accum_micro_batch, exp.tradeoff_stories) == (2, 32, 4, 2000)
    assert 9 + max(exp.kv_new_tokens) == 512 and len(exp.attention_texts) == 5  # <sos> + 8 prompt tokens
    assert cfg.model.d_attn == 304 and cfg.tokenizer.type == "word" and cfg.data.train == "a.txt"
    assert (exp.bleu_samples, exp.prompt_tokens, exp.temperatures, exp.beam_widths) == (50, 5, [0.7, 1.0, 1.2], [5, 10])
    assert exp.accum_steps == [1, 2, 4, 8] and exp.smoothing == "method1"
    assert (exp.decoding.temperature, exp.decoding.top_k) == (0.8, 50)
    column = column_config(cfg, exp)  # the same data and tokenizer; 300-d FastText rows projected to d_model
    assert column.tokenizer == cfg.tokenizer and column.embeddings == cfg.embeddings and column.model.d_embed == 300
    assert column.data.batching == "packed" and column.train.document_attention and column.train.optimizer == "muon"
    assert (column.train.max_minutes, column.train.schedule_clock, column.train.epochs) == (60, "wall", None)
    quick_cfg, quick_exp = load_experiment_config(path, [], quick=True)
    assert quick_cfg.model.d_model < cfg.model.d_model and quick_cfg.train.max_minutes <= 2
    assert quick_exp.bleu_samples == 50 and quick_exp.tradeoff_micro_batches % 8 == 0
    quick_column = column_config(quick_cfg, quick_exp)
    assert quick_column.model.d_embed == quick_cfg.model.d_model and quick_column.train.max_minutes <= 2


COLUMN = [  # the second column from the command line, key by key over the file's (empty) section
    "experiments.tinylm_settings.data.batching=packed",
    "experiments.tinylm_settings.model.positions=rope",
    "experiments.tinylm_settings.model.norm=rmsnorm",
    "experiments.tinylm_settings.model.qk_norm=true",
    "experiments.tinylm_settings.train.optimizer=muon",
    "experiments.tinylm_settings.train.ema_decay=0.9",
    "experiments.tinylm_settings.train.document_attention=true",
    "experiments.tinylm_settings.train.max_steps=12",
]


@pytest.mark.slow
def test_the_tinylm_settings_column_is_trained_on_the_same_tokens_and_judged_by_the_quality_parts(corpus, tmp_path):
    config, data = corpus
    run = tmp_path / "run"
    args = ["experiments", "--config", str(config), "--quick", "--out", str(run), *data, *COLUMN]
    assert main([*args, "--only", "bleu"]) == 0
    parts = json.loads((run / "experiments.json").read_text())["parts"]
    # BLEU judges the column's model: the report-settings baseline is not needed, so not trained
    assert (parts["baseline"], parts["tinylm_settings"], parts["bleu"]) == ("not requested", "done", "done")
    column = run / "tinylm-settings"
    assert json.loads((column / "tokenizer.json").read_text()) and not (run / "checkpoints").exists()
    assert (column / "checkpoints" / "ema").is_dir()  # the weight average is the column's result
    summary = json.loads((run / "tinylm_settings.json").read_text())["summary"]
    assert summary["checkpoint"] == "checkpoints/ema" and summary["steps"] == 12

    assert main([*args, "--only", "curves"]) == 0  # the baseline's part: now it trains
    parts = json.loads((run / "experiments.json").read_text())["parts"]
    assert (parts["baseline"], parts["tinylm_settings"], parts["bleu"]) == ("done", "done", "done")  # bleu still fresh
    assert (run / "tokenizer.json").read_text() == (column / "tokenizer.json").read_text()  # the same vocabulary
    md = (run / "report.md").read_text()
    assert "## Report settings and tinylm settings" in md
    ppl = [json.loads((d / "eval.json").read_text())["eval"]["valid"]["token_ppl"] for d in (run, column)]
    assert f"| valid perplexity per word token | {ppl[0]:.2f} | {ppl[1]:.2f} |" in md
    assert "| architecture | learned positions, layernorm, gelu | rope positions, rmsnorm, gelu, QK-norm |" in md
    assert "|  | tinylm, report settings | tinylm settings |" in md  # both columns beside the reports
    assert "judged the tinylm-settings model (tinylm-settings/): bleu; the report-settings model: none" in md


def test_the_column_may_not_change_the_tokens_and_is_checked_whole_at_load(corpus):
    config, data = corpus
    with pytest.raises(TinyLMError, match="data.batching only"):
        load_experiment_config(config, [*data, "experiments.tinylm_settings.tokenizer.vocab_size=50"])
    with pytest.raises(TinyLMError, match="data.batching only"):
        load_experiment_config(config, [*data, "experiments.tinylm_settings.data.lowercase=true"])
    with pytest.raises(TinyLMError, match=r"experiments.tinylm_settings: unknown config key model.n_layerz"):
        load_experiment_config(config, [*data, "experiments.tinylm_settings.model.n_layerz=2"])
    with pytest.raises(TinyLMError, match=r"experiments.tinylm_settings: .*train.lr"):
        load_experiment_config(config, [*data, "experiments.tinylm_settings.train.lr=-1"])


def test_head_patterns_name_the_head_that_follows_each_pattern_most():
    T = 6
    previous, own = np.eye(T, k=-1), np.eye(T)
    previous[0, 0] = 1
    first = np.zeros((T, T))
    first[:, 0] = 1
    found = head_patterns([np.stack([own, previous]), np.stack([first, (previous + own) / 2])])
    assert [(h["pattern"], h["layer"], h["head"], h["weight"]) for h in found] == [
        ("the previous token", 0, 1, 1.0),
        ("the first token (<sos>)", 1, 0, 1.0),
        ("its own token", 0, 0, 1.0),
    ]
    assert head_patterns([own[None, :2, :2]]) == []  # too short for the first, previous and own tokens to differ


@pytest.mark.slow
def test_a_whole_run_with_the_column_trains_the_baseline_first_and_judges_the_column(corpus, tmp_path):
    config, data = corpus
    run = tmp_path / "run"
    assert main(["experiments", "--config", str(config), "--quick", "--out", str(run), *data, *COLUMN]) == 0
    parts = json.loads((run / "experiments.json").read_text())["parts"]
    assert all(status == "done" for status in parts.values()), parts
    for name in ("bleu", "decoding", "generations", "kv_cache", "attention"):
        assert json.loads((run / f"{name}.json").read_text())["judged"] == "tinylm-settings", name
    # the trade-off runs continue from the column's model; the embedding comparison trains its own
    for name in ("accumulation", "checkpointing"):
        part = json.loads((run / f"{name}.json").read_text())
        assert part["judged"] == "tinylm-settings" and part["start"]["from"].startswith("tinylm-settings/checkpoints/")
    column_params = json.loads((run / "tinylm_settings.json").read_text())["parameters_total"]
    assert "judged" not in json.loads((run / "embedding_init.json").read_text())
    assert json.loads((run / "checkpointing.json").read_text())["rows"][0]["peak_activation_bytes"] > 0
    assert column_params > 0
    baseline = json.loads((run / "baseline.json").read_text())
    assert baseline["parameters_total"] == json.loads((run / "eval.json").read_text())["parameters"]


def test_a_trade_off_option_changes_only_the_keys_of_the_parts_that_read_it(corpus, tmp_path):
    from tinylm.studies.tinystories import OPTION_READERS, ExperimentsConfig, Study, part_key

    config, data = corpus
    keys = []
    for option in ([], ["experiments.accum_micro_batch=2"]):
        cfg, exp = load_experiment_config(config, [*data, *option], quick=True)
        study = Study(cfg, exp, tmp_path, quick=True)
        keys.append({name: part_key(study, name, {}) for name in PARTS})
    changed = {name for name in PARTS if keys[0][name] != keys[1][name]}
    assert changed == {"accumulation"}
    fields = {f.name for f in dataclasses.fields(ExperimentsConfig)}
    assert set(OPTION_READERS) <= fields and all(set(r) <= set(PARTS) for r in OPTION_READERS.values())


def test_a_part_that_reuses_finished_runs_trains_each_settings_once(tmp_path, monkeypatch):
    import types

    import numpy as np

    from tinylm.config import RunConfig
    from tinylm.data.prepare import PreparedData
    from tinylm.data.tokens import TokenSplit
    from tinylm.studies import tradeoffs as tradeoffs_module
    from tinylm.studies.tradeoffs import Tradeoffs, Variant, _tradeoff_run

    trained = []

    def fake_train(cfg, prepared, out):
        trained.append(cfg.train.max_steps)
        (out / "metrics.csv").write_text(
            "step,tokens,lr,train_loss,val_loss,val_ppl,tokens_per_s,elapsed_s\n"
            f"{cfg.train.max_steps},128,0.001,2.5,2.6,13.5,100.0,7.5\n"
        )
        return types.SimpleNamespace(steps=cfg.train.max_steps, final_train_loss=2.5, best_val_loss=2.6, seconds=8.0)

    monkeypatch.setattr(tradeoffs_module, "train", fake_train)
    split = TokenSplit("train", np.arange(64 * 9 + 1) % 50, np.array([0, 64 * 9 + 1]), n_bytes=9, n_words=9)
    prepared = PreparedData(tokenizer=None, tokenizer_path=tmp_path, splits={"train": split, "valid": split}, report={})
    cfg = RunConfig()
    cfg.data.batching, cfg.model.context_length, cfg.train.batch_size = "packed", 64, 2

    def run(micro_batches, reuse):
        t = Tradeoffs(cfg, prepared, tmp_path, micro_batches, repeats=1, threads=1, reuse_finished=reuse)
        return _tradeoff_run(t, Variant("frozen"), "frozen_0")

    first = run(4, reuse=True)
    assert run(4, reuse=True) == first and trained == [4]  # the same settings: the saved row
    assert run(6, reuse=True)["optimizer_steps"] == 6 and trained == [4, 6]  # other settings: trained again
    run(6, reuse=False)
    assert trained == [4, 6, 6]  # a part that does not reuse runs always trains
    assert first["seconds"] == 7.5 and first["final_val_loss"] == 2.6
