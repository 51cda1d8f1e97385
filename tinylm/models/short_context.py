"""N-gram and neural bigram models behind the GPT's forward pass, so that what scores a GPT
(tinylm.evaluation.perplexity, ``tinylm evaluate``, the server's score routes) scores them the same way.

``ShortContextLM(model)(idx, targets, loss_reduction=...)`` returns ``(logits (B, T, V), loss)``
like ``GPT.forward``: the logits at position t are log P(next | idx[:, : t + 1]). An n-gram looks at
its last ``order - 1`` tokens of context (from the last ``<sos>``, as in its training streams), the
bigram at the last one, so scoring a document with the strided windows of the GPT protocol gives
each token exactly the probability the model's own ``score`` gives it on the document's stream.

``load_short_context(path)`` reads a file written by ``NGramLM.save`` (``.npz``) or
``NeuralBigramLM.save`` (what ``tinylm study shakespeare`` keeps as ``ngram-<order>.npz`` and
``bigram.pt`` beside its ``tokenizer.json``). They decode no text of their own: generation with
them is ``tinylm study``'s sampler, not the GPT's KV-cache decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tinylm.constants import IGNORE_INDEX
from tinylm.errors import TinyLMError
from tinylm.models.bigram import NeuralBigramLM
from tinylm.models.ngram import NGramLM

# windows of this many tokens: every n-gram order (<= 5) and the bigram see their whole context, and a
# batch of 32 windows of float32 log probabilities over a few thousand tokens stays near 100 MB
CONTEXT_LENGTH = 256


@dataclass
class ShortContextConfig:
    """What the served model card and the evaluation read of a model's shape."""

    kind: Literal["ngram", "bigram"]
    vocab_size: int
    order: int
    smoothing: str | None = None
    context_length: int = CONTEXT_LENGTH

    @property
    def described(self) -> str:
        return f"order-{self.order} n-gram, {self.smoothing}" if self.kind == "ngram" else "neural bigram"


class ShortContextLM(nn.Module):
    generates = False  # the GPT's KV-cache decoder does not apply (see new_kv_cache)

    def __init__(self, lm: NGramLM | NeuralBigramLM):
        super().__init__()
        if isinstance(lm, NGramLM):
            lm._check_fitted()
            self.config = ShortContextConfig("ngram", lm.V, lm.order, lm.smoothing)
            self.ngram, self.bigram = lm, None
            # the evaluation finds the device of a model from its first parameter: an n-gram has none
            self.device_anchor = nn.Parameter(torch.zeros(0), requires_grad=False)
        elif isinstance(lm, NeuralBigramLM):
            self.config = ShortContextConfig("bigram", lm.vocab_size, 2)
            self.ngram, self.bigram = None, lm
        else:
            raise TinyLMError(f"ShortContextLM takes an NGramLM or a NeuralBigramLM, not {type(lm).__name__}")

    def num_parameters(self) -> int:
        """The bigram's weights; for an n-gram, the counts it stores (one per distinct n-gram of each order)."""
        if self.bigram is not None:
            return self.bigram.num_parameters()
        return self.ngram.V + sum(int(level.keys.shape[0]) for level in self.ngram.levels[2:])

    def _ngram_logits(self, idx: torch.Tensor) -> torch.Tensor:
        rows = idx.tolist()
        out = np.empty((len(rows), len(rows[0]) if rows else 0, self.config.vocab_size), dtype=np.float32)
        with np.errstate(divide="ignore"):  # log 0 = -inf: a token Kneser-Ney leaves no mass (tiny counts)
            for b, row in enumerate(rows):
                for t in range(len(row)):
                    out[b, t] = np.log(self.ngram.distribution(_context_of(row, t, self.config.order)))
        return torch.from_numpy(out)

    def new_kv_cache(self, *_args, **_kwargs):
        raise TinyLMError(
            f"this model ({self.config.described}) is loaded for scoring only; its samples come from "
            "`tinylm study shakespeare` (the GPT's cached decoder does not apply to it)"
        )

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        loss_reduction: str = "mean",
        kv_cache=None,
        attention_out: list | None = None,
        **_unused,
    ):
        if kv_cache is not None:
            self.new_kv_cache()
        if attention_out is not None:
            raise TinyLMError(f"this model ({self.config.described}) has no attention to show")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.config.vocab_size):
            raise TinyLMError(f"token ids must be in 0..{self.config.vocab_size - 1} (the model's vocabulary)")
        logits = self.bigram(idx).float() if self.bigram is not None else self._ngram_logits(idx)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(
            logits.double().reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction=loss_reduction,
        )
        return logits, loss


def _context_of(row: list[int], t: int, order: int) -> list[int]:
    """The tokens an order-``order`` model reads to predict position t + 1 (the n-gram finds
    its ``<sos>`` in them; more would change nothing)."""
    return row[max(0, t + 2 - order) : t + 1]


def load_short_context(path: str | Path) -> ShortContextLM:
    """An n-gram ``.npz`` or a neural bigram file, as a ShortContextLM."""
    path = Path(path)
    if path.suffix == ".npz":
        return ShortContextLM(NGramLM.load(path))
    try:
        return ShortContextLM(NeuralBigramLM.load(path))
    except TinyLMError:
        raise
    except Exception as exc:  # torch.load refuses a damaged or foreign file in many ways
        raise TinyLMError(f"{path} is not a tinylm neural bigram file ({type(exc).__name__})") from exc


def looks_like_short_context(path: str | Path) -> bool:
    """A file NGramLM.save or NeuralBigramLM.save wrote (by its name, as they write them)."""
    return Path(path).suffix in (".npz", ".pt")
