"""The study end to end on a tiny corpus the test writes itself (a few seconds), its refusal of a
split shorter than one context window, and the `tinylm study` command line."""
from __future__ import annotations

import csv
import json
import math
import random

import pytest

from tinylm.cli import build_parser, main
from tinylm.errors import TinyLMError
from tinylm.studies.shakespeare import StudyConfig, load_study_config, run_study

LINES = ["ROMEO. But soft, what light through yonder window breaks?", "JULIET. O Romeo, Romeo, wherefore art thou Romeo?",
         "HAMLET. To be, or not to be, that is the question.", "KING. Once more unto the breach, dear friends, once more.",
         "PUCK. If we shadows have offended, think but this, and all is mended.", "LEAR. Nothing will come of nothing."]


@pytest.fixture
def corpus(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "plays.jsonl"
    docs = ["\n\n".join(" ".join(rng.choice(LINES) for _ in range(3)) for _ in range(8)) + f"\n\nEnd of play {i}." for i in range(30)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def tiny_config(out_dir, corpus, **kw) -> StudyConfig:
    base = dict(out_dir=str(out_dir), source="text", train_path=str(corpus), valid_fraction=0.15, test_fraction=0.15,
                bpe_merges=[40], word_vocab=40, orders=[1, 2], bigram_d_embeds=[8], bigram_weight_decays=[0.0, 0.1],
                bigram_max_steps=40, bigram_max_seconds=5.0, context_length=16, d_model=16, n_layers=1, n_heads=2,
                dropout=0.0, gpt_batch_size=4, gpt_max_steps=4, gpt_minutes=0.5, gpt_eval_interval=2,
                gpt_eval_batches=1, prompts=["ROMEO."], sample_tokens=5)
    base.update(kw)
    return StudyConfig(**base)


@pytest.mark.slow
def test_study_writes_one_table_for_every_model_and_tokenizer(tmp_path, corpus):
    cfg = tiny_config(tmp_path / "study", corpus)
    run_study(cfg)
    out = tmp_path / "study"
    rows = list(csv.DictReader(open(out / "results.csv")))
    per_tokenizer = len(cfg.orders) * len(cfg.smoothings) + 2  # n-grams + neural bigram + GPT
    assert len(rows) == 3 * per_tokenizer
    assert {r["tokenizer"] for r in rows} == {"bpe-40", "char", "word"}
    test_bytes = set()
    for r in rows:
        for key in ("valid_ppl", "test_ppl", "valid_bpb", "test_bpb"):
            assert math.isfinite(float(r[key])) and float(r[key]) > 0, (r, key)
        # bits per byte and token perplexity describe the same NLL: tokens x ln(ppl) = bytes x ln 2 x bpb,
        # and every row, whatever its tokenizer, scores the same test text, so the same number of bytes
        assert float(r["test_ppl"]) > 1.0
        test_bytes.add(round(int(r["test_tokens"]) * math.log(float(r["test_ppl"])) / (math.log(2) * float(r["test_bpb"])), 6))
    assert len(test_bytes) == 1 and float(test_bytes.pop()).is_integer()
    kn = {(r["tokenizer"], r["order"]): float(r["test_bpb"]) for r in rows if r["smoothing"] == "kneser_ney"}
    assert kn[("char", "2")] < kn[("char", "1")]  # a bigram context helps on text
    md = (out / "results.md").read_text()
    assert "not comparable across tokenizers" in md and "bits per byte" in md.lower()
    assert "| GPT |" in md and "neural bigram" in md
    assert (out / "learning_curves.png").stat().st_size > 10_000
    samples = (out / "samples.md").read_text()
    assert samples.count("ROMEO.") >= 9  # 3 models x 3 tokenizers
    study = json.loads((out / "study.json").read_text())
    assert [t["tokenizer"] for t in study["tokenizers"]] == ["bpe-40", "char", "word"]
    assert study["tokenizers"][0]["reconstructed"].split("/")[0] == study["tokenizers"][0]["reconstructed"].split("/")[1]
    assert len(study["bigram_sweep"]) == 2


def test_a_split_shorter_than_the_context_is_an_error_not_infinity(tmp_path, corpus):
    cfg = tiny_config(tmp_path / "study", corpus, context_length=100_000, char=False, word=False)
    with pytest.raises(TinyLMError, match="fewer than one context window"):
        run_study(cfg)


def test_cli_registers_the_study_and_reports_errors_on_one_line(tmp_path, capsys):
    args = build_parser().parse_args(["study", "shakespeare", "--quick", "--out", str(tmp_path / "q")])
    assert args.quick and args.out == str(tmp_path / "q") and args.corpus == "shakespeare"
    assert load_study_config(quick=True).gpt_minutes * 60 * 5 < 60  # five quick GPTs stay within a minute of training
    with pytest.raises(SystemExit):
        build_parser().parse_args(["study", "tinystories"])
    capsys.readouterr()
    assert main(["study", "shakespeare", "--quick", "--bpe-merges", "-5", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tinylm study: error:") and "\n" not in err and "merges" in err
