"""The fluency part: each decoding's continuations scored by a judge model, beside the real ones."""

import csv
import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import make_stories

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.evaluation.byte_bits import score_bytes
from tinylm.evaluation.report import Doc
from tinylm.models.checkpoint import save_checkpoint
from tinylm.models.gpt import GPT
from tinylm.studies.tinystories_fluency import (
    REAL,
    judge_stamp,
    part_fluency,
    repeated_ngram_share,
    section_fluency,
    without_unk,
)
from tinylm.tokenizers.char import CharTokenizer

PROMPTS = ["once upon a time ,", "the dog ran to"]
REAL_TEXTS = ["there was a girl named <unk> . she liked cats .", "the park and played with a red ball ."]
LOOP = "the box and the box and the box and the box and the box and the box ."


@pytest.fixture
def judge(tmp_path):
    torch.manual_seed(0)
    tok = CharTokenizer().train([s.lower() for s in make_stories()])
    # a context of 24 characters: the longer texts are scored in sliding windows, as tinylm evaluate scores them
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=24, d_model=32, n_layers=2, n_heads=4)).eval()
    run = tmp_path / "judge-run"  # a training run's layout: its eval.json beside checkpoints/
    run.mkdir()
    (run / "eval.json").write_text(json.dumps({"eval": {"valid": {"bpb": 0.79}}}))
    return save_checkpoint(run / "checkpoints" / "ema", model, tok, info={"step": 7}), model, tok


def write_csv(path, prompts, refs, hyps):
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "reference_continuation", "hypothesis_continuation", "per_sample_ppl", "sentence_bleu4"])
        for p, r, h in zip(prompts, refs, hyps):
            w.writerow([p, r, h, 10.0, 0.1])


def write_parts(run, decoding=(), bleu=()):
    """decoding.json and bleu.json naming their CSVs, as those parts write them."""
    for part, names, prefix in (("decoding", decoding, "decoding_samples_"), ("bleu", bleu, "bleu_samples_")):
        settings = [{"name": n, "csv": f"{prefix}{n}.csv"} for n in names]
        (run / f"{part}.json").write_text(json.dumps({"settings": settings}))


def study_in(run_dir, judge_path):
    return SimpleNamespace(run_dir=run_dir, exp=SimpleNamespace(judge=judge_path), threads=1)


def test_each_setting_is_scored_after_its_prompt_and_beside_the_real_continuations(judge, tmp_path):
    path, model, tok = judge
    run = tmp_path / "run"
    run.mkdir()
    write_csv(run / "decoding_samples_greedy.csv", PROMPTS, REAL_TEXTS, [LOOP, "home . <unk> <unk> the end ."])
    write_csv(run / "bleu_samples_T1.csv", PROMPTS, REAL_TEXTS, ["a cat sat .", "school and learned ."])
    write_csv(run / "bleu_samples_T0.5.csv", PROMPTS, REAL_TEXTS, ["a dog sat .", "school ."])
    write_parts(run, decoding=["greedy"], bleu=["T1", "T0.5"])  # the parts' order, not the files' names
    out = part_fluency(study_in(run, str(path)))
    rows = {r["name"]: r for r in out["settings"]}
    assert [r["name"] for r in out["settings"]] == [REAL, "greedy", "sample T1", "sample T0.5"]
    assert out["judge_step"] == 7 and out["judge_valid_bpb"] == 0.79 and (run / out["png"]).is_file()

    # the pooled number: the judge's bits on each continuation's bytes after "prompt ", over those bytes
    bits = nbytes = 0.0
    for prompt, text in zip(PROMPTS, [LOOP, "home . the end ."]):
        score = score_bytes(model, tok, f"{prompt} {text}")
        start = len(prompt) + 1
        bits, nbytes = bits + score.byte_bits[start:].sum(), nbytes + score.n_bytes - start
    assert rows["greedy"]["bpb"] == pytest.approx(bits / nbytes, rel=1e-9)
    assert rows["greedy"]["scored_bytes"] == nbytes
    assert rows[REAL]["bpb_q1"] <= rows[REAL]["bpb_median"] <= rows[REAL]["bpb_q3"]
    assert all(math.isfinite(r["bpb"]) and r["bpb"] > 0 for r in rows.values())

    # repetition and <unk>: the loop repeats most of its 4-grams, the real stories none
    assert rows["greedy"]["repeated_4gram_share"] > 0.3 and rows[REAL]["repeated_4gram_share"] == 0.0
    assert rows["greedy"]["unk_per_100_words"] == pytest.approx(100 * 2 / (len(LOOP.split()) + 7))
    assert rows[REAL]["unk_per_100_words"] > 0 and rows["sample T1"]["unk_per_100_words"] == 0

    # the report section: one row per setting with its difference to the real continuations
    doc = Doc()
    section_fluency(doc, run, out)
    text = doc.markdown()
    assert "0.790 bits per byte on the validation stories" in text
    assert "greedy" in text and f"{rows['greedy']['bpb'] - rows[REAL]['bpb']:+.3f}" in text


def test_helpers_and_clear_errors(judge, tmp_path):
    path, _, _ = judge
    assert without_unk("a <unk> b <unk>") == ("a b", 2)
    assert repeated_ngram_share("a b c d a b c d") == pytest.approx(1 / 5)
    assert repeated_ngram_share("a b c") == 0.0
    stamp = judge_stamp(str(path))
    (path / "checkpoint.json").write_text((path / "checkpoint.json").read_text().replace('"step": 7', '"step": 8'))
    assert stamp and judge_stamp(str(path)) not in (None, stamp) and judge_stamp(None) is None

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(TinyLMError, match="tinystories-cpu-25m"):
        part_fluency(study_in(run, str(tmp_path / "nowhere")))
    with pytest.raises(TinyLMError, match="run the decoding part first"):
        part_fluency(study_in(run, str(path)))
    write_csv(run / "decoding_samples_greedy.csv", PROMPTS, REAL_TEXTS, REAL_TEXTS)
    write_csv(run / "decoding_samples_beam5.csv", PROMPTS[::-1], REAL_TEXTS, REAL_TEXTS)
    write_parts(run, decoding=["greedy", "beam5"])
    with pytest.raises(TinyLMError, match="other prompts"):
        part_fluency(study_in(run, str(path)))
    assert part_fluency(study_in(run, None)) == {"off": True}
