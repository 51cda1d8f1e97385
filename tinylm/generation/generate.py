"""Autoregressive generation for one prompt or a batch of prompts, with a preallocated KV cache.

The loop: prefill every prompt in one forward pass (left-padded to a common length, with a key
mask and per-row positions), then feed one token per row per step. Rows finish independently
(stop token, stop string or ``max_new_tokens``); a finished row keeps riding along in the batch
but its output no longer changes.

Context overflow: when the cache is full, the cache is dropped and re-filled with the last
``context_length // 2`` tokens of every row (a sliding window; positions restart at 0 for the
window), so generation can run past the context length. ``use_cache=False`` recomputes the whole
window (at most ``context_length`` tokens) every step instead.

Sampling draws all rows of a batch from one ``torch.Generator`` seeded with ``seed`` (the draws
Hugging Face makes), or with ``seed_per_row`` row i from its own generator seeded ``seed + i``;
greedy, beam search and per-row-seeded sampling give each row of a batch what it gets alone.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from tinylm.errors import TinyLMError
from tinylm.generation.processors import GenerationConfig, HistoryProcessor
from tinylm.generation.sampling import sample_next, select_next

PAD_TOKEN = 0  # what left padding holds; never attended to, so any id works


@dataclass
class Generated:
    tokens: list[int]  # new tokens only, without the stop token
    finish_reason: str  # "stop_token" | "stop_string" | "length"
    score: float | None = None  # beam search: length-normalised log probability


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Kept for callers of the original API: ValueError naming the bad argument."""
    GenerationConfig(temperature=temperature, top_k=top_k, top_p=top_p).validate()


def fit_prompts(prompts: Iterable[Iterable[int]], context_length: int) -> list[list[int]]:
    rows = []
    for ids in prompts:
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().tolist() if not isinstance(ids, list) else list(ids)
        if not ids:
            raise TinyLMError("the prompt encodes to no tokens; give a non-empty prompt")
        if len(ids) > context_length:
            warnings.warn(f"prompt of {len(ids)} tokens is longer than the context ({context_length}); "
                          f"keeping the last {context_length}")
            ids = ids[-context_length:]
        rows.append(ids)
    if not rows:
        raise TinyLMError("no prompts given")
    return rows


def prefill(model, rows: list[list[int]], max_len: int):
    """Run left-padded ``rows`` through the model into a new cache of ``max_len`` slots.

    Returns (cache, logits of each row's last token (B, V), next position per row (B,) or None
    when no row is padded). Slots after the prompt are marked real in the key mask up front, so
    a decoding step needs no mask building beyond slicing."""
    device = model_device(model)
    B, L = len(rows), max(len(r) for r in rows)
    ids = torch.full((B, L), PAD_TOKEN, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, L - len(row) :] = torch.tensor(row, dtype=torch.long)
    ids = ids.to(device)
    cache = model.new_kv_cache(B, max_len)
    if all(len(r) == L for r in rows):
        logits, _ = model(ids, kv_cache=cache, last_logits_only=True)
        return cache, logits[:, -1], None
    lengths = torch.tensor([len(r) for r in rows], device=device)
    real = torch.arange(L, device=device)[None, :] >= (L - lengths)[:, None]  # (B, L)
    cache.key_mask = torch.ones(B, max_len, dtype=torch.bool, device=device)
    cache.key_mask[:, :L] = real
    positions = (real.cumsum(1) - 1).clamp(min=0)
    logits, _ = model(ids, kv_cache=cache, position_ids=positions, last_logits_only=True)
    return cache, logits[:, -1], lengths.clone()


def full_forward(model, rows: list[list[int]]) -> torch.Tensor:
    """No-cache path: the logits after each row's last token, recomputing everything."""
    if all(len(r) == len(rows[0]) for r in rows):
        logits, _ = model(torch.tensor(rows, device=model_device(model)), last_logits_only=True)
        return logits[:, -1]
    return prefill(model, rows, max(len(r) for r in rows))[1]


