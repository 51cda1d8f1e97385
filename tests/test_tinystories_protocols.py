"""The reports' protocols part (tinylm.studies.tinystories_protocols): per-target NLLs that add up
to tinylm's perplexity, the masks and averages the reports may have used, truncation to 64
tokens, individual vs cumulative and corpus vs sentence-mean BLEU on hand examples, and the part
end to end on a tiny seeded model, its tinylm rows equal to what the other parts compute."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_stories

from tinylm.config import ModelConfig
from tinylm.constants import EOS_ID, SOS_ID, UNK_ID
from tinylm.evaluation.bleu import corpus_stats
from tinylm.evaluation.perplexity import evaluate_texts, score_token_documents
from tinylm.evaluation.protocol import BleuProtocol, Decoding, reference_nll, run_bleu, select_samples
from tinylm.evaluation.report import Doc
from tinylm.models.gpt import GPT
from tinylm.studies import tinystories_protocols as tp
from tinylm.studies.tinystories import PARTS, ExperimentsConfig
from tinylm.studies.tinystories_compare import published
from tinylm.studies.tinystories_report import QUALITY_PARTS
from tinylm.tokenizers.io import new_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    """A seeded word tokenizer and a tiny random GPT (context 96: a 64-token cut fits in one window)."""
    stories = make_stories(40)
    tok = new_tokenizer("word", lowercase=True).train(stories[:30], 300)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=96, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    return GPT(cfg).eval(), tok, stories


def _long_docs(tok, stories, n=3) -> list[list[int]]:
    """Documents of more than 64 tokens: a few stories run together."""
    return [[SOS_ID, *tok.encode(" ".join(stories[i : i + 4])), EOS_ID] for i in range(n)]


def test_token_nlls_add_up_to_tinylm_scoring_and_truncation_keeps_the_first_63_targets(tiny):
    model, tok, stories = tiny
    docs = _long_docs(tok, stories)
    assert all(len(d) > 100 for d in docs)  # past the context of 96: strided windows
    rows = tp.token_nlls(model, docs)
    total, count = score_token_documents(model, docs)
    assert [r.shape for r in rows] == [(1, len(d) - 1) for d in docs]
    assert sum(r.sum() for r in rows) == pytest.approx(total, rel=1e-5) and sum(r.size for r in rows) == count
    # the first 64 tokens: <sos> + 63 targets, exactly the first 63 NLLs of the whole story
    cut = [tp.first_tokens(d) for d in docs]
    assert [len(c) for c in cut] == [64] * 3 and cut[0] == docs[0][:64]
    alone = tp.token_nlls(model, cut)
    for whole, first in zip(rows, alone):
        assert first.shape == (1, 63)
        np.testing.assert_allclose(first[0], whole[0, :63], rtol=1e-5, atol=1e-6)
    assert score_token_documents(model, cut)[1] == 3 * 63


def test_stories_longer_than_the_context_score_as_tinylm_scores_them_and_add_their_eos():
    stories = make_stories(8)
    tok = new_tokenizer("word", lowercase=True).train(stories, 300)
    torch.manual_seed(1)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=12, d_model=16, n_layers=1, n_heads=2, d_ff=32))
    bodies = [[SOS_ID, *tok.encode(t)] for t in stories]
    assert min(map(len, bodies)) > 12 and max(map(len, bodies)) > 24  # two and more windows
    rows = tp.story_nlls(model.eval(), bodies, EOS_ID)
    scored = tp.Scored([np.asarray([*b[1:], EOS_ID]) for b in bodies], [r[0] for r in rows])
    sums, counts = scored.sums(EOS_ID, UNK_ID, False, True)
    assert tp.average_ppl(sums, counts, tp.POOLED) == pytest.approx(evaluate_texts(model, tok, stories)["token_ppl"])
    # the <eos> NLL is the last target of the story with its <eos>, in tinylm's windows
    with_eos = tp.token_nlls(model, [[*b, EOS_ID] for b in bodies])
    np.testing.assert_allclose([r[0, -1] for r in rows], [r[0, -1] for r in with_eos], rtol=1e-5)


class Lookup(torch.nn.Module):
    """Logits from the previous token only, from a table the test writes."""

    def __init__(self, table: torch.Tensor, context_length: int = 64):
        super().__init__()
        self.table = torch.nn.Parameter(table)
        self.config = SimpleNamespace(context_length=context_length)

    def forward(self, idx, targets=None, loss_reduction="mean"):
        logits = self.table[idx]
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=loss_reduction)


def test_eos_and_unk_counted_or_not_move_perplexity_the_way_their_nll_says():
    V, dot, word = 8, 5, 6
    table = torch.zeros(V, V)
    table[dot, EOS_ID] = 6.0  # after "." the story ends: an easy <eos>
    table[:, UNK_ID] = -6.0  # <unk> is never expected: a hard target
    model = Lookup(table)
    docs = [[SOS_ID, word, word, dot, EOS_ID], [SOS_ID, word, UNK_ID, word, dot, EOS_ID]]
    scored = tp.Scored([np.asarray(d[1:]) for d in docs], [r[0] for r in tp.token_nlls(model, docs)])
    logp = torch.log_softmax(table, -1)

    def ppl(eos: bool, unk: bool) -> float:
        return tp.average_ppl(*scored.sums(EOS_ID, UNK_ID, eos, unk), tp.POOLED)

    by_hand = [-logp[a, b].item() for d in docs for a, b in zip(d, d[1:]) if b != EOS_ID]
    assert ppl(False, True) == pytest.approx(math.exp(sum(by_hand) / len(by_hand)))
    assert ppl(True, True) < ppl(False, True)  # the easy <eos> lowers it
    assert ppl(False, False) < ppl(False, True)  # leaving the hard <unk> out lowers it too
    # counted <eos> is what tinylm's scoring gives with <eos> kept in the documents
    total, count = score_token_documents(model, docs)
    assert ppl(True, True) == pytest.approx(math.exp(total / count))


def test_averages_on_a_hand_example():
    sums, counts = np.array([2.0, 4.0, 9.0]), np.array([2.0, 2.0, 3.0])
    assert tp.average_ppl(sums, counts, tp.POOLED) == pytest.approx(math.exp(15 / 7))
    # batches of 2 in order: losses 6/4 and 9/3
    assert tp.average_ppl(sums, counts, tp.BATCH_LOSS, batch=2) == pytest.approx(math.exp((1.5 + 3) / 2))
    assert tp.average_ppl(sums, counts, tp.BATCH_PPL, batch=2) == pytest.approx((math.exp(1.5) + math.exp(3)) / 2)
    assert tp.average_ppl(sums, counts, tp.SAMPLE_PPL) == pytest.approx((math.e + math.exp(2) + math.exp(3)) / 3)
    # a mean of exp is at least exp of the mean (report 002's perplexity column sat above exp(loss))
    assert tp.average_ppl(sums, counts, tp.BATCH_PPL, 2) >= tp.average_ppl(sums, counts, tp.BATCH_LOSS, 2)


def test_bleu_individual_cumulative_corpus_and_sentence_mean_on_a_hand_example():
    pairs = [("a b c d", "a b c d"), ("a x", "a y")]
    stats = [corpus_stats([h.split()], [r.split()]) for h, r in pairs]
    value = lambda n, cum, sm, corpus: tp.bleu_value(stats, n, cum, sm, corpus)  # noqa: E731
    # corpus: unigrams 5/6, bigrams 3/4, trigrams 2/3, 4-grams 1/2 (NLTK counts one n-gram for a short
    # hypothesis), equal lengths so no brevity penalty
    assert value(2, True, "none", True) == pytest.approx(math.sqrt(5 / 6 * 3 / 4))
    assert value(4, True, "none", True) == pytest.approx((5 / 6 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25)
    assert value(4, False, "none", True) == pytest.approx(1 / 2)  # individual: the 4-gram precision alone
    assert value(1, False, "none", True) == value(1, True, "none", True) == pytest.approx(5 / 6)
    for n in (2, 3, 4):
        assert value(n, False, "none", True) <= value(n, True, "none", True)
    # sentence mean: the second pair has no bigram in common, 0 without smoothing, sqrt(1/2 x 0.1/1) with method1
    assert value(2, True, "none", False) == pytest.approx((1 + 0) / 2)
    assert value(2, True, "method1", False) == pytest.approx((1 + math.sqrt(0.5 * 0.1)) / 2)
    assert value(2, False, "method1", False) == pytest.approx((1 + 0.1) / 2)
    # a short hypothesis: the brevity penalty exp(1 - 4/2), or none when it is left out
    short = [corpus_stats([["a", "b"]], [["a", "b", "c", "d"]])]
    assert tp.bleu_value(short, 2, True, "none", True) == pytest.approx(math.exp(-1))
    assert tp.bleu_value(short, 2, True, "none", True, brevity=False) == pytest.approx(1.0)
    nltk = pytest.importorskip("nltk.translate.bleu_score")
    hyps, refs = [h.split() for h, _ in pairs], [[r.split()] for _, r in pairs]
    for n, cum in itertools.product((1, 2, 3, 4), (True, False)):
        weights = tuple([1 / n] * n) if cum else tuple([0.0] * (n - 1) + [1.0])
        assert value(n, cum, "method1", True) == pytest.approx(
            nltk.corpus_bleu(refs, hyps, weights, smoothing_function=nltk.SmoothingFunction().method1)
        )


def test_sentences_and_the_first_words():
    text = 'Tom ran. He fell!\n"Ouch," he said. "Help!" The end.'
    assert tp.split_sentences(text) == ["Tom ran.", "He fell!", '"Ouch," he said.', '"Help!"', "The end."]
    tok = new_tokenizer("word", lowercase=True).train(["once upon a time , there was a dog ."], 50)
    ids = tok.encode("Once upon a time, there was a dog.")
    owner = SimpleNamespace(tok=tok)
    assert tp.words_prefix(tok.decode(ids), 4) == "once upon a time,"
    assert tp.Measurements._tokens_for_words(owner, ids, 4) == 5  # the comma belongs to the 4th word
    assert tp.Measurements._tokens_for_words(owner, ids, 50) == len(ids)  # fewer words than asked: all


def test_the_published_numbers_are_the_reports_as_the_reports_file_holds_them():
    files = {r["file"]: r for r in published()}
    expect = {}
    for r in files.values():
        key = r["file"][:3]
        expect[f"{key}-sample"] = r["eval_perplexity"]["value"]
        vp = r["validation_perplexity"]
        expect[f"{key}-valid"] = (vp.get("per_epoch") or [None])[-1] if key == "002" else vp["final"]
        for b in r.get("bleu") or []:
            expect[f"{key}-bleu"] = b.get("bleu")
            expect |= {f"{key}-bleu{n}": b.get(f"bleu{n}") for n in (1, 2, 3, 4)}
    for row in tp.ROWS:
        assert row.report in files and row.value == expect[row.key], row.key
    text_dir = ROOT.parent / "shared" / "reports"
    if not text_dir.is_dir():
        return  # the cited lines are checked where the reports' text copies are at hand
    for row in tp.ROWS:
        line = int(re.match(r"L(\d+)", row.where).group(1))
        printed = (text_dir / row.report).read_text(encoding="utf-8").splitlines()[line - 1]
        assert re.search(rf"\b{re.escape(f'{row.value:g}')}0*\b", printed), (row.key, printed)


def test_the_part_is_registered_and_judges_the_tinylm_settings_model():
    names = list(PARTS)
    assert names.index("protocols") == names.index("tokenizers") - 1 and "protocols" in QUALITY_PARTS


def test_the_part_on_a_tiny_model_matches_the_other_parts_and_renders(tiny, tmp_path):
    model, tok, stories = tiny
    exp = ExperimentsConfig(bleu_samples=6, seed=3)
    study = SimpleNamespace(model=(model, tok), valid_texts=stories[30:], exp=exp, run_dir=tmp_path)
    out = json.loads(json.dumps({**tp.part_protocols(study), "seconds": 1.5}))  # what the stage stores
    rows = {r["key"]: r for r in out["rows"]}
    assert list(rows) == [r.key for r in tp.ROWS] and out["samples"] == 6
    for spec in tp.ROWS:
        r = rows[spec.key]
        assert r["variants"] == math.prod(len(o) for _, o in spec.choices)
        assert r["min"] <= r["closest"] <= r["max"] and all(math.isfinite(r[k]) for k in ("min", "max"))
    # tinylm's own protocol, recomputed here, is what the eval and BLEU parts compute
    own = out["tinylm_protocol"]
    assert own["valid_token_ppl"] == pytest.approx(evaluate_texts(model, tok, stories[30:])["token_ppl"], rel=1e-5)
    protocol = BleuProtocol(6, exp.prompt_tokens, None, exp.seed, exp.smoothing, exp.bleu_selection)
    samples = select_samples(tok, stories[30:], protocol, model.config.context_length).samples
    nll = reference_nll(model, samples, tok.bos_id)
    assert own["reference_ppl"] == pytest.approx(math.exp(sum(s for s, _ in nll) / sum(n for _, n in nll)), rel=1e-5)
    bleu = run_bleu(model, tok, stories[30:], protocol, [Decoding("T0.7", temperature=0.7)])["settings"][0]
    assert own["bleu_T0.7"]["bleu4"] == pytest.approx(bleu["bleu4"], rel=1e-6)
    doc = Doc()
    tp.section_protocols(doc, tmp_path, out)
    md = doc.markdown()
    assert not doc.missing and md.count("\n| 00") >= len(tp.ROWS) and "not reproducible" in md.lower()
    assert f"{rows['001-valid']['closest']:.2f}" in md and "(bleu.json: not run" in md and "2 s in all" in md
