"""Multi-process data parallel through torchrun and DistributedDataParallel.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; ``setup_distributed``
reads them, joins the process group (nccl on GPUs, gloo on CPU) and picks the rank's device.
Without those variables everything runs as one process and no process group is created.

Sharding: the global batch of a step holds ``world * grad_accum_steps * batch_size`` rows, drawn by
``Batches.get`` as a deterministic function of (seed, step). Rank k at micro-step m takes rows
``(m * world + k) * B .. + B``, so the union over ranks and micro-steps is exactly the batch a
single process with ``world`` times the batch would draw.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from tinylm.errors import TinyLMError


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    owns_group: bool = False  # we created the process group, so we destroy it

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise TinyLMError(f"environment variable {name}={value!r} is not an integer") from exc


def setup_distributed(device_name: str = "auto") -> DistContext:
    """Join the torchrun process group when WORLD_SIZE > 1; a no-op context otherwise."""
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return DistContext()
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available() and not device_name.startswith("cpu")
    owns = not torch_dist.is_initialized()
    if owns:
        if use_cuda:
            torch.cuda.set_device(local_rank)
        torch_dist.init_process_group(backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    return DistContext(torch_dist.get_rank(), torch_dist.get_world_size(), local_rank, torch_dist.get_backend(), owns)


def rank_device(dist: DistContext, device: torch.device) -> torch.device:
    """Under DDP on GPUs each rank drives the GPU of its local rank."""
    if dist.enabled and device.type == "cuda":
        return torch.device("cuda", dist.local_rank)
    return device


def shard_rows(micro_step: int, rank: int, world_size: int, batch_size: int) -> tuple[int, int]:
    """(row_start, n_rows) of the step's global batch for this rank and micro-step."""
    return (micro_step * world_size + rank) * batch_size, batch_size


def all_reduce_sum(values: list[float], dist: DistContext, device: torch.device) -> list[float]:
    """Sum a few numbers over ranks (float64, so token counts stay exact)."""
    if not dist.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
    return t.tolist()


def gather_objects(obj, dist: DistContext) -> list:
    """Every rank's ``obj`` (in rank order) on every rank; [obj] in one process."""
    if not dist.enabled:
        return [obj]
    out = [None] * dist.world_size
    torch_dist.all_gather_object(out, obj)
    return out


def barrier(dist: DistContext) -> None:
    if dist.enabled:
        torch_dist.barrier()


def cleanup(dist: DistContext) -> None:
    if dist.owns_group and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def wrap_ddp(model: torch.nn.Module, dist: DistContext, device: torch.device) -> torch.nn.Module:
    if not dist.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel  # deferred: only multi-process runs wrap the model

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


@contextlib.contextmanager
def main_process_first(dist: DistContext):
    """Rank 0 runs the body first (e.g. writes a cache); the other ranks run it afterwards."""
    if not dist.is_main:
        barrier(dist)
    yield
    if dist.is_main:
        barrier(dist)
