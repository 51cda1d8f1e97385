"""The study end to end on a tiny corpus the test writes itself (a few seconds), resuming by stage,
its refusal of a split shorter than one context window, the report preset's quick mode on
Shakespeare (every stage, under 90 s), the study config's sections and
the `tinylm study` command line."""

from __future__ import annotations

import copy
import csv
import json
import math
import random
import time

import pytest
import yaml

from tinylm.cli import build_parser, main
from tinylm.config import parse_overrides
from tinylm.errors import TinyLMError
from tinylm.studies.shakespeare import run_study
from tinylm.studies.study_config import StudyConfig, load_study_config, study_config

LINES = [
    "ROMEO. But soft, what light through yonder window breaks?",
    "JULIET. O Romeo, Romeo, wherefore art thou Romeo?",
    "HAMLET. To be, or not to be, that is the question.",
    "KING. Once more unto the breach, dear friends, once more.",
    "PUCK. If we shadows have offended, think but this, and all is mended.",
    "LEAR. Nothing will come of nothing.",
]


@pytest.fixture
def corpus(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "plays.jsonl"
    docs = [
        "\n\n".join(" ".join(rng.choice(LINES) for _ in range(3)) for _ in range(8)) + f"\n\nEnd of play {i}."
        for i in range(30)
    ]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def tiny_config(out_dir, corpus, *overrides: str) -> StudyConfig:
    base = {
        "out_dir": str(out_dir),
        "data": {"source": "text", "train": str(corpus), "valid_fraction": 0.15, "test_fraction": 0.15},
        "tokenizers": {"bpe_merges": [40], "word_vocab": 40},
        "ngram": {"orders": [1, 2]},
        "bigram": {"d_embeds": [8], "weight_decays": [0.0, 0.1], "max_steps": 40, "max_seconds": 5.0},
        "gpt": {
            "context_length": 16,
            "sizes": ["t=1x16x2"],
            "dropout": 0.0,
            "batch_size": 4,
            "max_steps": 4,
            "minutes": 0.5,
            "eval_interval": 2,
            "eval_batches": 1,
        },
        "sampling": {"prompts": ["ROMEO."], "max_new_tokens": 5},
    }
    return study_config(base, parse_overrides(list(overrides)))


@pytest.mark.slow
def test_study_writes_one_table_for_every_model_and_tokenizer(tmp_path, corpus):
    cfg = tiny_config(tmp_path / "study", corpus, 'gpt.run_overrides=["model.norm=rmsnorm"]')
    run_study(cfg)
    out = tmp_path / "study"
    rows = list(csv.DictReader(open(out / "results.csv")))
    per_tokenizer = len(cfg.ngram.orders) * len(cfg.ngram.smoothings) + 2  # n-grams + neural bigram + GPT
    assert len(rows) == 3 * per_tokenizer
    assert {r["tokenizer"] for r in rows} == {"bpe-40", "char", "word"}
    test_bytes = set()
    for r in rows:
        for key in ("valid_ppl", "test_ppl", "valid_bpb", "test_bpb"):
            assert math.isfinite(float(r[key])) and float(r[key]) > 0, (r, key)
        # bits per byte and token perplexity describe the same NLL: tokens x ln(ppl) = bytes x ln 2 x bpb,
        # and every row, whatever its tokenizer, scores the same test text, so the same number of bytes
        assert float(r["test_ppl"]) > 1.0
        test_bytes.add(
            round(int(r["test_tokens"]) * math.log(float(r["test_ppl"])) / (math.log(2) * float(r["test_bpb"])), 6)
        )
    assert len(test_bytes) == 1 and float(test_bytes.pop()).is_integer()
    kn = {(r["tokenizer"], r["order"]): float(r["test_bpb"]) for r in rows if r["smoothing"] == "kneser_ney"}
    assert kn[("char", "2")] < kn[("char", "1")]  # a bigram context helps on text
    md = (out / "results.md").read_text()
    assert "not comparable across tokenizers" in md and "bits per byte" in md.lower()
    assert "| GPT t |" in md and "neural bigram" in md
    assert (out / "learning_curves.png").stat().st_size > 10_000
    samples = (out / "samples.md").read_text()
    assert samples.count("ROMEO.") >= 9  # 3 models x 3 tokenizers
    study = json.loads((out / "study.json").read_text())
    assert [t["tokenizer"] for t in study["tokenizers"]] == ["bpe-40", "char", "word"]
    for name in ("train", "valid", "test"):  # byte-level BPE is lossless on every split
        stats = study["tokenizers"][0]["splits"][name]
        assert stats["reconstructed"] == stats["documents"] > 0
    assert len(study["bigram_runs"]) == 2 + 1 + 1  # the sweep on the first tokenizer, its best on the others
    # 4 steps and 40 bigram steps end on the step cap, not on early stopping: marked in every table
    assert all(g["converged"] is False for g in study["gpt_runs"])
    assert "max_steps (not converged)" in md and "GPT t | " in md and "(not converged) |" in md
    assert "does not beat" in md or "beats" in md
    gpt_bpe = next(r for r in rows if r["tokenizer"] == "bpe-40" and r["model"] == "gpt")
    assert f"at {float(gpt_bpe['test_bpb']):.3f} test bits per byte" in md
    assert yaml.safe_load((out / "bpe-40" / "gpt-t" / "config.yaml").read_text())["model"]["norm"] == "rmsnorm"
    assert study["gpt_runs"][0]["tokens_per_parameter"] == pytest.approx(
        study["gpt_runs"][0]["train_tokens"] / study["gpt_runs"][0]["parameters"]
    )


@pytest.mark.slow
def test_a_rerun_resumes_by_stage(tmp_path, corpus, caplog):
    cfg = tiny_config(tmp_path / "study", corpus, "tokenizers.char=false", "tokenizers.word=false")
    first = run_study(cfg)
    caplog.clear()
    again = copy.deepcopy(cfg)
    again.gpt.max_steps = 2  # only the GPT stage depends on it
    with caplog.at_level("INFO"):
        again = run_study(again)
    reused = [r.message.split()[-1] for r in caplog.records if "reusing bpe-40/stage" in r.message]
    assert reused == ["bpe-40/stage-tokenizer.json", "bpe-40/stage-ngram.json", "bpe-40/stage-bigram.json"]
    assert again["rows"][:-1] == first["rows"][:-1]
    assert again["gpt_runs"][0]["steps"] == 2 != first["gpt_runs"][0]["steps"]


def test_a_split_shorter_than_the_context_is_an_error_not_infinity(tmp_path, corpus):
    cfg = tiny_config(
        tmp_path / "study", corpus, "gpt.context_length=100000", "tokenizers.char=false", "tokenizers.word=false"
    )
    with pytest.raises(TinyLMError, match="fewer than one context window"):
        run_study(cfg)
    # the report's 1% GPT run: its validation stream is shorter than the context
    cfg = tiny_config(
        tmp_path / "frac",
        corpus,
        "gpt.context_length=64",
        "gpt.data_fraction=0.01",
        "tokenizers.char=false",
        "tokenizers.word=false",
    )
    with pytest.raises(TinyLMError, match="fewer than one context window"):
        run_study(cfg)


def test_grids_and_sizes_come_from_the_command_line():
    cfg = load_study_config(
        "shakespeare-report",
        [
            'gpt.sizes=["tiny=2x32x2"]',
            "bigram.lrs=[1e-3]",
            "tokenizers.bpe_merges=[50,60]",
            "tokenizers.model_merges=[50]",
            "ngram.start_padding=single",
        ],
    )
    assert cfg.gpt.sizes == ["tiny=2x32x2"] and cfg.bigram.lrs == [1e-3] and cfg.ngram.start_padding == "single"
    assert (
        cfg.tokenizers.bpe_type == "word_bpe" and cfg.bigram.d_embeds == [64, 128] and cfg.data.valid_fraction == 0.05
    )
    with pytest.raises(TinyLMError, match="gpt.sizes: 'big' is not of the form name=LAYERSxD_MODELxHEADS"):
        load_study_config("shakespeare-report", ['gpt.sizes=["big"]', "out_dir=/nonexistent/x"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ("bigram.mode=minibatch", "bigram.mode='minibatch' is not one of auto, counts, pairs"),
        ("tokenizers.bpe_type=sentencepiece", "tokenizers.bpe_type='sentencepiece' is not one of bpe, word_bpe"),
        ('ngram.smoothings=["witten_bell"]', "ngram.smoothings='witten_bell' is not one of laplace, add_0.1"),
        ("gpt.data_fraction=1.5", "gpt.data_fraction must be in (0, 1] (got 1.5)"),
        ("tokenizers.model_merges=[5000]", "tokenizers.model_merges [5000] must be among bpe_merges"),
        ("ngram.fixed_weights=[0.5,0.5]", "ngram.fixed_weights needs 5 weights"),
        ('gpt.tokenizers=["char"]', "gpt.tokenizers ['char'] are not modelled tokenizers"),
        ("bigram.lrs=[] bigram.d_embeds=[]", "bigram.lrs is empty and so is d_embeds x weight_decays"),
    ],
)
def test_a_bad_setting_is_one_error_naming_the_key_before_any_work(overrides, message):
    with pytest.raises(TinyLMError) as info:
        load_study_config("shakespeare-report", overrides.split())
    assert message in str(info.value) and "\n" not in str(info.value)
    assert load_study_config("shakespeare-report", ["bigram.lrs=[]"]).bigram.lrs == []  # the grid alone is a sweep


def test_gpt_run_overrides_must_name_a_model_or_train_key():
    with pytest.raises(TinyLMError, match="gpt.run_overrides"):
        study_config(parse_overrides(['gpt.run_overrides=["data.train=x"]']))
    with pytest.raises(TinyLMError, match="norm"):  # checked by the run config when the GPT is built
        from tinylm.config import RunConfig, apply_updates

        apply_updates(RunConfig(), parse_overrides(["model.norm=batchnorm"]))


def test_the_verdict_names_each_reference_and_the_gap():
    from tinylm.studies.shakespeare_summary import answer_lines

    def row(model, order, smoothing, bpb, converged=True):
        return {
            "tokenizer": "bpe-10",
            "model": model,
            "order": order,
            "smoothing": smoothing,
            "test_bpb": bpb,
            "converged": converged,
        }

    run = {
        "rows": [
            row("ngram", 2, "kneser_ney", 2.0),
            row("ngram", 4, "kneser_ney", 1.8),
            row("ngram", 4, "laplace", 3.0),
            row("neural_bigram", 2, "d=8", 2.4, False),
            row("gpt", None, "small", 1.62),
            row("gpt", None, "big", 1.9, False),
        ]
    }
    text = "\n".join(answer_lines(None, run))
    assert "the best GPT, small at 1.620 test bits per byte" in text
    assert "beats the 4-gram kneser_ney (1.800) by 0.180 bits per byte (10.0%)" in text
    assert "beats the neural bigram (2.400, not converged) by 0.780" in text
    assert "It was stopped by a cap" not in text  # the best GPT, small, converged
    run["rows"][-2]["test_bpb"] = 1.85
    text = "\n".join(answer_lines(None, run))
    assert "does not beat the 4-gram kneser_ney (1.800): it is 0.050 bits per byte worse" in text
    assert "It was stopped by a cap" not in text
    run["rows"][-2]["converged"] = False  # a capped GPT that loses: the cap may be why
    assert "where it loses the cap may be the reason" in "\n".join(answer_lines(None, run))
    run["rows"][-2]["test_bpb"] = 1.62  # a capped GPT that wins: the margin is a lower bound
    assert "these margins are what the cap allowed" in "\n".join(answer_lines(None, run))


def test_the_bigram_section_names_the_optimizer_its_runs_used():
    from tinylm.studies.shakespeare_report import bigram_lines

    run = {"tokenizer": "word_bpe-1000", "label": "d=64 wd=1e-05", "lr": 1e-3, "d_embed": 64, "weight_decay": 1e-5}
    run |= {"best_val_loss": 3.6534, "valid_ppl": 38.58, "test_ppl": 36.95, "test_bpb": 2.4748, "steps": 5000}
    run |= {"stopped": "max_steps", "converged": False}
    lines = bigram_lines(load_study_config("shakespeare-report").bigram, {"bigram_runs": [run]}, {})
    assert lines[3].startswith("Adam with the weight decay added to the gradient as an L2 term, random minibatches")
    assert "| 38.58 | 36.95 | 2.4748 | 5000 | max_steps (not converged) | - |" in lines[-3]
    lines = bigram_lines(load_study_config("shakespeare-study").bigram, {"bigram_runs": [run]}, {})
    assert lines[3].startswith("AdamW, every pair through the pair-count matrix")


@pytest.mark.slow
def test_the_report_preset_quick_mode_covers_every_stage_under_90_s(tmp_path):
    cfg = load_study_config("shakespeare-report", [f"out_dir={tmp_path / 'r'}", "compare_with=null"], quick=True)
    start = time.perf_counter()
    state = run_study(cfg)
    assert time.perf_counter() - start < 90
    out = tmp_path / "r"
    names = [t["tokenizer"] for t in state["tokenizers"]]
    assert names == ["word_bpe-100", "word_bpe-200", "word_bpe-100-aggressive", "word_bpe-200-aggressive"]
    assert {(r["model"], r["smoothing"]) for r in state["rows"] if r["model"] == "ngram" and r["order"] == 3} == {
        ("ngram", s) for s in ("laplace", "add_0.1", "interpolated", "interpolated_fixed", "kneser_ney")
    }
    assert [r["label"] for r in state["bigram_runs"]] == ["lr=0.0005 d=64", "d=16 wd=0.0001"]
    assert state["gpt_runs"][0]["size"] == "tiny" and state["gpt_runs"][0]["parameters"] > 0
    assert len(list((out / "bigram_curves").glob("*.png"))) == 2
    md = (out / "results.md").read_text()
    for heading in ("## Summary", "## Task 1", "### Compression", "### Verbatim overlap", "## Task 3", "## Task 4"):
        assert heading in md
    assert "| 2 n-gram | 1000 merges, 3-gram add_0.1 | 25.47 / 23.49 |" in md  # the report's number, cited
    samples = (out / "samples.md").read_text()
    assert samples.count("\n## ") == (3 * 5 + 1 + 1) * 3  # every n-gram, the best bigram, the GPT; 3 prompts each


def test_cli_registers_the_study_and_reports_errors_on_one_line(tmp_path, capsys):
    args = build_parser().parse_args(["study", "shakespeare", "--quick", "--out", str(tmp_path / "q")])
    assert args.quick and args.out == str(tmp_path / "q") and args.corpus == "shakespeare"
    assert load_study_config(quick=True).gpt.minutes * 60 * 5 < 60  # five quick GPTs stay within a minute of training
    with pytest.raises(SystemExit):
        build_parser().parse_args(["study", "tinystories"])
    capsys.readouterr()
    assert main(["study", "shakespeare", "--quick", "--bpe-merges", "-5", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tinylm study: error:") and "\n" not in err and "merges" in err


def test_a_capped_gpt_follows_its_cap_with_its_cosine(tmp_path):
    from tinylm.studies.shakespeare import run_config
    from tinylm.studies.study_config import TokenizerSpec

    spec = TokenizerSpec("bpe-100", "bpe", 356, 100)
    capped = load_study_config("shakespeare-report")
    rc = run_config(capped, spec, tmp_path)
    assert (rc.train.schedule_clock, rc.train.max_minutes, rc.train.max_steps) == ("wall", 12, 20000)
    assert capped.bigram.optimizer == "adam_l2"  # the report's Adam with the decay in the gradient
    uncapped = copy.deepcopy(capped)
    uncapped.gpt.minutes = 0
    rc = run_config(uncapped, spec, tmp_path)
    assert (rc.train.schedule_clock, rc.train.max_minutes) == ("steps", None)
