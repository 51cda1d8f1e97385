"""`tinylm evaluate --adapter ADAPTER.py`: a student's whole model scored on tinylm's protocol.

The adapter's ``model_info``, ``model_encode``, ``model_decode``, ``model_logits`` and
``model_generate`` run in the student's own process (``sandbox``: for `tinylm evaluate --adapter`
the plain process, with tinylm importable and the environment kept, since the adapter may wrap a
tinylm checkpoint; for a class's students the namespace sandbox), and tinylm's own scoring drives
them: the student's logits become a module that ``evaluation.perplexity.evaluate_texts`` scores
exactly as it scores a tinylm checkpoint (each document alone from the start id, the same windows,
the same batches, the loss in float32), so an adapter wrapping a tinylm checkpoint gives that
checkpoint's numbers. The KV cache's speed-up is timed here, around the student's process, the same
way for every adapter. BLEU (``--bleu``) is ``evaluation.protocol.run_bleu`` on that module: the
same stories, prompts and references, and tinylm's own decoding loop choosing each token from the
student's logits (greedy or sampled; no cache, so every step sends the whole sequence; beam search
is left out), the texts from ``model_decode``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import BinaryIO

import torch
import torch.nn.functional as F
from torch import nn

from tinylm.constants import IGNORE_INDEX
from tinylm.courses.sandbox import DEFAULT_MEMORY_BYTES, STARTUP_SECONDS, Limits, Sandbox
from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import evaluate_texts
from tinylm.evaluation.protocol import BleuProtocol, Decoding, run_bleu

CALL_SECONDS = 300.0  # one batch of logits, or one generation, on a slow student model
REPLY_BYTES = 4 << 30  # a batch of logits over a large vocabulary: 32 x 256 x 50,257 float32 is 1.6 GB
CPU_SECONDS = 6 * 3600  # the whole evaluation: a guard against a runaway process, not a budget
ENCODE_CHUNK = 64  # documents encoded per request
SPEEDUP_PROMPT, SPEEDUP_TOKENS, SPEEDUP_ROUNDS = 16, 64, 3

DEFINITIONS = {
    "token_ppl": "exp(total NLL / predicted tokens); each document encoded alone by model_encode, "
    "model_info's bos_id first, every later token predicted (windows of the context length, stride half of "
    "it, for a longer document)",
    "bpb": "total NLL / (ln 2 x the UTF-8 bytes of the documents): comparable across tokenizers",
    "word_ppl": "exp(total NLL / whitespace-separated words of the documents): comparable across tokenizers",
    "kv_speedup": f"median time of greedy generation of up to {SPEEDUP_TOKENS} tokens from the first "
    f"{SPEEDUP_PROMPT} tokens of the first document without the cache over with it "
    f"({SPEEDUP_ROUNDS} rounds each, alternated, one torch thread, after one untimed warm-up each)",
}


def call(sandbox: Sandbox, function: str, calls: list[dict]):
    """The adapter's ``function`` on each call's arguments (a list of outputs for several calls),
    or a TinyLMError naming what went wrong in the student's process."""
    reply = sandbox.call({"function": function, "calls": calls, "grad": [], "projection": None})
    if reply["status"] != "ok":
        detail = f": {reply['error']}" if reply.get("error") else ""
        raise TinyLMError(f"the adapter's {function} {reply['status']}{detail}")
    return reply["output"]


def ids_of(output) -> list[int]:
    if isinstance(output, torch.Tensor):
        return [int(i) for i in output.flatten().tolist()]
    return [int(float(i)) for i in output]


