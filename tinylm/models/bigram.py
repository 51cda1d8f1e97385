"""Neural bigram LM: embedding -> linear -> softmax, P(next | previous token).

Trained on the (previous, next) pairs of a token stream with AdamW (weight decay on the two
matrices, none on the bias, as tinylm.training.optim.param_groups does for the GPT), the GPT's
warmup + cosine schedule (tinylm.training.optim.lr_at) and early stopping on the validation loss.
The GPT trainer draws context windows; a bigram needs only pairs, so the loop here is small.
Two ways to form a step's loss: random minibatches of pairs (``mode="pairs"``), or all pairs at
once through their count matrix (``mode="counts"``: exact full-data gradient at the cost of one
softmax per distinct previous token, much faster to converge for vocabularies of a few thousand).

Pairs follow the n-gram convention (tinylm.models.ngram): never across a document boundary, so the
first token of a document is predicted from ``<sos>``; ``<sos>`` is never a target and ``<eos>``
is scored only with ``score_eos``.

The validation loss is exact and cheap: a bigram's prediction depends on the previous token
only, so the log-softmax is computed once per distinct previous token and gathered.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tinylm.config import TrainConfig
from tinylm.constants import EOS_ID, SOS_ID
from tinylm.errors import TinyLMError
from tinylm.generation.processors import GenerationConfig
from tinylm.generation.sampling import sample_from_context
from tinylm.models.gpt import eval_mode
from tinylm.training.optim import lr_at, param_groups

log = logging.getLogger(__name__)


@dataclass
class BigramConfig:
    d_embed: int = 64
    weight_decay: float = 0.1
    lr: float = 1e-2
    min_lr: float = 1e-3
    warmup_steps: int = 50
    batch_size: int = 2048  # pairs per step (mode "pairs")
    # "counts": every step uses the whole training set through its V x V matrix of pair counts
    # (exact full-batch gradient, one softmax per distinct previous token); "pairs": random
    # minibatches of pairs; "auto": counts when the vocabulary is at most counts_max_vocab
    mode: str = "pairs"
    counts_max_vocab: int = 4096
    max_steps: int = 3000
    eval_interval: int = 100
    patience: int = 4  # evaluations without improvement before stopping; 0 disables
    max_seconds: float | None = None
    seed: int = 0
    threads: int | None = None


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
    def generate(self, prompt_ids, max_new_tokens: int = 50, temperature: float = 1.0, seed: int = 0,
                 eos_id: int | None = EOS_ID, top_k: int | None = None, top_p: float | None = None) -> list[int]:
        """Sample continuation ids (temperature 0 = greedy, top-k, top-p); see ``sample_from_context``."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise TinyLMError("the neural bigram needs at least one prompt token (e.g. <sos>)")
        cfg = GenerationConfig(max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                               stop_ids=() if eos_id is None else (eos_id,))
        return sample_from_context(lambda ctx: self(torch.tensor([ctx[-1]]))[0], prompt, cfg)

    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        path = Path(path)
        torch.save({"format": "tinylm-bigram", "vocab_size": self.vocab_size, "d_embed": self.d_embed,
                    "state": self.state_dict(), "extra": extra or {}}, path)
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
    x = np.asarray(ids)
    if x.ndim != 1 or x.size == 0:
        raise TinyLMError("the token stream is empty (or not 1-D): nothing to train on or score")
    x = x.astype(np.int64, copy=False)
    if int(x.max()) >= vocab_size or int(x.min()) < 0:
        raise TinyLMError(f"the stream holds token id {int(x.max())}, outside the model's vocabulary of {vocab_size}")
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


@dataclass
class BigramResult:
    model: NeuralBigramLM
    config: BigramConfig
    history: list[dict]  # {"step", "train_loss", "val_loss"} at each evaluation
    best_val_loss: float
    steps: int
    seconds: float
    stopped_because: str


def train_bigram(train_ids, valid_ids, vocab_size: int, cfg: BigramConfig | None = None) -> BigramResult:
    """Train on the pairs of ``train_ids``; keep the weights of the best validation loss."""
    cfg = cfg or BigramConfig()
    if cfg.weight_decay < 0:
        raise TinyLMError(f"weight_decay must be >= 0 (got {cfg.weight_decay})")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    prev, nxt = stream_pairs(train_ids, vocab_size, score_eos=True)
    vprev, vnxt = stream_pairs(valid_ids, vocab_size, score_eos=True)
    if prev.size == 0 or vprev.size == 0:
        raise TinyLMError("the training or validation split holds no (previous, next) pair")
    n_val = vprev.size
    model = NeuralBigramLM(vocab_size, cfg.d_embed)
    sched = TrainConfig(lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                        weight_decay=cfg.weight_decay)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.99))
    if cfg.mode not in ("pairs", "counts", "auto"):
        raise TinyLMError(f"bigram mode {cfg.mode!r} is not one of pairs, counts, auto")
    use_counts = cfg.mode == "counts" or (cfg.mode == "auto" and vocab_size <= cfg.counts_max_vocab)
    prev_t, nxt_t = torch.from_numpy(prev), torch.from_numpy(nxt)
    g = torch.Generator().manual_seed(cfg.seed)
    if use_counts:
        rows = np.unique(prev)  # distinct previous tokens
        row_of = np.searchsorted(rows, prev)
        pair_counts = torch.zeros(rows.size, vocab_size)
        pair_counts.index_put_((torch.from_numpy(row_of), nxt_t), torch.ones(prev.size), accumulate=True)
        pair_counts /= prev.size  # the loss is then the mean NLL over all training pairs
        rows_t = torch.from_numpy(rows)
    best, best_state, bad, history = math.inf, None, 0, []
    stopped, start, step, running = "max_steps", time.perf_counter(), 0, []
    for step in range(1, cfg.max_steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, sched)
        if use_counts:
            loss = -(pair_counts * F.log_softmax(model(rows_t), dim=-1)).sum()
        else:
            idx = torch.randint(0, prev.size, (cfg.batch_size,), generator=g)
            loss = F.cross_entropy(model(prev_t[idx]), nxt_t[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        running.append(float(loss.detach()))
        out_of_time = cfg.max_seconds is not None and time.perf_counter() - start >= cfg.max_seconds
        if step % cfg.eval_interval == 0 or step == cfg.max_steps or out_of_time:
            val = pair_nll(model, vprev, vnxt) / n_val
            history.append({"step": step, "train_loss": float(np.mean(running)), "val_loss": val})
            running = []
            log.debug(f"bigram d={cfg.d_embed} wd={cfg.weight_decay}: step {step} train {history[-1]['train_loss']:.4f} valid {val:.4f}")
            if val < best - 1e-5:
                best, bad = val, 0
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                bad += 1
                if cfg.patience and bad >= cfg.patience:
                    stopped = "early_stopping"
                    break
        if out_of_time:
            stopped = "max_seconds"
            break
    model.load_state_dict(best_state)
    return BigramResult(model, cfg, history, best, step, time.perf_counter() - start, stopped)


def sweep_bigram(train_ids, valid_ids, vocab_size: int, d_embeds=(32, 128), weight_decays=(0.0, 0.1),
                 base: BigramConfig | None = None) -> list[BigramResult]:
    """One run per (embedding size, weight decay); the results sorted best validation loss first."""
    base = base or BigramConfig()
    results = [train_bigram(train_ids, valid_ids, vocab_size, dataclasses.replace(base, d_embed=d, weight_decay=wd))
               for d in d_embeds for wd in weight_decays]
    return sorted(results, key=lambda r: r.best_val_loss)
