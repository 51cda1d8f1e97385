"""Activation memory, measured on any device: what the autograd graph keeps for backward.

``ActivationMeter`` installs ``torch.autograd.graph.saved_tensors_hooks``. Every tensor autograd
saves passes through the pack hook; the meter counts the bytes of its storage once (views of one
storage share it) and releases them when autograd drops the saved tensor (the packed handle is
garbage-collected as backward frees each node). It tracks the live total and its peak, so
recomputation inside backward (gradient checkpointing) is counted at the moment it happens.
Parameters (and anything else registered with ``exclude``) are not activations and are skipped.

On CUDA, ``cuda_peak_bytes`` reads ``torch.cuda.max_memory_allocated`` as a second measurement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


class _Saved:
    """What the pack hook hands to autograd: the tensor plus a release callback on deletion."""

    __slots__ = ("tensor", "_meter", "_key")

    def __init__(self, tensor, meter, key):
        self.tensor, self._meter, self._key = tensor, meter, key

    def __del__(self):
        if self._key is not None:
            self._meter._release(self._key)


class ActivationMeter:
    """Counts bytes of tensors saved for backward inside ``with meter:`` (forward and backward)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {_storage_key(t) for t in exclude}
        self._refs: dict[tuple[str, int], int] = {}  # storage -> number of saved tensors using it
        self._sizes: dict[tuple[str, int], int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = None

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "ActivationMeter":
        return cls(exclude=[*model.parameters(), *model.buffers()])

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key in self._excluded or t.untyped_storage().nbytes() == 0:
            return _Saved(t, self, None)
        if key not in self._refs:
            nbytes = t.untyped_storage().nbytes()
            self._sizes[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Saved(t, self, key)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key) -> None:
        if key not in self._refs:
            return
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live_bytes -= self._sizes.pop(key)

    def __enter__(self) -> "ActivationMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


def cuda_peak_bytes(device: torch.device | str | None = None) -> int | None:
    """``torch.cuda.max_memory_allocated`` since the last reset, or None off CUDA."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated(device))


@contextlib.contextmanager
def cuda_peak_scope(device=None):
    """Reset CUDA's peak counter on entry (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    yield


def measure_step_activation_bytes(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, checkpoint_blocks: Callable | None = None
) -> dict:
    """Peak bytes saved for backward during one forward + backward of ``model`` on (x, y), its
    blocks run through ``checkpoint_blocks`` when given (gradient checkpointing).

    Gradients are left in ``.grad``; the caller zeroes them. Returns peak and forward-end bytes.
    """
    meter = ActivationMeter.for_model(model)
    # only when given: a model without gradient checkpointing need not take the argument
    options = {"checkpoint_blocks": checkpoint_blocks} if checkpoint_blocks is not None else {}
    with meter:
        _, loss = model(x, y, **options)
        after_forward = meter.live_bytes
        loss.backward()
    del loss
    return {"peak_activation_bytes": meter.peak_bytes, "forward_end_bytes": after_forward}
