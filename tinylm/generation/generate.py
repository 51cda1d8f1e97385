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

Text in, text out (``complete``): each prompt is encoded after the tokenizer's start id and
continued with seed ``seed + i`` for prompt i, whether prompts run one at a time or in batches,
so the text of a prompt never depends on the others.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from tinylm.config import GenerationConfig
from tinylm.errors import TinyLMError
from tinylm.generation.beam import beam_search
from tinylm.generation.core import Generated, cache_slots, fit_prompts, full_forward, model_device, prefill
from tinylm.generation.decode import decode_step, prepare_for_inference
from tinylm.generation.processors import HistoryProcessor
from tinylm.generation.sampling import select_next
from tinylm.models.gpt import eval_mode


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
        with eval_mode(self.model):
            yield from self._steps(self.model, self.cfg)

    def _steps(self, model, cfg):
        context_length = model.config.context_length
        device = model_device(model)
        B = len(self.prompts)
        seqs = [list(p) for p in self.prompts]  # prompt + accepted tokens: windows for re-prefill
        outs = [r.tokens for r in self.results]
        done = [False] * B
        stop_set = set(cfg.stop_ids)
        generator = None
        if cfg.seed is not None and cfg.seed_per_row:
            generator = [torch.Generator(device=device).manual_seed(cfg.seed + r) for r in range(B)]
        elif cfg.seed is not None:
            generator = torch.Generator(device=device).manual_seed(cfg.seed)
        history = HistoryProcessor(cfg, self.prompts, model.config.vocab_size, device)
        history = history if history.active else None
        max_len = cache_slots(context_length, max(len(p) for p in self.prompts) + cfg.max_new_tokens, cfg.compile)
        prepared = prepare_for_inference(model) if cfg.use_cache else None

        cache = positions = tokens = None
        for step in range(cfg.max_new_tokens):
            # inference mode per step, not across the yield: the caller's code between steps
            # must not run in it
            with torch.inference_mode():
                cache, positions, tokens, token_list = self._step(
                    model, prepared, cfg, step, seqs, cache, positions, tokens, max_len, history, generator
                )
            emitted: list[int | None] = [None] * B
            for r, t in enumerate(token_list):
                if done[r]:
                    continue
                if t in stop_set:
                    done[r], self.results[r].finish_reason = True, "stop_token"
                    continue
                outs[r].append(t)
                seqs[r].append(t)
                emitted[r] = t
                if cfg.stop_strings and hits_stop_string(self.decode, outs[r], cfg.stop_strings):
                    done[r], self.results[r].finish_reason = True, "stop_string"
            yield emitted
            if all(done):
                break

    @staticmethod
    def _step(model, prepared, cfg, step, seqs, cache, positions, tokens, max_len, history, generator):
        """One forward pass and one token per row."""
        context_length = model.config.context_length
        if not cfg.use_cache:
            logits = full_forward(model, [s[-context_length:] for s in seqs])
        elif step == 0:
            cache, logits, positions = prefill(model, seqs, max_len)
        elif cache.length >= cache.max_len:  # full: slide the window and re-prefill
            cache, logits, positions = prefill(model, [s[-(context_length // 2) :] for s in seqs], context_length)
        else:
            logits = decode_step(prepared, cache, tokens, positions, cfg.compile)
            if positions is not None:
                positions += 1
        if history is not None:
            logits = history(logits.float(), step)
            if not bool(torch.isfinite(logits).any(dim=-1).all()):
                raise ValueError(
                    f"no token is allowed at step {step + 1}: no_repeat_ngram_size / min_new_tokens "
                    "ban the whole vocabulary (ask for fewer new tokens or a smaller n-gram ban)"
                )
        tokens = select_next(logits, cfg, generator)
        token_list = tokens.tolist()
        if history is not None:
            history.observe(tokens, token_list)
        return cache, positions, tokens, token_list


def hits_stop_string(decode: Callable[[list[int]], str], ids: list[int], stop_strings) -> bool:
    """Whether the text of ``ids`` holds a stop string, checked after each new token: only the end
    can hold a new match, so decoding a generous tail keeps this cheap."""
    tail = decode(ids[-64:])
    return any(s in tail for s in stop_strings)


def generate_many(model, prompts, cfg: GenerationConfig, decode=None) -> list[Generated]:
    """Generate for several prompts at once (or beam search when ``cfg.beam_width > 1``; then each
    prompt gets ``num_return_sequences`` results, best first, flattened prompt by prompt)."""
    if cfg.beam_width > 1:
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
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        use_cache=use_cache,
        seed=seed,
        stop_ids=stop_ids,
        **options,
    )
    return generate_many(model, [prompt_ids], cfg, decode)[0].tokens


# ----------------------------------------------------------------------------------- text in, out
def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt's ids after the tokenizer's start id; a prompt of no tokens is an error."""
    ids = list(tokenizer.encode(prompt))
    if not ids:
        raise TinyLMError(f"prompt {prompt!r} encodes to no tokens; give a non-empty prompt")
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids


def prompt_head(tokenizer, prompt: str, prompt_ids: list[int]) -> str:
    """The text shown before the continuation: the prompt as typed, or as the model's tokenizer
    decodes it (llama2.c prints decode(prompt ids + new ids), as run.c does)."""
    return tokenizer.decode(prompt_ids) if tokenizer.decode_with_prompt else prompt


def cut_at_stop(text: str, stops) -> str:
    """End the text right after the first stop string (the token that completed it may carry more)."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text


@dataclass
class Completion:
    prompt: str
    prompt_ids: list[int]  # with the start id
    results: list[Generated]  # one, or num_return_sequences (best first) with beam search
    tokens_per_s: float  # new tokens of the prompt's batch / the batch's generation time
    stop_strings: tuple[str, ...] = ()

    def continuation(self, tokenizer, i: int = 0) -> str:
        """What result ``i`` adds after the prompt (keeps a word-level tokenizer's space)."""
        return tokenizer.decode_continuation(self.prompt_ids, self.results[i].tokens)

    def text(self, tokenizer, i: int = 0) -> str:
        """Prompt and continuation as a reader sees them, cut after any stop string."""
        text = prompt_head(tokenizer, self.prompt, self.prompt_ids) + self.continuation(tokenizer, i)
        return cut_at_stop(text, self.stop_strings)


def complete(model, tokenizer, prompts: list[str], cfg: GenerationConfig, batch_size: int = 1) -> list[Completion]:
    """Continue each prompt (``batch_size`` at a time, left-padded); prompt i samples with seed
    ``cfg.seed + i``, so batching does not change any text."""
    if batch_size < 1:
        raise TinyLMError(f"the batch size must be >= 1 (got {batch_size})")
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    per_prompt = cfg.num_return_sequences if cfg.beam_width > 1 else 1
    out = []
    for b in range(0, len(prompts), batch_size):
        chunk = encoded[b : b + batch_size]
        seed = None if cfg.seed is None else cfg.seed + b
        t0 = time.perf_counter()
        results = generate_many(
            model, chunk, dataclasses.replace(cfg, seed=seed, seed_per_row=True), decode=tokenizer.decode
        )
        rate = sum(len(r.tokens) for r in results) / max(time.perf_counter() - t0, 1e-9)
        for j, ids in enumerate(chunk):
            out.append(
                Completion(prompts[b + j], ids, results[j * per_prompt : (j + 1) * per_prompt], rate, cfg.stop_strings)
            )
    return out
