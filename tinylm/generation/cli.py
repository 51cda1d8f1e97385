"""`tinylm generate`: arguments and implementation (tinylm/cli.py only registers it).

Checkpoints: a tinylm checkpoint or run directory, a llama2.c ``.bin`` (with ``--tokenizer
tokenizer.bin``) or a Hugging Face model directory. Prompts get the model's start token
(<sos> for tinylm, BOS for llama2.c); the printed text is the prompt followed by the
continuation (for llama2.c exactly what run.c prints: the decoded prompt and continuation).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tinylm.errors import TinyLMError


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="tinylm checkpoint/run directory, llama2.c .bin, or Hugging Face model directory")
    p.add_argument("--tokenizer", help="tokenizer file (llama2.c tokenizer.bin, or a tinylm tokenizer.json)")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--min-new-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--no-repeat-ngram-size", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beam-width", type=int, default=1)
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam score / length**alpha (0: none)")
    p.add_argument("--num-return-sequences", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1, help="prompts generated together (left-padded)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context every step")
    p.add_argument("--stream", action="store_true", help="print text as tokens arrive")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt (text, tokens, tokens_per_s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        p = Path(args.prompts_file)
        if not p.is_file():
            raise TinyLMError(f"prompts file {p} does not exist")
        prompts += [line.rstrip("\n") for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise TinyLMError("give at least one --prompt or a --prompts-file")
    return prompts


def _config(args, stop_ids, seed):
    from tinylm.generation.processors import GenerationConfig

    cfg = GenerationConfig(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size, stop_ids=tuple(stop_ids), stop_strings=tuple(args.stop),
        seed=seed, seed_per_row=True, use_cache=not args.no_cache, beam_width=args.beam_width,
        length_penalty=args.length_penalty, num_return_sequences=args.num_return_sequences)
    return cfg


def _cut_at_stop(text: str, stops: list[str]) -> str:
    """End the text right after the first stop string (the token that completed it may carry more)."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text


def run_generate(args) -> int:
    import torch

    from tinylm.generation.generate import TextStream, generate_many
    from tinylm.interop import load_any_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch_size < 1:
        raise TinyLMError(f"--batch-size must be >= 1 (got {args.batch_size})")
    model, tokenizer, info = load_any_checkpoint(args.checkpoint, args.tokenizer)
    prompts = read_prompts(args)
    start = [info["bos_id"]] if info.get("bos_id") is not None else []
    encoded = []
    for prompt in prompts:
        ids = list(tokenizer.encode(prompt))
        if not ids:
            raise TinyLMError(f"prompt {prompt!r} encodes to no tokens; give a non-empty prompt")
        encoded.append(start + ids)

    def render(prompt: str, ids: list[int], new: list[int]) -> str:
        if info.get("decode_with_prompt"):
            return tokenizer.decode(ids + new)
        if hasattr(tokenizer, "decode_continuation"):  # keeps a word-level tokenizer's space
            return prompt + tokenizer.decode_continuation(ids, new)
        return prompt + tokenizer.decode(new)

    try:
        if args.stream and not args.json:
            if args.beam_width > 1:
                raise TinyLMError("--stream works with sampling/greedy only, not with --beam-width > 1")
            for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
                head = tokenizer.decode(ids) if info.get("decode_with_prompt") else prompt
                sys.stdout.write(head)
                sys.stdout.flush()
                # with decode_with_prompt the continuation's first piece may need the prompt to
                # decode right (e.g. sentencepiece spaces), so pieces are diffs of the full text
                decode = (lambda new, ids=ids, head=head: tokenizer.decode(ids + new)[len(head):]) \
                    if info.get("decode_with_prompt") else (
                        (lambda new, ids=ids: tokenizer.decode_continuation(ids, new))
                        if hasattr(tokenizer, "decode_continuation") else tokenizer.decode)
                for piece in TextStream(model, decode, ids, _config(args, info["stop_ids"], args.seed + i)):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                sys.stdout.write("\n\n")
            return 0
        for b in range(0, len(prompts), args.batch_size):
            chunk = list(range(b, min(b + args.batch_size, len(prompts))))
            cfg = _config(args, info["stop_ids"], args.seed + b)
            decode = tokenizer.decode
            t0 = time.perf_counter()
            results = generate_many(model, [encoded[i] for i in chunk], cfg, decode=decode)
            dt = time.perf_counter() - t0
            per_prompt = cfg.num_return_sequences if cfg.beam_width > 1 else 1
            n_tokens = sum(len(r.tokens) for r in results)
            for j, i in enumerate(chunk):
                for r in results[j * per_prompt : (j + 1) * per_prompt]:
                    text = render(prompts[i], encoded[i], r.tokens)
                    if args.stop:
                        text = _cut_at_stop(text, args.stop)
                    if args.json:
                        print(json.dumps({"prompt": prompts[i], "text": text, "tokens": len(r.tokens), "token_ids": r.tokens,
                                          "tokens_per_s": round(n_tokens / max(dt, 1e-9), 1),
                                          "finish_reason": r.finish_reason}, ensure_ascii=False))
                    else:
                        print(text)
                        print()
    except ValueError as exc:
        raise TinyLMError(str(exc)) from exc
    return 0
