"""Int8 weights for CPU inference: symmetric, one scale per output channel.

``quantize_rows(w)`` turns a float (out, in) matrix into int8 values and one float scale per
row (output channel): ``w ~= q * scale[:, None]``, ``scale = max |w_row| / 127``, so each row
keeps its own range and the error of one weight is at most ``scale / 2``.

``Int8Linear`` is a drop-in for ``nn.Linear`` holding such weights, and ``quantize_gpt(model)``
converts every ``nn.Linear`` of a GPT (attention, feed-forward, output head; the embedding table
and the norms stay float32: a lookup reads one row per token). The converted model runs its own
forward (prefill, evaluation, bits per byte) through ``Int8Linear`` and the decoding step
(``generation.decode``) through ``Int8Matmul`` on the same integers.

How the product is computed (``kernel``):

* ``"rowwise"`` (the default, ``--dtype int8``): W8A8, not weight-only. Each row (token) of the
  activations is quantised to int8 with its own scale at every call, the product runs in
  integers (``torch._int_mm``, exact int32 sums), and the result is scaled back per row and
  column. A row's result does not depend on the other rows of its batch.
* ``"dequantize"``: weight-only: the int8 matrix is widened to float at every call and multiplied
  in float; the closest to the float model.

Measured on a 2-core AMD EPYC (AVX-512, no VNNI), one thread, under load (CPU time, alternating
runs), greedy on bench_generate.py's 4.3M-parameter model, against float32 in the same mode:
eager, rowwise 1.34x at batch 1 and 1.43x at batch 16, dequantize 1.41x and 1.18x (reading a
quarter of the bytes outweighs the widening); compiled, rowwise 2.4x and 1.5x (inductor fuses
the activations' rounding into the code around it), dequantize 1.3x and 1.0x. On small models
the extra operations per product cost more than the bytes save (stories260K, d_model 64: slower
than float32). Bits per byte on valid.txt (20 and 200 stories): stories260K +0.001 to +0.002
rowwise, +0.0003 to +0.0008 dequantize; a 1.4M-parameter TinyStories model +0.0003 and +0.00004.
Also measured and left out: ``torch._weight_int8pack_mm`` (weight-only, one ATen kernel), 10x
slower than the float32 product on that CPU; fbgemm's dynamically quantised linear
(``quantize_dynamic``: one activation scale per call, so a row's result depends on its batch),
+0.03 bits per byte on stories260K and opaque to ``torch.compile``.
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


class Int8Matmul:
    """``x @ W + b`` for x (N, in) float, W (in, out) stored as int8 ``q_t`` with one scale per
    column (per output channel). bfloat16 inputs are widened and the result narrowed back."""

    def __init__(self, q_t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kernel: Int8Kernel):
        self.kernel = kernel
        self.q_t = q_t.contiguous()  # (in, out)
        self.scale = scale.float()  # (out,)
        self.col_scale = self.scale / QMAX  # rowwise: one factor less per call
        self.bias = None if bias is None else bias.detach().float()

    @property
    def shape(self) -> tuple[int, int]:
        """(in, out), like the float matrix it stands for in the decoding layout."""
        return tuple(self.q_t.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype != torch.float32:
            x = x.float()
        if self.kernel == "rowwise":
            row_max = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).clamp_(min=1e-30)
            xq = (x * (QMAX / row_max)).round_().to(torch.int8)
            y = torch._int_mm(xq, self.q_t) * row_max  # int32 sums, exact; times the row's scale * 127
            y = y * self.col_scale if self.bias is None else torch.addcmul(self.bias, y, self.col_scale)
        else:
            y = x @ self.q_t.to(torch.float32)
            y = y * self.scale if self.bias is None else torch.addcmul(self.bias, y, self.scale)
        return y if dtype == torch.float32 else y.to(dtype)


def quantize_transposed(w_t: torch.Tensor, bias: torch.Tensor | None, kernel: Int8Kernel) -> Int8Matmul:
    """An (in, out) float matrix (the decoding layout) and its bias as an ``Int8Matmul``."""
    q, scale = quantize_rows(w_t.t())
    return Int8Matmul(q.t(), scale, bias, kernel)


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights (one scale per output channel), for inference only.

    ``weight`` is the dequantised float matrix (what the int8 values stand for), so code that
    reads a Linear's weight (the decoding layout) sees the quantised model."""

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
        y = Int8Matmul(self.q_t, self.scale, self.bias, self.kernel)(x.reshape(-1, self.in_features))
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
