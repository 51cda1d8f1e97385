"""Gradient checkpointing written by hand: keep each block's input, recompute its insides in backward.

``CheckpointedBlock`` is a ``torch.autograd.Function``. Its forward runs the block under
``torch.no_grad()``, so autograd saves nothing inside the block; only the block input is kept.
Its backward re-runs the block with gradients enabled and differentiates that recomputation.

Two things must match between the first forward and the recomputation:
- the random numbers (dropout masks): the CPU and CUDA generator states are captured before the
  forward and restored, inside a ``fork_rng`` so the training run's RNG stream is left where the
  first forward put it;
- the autocast state (bf16 / fp16), since backward runs outside the caller's ``autocast`` block.

The block's parameters are passed to the Function as inputs and their gradients are returned from
backward, so they flow through the ordinary autograd graph (DistributedDataParallel's gradient
hooks fire as usual; ``torch.autograd.grad`` works too).

A GPT takes the function that runs each block as ``model(x, y, checkpoint_blocks=fn)``:
``checkpoint_function("tinylm")`` is the Function above, ``checkpoint_function("torch")`` is
``torch.utils.checkpoint``, the reference implementation.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class CheckpointedBlock(torch.autograd.Function):
    """out = block(x, rope, mask, idx=idx), storing only ``x`` (plus RNG and autocast state) for
    backward. ``idx`` (token ids, for value embeddings) is integers: it gets no gradient."""

    @staticmethod
    def forward(ctx, block: nn.Module, rope, mask, idx, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.block, ctx.rope, ctx.mask, ctx.idx = block, rope, mask, idx
        ctx.device_type = x.device.type
        ctx.autocast = _autocast_state(ctx.device_type)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_devices = [x.device] if x.device.type == "cuda" else []
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x, rope, mask, idx=idx)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        params = [p for p in ctx.block.parameters()]
        x = x.detach().requires_grad_(True)
        # fork_rng restores the generators afterwards: recomputing must not advance the run's RNG
        with torch.random.fork_rng(devices=ctx.cuda_devices, enabled=True, device_type="cuda"):
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in zip(ctx.cuda_devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
                out = ctx.block(x, ctx.rope, ctx.mask, idx=ctx.idx)
        wanted = [x] + [p for p in params if p.requires_grad]
        grads = torch.autograd.grad(out, wanted, grad_out, allow_unused=True)
        grad_x, grad_params = grads[0], iter(grads[1:])
        param_grads = tuple(next(grad_params) if p.requires_grad else None for p in params)
        return (None, None, None, None, grad_x, *param_grads)


def tinylm_checkpoint(block: nn.Module, x: torch.Tensor, rope=None, mask=None, idx=None) -> torch.Tensor:
    """A ``checkpoint_blocks`` function for ``GPT.forward`` with our autograd Function."""
    return CheckpointedBlock.apply(block, rope, mask, idx, x, *block.parameters())


def torch_checkpoint(block: nn.Module, x: torch.Tensor, rope=None, mask=None, idx=None) -> torch.Tensor:
    """The reference: PyTorch's non-reentrant checkpoint (also restores RNG state)."""
    from torch.utils.checkpoint import checkpoint  # deferred: only the reference implementation uses it

    return checkpoint(block, x, rope, mask, idx=idx, use_reentrant=False, preserve_rng_state=True)


def checkpoint_function(impl: str = "tinylm") -> Callable:
    """What ``GPT.forward(..., checkpoint_blocks=)`` takes so that every block recomputes its
    activations in backward: ``impl`` is ``train.checkpoint_impl`` (tinylm or torch)."""
    return torch_checkpoint if impl == "torch" else tinylm_checkpoint


def compiled_tinylm_checkpoint(compile_options: dict | None = None) -> Callable:
    """Our checkpoint Function around compiled blocks (``train.compile`` with ``checkpoint_impl: tinylm``).

    Dynamo cannot trace into ``CheckpointedBlock`` (it reads and restores RNG states), and a graph
    break inside the loop over blocks makes a compiled whole model fall back to eager altogether.
    So the Function stays ours and eager, and the block it runs (forward under no_grad, the
    recomputation with grad) is ``torch.compile``d: one compiled graph serves every block of the
    same shape. Parameters are the block's own, so gradients flow as with the plain Function."""
    compiled: dict[int, nn.Module] = {}

    def checkpoint_blocks(block: nn.Module, x: torch.Tensor, rope=None, mask=None, idx=None) -> torch.Tensor:
        fast = compiled.get(id(block))
        if fast is None:
            fast = compiled[id(block)] = torch.compile(block, options=compile_options)
        return CheckpointedBlock.apply(fast, rope, mask, idx, x, *block.parameters())

    return checkpoint_blocks
