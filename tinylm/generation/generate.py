"""Autoregressive generation for one prompt or a batch of prompts: ``TokenStream`` steps the
decoding core (``generation.batch.Batch``) until every row is done.

Rows finish independently (stop token, stop string or ``max_new_tokens``). A row that fills the
context slides (``core.window``: its last ``context_length // 2`` tokens prefilled again), so
generation can run past the context length; ``use_cache=False`` recomputes the whole window (at
most ``context_length`` tokens) every step instead.

Sampling draws all rows of a batch from one ``torch.Generator`` seeded with ``seed`` (the draws
Hugging Face makes), or with ``seed_per_row`` row i from its own stream seeded ``seed + i``
(``sampling.stream_uniforms``); greedy, beam search and per-row-seeded sampling give each row of
a batch what it gets alone.

Text in, text out (``complete``): each prompt is encoded after the tokenizer's start id and
continued with seed ``seed + i`` for prompt i, whether prompts run one at a time or in batches,
so the text of a prompt never depends on the others.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import torch

from tinylm.config import GenerationConfig
from tinylm.errors import TinyLMError
from tinylm.generation.batch import Batch, ErrorEvent, Row
from tinylm.generation.beam import beam_search
from tinylm.generation.core import Generated, fit_prompts, model_device
from tinylm.models.gpt import eval_mode
from tinylm.tokenizers.base import ContinuationText


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
            yield from self._steps()

    def _rows(self) -> list[Row]:
        """One row per prompt. Its tokens are read off the row after each step; its end (or an
        error) arrives as an event, which sets its result."""
        cfg, rows = self.cfg, []
        for r, prompt in enumerate(self.prompts):
            row_cfg = dataclasses.replace(cfg, seed=cfg.seed + r) if cfg.seed is not None and cfg.seed_per_row else cfg
            rows.append(Row(prompt, row_cfg, partial(self._record, r), self.decode, token_events=False))
        return rows

    def _record(self, r: int, event) -> None:
        if isinstance(event, ErrorEvent):
            raise ValueError(event.message)
        self.results[r].finish_reason = event.finish_reason

    def _steps(self):
        cfg = self.cfg
        shared = None
        if cfg.seed is not None and not cfg.seed_per_row and not cfg.greedy:  # Hugging Face's batched draws
            shared = torch.Generator(device=model_device(self.model)).manual_seed(cfg.seed)
        batch = Batch(
            self.model,
            max_batch=len(self.prompts),
            compile=cfg.compile,
            use_cache=cfg.use_cache,
            shared_generator=shared,
            keep_finished=shared is not None,
        )
        rows, counts = self._rows(), [0] * len(self.prompts)
        for step in range(cfg.max_new_tokens):
            batch.step(rows if step == 0 else ())
            if step == 0:  # the rows' own lists: they grow as the rows accept tokens
                for result, row in zip(self.results, rows):
                    result.tokens = row.out
            emitted: list[int | None] = [None] * len(rows)
            for r, row in enumerate(rows):
                if len(row.out) > counts[r]:
                    emitted[r], counts[r] = row.out[-1], len(row.out)
            yield emitted
            if all(row.finished for row in rows):
                break


def generate_many(model, prompts, cfg: GenerationConfig, decode=None, between_steps=None) -> list[Generated]:
    """Generate for several prompts at once (or beam search when ``cfg.beam_width > 1``; then each
    prompt gets ``num_return_sequences`` results, best first, flattened prompt by prompt, and
    ``between_steps`` is ``beam_search``'s)."""
    if cfg.beam_width > 1:
        return [h for hyps in beam_search(model, prompts, cfg, between_steps) for h in hyps]
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
        shown, streamed = "", ContinuationText(self.decode, [])
        for emitted in self.tokens:
            if emitted[0] is None:
                continue
            text = streamed.update(self.result.tokens)
            if text.endswith("\ufffd") or not text.startswith(shown) or len(text) == len(shown):
                continue
            yield text[len(shown) :]
            shown = text
        text = streamed.update(self.result.tokens)
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
