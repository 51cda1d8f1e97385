"""Int8 weights for CPU inference: symmetric, one scale per output channel.

``quantize_rows(w)`` turns a float (out, in) matrix into int8 values and one float scale per
row (output channel): ``w ~= q * scale[:, None]``, ``scale = max |w_row| / 127``, so each row
keeps its own range and the error of one weight is at most ``scale / 2``.

``Int8Linear`` is a drop-in for ``nn.Linear`` holding such weights, and ``quantize_gpt(model)``
converts every linear map of a GPT (attention, feed-forward, output head; the embedding table and
the norms stay float32: a lookup reads one row per token). The integers are stored (in, out), the
layout the decoding step multiplies by, so the converted model runs training-shaped forwards
(prefill, evaluation, bits per byte) and the decoding step through the same ``int8_matmul``.

How the product is computed (``kernel``):

* ``"rowwise"`` (the default, ``--dtype int8``): W8A8, not weight-only. Each row (token) of the
  activations is quantised to int8 with its own scale at every call, the product runs in
  integers (``torch._int_mm``, exact int32 sums), and the result is scaled back per row and
  column. A row's result does not depend on the other rows of its batch.
* ``"dequantize"``: weight-only: the int8 matrix is widened to float at every call and multiplied
  in float; the closest to the float model.

Speed and bits per byte of both kernels against float32, and the kernels measured and left out
(``torch._weight_int8pack_mm``, fbgemm's ``quantize_dynamic``), are in docs/notes/int8.md.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn

from tinylm.errors import TinyLMError

Int8Kernel = Literal["rowwise", "dequantize"]
QMAX = 127  # symmetric: -127..127 (no -128, so negating a weight stays exact)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> (int8 (out, in), float32 scale (out,)) with w ~= q * scale[:, None]."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def int8_matmul(
    x: torch.Tensor, q_t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kernel: Int8Kernel
) -> torch.Tensor:
    """``x @ W + b`` for x (N, in) float, W (in, out) stored as int8 ``q_t`` with one float32 scale
    per column (output channel). bfloat16 inputs are widened and the result narrowed back."""
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.float()
    if kernel == "rowwise":
        row_max = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).clamp_(min=1e-30)
        xq = (x * (QMAX / row_max)).round_().to(torch.int8)
        y = torch._int_mm(xq, q_t) * row_max  # int32 sums, exact; times the row's scale * 127
        col_scale = scale * (1.0 / QMAX)
        y = y * col_scale if bias is None else torch.addcmul(bias, y, col_scale)
    else:
        y = x @ q_t.to(torch.float32)
        y = y * scale if bias is None else torch.addcmul(bias, y, scale)
    return y if dtype == torch.float32 else y.to(dtype)


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights (one scale per output channel), for inference only.

    ``weight`` is the dequantised float matrix (what the int8 values stand for), so code that
    reads a Linear's weight (exports, attention maps) sees the quantised model."""

    def __init__(self, linear: nn.Linear, kernel: Int8Kernel = "rowwise"):
        super().__init__()
        q, scale = quantize_rows(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("q_t", q.t().contiguous())  # (in, out): the layout both kernels read
        self.register_buffer("scale", scale)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernel = kernel

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_rows(self.q_t.t(), self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x.reshape(-1, self.in_features), self.q_t, self.scale, self.bias, self.kernel)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 {self.kernel}"


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def int8_kernel_of(model: nn.Module) -> Int8Kernel:
    """The kernel ``quantize_gpt`` gave the model's layers."""
    return next(m.kernel for m in model.modules() if isinstance(m, Int8Linear))


@torch.no_grad()
def quantize_gpt(model: nn.Module, kernel: Int8Kernel = "rowwise") -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by an ``Int8Linear``; returns the model
    in eval mode. It must be float32 on the CPU (``torch._int_mm`` with int8 inputs is a CPU path
    here); a tied output head gets its own int8 copy of the embedding matrix."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise TinyLMError(f"int8 weights need a float32 model on the CPU (got {p.dtype} on {p.device})")
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Int8Linear(linear, kernel))
    return model.eval()


InferenceDtype = Literal["float32", "bfloat16", "int8"]


def to_inference_dtype(model: nn.Module, dtype: InferenceDtype) -> nn.Module:
    """The model for decoding in ``dtype``: float32 as is, bfloat16 weights, or int8 weights
    (``quantize_gpt``, CPU only); returns the model (converted in place)."""
    if dtype == "bfloat16":
        return model.to(torch.bfloat16)
    if dtype == "int8":
        return quantize_gpt(model)
    return model