class AdapterLM(nn.Module):
    """The student's ``model_logits`` as the module tinylm's scoring expects: ``forward(idx,
    targets, loss_reduction)`` returns (logits, loss), the loss as ``GPT.forward`` computes it."""

    def __init__(self, sandbox: Sandbox, context_length: int, vocab_size: int | None = None):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(0), requires_grad=False)  # where the scoring puts its inputs
        self.config = SimpleNamespace(context_length=context_length, vocab_size=vocab_size)
        self.sandbox = sandbox

    def forward(self, idx, targets=None, loss_reduction="mean", last_logits_only=False):
        logits = call(self.sandbox, "model_logits", [{"tokens": idx}])
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(idx.shape):
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TinyLMError(f"the adapter's model_logits returned {shape} for tokens {tuple(idx.shape)}; (B, T, V)")
        if targets is None:
            return (logits[:, -1:] if last_logits_only else logits), None
        wide = logits.float().reshape(-1, logits.shape[-1])
        return logits, F.cross_entropy(wide, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction=loss_reduction)


class AdapterTokenizer:
    """The student's ``model_encode``, every document encoded up front (a request per chunk)."""

    def __init__(self, sandbox: Sandbox, bos_id: int | None, texts: list[str], stop_ids: tuple[int, ...] = ()):
        self.sandbox, self.bos_id, self.stop_ids = sandbox, bos_id, stop_ids
        self.ids: dict[str, list[int]] = {}
        for start in range(0, len(texts), ENCODE_CHUNK):
            chunk = texts[start : start + ENCODE_CHUNK]
            outputs = call(sandbox, "model_encode", [{"text": t} for t in chunk])
            for text, output in zip(chunk, outputs if len(chunk) > 1 else [outputs]):
                self.ids[text] = ids_of(output)

    def encode(self, text: str) -> list[int]:
        return self.ids[text]

    def decode(self, ids: list[int]) -> str:
        text = call(self.sandbox, "model_decode", [{"ids": [int(i) for i in ids]}])
        if not isinstance(text, str):
            raise TinyLMError(f"the adapter's model_decode returned {type(text).__name__}; a str")
        return text


def kv_speedup(sandbox: Sandbox, prompt: list[int], context_length: int) -> dict:
    """Greedy generation timed with and without the student's cache, around their process."""
    n_new = max(1, min(SPEEDUP_TOKENS, context_length - len(prompt)))
    arguments = {"prompt": prompt, "max_new_tokens": n_new}
    for use_cache in (True, False):  # warm-up: first-call costs (allocations, lazy loading) are not timed
        call(sandbox, "model_generate", [{**arguments, "max_new_tokens": 2, "use_cache": use_cache}])
    seconds: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    for _ in range(SPEEDUP_ROUNDS):
        for use_cache in (True, False):
            start = time.perf_counter()
            tokens[use_cache] = ids_of(call(sandbox, "model_generate", [{**arguments, "use_cache": use_cache}]))
            seconds[use_cache].append(time.perf_counter() - start)
    cached, uncached = statistics.median(seconds[True]), statistics.median(seconds[False])
    return {
        "kv_speedup": uncached / cached,
        "new_tokens": n_new,
        "cached_tokens_per_s": n_new / cached,
        "uncached_tokens_per_s": n_new / uncached,
        "same_tokens": tokens[True] == tokens[False],
    }


def evaluate_adapter(
    adapter: str | Path,
    texts: list[str],
    batch_size: int = 32,
    speedup: bool = True,
    memory_bytes: int | None = None,
    bleu: tuple[BleuProtocol, list[Decoding], Path | None] | None = None,
    trusted: bool = True,
    visible: Path | None = None,
    output: BinaryIO | None = None,
) -> dict:
    """The protocol's numbers for the adapter's model on ``texts``: tinylm's metrics (token_ppl,
    bpb, word_ppl, ...), the KV cache's speed-up when the adapter has ``model_generate``, and,
    given ``bleu`` (the protocol, its decoding settings, where the per-sample CSVs go), BLEU.
    ``trusted``: the plain process with tinylm importable and the environment kept (a student
    scoring their own model, which may wrap a tinylm checkpoint); False for a class's students:
    the namespace sandbox, seeing ``visible``, printing to ``output`` (default stderr)."""
    path = Path(adapter)
    if not path.is_file():
        raise TinyLMError(f"adapter file {path} does not exist" if not path.exists() else f"{path} is not a file")
    memory = DEFAULT_MEMORY_BYTES if memory_bytes is None else memory_bytes
    limits = Limits(CALL_SECONDS, memory, int(STARTUP_SECONDS + CPU_SECONDS), reply_bytes=REPLY_BYTES)
    prints = sys.stderr.buffer if output is None else output
    with Sandbox(path.resolve(), limits, visible, prints, trusted) as sandbox:
        info = call(sandbox, "model_info", [{}])
        if not isinstance(info, dict) or "context_length" not in info:
            raise TinyLMError('the adapter\'s model_info must return {"context_length": int, "bos_id": int or None}')
        context = int(info["context_length"])
        bos = info.get("bos_id")
        stops = tuple(int(i) for i in info.get("stop_ids") or ())
        tokenizer = AdapterTokenizer(sandbox, None if bos is None else int(bos), texts, stops)
        result = evaluate_texts(AdapterLM(sandbox, context), tokenizer, texts, batch_size=batch_size)
        if speedup:
            result.update(speedup_or_reason(sandbox, tokenizer, texts, context))
        if bleu is not None:
            result["bleu"] = adapter_bleu(sandbox, tokenizer, texts, context, *bleu)
    return result


