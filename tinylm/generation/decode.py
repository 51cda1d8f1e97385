"""One decoding step: the model's own forward with ``cache_slot``, eager or under ``torch.compile``.

``decode_step(model, cache, tokens, positions)`` feeds one token per row into the next slot of a
preallocated ``KVCache`` and returns the next-token logits. Compiled (``compile=True``), the model
attends over *every* slot of the cache under a mask, so all shapes are fixed by (batch, cache
slots): the same step compiles once per shape (paid once per process and shape) and runs with no
per-step branching on the length; eager, it attends over the slots filled so far. Prompts are
filled by the model's forward without a slot (``generation.core.prefill``). Call
``model.prepare_for_decoding()`` once per generation first.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from tinylm.models.gpt import GPT, KVCache, Linear, StepPrompts

log = logging.getLogger(__name__)

_compiled: dict[str, Callable] = {}  # device type -> the step under torch.compile
_compiled_shapes: dict[tuple, float] = {}  # (B, S, dtype, ...) -> seconds its first call took
# CPU: the C++ wrapper calls the kernels without Python in between (measured 1.2x the Python
# wrapper on stories260K at batch 1); CUDA: CUDA graphs replay the whole step as one launch
STEP_COMPILE_OPTIONS = {"cpu": dict(options={"cpp_wrapper": True}), "cuda": dict(mode="reduce-overhead")}
_limit_raised = threading.local()


def _step(model: GPT, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, prompts=None):
    logits, _ = model(tokens[:, None], kv_cache=cache, position_ids=positions, cache_slot=slot, step_prompts=prompts)
    return logits[:, 0]


def compiled_step(device_type: str) -> Callable:
    """The step under ``torch.compile`` (one compiled function per process and device type; each
    new shape compiles on its first call)."""
    if not getattr(_limit_raised, "done", False):
        import torch._dynamo  # deferred: eager decoding never loads the compiler stack

        # each (batch, cache slots) shape is one more compile; dynamo's settings are per thread,
        # so every thread that decodes (a server's scheduler thread too) raises the limit once
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _limit_raised.done = True
    if device_type not in _compiled:
        _compiled[device_type] = torch.compile(
            _step, dynamic=False, fullgraph=True, **STEP_COMPILE_OPTIONS.get(device_type, {})
        )
    return _compiled[device_type]


def _mark_static(model: GPT, cache: KVCache) -> None:
    """Tell CUDA graphs that the decoding weights and the cache keep their addresses from step to
    step: the graph then reads them in place and may write the cache (a graph over inputs it must
    copy in refuses in-place writes and would not be used)."""
    import torch._dynamo  # deferred: eager decoding never loads the compiler stack

    marked = (id(model), cache.k[0].data_ptr())  # a beam search's first reorder makes new cache tensors
    if getattr(cache, "_marked_static", None) == marked:
        return
    layouts = [m.decode_layout[0] for m in model.modules() if isinstance(m, Linear) and m.decode_layout is not None]
    for t in (*layouts, *cache.k, *cache.v):
        if t is not None:
            torch._dynamo.mark_static_address(t)
    cache._marked_static = marked


def decode_step(
    model: GPT,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor | None = None,
    compile: bool = False,
    prompts: StepPrompts | None = None,
) -> torch.Tensor:
    """Feed ``tokens`` (B,) into ``cache`` at its next slot; returns the next-token logits (B, V).

    positions: (B,) the tokens' positions (left-padded rows); default: the slot index.
    prompts: rows joining with their whole prompts, in the cache rows after the B
    (``gpt.step_prompts`` at this slot; eager only): their logits follow, (B + prompts, V).
    Call under ``torch.inference_mode()``."""
    if cache.length >= cache.max_len:
        raise ValueError(f"the KV cache is full ({cache.max_len} slots); re-prefill a shorter window")
    slot = torch.tensor([cache.length], device=tokens.device)
    if positions is None:
        positions = slot.expand(tokens.shape[0])
    if prompts is not None and compile:
        raise ValueError("joining prompts ride along an eager step only (a compiled step has fixed shapes)")
    if not compile:
        logits = _step(model, cache, tokens, positions, slot, prompts)
    else:
        # what the compiled code is specialised on: shapes, dtype, device, padding (not the weights' values)
        shape = (
            tuple(cache.k[0].shape),
            len(cache.k),
            cache.k[0].dtype,
            tokens.device.type,
            cache.key_mask is None,
            id(model),
        )
        first = shape not in _compiled_shapes
        t0 = time.perf_counter()
        cuda = tokens.device.type == "cuda"
        if cuda:  # CUDA graphs: a new step may reuse the last step's output memory
            _mark_static(model, cache)
            torch.compiler.cudagraph_mark_step_begin()
        logits = compiled_step(tokens.device.type)(model, cache, tokens, positions, slot)
        if cuda:
            logits = logits.clone()
        if first:
            _compiled_shapes[shape] = time.perf_counter() - t0
            log.info(
                "compiled the decoding step for batch %d x %d cache slots in %.1f s (once per process and shape)",
                cache.batch_size,
                cache.max_len,
                _compiled_shapes[shape],
            )
    cache.length += 1
    return logits