class TokenStream:
    """Iterate to generate: each step yields, per row, the token just accepted or None (row
    finished, or ended at this step). After iteration ``results`` holds a ``Generated`` per row.

    ``decode`` (ids -> text) is needed only for ``stop_strings``.
    """

    def __init__(self, model, prompts, cfg: GenerationConfig, decode: Callable[[list[int]], str] | None = None):
        cfg.validate(model.config.vocab_size)
        if cfg.stop_strings and decode is None:
            raise ValueError("stop_strings needs a decode function (give the tokenizer)")
        self.model, self.cfg, self.decode = model, cfg, decode
        self.prompts = fit_prompts(prompts, model.config.context_length)
        self.results = [Generated([], "length") for _ in self.prompts]

    def __iter__(self) -> Iterator[list[int | None]]:
        model, cfg = self.model, self.cfg
        was_training = model.training
        model.eval()
        try:
            yield from self._steps(model, cfg)
        finally:
            model.train(was_training)

    def _steps(self, model, cfg):
        ctx = model.config.context_length
        device = model_device(model)
        B = len(self.prompts)
        seqs = [list(p) for p in self.prompts]  # prompt + accepted tokens: windows for re-prefill
        outs = [r.tokens for r in self.results]
        done = [False] * B
        n_done = 0
        stop_set = set(cfg.stop_ids)
        generator = None
        if cfg.seed is not None and cfg.seed_per_row:
            generator = [torch.Generator(device=device).manual_seed(cfg.seed + r) for r in range(B)]
        elif cfg.seed is not None:
            generator = torch.Generator(device=device).manual_seed(cfg.seed)
        history = HistoryProcessor(cfg, self.prompts, model.config.vocab_size, device)
        history = history if history.active else None
        max_len = min(ctx, max(len(p) for p in self.prompts) + cfg.max_new_tokens)

        cache = positions = tokens = None
        for step in range(cfg.max_new_tokens):
            # inference mode per step, not across the yield: the caller's code between steps
            # must not run in it
            with torch.inference_mode():
                cache, positions, tokens, token_list = self._step(
                    model, cfg, step, seqs, cache, positions, tokens, max_len, history, generator)
            emitted: list[int | None] = [None] * B
            for r, t in enumerate(token_list):
                if done[r]:
                    continue
                if t in stop_set:
                    done[r], self.results[r].finish_reason = True, "stop_token"
                    n_done += 1
                    continue
                outs[r].append(t)
                seqs[r].append(t)
                emitted[r] = t
                if cfg.stop_strings and self._hit_stop_string(outs[r]):
                    done[r], self.results[r].finish_reason = True, "stop_string"
                    n_done += 1
            yield emitted
            if n_done == B:
                break

    @staticmethod
    def _step(model, cfg, step, seqs, cache, positions, tokens, max_len, history, generator):
        """One forward pass and one token per row."""
        ctx = model.config.context_length
        if not cfg.use_cache:
            logits = full_forward(model, [s[-ctx:] for s in seqs])
        elif step == 0:
            cache, logits, positions = prefill(model, seqs, max_len)
        elif cache.length >= cache.max_len:  # full: slide the window and re-prefill
            cache, logits, positions = prefill(model, [s[-(ctx // 2) :] for s in seqs], ctx)
        else:
            pos = positions[:, None] if positions is not None else None
            logits = model(tokens[:, None], kv_cache=cache, position_ids=pos)[0][:, -1]
            if positions is not None:
                positions += 1
        if history is not None:
            logits = history(logits.float(), step)
        tokens = select_next(logits, cfg, generator)
        token_list = tokens.tolist()
        if history is not None:
            history.observe(tokens, token_list)
        return cache, positions, tokens, token_list

    def _hit_stop_string(self, ids: list[int]) -> bool:
        # only the end can hold a new match; decoding a generous tail keeps this cheap
        tail = self.decode(ids[-64:])
        return any(s in tail for s in self.cfg.stop_strings)


def generate_many(model, prompts, cfg: GenerationConfig, decode=None) -> list[Generated]:
    """Generate for several prompts at once (or beam search when ``cfg.beam_width > 1``; then each
    prompt gets ``num_return_sequences`` results, best first, flattened prompt by prompt)."""
    if cfg.beam_width > 1:
        from tinylm.generation.beam import beam_search

        return [h for hyps in beam_search(model, prompts, cfg) for h in hyps]
    stream = TokenStream(model, prompts, cfg, decode)
    for _ in stream:
        pass
    return stream.results


class TextStream:
    """Iterate to get the continuation of one prompt as text pieces, as tokens arrive.

    Each piece is the new part of decode(all new tokens), so the pieces join to exactly the final
    text; a piece ending in an incomplete UTF-8 sequence (byte-level tokens) is held back until
    the character is complete. ``result`` is the ``Generated`` record once iteration ends."""

    def __init__(self, model, decode: Callable[[list[int]], str], prompt_ids, cfg: GenerationConfig):
        if cfg.beam_width > 1:
            raise ValueError("beam_width > 1 cannot stream (the best beam is known only at the end)")
        self.decode = decode
        self.tokens = TokenStream(model, [prompt_ids], cfg, decode)

    @property
    def result(self) -> Generated:
        return self.tokens.results[0]

    def __iter__(self) -> Iterator[str]:
        shown = ""
        for emitted in self.tokens:
            if emitted[0] is None:
                continue
            text = self.decode(self.result.tokens)
            if text.endswith("\ufffd") or not text.startswith(shown) or len(text) == len(shown):
                continue
            yield text[len(shown) :]
            shown = text
        text = self.decode(self.result.tokens)
        if len(text) > len(shown) and text.startswith(shown):
            yield text[len(shown) :]


def stream_text(model, decode, prompt_ids, cfg: GenerationConfig) -> TextStream:
    return TextStream(model, decode, prompt_ids, cfg)


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
    **options,
) -> list[int]:
    """Continue one prompt; returns the new token ids (without the prompt, stopping at ``eos_id``,
    which is not included). ``options``: any other GenerationConfig field (min_p,
    repetition_penalty, no_repeat_ngram_size, min_new_tokens, stop_ids, beam_width, ...);
    ``decode`` for stop_strings."""
    decode = options.pop("decode", None)
    stop_ids = tuple(options.pop("stop_ids", ())) + ((eos_id,) if eos_id is not None else ())
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           use_cache=use_cache, seed=seed, stop_ids=stop_ids, **options)
    return generate_many(model, [prompt_ids], cfg, decode)[0].tokens


__all__ = ["Generated", "GenerationConfig", "TextStream", "TokenStream", "generate", "generate_many",
           "prefill", "sample_next", "stream_text"]
