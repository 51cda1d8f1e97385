"""Mixed precision: autocast for bf16 / fp16, a gradient scaler for fp16 (CUDA only).

Weights, optimizer state and the loss stay float32; autocast runs matrix products in the lower
precision. fp16 overflows without loss scaling, and PyTorch's scaler is used on CUDA only here,
so fp16 elsewhere is refused. bf16 needs no scaler and works on CPU.
"""

from __future__ import annotations

import contextlib

import torch

from tinylm.errors import TinyLMError


def check_precision(device: torch.device, precision: str) -> None:
    """Raise a one-line error for a precision this device cannot train in."""
    if precision == "fp16" and device.type != "cuda":
        raise TinyLMError(
            f"train.precision=fp16 needs a CUDA device (its gradient scaler is CUDA-only); "
            f"on {device.type} use bf16 or fp32"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise TinyLMError("train.precision=bf16 is not supported by this GPU; use fp16 or fp32")
    if precision == "bf16" and device.type == "mps":
        raise TinyLMError("train.precision=bf16 autocast is not supported on mps here; use fp32")


def autocast(device: torch.device, precision: str):
    """A fresh autocast context for one forward pass (nullcontext for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """Enabled for fp16 on CUDA; a pass-through otherwise (scale() returns the loss unchanged)."""
    return torch.amp.GradScaler("cuda", enabled=precision == "fp16" and device.type == "cuda")
