"""The optimizers (AdamW with decoupled weight decay on matrices only; Muon for the blocks' matrices
with AdamW for the rest) and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from tinylm.config import TrainConfig
from tinylm.errors import TinyLMError
from tinylm.models.gpt import split_sizes_by_parameter


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay weight matrices (linear layers, embeddings); never biases or norm gains."""
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear twice
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic of Keller Jordan's Muon (and torch.optim.Muon)


def orthogonalize(g: torch.Tensor, steps: int = 5, dtype: str = "float32") -> torch.Tensor:
    """Newton-Schulz iteration towards U V^T of g = U S V^T: the quintic pushes every singular value
    into roughly [0.5, 1.5] in five steps, which is all Muon needs. Computed in ``dtype`` (a torch
    dtype's name, so that optimizer state stays JSON); returns g's dtype."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(getattr(torch, dtype))
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T
    x = x / x.norm().clamp(min=1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x if wide else x.T).to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Muon: SGD momentum (Nesterov) whose update is orthogonalised per weight matrix, scaled by
    sqrt(max(1, rows / cols)), with decoupled weight decay. The same arithmetic as torch.optim.Muon
    (tests compare the two), with the Newton-Schulz precision as a choice: torch's runs it in
    bfloat16, which is fast only where the CPU has bf16 matrix units (AMX) or on a GPU.

    ``split_sizes`` maps id(parameter) to row counts for a parameter that stacks several matrices
    (a fused q/k/v weight): each block of rows is orthogonalised and scaled as its own matrix, so
    the update is the one the separate matrices would get."""

    def __init__(
        self,
        params,
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: str = "float32",
        split_sizes: dict[int, tuple[int, ...]] | None = None,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                ns_dtype=ns_dtype,
            ),
        )
        self.split_sizes = dict(split_sizes or {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    raise ValueError(f"Muon updates weight matrices only (got a {p.dim()}-D parameter)")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                p.mul_(1 - group["lr"] * group["weight_decay"])
                sizes = self.split_sizes.get(id(p), p.shape[0])
                for rows, part in zip(p.split(sizes), update.split(sizes)):
                    part = orthogonalize(part, group["ns_steps"], group["ns_dtype"])
                    rows.add_(part, alpha=-group["lr"] * math.sqrt(max(1.0, rows.shape[0] / rows.shape[1])))
        return loss


class MuonWithAdamW:
    """Muon for the transformer blocks' weight matrices, AdamW for everything else, stepped as one
    optimizer: ``param_groups`` lists both (each group's ``lr_scale`` turns the schedule's rate
    into its own), ``state_dict`` numbers the parameters across both like one torch optimizer."""

    def __init__(self, muon: Muon, adamw: torch.optim.AdamW):
        self.parts = (muon, adamw)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.parts for g in opt.param_groups]

    def step(self, closure=None):
        for opt in self.parts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts:
            opt.zero_grad(set_to_none=set_to_none)

    def _sizes(self) -> list[int]:
        return [sum(len(g["params"]) for g in opt.param_groups) for opt in self.parts]

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for opt, size in zip(self.parts, self._sizes()):
            sd = opt.state_dict()
            state.update({offset + i: v for i, v in sd["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]]
            offset += size
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        offset, n_groups = 0, 0
        for opt, size in zip(self.parts, self._sizes()):
            k = len(opt.param_groups)
            groups = [
                {**g, "params": [i - offset for i in g["params"]]} for g in sd["param_groups"][n_groups : n_groups + k]
            ]
            state = {int(i) - offset: v for i, v in sd["state"].items() if offset <= int(i) < offset + size}
            opt.load_state_dict({"state": state, "param_groups": groups})
            offset, n_groups = offset + size, n_groups + k


def _fused_adamw_ok(model: torch.nn.Module) -> bool:
    """torch's fused AdamW takes floating-point parameters on CPU or CUDA."""
    return all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in model.parameters())


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """AdamW over every parameter, or (train.optimizer=muon) Muon for the 2-D weights inside the
    transformer blocks and AdamW for embeddings (value-embedding tables too), head, norm gains and
    biases. Muon's weight decay is rescaled so that a matrix shrinks by the same factor per step as
    under AdamW (lr x wd). With ``train.compile`` the AdamW parts use torch's fused kernel."""
    betas = (cfg.beta1, cfg.beta2)
    # with train.compile, AdamW's fused kernel: one pass over each tensor instead of a dozen foreach
    # ops (3.5x faster a step on a 2-core CPU, and faster than torch.compile of the step, which
    # costs seconds to minutes of compile time); the same update up to float rounding
    fused = {"fused": True} if cfg.compile and _fused_adamw_ok(model) else {}
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=betas, **fused)
    blocks = getattr(model, "blocks", None)
    matrices = set()
    if blocks is not None:
        # embedding tables inside the blocks (value embeddings) are looked up row by row, not
        # multiplied: AdamW trains them, as it does tok_emb
        tables = {id(m.weight) for m in blocks.modules() if isinstance(m, torch.nn.Embedding)}
        matrices = {id(p) for p in blocks.parameters() if p.dim() == 2 and id(p) not in tables}
    if not matrices:
        raise TinyLMError("train.optimizer=muon needs a model with transformer blocks (model.blocks)")
    hidden = [p for p in model.parameters() if id(p) in matrices and p.requires_grad]
    ns_dtype = "bfloat16" if hidden[0].is_cuda else "float32"
    muon = Muon(
        [{"params": hidden, "lr_scale": cfg.muon_lr / cfg.lr}],
        lr=cfg.muon_lr,
        weight_decay=cfg.weight_decay * cfg.lr / cfg.muon_lr,
        momentum=cfg.muon_momentum,
        ns_dtype=ns_dtype,
        split_sizes=split_sizes_by_parameter(model),
    )  # fused q/k/v (gate/up): each its own matrix
    rest = param_groups(model, cfg.weight_decay)
    for g in rest:
        g["params"] = [p for p in g["params"] if id(p) not in matrices]
    adamw = torch.optim.AdamW([g for g in rest if g["params"]], lr=cfg.lr, betas=betas, **fused)
    return MuonWithAdamW(muon, adamw)


def lr_at(step: int, cfg: TrainConfig, wall_fraction: float | None = None) -> float:
    """``scheduled_lr`` with the train config's schedule."""
    return scheduled_lr(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps, cfg.schedule, wall_fraction)


def scheduled_lr(
    step: int,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    max_steps: int,
    schedule: str = "cosine",
    wall_fraction: float | None = None,
) -> float:
    """Linear warmup over ``warmup_steps``, then cosine (or linear) decay to ``min_lr`` at ``max_steps``.

    ``wall_fraction`` (elapsed / wall budget, for ``schedule_clock="wall"``): the decay follows
    whichever budget is further spent, time or steps, so the run reaches ``min_lr`` when its time is
    up on a slow machine and at ``max_steps`` on a fast one. Warmup stays in steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if wall_fraction is not None:
        progress = min(1.0, max(progress, wall_fraction))
    if schedule == "linear":
        return lr + (min_lr - lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def wall_schedule_enabled(cfg: TrainConfig) -> bool:
    """True when the decay follows the wall clock (TrainConfig.validate: only with max_minutes)."""
    return cfg.schedule_clock == "wall"
