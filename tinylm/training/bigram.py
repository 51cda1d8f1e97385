"""Training the neural bigram (tinylm.models.bigram) on the (previous, next) pairs of a token stream.

AdamW with weight decay on the two matrices and none on the bias (``param_groups``, as for the
GPT), or (``optimizer="adam_l2"``) Adam with the decay added to the gradient as an L2 term, as
the four-stage report trained it; the GPT's warmup + cosine schedule (``scheduled_lr``) and early
stopping on the validation loss. The GPT trainer draws context windows; a bigram needs only pairs,
so the loop here is small.
Two ways to form a step's loss: random minibatches of pairs (``mode="pairs"``), or all pairs at
once through their count matrix (``mode="counts"``: exact full-data gradient at the cost of one
softmax per distinct previous token, much faster to converge for vocabularies of a few thousand).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tinylm.errors import TinyLMError
from tinylm.models.bigram import NeuralBigramLM, pair_nll, stream_pairs
from tinylm.training.optim import param_groups, scheduled_lr

log = logging.getLogger(__name__)


@dataclass
class BigramConfig:
    d_embed: int = 64
    weight_decay: float = 0.1
    # adamw: decoupled decay, weights shrink by lr x weight_decay per step; adam_l2: weight_decay x w is
    # added to the gradient before Adam's normalisation (torch.optim.Adam's weight_decay)
    optimizer: str = "adamw"
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
    model = NeuralBigramLM(vocab_size, cfg.d_embed)
    if cfg.optimizer not in ("adamw", "adam_l2"):
        raise TinyLMError(f"bigram optimizer {cfg.optimizer!r} is not one of adamw, adam_l2")
    adam = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    optimizer = adam(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.99))
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
            group["lr"] = scheduled_lr(step - 1, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
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
            val = pair_nll(model, vprev, vnxt) / vprev.size
            history.append({"step": step, "train_loss": float(np.mean(running)), "val_loss": val})
            running = []
            log.debug(
                f"bigram d={cfg.d_embed} wd={cfg.weight_decay}: step {step} "
                f"train {history[-1]['train_loss']:.4f} valid {val:.4f}"
            )
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


def sweep_bigram(
    train_ids,
    valid_ids,
    vocab_size: int,
    d_embeds=(32, 128),
    weight_decays=(0.0, 0.1),
    base: BigramConfig | None = None,
) -> list[BigramResult]:
    """One run per (embedding size, weight decay); the results sorted best validation loss first."""
    base = base or BigramConfig()
    results = [
        train_bigram(train_ids, valid_ids, vocab_size, dataclasses.replace(base, d_embed=d, weight_decay=wd))
        for d in d_embeds
        for wd in weight_decays
    ]
    return sorted(results, key=lambda r: r.best_val_loss)