def adapter_bleu(
    sandbox: Sandbox,
    tokenizer: AdapterTokenizer,
    texts: list[str],
    context: int,
    protocol: BleuProtocol,
    settings: list[Decoding],
    csv_dir: Path | None,
) -> dict:
    """tinylm's BLEU protocol on the student's model (see the module's docstring)."""
    beams = [s.name for s in settings if s.beam_width > 1]
    if beams:
        raise TinyLMError(f"--adapter decodes without a KV cache, which beam search needs: drop {', '.join(beams)}")
    probe = call(sandbox, "model_logits", [{"tokens": torch.tensor([[tokenizer.bos_id or 0]])}])
    if not isinstance(probe, torch.Tensor) or probe.dim() != 3:
        raise TinyLMError("the adapter's model_logits must return (B, T, V) logits")
    model = AdapterLM(sandbox, context, vocab_size=int(probe.shape[-1]))
    uncached = [dataclasses.replace(s, use_cache=False) for s in settings]
    return run_bleu(model, tokenizer, texts, protocol, uncached, csv_dir=csv_dir)


def speedup_or_reason(sandbox: Sandbox, tokenizer: AdapterTokenizer, texts: list[str], context: int) -> dict:
    start = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    prompt = (start + tokenizer.encode(texts[0]))[:SPEEDUP_PROMPT]
    try:
        return kv_speedup(sandbox, prompt, context)
    except TinyLMError as exc:  # no model_generate, or it fails: the other numbers stand
        return {"kv_speedup": None, "kv_speedup_error": str(exc)}


def format_report(result: dict, n_docs: int) -> str:
    """The numbers, each with how it is defined."""
    lines = [
        f"documents        {n_docs:,}",
        f"token perplexity {result['token_ppl']:.4f}   (over {result['tokens']:,} tokens)",
        f"bits per byte    {result['bpb']:.4f}   (over {result['bytes']:,} UTF-8 bytes)",
        f"word perplexity  {result['word_ppl']:.4f}   (over {result['words']:,} whitespace-separated words)",
    ]
    if result.get("kv_speedup") is not None:
        same = "identical tokens" if result["same_tokens"] else "DIFFERENT tokens with and without the cache"
        lines.append(
            f"KV-cache speed-up {result['kv_speedup']:.2f}x   ({result['cached_tokens_per_s']:.1f} tokens/s with the "
            f"cache, {result['uncached_tokens_per_s']:.1f} without, {result['new_tokens']} new tokens, {same})"
        )
    elif "kv_speedup_error" in result:
        lines.append(f"KV-cache speed-up not measured: {result['kv_speedup_error']}")
    lines += ["", "how each number is defined:"]
    lines += [f"  {name}: {text}" for name, text in DEFINITIONS.items()]
    return "\n".join(lines)


def finite(result: dict) -> dict:
    """JSON has no infinity or nan: such a number becomes its name as a string."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}
