"""Count-based n-gram language models over token ids, orders 1-5, counted with numpy.

Smoothings:
  ``add_k``        (c(h w) + k) / (c(h) + k V) on the longest available context (k = 1 is Laplace);
                   an unseen context gives the uniform 1/V.
  ``interpolated`` Jelinek-Mercer: sum_j lambda_j ML_j(w | h) with ML_0 = 1/V; the weights are fitted
                   by EM on held-out data (``fit_weights``). ML_j of an unseen context falls back to
                   the longest shorter context that was seen, so every component is a distribution.
  ``kneser_ney``   interpolated modified Kneser-Ney (Chen & Goodman 1998), as KenLM's ``lmplz``:
                   adjusted counts (raw counts at the highest order, numbers of distinct left
                   extensions below it), three discounts D1, D2, D3+ per order from counts of
                   adjusted counts, and the unigram level interpolated with the uniform 1/V.

Every smoothing gives, for every context, a distribution over the full vocabulary (tested).

Documents, ``<sos>`` and ``<eos>``: the training and query streams are the TokenSplit layout,
``<sos> tokens <eos>`` per document. An n-gram never crosses a document boundary: its tokens after
the first are never ``<sos>`` and its tokens before the last are never ``<eos>``. So the first
token of a document is predicted from the context ``<sos>`` alone, the second from ``<sos> t1``,
and so on (a single ``<sos>``, no padding to n-1 symbols: KenLM's convention). ``<sos>`` is
never predicted (it is not an event, so it gets no unigram count); ``<eos>`` is predicted like any
token, and ``score(..., score_eos=False)`` leaves it out of the perplexity (the protocol of
tinylm.evaluation.perplexity for the GPT). For Kneser-Ney, an occurrence with nothing to its left
(an n-gram that starts with ``<sos>``, or the first token of a stream without one) counts as its own
left extension; this is KenLM's rule that n-grams beginning with ``<s>`` keep their raw counts.

``start_padding="order"`` pads instead, as the Shakespeare four-stage report does: each ``<sos>``
becomes n-1 of them, so the first token is predicted from ``<sos> ... <sos>`` at the highest order.
Windows then may start with a run of ``<sos>``; an all-``<sos>`` window is kept as a context with
count 0 (never an event). Add-k and Jelinek-Mercer give the same probabilities either way (the
padded counts equal the unpadded ones); Kneser-Ney does not, since the padded lower-order n-grams
get continuation counts instead of raw ones.

Counting: an n-gram is an int64 key ``dense_id(its first n-1 tokens) * V + last token``, where the
dense id of an (n-1)-gram is its rank among the distinct (n-1)-grams. ``np.unique`` gives counts
and dense ids one order after the other; queries are ``np.searchsorted`` in the sorted keys. The
keys never overflow (distinct n-grams <= stream length).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np
import torch

from tinylm.config import StartPadding
from tinylm.constants import EOS_ID, SOS_ID
from tinylm.errors import TinyLMError

SMOOTHINGS = ("add_k", "interpolated", "kneser_ney")
MAX_ORDER = 5


@dataclass
class _Level:
    """The n-grams of one order k >= 2 and the statistics of their (k-1)-gram contexts."""

    keys: np.ndarray  # sorted distinct keys ctx_id * V + w
    counts: np.ndarray  # raw counts
    adjusted: np.ndarray  # Kneser-Ney adjusted counts
    ctx_total: np.ndarray | None = None  # per context id: sum of raw counts
    ctx_adjusted: np.ndarray | None = None  # per context id: sum of adjusted counts
    ctx_gamma: np.ndarray | None = None  # per context id: Kneser-Ney back-off weight


def _ok_windows(x: np.ndarray, order: int, sos_prefix: bool = False) -> list[np.ndarray]:
    """ok[k][i]: the window x[i : i + k] lies in one document and does not end with <sos>; with
    ``sos_prefix`` (padded streams) it may also hold a leading run of <sos>, or be all <sos>."""
    n = x.shape[0]
    not_sos, not_eos = x != SOS_ID, x != EOS_ID
    ok = [np.zeros(0, bool), np.ones(n, bool) if sos_prefix else not_sos.copy()]
    for k in range(2, order + 1):
        m = max(n - k + 1, 0)
        last_ok = not_sos[k - 1 : k - 1 + m]
        if sos_prefix:  # a <sos> may follow a <sos>
            last_ok = last_ok | ~not_sos[k - 2 : k - 2 + m]
        here = not_eos[k - 2 : k - 2 + m] & last_ok
        if k > 2:
            here &= ok[k - 1][:m]
        ok.append(here)
    return ok


def _group(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """np.unique(keys, return_index, return_inverse, return_counts) with one unstable argsort
    (about twice as fast); the index returned is of *an* occurrence, not necessarily the first."""
    if keys.shape[0] == 0:
        e = np.zeros(0, np.int64)
        return e, e, e, e
    order = np.argsort(keys)
    sorted_keys = keys[order]
    new = np.empty(keys.shape[0], bool)
    new[0] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, keys.shape[0]))
    inverse = np.empty(keys.shape[0], np.int64)
    inverse[order] = np.repeat(np.arange(starts.shape[0], dtype=np.int64), counts)  # faster than cumsum of bools
    return sorted_keys[starts], order[starts], inverse, counts


def _check_order(order: int) -> None:
    if not isinstance(order, (int, np.integer)) or not 1 <= order <= MAX_ORDER:
        raise TinyLMError(f"n-gram order must be an integer from 1 to {MAX_ORDER} (got {order!r})")


def as_stream(ids, vocab_size: int, what: str) -> np.ndarray:
    x = np.asarray(ids)
    if x.ndim != 1:
        raise TinyLMError(f"the {what} must be a 1-D stream of token ids (got shape {x.shape})")
    if x.size == 0:
        raise TinyLMError(f"the {what} is empty: no tokens to count or score")
    x = x.astype(np.int64, copy=False)
    lo, hi = int(x.min()), int(x.max())
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        raise TinyLMError(
            f"the {what} holds token id {bad}, outside the model's vocabulary of {vocab_size} "
            "(was it encoded with a bigger tokenizer?)"
        )
    return x


def chen_goodman_discounts(adjusted: np.ndarray) -> np.ndarray:
    """D1, D2, D3+ from counts of (adjusted) counts: D_j = j - (j+1) Y t_{j+1} / t_j,
    Y = t1 / (t1 + 2 t2). Undefined or out-of-range estimates (tiny corpora) are clipped to [0, j]
    and replaced by (0.5, 1.0, 1.5) when t1..t4 has a zero (KenLM refuses such corpora)."""
    t = np.array([np.count_nonzero(adjusted == j) for j in range(1, 5)], dtype=np.float64)
    if np.any(t == 0):
        return np.array([0.5, 1.0, 1.5])
    y = t[0] / (t[0] + 2 * t[1])
    d = np.array([j - (j + 1) * y * t[j] / t[j - 1] for j in range(1, 4)])
    return np.clip(d, 0.0, np.array([1.0, 2.0, 3.0]))


class NGramLM:
    """An n-gram LM over ids ``0 .. vocab_size - 1``; ``fit`` a stream, then score or sample."""

    def __init__(
        self,
        order: int,
        vocab_size: int,
        smoothing: str = "kneser_ney",
        k: float = 1.0,
        discounts: list[float] | None = None,
        start_padding: str = "single",
    ):
        _check_order(order)
        if start_padding not in get_args(StartPadding):
            raise TinyLMError(
                f"n-gram start_padding {start_padding!r} is not one of {', '.join(get_args(StartPadding))}"
            )
        self.start_padding = start_padding
        if smoothing not in SMOOTHINGS:
            raise TinyLMError(f"n-gram smoothing {smoothing!r} is not one of {', '.join(SMOOTHINGS)}")
        if not (isinstance(k, (int, float)) and math.isfinite(k) and k > 0):
            raise TinyLMError(f"add-k smoothing needs k > 0 (got {k!r}); k = 1 is Laplace")
        if vocab_size < 1:
            raise TinyLMError(f"vocab_size must be at least 1 (got {vocab_size})")
        self.order, self.V, self.smoothing, self.k = int(order), int(vocab_size), smoothing, float(k)
        # fixed discounts (one value for every order and count class) override Chen-Goodman's:
        # that is plain interpolated Kneser-Ney with one discount, as nltk.lm.KneserNeyInterpolated
        self.fixed_discounts = None if discounts is None else [float(d) for d in discounts]
        self.lambdas = np.full(self.order + 1, 1.0 / (self.order + 1))  # interpolation weights, j = 0..order
        self.n_train_tokens = 0

    # ------------------------------------------------------------------------------ counting
    @property
    def _padded(self) -> bool:
        return self.start_padding == "order" and self.order > 2

    def _pad(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the stream with each <sos> repeated order-1 times when padding, the original position
        of each of its tokens)."""
        if not self._padded:
            return x, np.arange(x.shape[0])
        reps = np.where(x == SOS_ID, self.order - 1, 1)
        return np.repeat(x, reps), np.repeat(np.arange(x.shape[0]), reps)

    def fit(self, ids) -> "NGramLM":
        x, _ = self._pad(as_stream(ids, self.V, "training stream"))
        V, N = self.V, self.order
        ok = _ok_windows(x, N, self._padded)
        self.unigram_counts = np.bincount(x[x != SOS_ID], minlength=V).astype(np.int64)
        if self.unigram_counts.sum() == 0:
            raise TinyLMError("the training stream holds no token to predict (only <sos>)")
        self.n_train_tokens = int(x.shape[0])
        levels: list[_Level | None] = [None, None]
        first_pos: list[np.ndarray | None] = [None, None]
        dense: list[np.ndarray | None] = [None, x]  # dense id of the k-gram starting at each position; k = 1: the token
        for k in range(2, N + 1):
            pos = np.flatnonzero(ok[k])
            keys = dense[k - 1][pos] * V + x[pos + k - 1]
            uniq, first, inverse, counts = _group(keys)
            counts[uniq % V == SOS_ID] = 0  # all-<sos> windows (padding only): contexts, not events
            ids_k = np.full(x.shape[0], -1, dtype=np.int64)
            ids_k[pos] = inverse
            levels.append(_Level(uniq, counts.astype(np.int64), counts.astype(np.int64)))
            first_pos.append(pos[first])
            dense.append(ids_k)
        # Kneser-Ney adjusted counts below the highest order: distinct left extensions, plus the
        # occurrences that have nothing to their left (n-grams starting a document)
        for k in range(1, N):
            n_types = V if k == 1 else levels[k].keys.shape[0]
            suffix_ids = dense[k][first_pos[k + 1] + 1]
            adjusted = np.bincount(suffix_ids, minlength=n_types)
            has_left = np.zeros(ok[k].shape[0], bool)  # the (k+1)-gram one step to the left is ok
            m = min(ok[k + 1].shape[0], ok[k].shape[0] - 1)
            has_left[1 : m + 1] = ok[k + 1][:m]
            lonely = np.flatnonzero(ok[k] & ~has_left & ((x != SOS_ID) if k == 1 else True))
            adjusted += np.bincount(dense[k][lonely], minlength=n_types)
            if k == 1:
                adjusted[SOS_ID] = 0
                self.unigram_adjusted = adjusted.astype(np.int64)
            else:
                adjusted[levels[k].keys % V == SOS_ID] = 0
                levels[k].adjusted = adjusted.astype(np.int64)
        if N == 1:
            self.unigram_adjusted = self.unigram_counts.copy()
        self.levels = levels
        self._finish()
        return self

    def smoothed(self, smoothing: str, k: float | None = None) -> "NGramLM":
        """The same counts under another smoothing (no recount): a shallow copy."""
        other = NGramLM(
            self.order, self.V, smoothing, self.k if k is None else k, self.fixed_discounts, self.start_padding
        )
        if hasattr(self, "levels"):
            state = {key: val for key, val in self.__dict__.items() if key not in ("smoothing", "k", "lambdas")}
            other.__dict__.update(copy.copy(state))
        return other

    def _finish(self) -> None:
        """Per-order discounts and per-context totals/back-off weights (also run after ``load``)."""
        V, N = self.V, self.order
        adj1 = self.unigram_adjusted
        self.discounts = [None, self._discounts(adj1[adj1 > 0])]
        self.unigram_total = int(self.unigram_counts.sum())
        for k in range(2, N + 1):
            lv = self.levels[k]
            n_ctx = V if k == 2 else self.levels[k - 1].keys.shape[0]
            ctx = lv.keys // V
            lv.ctx_total = np.bincount(ctx, weights=lv.counts, minlength=n_ctx)
            lv.ctx_adjusted = np.bincount(ctx, weights=lv.adjusted, minlength=n_ctx)
            d = self._discounts(lv.adjusted)
            self.discounts.append(d)
            mass = np.bincount(
                ctx, weights=np.where(lv.adjusted > 0, d[np.clip(lv.adjusted, 1, 3) - 1], 0.0), minlength=n_ctx
            )
            lv.ctx_gamma = np.divide(mass, lv.ctx_adjusted, out=np.zeros(n_ctx), where=lv.ctx_adjusted > 0)
        # the unigram level: discounted adjusted counts + the freed mass spread uniformly over V
        d1 = self.discounts[1]
        a1 = adj1.astype(np.float64)
        total = a1.sum()
        disc = np.where(adj1 > 0, d1[np.clip(adj1, 1, 3) - 1], 0.0)
        self.kn_unigram = np.maximum(a1 - disc, 0.0) / total + disc.sum() / total / V
        self.ml_unigram = self.unigram_counts / self.unigram_total

    def _discounts(self, adjusted: np.ndarray) -> np.ndarray:
        if self.fixed_discounts is not None:
            d = self.fixed_discounts
            return np.array(d * 3 if len(d) == 1 else d, dtype=np.float64)
        return chen_goodman_discounts(adjusted)

    # ------------------------------------------------------------------------------- lookups
    def _find(self, k: int, ctx_ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Index of the k-gram (ctx_id, w) in level k's keys, -1 when absent or ctx_id < 0."""
        keys = self.levels[k].keys
        if keys.shape[0] == 0:
            return np.full(np.shape(ctx_ids), -1, dtype=np.int64)
        q = np.where(ctx_ids >= 0, ctx_ids, 0) * self.V + w
        if q.size > 4096:  # sorted needles: each binary search starts near the last (cache friendly, ~4x)
            order = np.argsort(q)
            idx = np.empty(q.shape, np.int64)
            idx[order] = np.searchsorted(keys, q[order])
        else:
            idx = np.searchsorted(keys, q)
        idx = np.minimum(idx, keys.shape[0] - 1)
        return np.where((ctx_ids >= 0) & (keys[idx] == q), idx, -1)

    def _query_ids(self, x: np.ndarray, ok: list[np.ndarray]) -> list[np.ndarray]:
        """qid[j][i]: training dense id of the query window x[i : i + j] (-1 when unseen)."""
        qid = [np.zeros(0, np.int64), x]
        for j in range(2, self.order):
            m = ok[j].shape[0]
            prev = np.where(ok[j], qid[j - 1][:m], -1)
            qid.append(self._find(j, prev, x[j - 1 : j - 1 + m]))
        return qid

    def _check_fitted(self) -> None:
        if not hasattr(self, "levels"):
            raise TinyLMError("this n-gram model has not been fitted (call fit on a training stream first)")

    # --------------------------------------------------------------------------- probabilities
    def _components(self, x: np.ndarray, targets: np.ndarray) -> dict:
        """For each target position: per order k, (context available, context id, k-gram index)."""
        ok = _ok_windows(x, self.order, self._padded)
        qid = self._query_ids(x, ok)
        out = {}
        for k in range(2, self.order + 1):
            s = targets - (k - 1)
            m = ok[k].shape[0]
            inside = (s >= 0) & (s < m)
            s_c = np.clip(s, 0, max(m - 1, 0))
            avail = inside & (ok[k][s_c] if m else False)
            ctx = np.where(avail, qid[k - 1][s_c] if k > 2 else x[s_c], -1)
            out[k] = (avail, ctx, self._find(k, ctx, x[targets]))
        return out

    def token_probs(self, ids, score_eos: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(target positions, probability of each target) over a stream: every position that is
        not ``<sos>`` (and not ``<eos>`` unless ``score_eos``)."""
        self._check_fitted()
        x, original = self._pad(as_stream(ids, self.V, "query stream"))
        keep = x != SOS_ID
        if not score_eos:
            keep &= x != EOS_ID
        targets = np.flatnonzero(keep)
        w = x[targets]
        comp = self._components(x, targets)
        if self.smoothing == "kneser_ney":
            p = self.kn_unigram[w]
            for k in range(2, self.order + 1):
                avail, ctx, idx = comp[k]
                lv = self.levels[k]
                ctx_c = np.maximum(ctx, 0)
                seen = avail & (ctx >= 0) & (lv.ctx_adjusted[ctx_c] > 0)
                a = np.where(idx >= 0, lv.adjusted[np.maximum(idx, 0)], 0)
                d = np.where(a > 0, self.discounts[k][np.clip(a, 1, 3) - 1], 0.0)
                denom = np.where(seen, lv.ctx_adjusted[ctx_c], 1.0)
                p = np.where(seen, np.maximum(a - d, 0.0) / denom + lv.ctx_gamma[ctx_c] * p, p)
            return original[targets], p
        if self.smoothing == "add_k":
            num = self.unigram_counts[w].astype(np.float64)
            den = np.full(w.shape, float(self.unigram_total))
            for k in range(2, self.order + 1):
                avail, ctx, idx = comp[k]
                lv = self.levels[k]
                c = np.where(idx >= 0, lv.counts[np.maximum(idx, 0)], 0)
                tot = np.where(ctx >= 0, lv.ctx_total[np.maximum(ctx, 0)], 0.0)
                num, den = np.where(avail, c, num), np.where(avail, tot, den)
            return original[targets], (num + self.k) / (den + self.k * self.V)
        return original[targets], self.lambdas @ self._ml_matrix(w, comp)

    def _ml_matrix(self, w: np.ndarray, comp: dict) -> np.ndarray:
        """Rows j = 0..order: ML_j of each target (see the module docstring)."""
        rows = [np.full(w.shape, 1.0 / self.V), self.ml_unigram[w]]
        for k in range(2, self.order + 1):
            avail, ctx, idx = comp[k]
            lv = self.levels[k]
            tot = np.where(ctx >= 0, lv.ctx_total[np.maximum(ctx, 0)], 0.0)
            c = np.where(idx >= 0, lv.counts[np.maximum(idx, 0)], 0)
            seen = avail & (tot > 0)
            rows.append(np.where(seen, c / np.where(seen, tot, 1.0), rows[-1]))
        return np.stack(rows)

    def set_weights(self, weights) -> np.ndarray:
        """Fixed interpolation weights instead of fitted ones: one per component j = 0..order
        (0 is the uniform 1/V, 1 the unigram, ...), scaled to sum to 1."""
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (self.order + 1,) or np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
            raise TinyLMError(
                f"an order-{self.order} model needs {self.order + 1} interpolation weights >= 0 "
                f"(uniform, unigram, ...), not all 0 (got {list(weights)})"
            )
        self.lambdas = w / w.sum()
        return self.lambdas

    def fit_weights(self, ids, iterations: int = 50, tol: float = 1e-6) -> np.ndarray:
        """EM for the interpolation weights on held-out ids (the validation split)."""
        self._check_fitted()
        x, _ = self._pad(as_stream(ids, self.V, "held-out stream"))
        targets = np.flatnonzero(x != SOS_ID)
        if targets.size == 0:
            raise TinyLMError("the held-out stream holds no token to predict")
        ml = self._ml_matrix(x[targets], self._components(x, targets))
        lam = np.full(self.order + 1, 1.0 / (self.order + 1))
        prev = -np.inf
        for _ in range(iterations):
            mix = lam @ ml
            ll = float(np.log(mix).mean())
            lam = (lam[:, None] * ml / mix).mean(axis=1)
            if ll - prev < tol:
                break
            prev = ll
        self.lambdas = lam / lam.sum()
        return self.lambdas

    def distribution(self, context) -> np.ndarray:
        """P(w | context) for every w in the vocabulary. As in the streams, the context starts at
        its last ``<sos>`` (padded to order - 1 of them with ``start_padding="order"``) and nothing
        before an ``<eos>`` is context."""
        self._check_fitted()
        ctx = [int(t) for t in context]
        if ctx and (min(ctx) < 0 or max(ctx) >= self.V):
            raise TinyLMError(f"context token ids must be in 0..{self.V - 1} (the model's vocabulary)")
        for i in range(len(ctx) - 1, -1, -1):
            if ctx[i] == EOS_ID:
                ctx = ctx[i + 1 :]
                break
            if ctx[i] == SOS_ID:
                ctx = [SOS_ID] * (self.order - 1 if self._padded else 1) + ctx[i + 1 :]
                break
        ctx = ctx[-(self.order - 1) :] if self.order > 1 else []
        sfx = {j: self._dense_id(ctx[-j:]) for j in range(1, len(ctx) + 1)}  # -1: unseen
        V = self.V
        if self.smoothing == "add_k":
            j = len(ctx)
            counts, tot = (
                (self.unigram_counts.astype(np.float64), float(self.unigram_total))
                if j == 0
                else self._row(j + 1, sfx[j], "counts")
            )
            return (counts + self.k) / (tot + self.k * V)
        if self.smoothing == "kneser_ney":
            p = self.kn_unigram.copy()
            for j in range(1, len(ctx) + 1):
                lv = self.levels[j + 1]
                cid = sfx[j]
                if cid < 0 or lv.ctx_adjusted[cid] <= 0:
                    break
                lo, hi = np.searchsorted(lv.keys, [cid * V, (cid + 1) * V])
                a = lv.adjusted[lo:hi]
                d = self.discounts[j + 1][np.clip(a, 1, 3) - 1]
                p = lv.ctx_gamma[cid] * p
                p[lv.keys[lo:hi] % V] += np.maximum(a - d, 0.0) / lv.ctx_adjusted[cid]
            return p
        rows = [np.full(V, 1.0 / V), self.ml_unigram.copy()]
        for j in range(1, self.order):
            counts, tot = self._row(j + 1, sfx[j], "counts") if j <= len(ctx) else (None, 0.0)
            rows.append(counts / tot if tot > 0 else rows[-1])
        return self.lambdas @ np.stack(rows)

    def kn_terms(self, context) -> tuple[np.ndarray, float]:
        """Kneser-Ney at the level of the whole (seen) context: P(w | h) = alpha(w) + gamma P(w | h')
        with h' = h without its first token. Returns (alpha over the vocabulary, gamma)."""
        self._check_fitted()
        ctx = [int(t) for t in context]
        if not 1 <= len(ctx) < self.order:
            raise TinyLMError(f"a context of {len(ctx)} tokens has no level in an order-{self.order} model")
        k = len(ctx) + 1
        cid = self._dense_id(ctx)
        lv = self.levels[k]
        if cid < 0 or lv.ctx_adjusted[cid] <= 0:
            raise TinyLMError(f"context {ctx} was not seen in training")
        a, _ = self._row(k, cid, "adjusted")
        d = np.where(a > 0, self.discounts[k][np.clip(a, 1, 3).astype(int) - 1], 0.0)
        return np.maximum(a - d, 0.0) / lv.ctx_adjusted[cid], float(lv.ctx_gamma[cid])

    def _dense_id(self, tokens: list[int]) -> int:
        """Training dense id of a (len >= 1)-gram, -1 when unseen."""
        cur = tokens[0]
        for j in range(2, len(tokens) + 1):
            cur = int(self._find(j, np.array([cur]), np.array([tokens[j - 1]]))[0])
            if cur < 0:
                return -1
        return cur

    def _row(self, k: int, cid: int, what: str) -> tuple[np.ndarray, float]:
        """Raw counts over the vocabulary of the k-grams whose context has dense id ``cid``."""
        row = np.zeros(self.V)
        if cid < 0:
            return row, 0.0
        lv = self.levels[k]
        lo, hi = np.searchsorted(lv.keys, [cid * self.V, (cid + 1) * self.V])
        row[lv.keys[lo:hi] % self.V] = getattr(lv, what)[lo:hi]
        return row, float(row.sum())

    # ------------------------------------------------------------------------------- metrics
    def score(self, ids, score_eos: bool = False) -> tuple[float, int]:
        """(total NLL in nats, number of scored tokens) over a stream."""
        _, p = self.token_probs(ids, score_eos=score_eos)
        if p.size == 0:
            raise TinyLMError("the query stream holds no token to score")
        return float(-np.log(p).sum()), int(p.size)

    def perplexity(self, ids, score_eos: bool = False) -> float:
        nll, n = self.score(ids, score_eos)
        return math.exp(nll / n)

    def next_token_logits(self, context) -> torch.Tensor:
        """log P(w | context) over the vocabulary: the logits ``sample_from_context`` shapes and samples."""
        return torch.from_numpy(self.distribution(context)).log()

    # ----------------------------------------------------------------------------- save/load
    def save(self, path: str | Path) -> Path:
        self._check_fitted()
        path = Path(path)
        arrays = {
            "unigram_counts": self.unigram_counts,
            "unigram_adjusted": self.unigram_adjusted,
            "lambdas": self.lambdas,
        }
        for k in range(2, self.order + 1):
            lv = self.levels[k]
            arrays.update({f"keys{k}": lv.keys, f"counts{k}": lv.counts, f"adjusted{k}": lv.adjusted})
        meta = {
            "format": "tinylm-ngram",
            "version": 1,
            "order": self.order,
            "vocab_size": self.V,
            "smoothing": self.smoothing,
            "k": self.k,
            "fixed_discounts": self.fixed_discounts,
            "start_padding": self.start_padding,
            "n_train_tokens": self.n_train_tokens,
        }
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "NGramLM":
        path = Path(path)
        if not path.is_file():
            raise TinyLMError(f"n-gram model file {path} does not exist")
        try:
            data = np.load(path)
            meta = json.loads(bytes(data["meta"]).decode())
        except Exception as exc:  # not an npz, or no meta entry
            raise TinyLMError(f"{path} is not a tinylm n-gram model file ({exc})") from exc
        if meta.get("format") != "tinylm-ngram":
            raise TinyLMError(f"{path} is not a tinylm n-gram model file")
        lm = cls(
            meta["order"],
            meta["vocab_size"],
            meta["smoothing"],
            meta["k"],
            meta["fixed_discounts"],
            meta.get("start_padding", "single"),
        )
        lm.unigram_counts, lm.unigram_adjusted = data["unigram_counts"], data["unigram_adjusted"]
        lm.lambdas, lm.n_train_tokens = data["lambdas"], meta["n_train_tokens"]
        lm.levels = [None, None] + [
            _Level(data[f"keys{k}"], data[f"counts{k}"], data[f"adjusted{k}"]) for k in range(2, lm.order + 1)
        ]
        lm._finish()
        return lm

    def __repr__(self) -> str:
        return f"NGramLM(order={self.order}, vocab_size={self.V}, smoothing={self.smoothing!r})"
