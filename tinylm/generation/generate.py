"""Autoregressive generation: one readable loop, with a KV cache.

``sample_next`` is a pure function from logits to the next token; ``generate`` prefills the
prompt in one forward pass and then feeds one token per step. When the context is full the
cache is dropped and re-filled with the last half-context of tokens (a sliding window), so
generation can run past the context length.
"""

from __future__ import annotations

import warnings

import torch

from tinylm.errors import TinyLMError


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (got {temperature})")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (got {top_k})")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (got {top_p})")


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next ids (B,). Greedy when temperature is 0."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    seed: int | None = None,
) -> list[int]:
    """Continue one prompt; returns the new token ids (without the prompt, stopping at ``eos_id``,
    which is not included)."""
    check_sampling_args(temperature, top_k, top_p)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().tolist()
    if not ids:
        raise TinyLMError("the prompt encodes to no tokens; give a non-empty prompt")
    ctx = model.config.context_length
    if len(ids) > ctx:
        warnings.warn(f"prompt of {len(ids)} tokens is longer than the context ({ctx}); keeping the last {ctx}")
        ids = ids[-ctx:]
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()

    out: list[int] = []
    cache = model.new_kv_cache(1) if use_cache else None
    window = ids  # tokens the model sees
    pending = window  # tokens not yet fed through the model
    for _ in range(max_new_tokens):
        if cache is not None:
            if cache.length + len(pending) > ctx:  # full: re-prefill the last half-context
                window = window[-(ctx // 2) :]
                cache = model.new_kv_cache(1)
                pending = window
            logits, _ = model(torch.tensor([pending], device=device), kv_cache=cache)
        else:
            window = window[-ctx:]
            logits, _ = model(torch.tensor([window], device=device))
        next_id = int(sample_next(logits[:, -1], temperature, top_k, top_p, generator)[0])
        if eos_id is not None and next_id == eos_id:
            break
        out.append(next_id)
        window = window + [next_id]
        pending = [next_id]
    model.train(was_training)
    return out
