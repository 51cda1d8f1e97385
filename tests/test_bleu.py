"""BLEU against sacrebleu and NLTK on fixed strings; the BLEU protocol's samples, CSV and the
per-sample perplexity of the reference continuation, checked against a hand computation."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from conftest import make_stories
from sacrebleu.metrics import BLEU
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

from tinylm.config import ModelConfig
from tinylm.constants import SOS_ID
from tinylm.errors import TinyLMError
from tinylm.evaluation.bleu import (
    bleu_from_stats,
    bleu_tokens,
    corpus_bleu_n,
    corpus_stats,
    sacrebleu_score,
    sentence_bleu_n,
)
from tinylm.evaluation.protocol import CSV_COLUMNS, BleuProtocol, Decoding, reference_nll, run_bleu, select_samples
from tinylm.models.gpt import GPT
from tinylm.tokenizers import WordTokenizer

HYPS = [
    "the cat sat on the mat and looked at the dog .",
    "once upon a time , a girl named lily found a shiny key in the park .",
    "he ran to his mom .",
    "the sun was hot",
    "they played all day and then they went home happy .",
]
REFS = [
    "the cat was sitting on the mat , looking at the big dog .",
    "once upon a time there was a little girl named lily who loved to play .",
    "he ran fast to his mom and gave her a hug .",
    "the birds were singing in the trees",
    "they played together all day long and went home happy .",
]


@pytest.mark.slow  # the nltk reference
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_bleu_n_method1_equals_nltk_corpus_bleu(n):
    from nltk.translate.bleu_score import SmoothingFunction, corpus_bleu  # deferred: nltk imports scipy, ~2 s

    ours = corpus_bleu_n(HYPS, REFS, smoothing="method1")[f"bleu{n}"]
    nltk = corpus_bleu(
        [[bleu_tokens(r)] for r in REFS],
        [bleu_tokens(h) for h in HYPS],
        weights=(1.0 / n,) * n,
        smoothing_function=SmoothingFunction().method1,
    )
    assert ours == pytest.approx(nltk, rel=1e-12)
    assert 0.0 < ours < 1.0


@pytest.mark.slow  # the nltk reference
def test_sentence_bleu_equals_nltk_and_its_mean_is_not_corpus_bleu():
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu  # deferred: nltk imports scipy, ~2 s

    ours = [sentence_bleu_n(h, r)["bleu4"] for h, r in zip(HYPS, REFS)]
    nltk = [
        sentence_bleu([bleu_tokens(r)], bleu_tokens(h), smoothing_function=SmoothingFunction().method1)
        for h, r in zip(HYPS, REFS)
    ]
    assert ours == pytest.approx(nltk, rel=1e-12)
    # "the sun was hot" shares one word with its reference: smoothing lifts it above 0, yet far below the rest
    assert 0.0 < ours[3] < 0.05 < min(ours[:3] + ours[4:])
    mean = sum(ours) / len(ours)
    assert mean == pytest.approx(0.1602, abs=5e-4)
    assert abs(mean - corpus_bleu_n(HYPS, REFS)["bleu4"]) > 0.01  # pooled counts give another number


@pytest.mark.slow  # the nltk reference
def test_smoothing_matters_when_no_4gram_matches():
    from nltk.translate.bleu_score import SmoothingFunction, corpus_bleu  # deferred: nltk imports scipy, ~2 s

    hyps, refs = ["a dog ran to the red box"], ["the dog went to a red box"]  # no common 4-gram
    method1 = corpus_bleu_n(hyps, refs, smoothing="method1")
    nltk1 = corpus_bleu(
        [[bleu_tokens(refs[0])]], [bleu_tokens(hyps[0])], smoothing_function=SmoothingFunction().method1
    )
    assert method1["bleu4"] == pytest.approx(nltk1, rel=1e-12)
    assert method1["bleu4"] > 0.05
    assert corpus_bleu_n(hyps, refs, smoothing="none")["bleu4"] == 0.0  # the unsmoothed collapse
    assert corpus_bleu_n(hyps, refs, smoothing="none")["bleu2"] == pytest.approx(
        corpus_bleu([[bleu_tokens(refs[0])]], [bleu_tokens(hyps[0])], weights=(0.5, 0.5)), rel=1e-12
    )


@pytest.mark.slow  # the nltk reference
def test_hypothesis_shorter_than_n_and_empty_hypothesis_match_nltk():
    from nltk.translate.bleu_score import SmoothingFunction, corpus_bleu  # deferred: nltk imports scipy, ~2 s

    hyps, refs = ["the cat", "", "a big red dog was here"], ["the cat sat down", "nothing", "a big dog was here too"]
    ours = corpus_bleu_n(hyps, refs)
    for n in (1, 2, 3, 4):
        nltk = corpus_bleu(
            [[bleu_tokens(r)] for r in refs],
            [bleu_tokens(h) for h in hyps],
            weights=(1.0 / n,) * n,
            smoothing_function=SmoothingFunction().method1,
        )
        assert ours[f"bleu{n}"] == pytest.approx(nltk, rel=1e-12)
    assert corpus_bleu_n(["zzz"], ["the cat"])["bleu1"] == 0.0  # nothing in common


def test_own_bleu_with_13a_tokens_and_exp_smoothing_equals_sacrebleu():
    tok = Tokenizer13a()
    stats = corpus_stats([tok(h).split() for h in HYPS], [tok(r).split() for r in REFS], min_one_total=False)
    ours = 100 * bleu_from_stats(stats, 4, smoothing="exp")
    assert ours == pytest.approx(BLEU().corpus_score(HYPS, [REFS]).score, rel=1e-9)
    # one sentence without any 4-gram match exercises the exp smoothing branch
    stats = corpus_stats(
        [tok("a dog ran to the red box").split()], [tok("the dog went to a red box").split()], min_one_total=False
    )
    assert 100 * bleu_from_stats(stats, 4, smoothing="exp") == pytest.approx(
        BLEU().corpus_score(["a dog ran to the red box"], [["the dog went to a red box"]]).score, rel=1e-9
    )


def test_sacrebleu_score_reports_signature():
    out = sacrebleu_score(HYPS, REFS)
    assert out["bleu"] == pytest.approx(BLEU().corpus_score(HYPS, [REFS]).score)
    assert "nrefs:1" in out["signature"] and "tok:13a" in out["signature"] and "smooth:exp" in out["signature"]


def test_unknown_smoothing_is_a_clear_error():
    with pytest.raises(TinyLMError, match="smoothing"):
        corpus_bleu_n(HYPS, REFS, smoothing="method7")


# ----------------------------------------------------------------------------------- protocol
@pytest.fixture
def model_and_tokenizer():
    stories = make_stories(40)
    tok = WordTokenizer(lowercase=True).train(stories, 200)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=2, n_heads=4))
    return model.eval(), tok, stories


@pytest.mark.parametrize("bos_id", [SOS_ID, 1, None])  # tinylm <sos>, llama2.c BOS, no start token
def test_per_sample_ppl_equals_hand_computation(model_and_tokenizer, bos_id):
    model, tok, stories = model_and_tokenizer
    sset = select_samples(tok, stories[:3], BleuProtocol(n_samples=3, prompt_tokens=5, max_continuation=12), 32)
    got = reference_nll(model, sset.samples, bos_id, batch_size=2)  # batched with padding
    for s, (nll_sum, n) in zip(sset.samples, got):
        # by hand: one prefix at a time, the log-probability of the next reference token
        prefix, nlls = [*([] if bos_id is None else [bos_id]), *s.prompt_ids], []
        for t in s.reference_ids:
            with torch.no_grad():
                logits, _ = model(torch.tensor([prefix]))
            nlls.append(-torch.log_softmax(logits[0, -1].double(), -1)[t].item())
            prefix.append(t)
        assert n == len(s.reference_ids) == 12
        assert math.exp(nll_sum / n) == pytest.approx(math.exp(sum(nlls) / len(nlls)), rel=1e-5)


def test_short_stories_are_skipped_and_counted_and_fewer_samples_said(model_and_tokenizer):
    _, tok, stories = model_and_tokenizer
    texts = ["the cat", stories[0], "one two three four five", stories[1]]  # 2 and 5 words: nothing after the prompt
    sset = select_samples(tok, texts, BleuProtocol(n_samples=10, prompt_tokens=5), 32)
    assert sorted(s.index for s in sset.samples) == [1, 3]
    assert sset.skipped_too_short == 2
    assert any("only 2 usable" in n for n in sset.notes) and any("skipped 2" in n for n in sset.notes)
    with pytest.raises(TinyLMError, match="longer than the 5-token prompt"):
        select_samples(tok, ["the cat"], BleuProtocol(prompt_tokens=5), 32)
    with pytest.raises(TinyLMError, match="no room"):
        select_samples(tok, texts, BleuProtocol(prompt_tokens=31), 32)


def test_stories_are_drawn_with_the_seed_and_first_n_is_an_option(model_and_tokenizer):
    _, tok, stories = model_and_tokenizer
    pick = lambda **kw: [s.index for s in select_samples(tok, stories, BleuProtocol(n_samples=10, **kw), 32).samples]  # noqa: E731
    assert pick(selection="first") == list(range(10))
    drawn = pick(seed=1)
    assert drawn == pick(seed=1) and drawn != pick(seed=2)  # reproducible, and the seed matters
    assert drawn != list(range(10)) and len(set(drawn)) == 10 and max(drawn) < len(stories)


def test_the_reference_is_the_rest_of_the_story_unless_capped(model_and_tokenizer):
    _, tok, _ = model_and_tokenizer
    long_story = " ".join(["the cat sat on the mat ."] * 10)  # 70 tokens
    rest = select_samples(tok, [long_story], BleuProtocol(n_samples=1, prompt_tokens=5), 200).samples[0]
    assert len(rest.reference_ids) == len(tok.encode(long_story)) - 5
    capped = select_samples(tok, [long_story], BleuProtocol(n_samples=1, prompt_tokens=5, max_continuation=12), 200)
    assert len(capped.samples[0].reference_ids) == 12
    in_context = select_samples(tok, [long_story], BleuProtocol(n_samples=1, prompt_tokens=5), 32)
    assert len(in_context.samples[0].reference_ids) == 32 - 1 - 5 and in_context.cut_to_context == 1
    assert any("cut to 26 tokens" in n for n in in_context.notes)


@pytest.mark.slow  # two whole BLEU runs
def test_run_bleu_writes_csv_and_is_seeded(model_and_tokenizer, tmp_path):
    model, tok, stories = model_and_tokenizer
    proto = BleuProtocol(n_samples=6, prompt_tokens=5, max_continuation=10, seed=3)
    settings = [Decoding("T0.7", temperature=0.7), Decoding("greedy", temperature=0.0)]
    a = run_bleu(model, tok, stories, proto, settings, csv_dir=tmp_path / "a")
    b = run_bleu(model, tok, stories, proto, settings, csv_dir=tmp_path / "b")
    assert a["samples"] == 6 and a["requested"] == 6
    assert [s["bleu4"] for s in a["settings"]] == [s["bleu4"] for s in b["settings"]]
    rows = list(csv.DictReader(open(tmp_path / "a" / "bleu_samples_T0.7.csv", encoding="utf-8")))
    assert list(rows[0]) == CSV_COLUMNS and len(rows) == 6
    # the CSV's BLEU inputs reproduce the reported score
    hyps = [r["hypothesis_continuation"] for r in rows]
    refs = [r["reference_continuation"] for r in rows]
    assert corpus_bleu_n(hyps, refs)["bleu4"] == pytest.approx(a["settings"][0]["bleu4"])
    ppls = [float(r["per_sample_ppl"]) for r in rows]
    assert a["mean_per_sample_ppl"] == pytest.approx(sum(ppls) / 6, rel=1e-5)
    # each row's own BLEU-4, and their mean beside the corpus score
    per_sample = [float(r["sentence_bleu4"]) for r in rows]
    assert per_sample == pytest.approx([sentence_bleu_n(h, r)["bleu4"] for h, r in zip(hyps, refs)], rel=1e-5)
    assert a["settings"][0]["sentence_bleu"]["bleu4"] == pytest.approx(sum(per_sample) / 6, rel=1e-5)
    assert all(p > 1.0 for p in ppls)  # an untrained model: far from certain


@pytest.mark.slow  # the whole evaluate command, twice
def test_evaluate_cli_with_bleu(model_and_tokenizer, tmp_path, capsys):
    from tinylm.cli import main
    from tinylm.models.checkpoint import save_checkpoint

    model, tok, stories = model_and_tokenizer
    ckpt = save_checkpoint(tmp_path / "ckpt", model, tok)
    data = tmp_path / "valid.txt"
    data.write_text("".join(f"{s}\n<|endoftext|>\n" for s in ["Too short.", *stories[:4]]), encoding="utf-8")
    argv = [
        "evaluate",
        "--checkpoint",
        str(ckpt),
        "--data",
        str(data),
        "--bleu",
        "--samples",
        "10",
        "--max-continuation",
        "8",
        "--temperature",
        "0.7",
        "--temperature",
        "0",
        "--csv-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "token perplexity" in out and "word perplexity" in out  # the perplexity lines stay
    assert "weak metric for stories" in out and "sacreBLEU signature: nrefs:1" in out
    assert "only 4 usable stories" in out and "skipped 1 stories" in out
    assert (tmp_path / "bleu_samples_T0.7.csv").is_file() and (tmp_path / "bleu_samples_greedy.csv").is_file()
    assert main([*argv, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert {"token_ppl", "bpb", "word_ppl"} <= set(obj) and obj["bleu"]["samples"] == 4
    assert [s["name"] for s in obj["bleu"]["settings"]] == ["T0.7", "greedy"]


def test_bad_decoding_settings_are_clear_errors(model_and_tokenizer):
    model, tok, stories = model_and_tokenizer
    proto = BleuProtocol(n_samples=2, prompt_tokens=5, max_continuation=4)
    with pytest.raises(TinyLMError, match="decoding setting bad: temperature"):
        run_bleu(model, tok, stories, proto, [Decoding("bad", temperature=-1.0)])
    with pytest.raises(TinyLMError, match="must be different"):
        run_bleu(model, tok, stories, proto, [Decoding("T1"), Decoding("T1")])


def test_continuation_starts_from_and_stops_at_the_models_own_ids(model_and_tokenizer):
    """a llama2.c model is prompted after BOS=1 and stops at its ids, not tinylm's <sos>/<eos>."""
    from tinylm.evaluation.protocol import continue_sample
    from tinylm.generation.generate import generate

    model, tok, stories = model_and_tokenizer
    sample = select_samples(tok, stories[:1], BleuProtocol(n_samples=1, prompt_tokens=5), 32).samples[0]
    greedy = Decoding("greedy", temperature=0.0)
    free = generate(model, [1, *sample.prompt_ids], 12, 0.0)  # no stop id at all
    assert continue_sample(model, sample, greedy, 12, 0, bos_id=1, stop_ids=()) == free
    stop_at = free[3]
    cut = continue_sample(model, sample, greedy, 12, 0, bos_id=1, stop_ids=(stop_at,))
    assert cut == free[: free.index(stop_at)]  # the stop id itself is not returned
    assert continue_sample(model, sample, greedy, 12, 0, SOS_ID, (3,)) == generate(
        model, [SOS_ID, *sample.prompt_ids], 12, 0.0, eos_id=3
    )
