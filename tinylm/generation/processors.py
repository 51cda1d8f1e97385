"""The logits processing the decoding knobs (tinylm.config.GenerationConfig) imply.

Processing order (the order Hugging Face applies them, so results are comparable):

    repetition penalty -> no-repeat n-gram ban -> min_new_tokens (stop ids banned)
    -> temperature -> top-k -> top-p -> min-p

The first three change *which* tokens may come next and also apply to beam search (on log
probabilities, as HF does); the last four shape the sampling distribution and only apply when
sampling (temperature > 0).
"""

from __future__ import annotations

import torch

from tinylm.config import GenerationConfig

NEG_INF = float("-inf")


# ------------------------------------------------------------------------- distribution shaping
def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep exactly ``k`` logits per row (the rest -inf). Among logits tied at the k-th largest
    value, the lowest token ids are kept, so the result never depends on topk's tie order."""
    if k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    keep = logits >= kth
    if bool((keep.sum(-1) > k).any()):  # ties at the k-th value (rare): keep the lowest ids
        above = logits > kth
        tied = logits == kth
        room = k - above.sum(-1, keepdim=True)  # how many tied tokens still fit
        keep = above | (tied & (tied.cumsum(-1) <= room))
    return logits.masked_fill(~keep, NEG_INF)


def top_p_filter(logits: torch.Tensor, top_p: float, candidates: int | None = None) -> torch.Tensor:
    """Nucleus filter: keep the most likely tokens until their probability reaches ``top_p``
    (always at least one). ``candidates``: only that many finite logits exist per row (after
    top-k), so only they are sorted instead of the whole vocabulary."""
    if top_p >= 1.0:
        return logits
    if candidates is not None and candidates < logits.size(-1):
        values, order = torch.topk(logits, candidates, dim=-1)  # sorted, descending
    else:
        values, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(values, dim=-1)
    mass_before = probs.cumsum(-1) - probs  # probability of the more likely tokens
    drop = mass_before >= top_p
    drop[..., 0] = False
    return torch.full_like(logits, NEG_INF).scatter(-1, order, values.masked_fill(drop, NEG_INF))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, NEG_INF)


def shape_distribution(logits: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on float logits (B, V); used when sampling."""
    logits = logits / cfg.temperature
    if cfg.top_k is not None:
        logits = top_k_filter(logits, cfg.top_k)
    if cfg.top_p is not None and cfg.top_p < 1.0:
        logits = top_p_filter(logits, cfg.top_p, candidates=cfg.top_k)
    if cfg.min_p:
        logits = min_p_filter(logits, cfg.min_p)
    return logits


# --------------------------------------------------------------------------- history-based bans
class HistoryProcessor:
    """Repetition penalty, no-repeat n-grams and min_new_tokens: rules that depend on what each
    row has produced so far. Keeps O(1)-per-step state (a seen-token mask, an n-gram table) so
    nothing is re-scanned at each step. ``reorder`` follows beam search's row shuffles."""

    def __init__(self, cfg: GenerationConfig, rows: list[list[int]], vocab_size: int, device):
        self.cfg = cfg
        self.penalty = cfg.repetition_penalty if cfg.repetition_penalty != 1.0 else None
        self.n = cfg.no_repeat_ngram_size
        self.stop_ids = torch.tensor(sorted(set(cfg.stop_ids)), dtype=torch.long, device=device)
        self.seen = None
        if self.penalty is not None:
            self.seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
            for r, ids in enumerate(rows):
                if ids:
                    self.seen[r, torch.tensor(ids, device=device)] = True
        self.history: list[list[int]] = [list(ids) for ids in rows] if self.n else []
        self.banned: list[dict[tuple, set]] = []
        if self.n:
            for ids in self.history:
                table: dict[tuple, set] = {}
                for i in range(len(ids) - self.n + 1):
                    table.setdefault(tuple(ids[i : i + self.n - 1]), set()).add(ids[i + self.n - 1])
                self.banned.append(table)

    @property
    def active(self) -> bool:
        return self.penalty is not None or self.n > 0 or (self.cfg.min_new_tokens > 0 and self.stop_ids.numel() > 0)

    def __call__(self, scores: torch.Tensor, step: int) -> torch.Tensor:
        """scores (rows, V): logits, or log probabilities in beam search. ``step``: tokens
        generated so far."""
        if self.penalty is not None:
            penalised = torch.where(scores > 0, scores / self.penalty, scores * self.penalty)
            scores = torch.where(self.seen, penalised, scores)
        if self.n:
            cloned = False
            for r, ids in enumerate(self.history):
                if len(ids) < self.n - 1:
                    continue
                ban = self.banned[r].get(tuple(ids[len(ids) - self.n + 1 :]) if self.n > 1 else ())
                if ban:
                    if not cloned:
                        scores, cloned = scores.clone(), True
                    scores[r, list(ban)] = NEG_INF
        if step < self.cfg.min_new_tokens and self.stop_ids.numel():
            scores = scores.index_fill(-1, self.stop_ids, NEG_INF)
        return scores

    def observe(self, tokens: torch.Tensor, token_list: list[int] | None = None) -> None:
        """Record each row's new token (tokens: (rows,))."""
        if self.seen is not None:
            self.seen.scatter_(1, tokens[:, None], True)
        if self.n:
            for r, t in enumerate(token_list if token_list is not None else tokens.tolist()):
                ids = self.history[r]
                ids.append(t)
                if len(ids) >= self.n:
                    self.banned[r].setdefault(tuple(ids[len(ids) - self.n : -1]), set()).add(t)

    def reorder(self, rows: list[int]) -> None:
        if self.seen is not None:
            self.seen = self.seen[torch.tensor(rows, device=self.seen.device)]
        if self.n:
            self.history = [list(self.history[r]) for r in rows]
            self.banned = [{k: set(v) for k, v in self.banned[r].items()} for r in rows]
