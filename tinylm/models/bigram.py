"""Neural bigram LM: embedding -> linear -> softmax, P(next | previous token); trained by
tinylm.training.bigram, sampled by tinylm.generation.sampling.sample_from_context.

Pairs follow the n-gram convention (tinylm.models.ngram): never across a document boundary, so the
first token of a document is predicted from ``<sos>``; ``<sos>`` is never a target and ``<eos>``
is scored only with ``score_eos``.

The validation loss is exact and cheap: a bigram's prediction depends on the previous token
only, so the log-softmax is computed once per distinct previous token and gathered.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tinylm.constants import EOS_ID, SOS_ID
from tinylm.errors import TinyLMError
from tinylm.models.gpt import eval_mode
from tinylm.models.ngram import as_stream


class NeuralBigramLM(nn.Module):
    def __init__(self, vocab_size: int, d_embed: int):
        super().__init__()
        if vocab_size < 1 or d_embed < 1:
            raise TinyLMError(f"a neural bigram needs vocab_size >= 1 and d_embed >= 1 (got {vocab_size}, {d_embed})")
        self.vocab_size, self.d_embed = vocab_size, d_embed
        self.embed = nn.Embedding(vocab_size, d_embed)
        self.out = nn.Linear(d_embed, vocab_size)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.out.weight, std=0.02)
        nn.init.zeros_(self.out.bias)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(prev))  # logits (..., V); softmax gives P(next | prev)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---------------------------------------------------------------------------- scoring
    @torch.no_grad()
    def score(self, ids, score_eos: bool = False) -> tuple[float, int]:
        """(total NLL in nats, scored tokens) over a stream; see the module docstring."""
        prev, nxt = stream_pairs(ids, self.vocab_size, score_eos=score_eos)
        if prev.size == 0:
            raise TinyLMError("the query stream holds no token to score")
        return pair_nll(self, prev, nxt), int(prev.size)

    def perplexity(self, ids, score_eos: bool = False) -> float:
        nll, n = self.score(ids, score_eos)
        return math.exp(nll / n)

    @torch.no_grad()
    def next_token_logits(self, context: list[int]) -> torch.Tensor:
        """(V,) logits of the token after ``context`` (its last token is all a bigram looks at)."""
        if not context:
            raise TinyLMError("the neural bigram needs at least one prompt token (e.g. <sos>)")
        return self(torch.tensor([context[-1]]))[0]

    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        path = Path(path)
        torch.save(
            {
                "format": "tinylm-bigram",
                "vocab_size": self.vocab_size,
                "d_embed": self.d_embed,
                "state": self.state_dict(),
                "extra": extra or {},
            },
            path,
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> "NeuralBigramLM":
        path = Path(path)
        if not path.is_file():
            raise TinyLMError(f"bigram model file {path} does not exist")
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or data.get("format") != "tinylm-bigram":
            raise TinyLMError(f"{path} is not a tinylm neural bigram file")
        model = cls(data["vocab_size"], data["d_embed"])
        model.load_state_dict(data["state"])
        return model


def stream_pairs(ids, vocab_size: int, score_eos: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(previous, next) pairs inside documents: next is never <sos>, previous is never <eos>."""
    x = as_stream(ids, vocab_size, "token stream")
    prev, nxt = x[:-1], x[1:]
    keep = (nxt != SOS_ID) & (prev != EOS_ID)
    if not score_eos:
        keep &= nxt != EOS_ID
    return prev[keep], nxt[keep]


@torch.no_grad()
def pair_nll(model: NeuralBigramLM, prev: np.ndarray, nxt: np.ndarray, rows_per_chunk: int = 512) -> float:
    """Exact summed NLL of the pairs: log-softmax once per distinct previous token."""
    with eval_mode(model):
        order = np.argsort(prev, kind="stable")
        prev_s, nxt_s = prev[order], nxt[order]
        distinct, starts = np.unique(prev_s, return_index=True)
        ends = np.append(starts[1:], prev_s.size)
        total = 0.0
        for c in range(0, distinct.size, rows_per_chunk):
            rows = torch.from_numpy(distinct[c : c + rows_per_chunk])
            logp = F.log_softmax(model(rows).float(), dim=-1)
            lo, hi = starts[c], ends[min(c + rows_per_chunk, distinct.size) - 1]
            row_index = np.searchsorted(distinct[c : c + rows_per_chunk], prev_s[lo:hi])
            total -= float(logp[torch.from_numpy(row_index), torch.from_numpy(nxt_s[lo:hi])].double().sum())
    return total
