"""A served model: loaded as ``tinylm generate`` loads it, named, with its scheduler, and what it
answers besides completions (model card, tokens, per-token scores, attention maps).

Scores go through ``evaluation.perplexity`` (the numbers of ``tinylm evaluate``), attention maps
through ``evaluation.plots.attention_maps`` (the numbers of ``tinylm attention``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tinylm.constants import IGNORE_INDEX, PAD_ID
from tinylm.data.tokens import pad_rows
from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import document_windows, evaluate_texts
from tinylm.evaluation.plots import attention_maps, attention_maps_of_ids, token_labels
from tinylm.evaluation.report import read_json
from tinylm.generation.core import ScoredTokens, scored_tokens
from tinylm.interop.loading import load_any_checkpoint
from tinylm.models.quantize import InferenceDtype, to_inference_dtype
from tinylm.serving.completions import APIError, bad, check_scored
from tinylm.serving.scheduler import Scheduler
from tinylm.training.metrics import read_metrics

CHECKPOINTS_DIR = "checkpoints"  # a run's checkpoints live in <run>/checkpoints/<name>
SCORED_FLOATS = 2**24  # log probabilities held at once when scoring (rows x positions x vocabulary)
# tokens of one scoring forward: a task pauses for the decoding steps at each block's boundary
# (scheduler.Turns), so this bounds what a scoring client adds to every other client's token gap
SCORE_FORWARD_TOKENS = 64


def score_batch(context_length: int, vocab_size: int) -> int:
    """Windows scored per forward (at least one)."""
    return max(1, min(SCORED_FLOATS // (context_length * vocab_size), SCORE_FORWARD_TOKENS // context_length))


def model_name(path: str, taken: set[str]) -> str:
    """The run a checkpoint belongs to: ``runs/demo`` -> demo, ``runs/demo/checkpoints/ema`` (or
    best, last, step-0000100) -> demo, ``stories260K.bin`` -> stories260K; a second model of the
    same name gets ``-2``."""
    parts = [x for x in Path(path).absolute().parts if x not in ("/", ".")]
    if CHECKPOINTS_DIR in parts[1:]:
        parts = parts[: len(parts) - 1 - parts[::-1].index(CHECKPOINTS_DIR)]
    base = Path(parts[-1]).stem if parts else "model"
    return unique_name(base, taken)


def unique_name(base: str, taken: set[str]) -> str:
    name, k = base, 2
    while name in taken:
        name, k = f"{base}-{k}", k + 1
    return name


def find_run_dir(path: Path) -> Path | None:
    """The tinylm run directory a checkpoint belongs to (it holds metrics.csv), if any."""
    for d in (path, path.parent, path.parent.parent):
        if (d / "metrics.csv").is_file():
            return d
    return None


@dataclass
class ModelSpec:
    """A model to serve, before it is loaded: what ``ServedModel.load`` reads, in this process or in
    the engine process (it travels there pickled)."""

    path: str
    tokenizer: str | None = None  # None: the checkpoint brings its own
    max_batch: int = 32
    dtype: InferenceDtype = "float32"
    compile: bool = False
    built: tuple | None = None  # (model, tokenizer, source) built in memory (tests): used instead of loading path


@dataclass
class ServedModel:
    name: str
    path: str
    model: torch.nn.Module
    tokenizer: object
    source: dict
    scheduler: Scheduler
    created: int

    @classmethod
    def load(cls, spec: "ModelSpec", name: str) -> "ServedModel":
        model, tokenizer, source = spec.built or load_any_checkpoint(spec.path, spec.tokenizer)
        source = {**source, "dtype": spec.dtype, "parameters": model.num_parameters()}  # before int8 moves them
        model = to_inference_dtype(model, spec.dtype).eval()
        scheduler = Scheduler(model, spec.max_batch, name, spec.compile)
        return cls(name, spec.path, model, tokenizer, source, scheduler, int(time.time()))

    @property
    def context_length(self) -> int:
        return self.model.config.context_length

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    # ---------------------------------------------------------------------------- model card
    def card(self) -> dict:
        config = dataclasses.asdict(self.model.config)
        card = {
            "format": self.source.get("format"),
            "path": self.path,
            "dtype": self.source.get("dtype", "float32"),
            "parameters": self.source.get("parameters") or self.model.num_parameters(),
            "config": {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))},
            "tokenizer": {
                "type": getattr(self.tokenizer, "type_name", type(self.tokenizer).__name__),
                "vocab_size": self.tokenizer.vocab_size,
                "bos_id": self.tokenizer.bos_id,
                "stop_ids": list(self.tokenizer.stop_ids),
            },
            "run": None,
        }
        meta = self.source.get("meta") or {}
        if meta:
            card["checkpoint"] = {k: meta[k] for k in ("step", "tokens", "val_loss", "best_val_loss") if k in meta}
        run = find_run_dir(Path(self.path))
        if run is not None:
            rows = read_metrics(run / "metrics.csv")
            curve = [{k: r.get(k) for k in ("step", "train_loss", "val_loss")} for r in rows]
            card["run"] = {
                "dir": run.name,
                "steps": len(rows),
                "curves": curve,
                "curves_png": (run / "curves.png").is_file(),
                "last": rows[-1] if rows else None,
                "eval": self._run_eval(run),
            }
        return card

    @staticmethod
    def _run_eval(run: Path) -> dict | None:
        """The run's eval.json summary (training time, stop reason, valid/test perplexity), if any."""
        data = read_json(run / "eval.json")
        if not isinstance(data, dict):
            return None
        keys = ("steps", "train_seconds", "tokens_per_s", "best_val_loss", "final_train_loss", "stopped_because")
        summary = {k: data[k] for k in keys if k in data}
        for split, m in (data.get("eval") or {}).items():
            if isinstance(m, dict):
                summary[split] = {k: m[k] for k in ("token_ppl", "bpb", "word_ppl") if k in m}
        return summary

    def curves_png(self) -> Path | None:
        run = find_run_dir(Path(self.path))
        return run / "curves.png" if run is not None and (run / "curves.png").is_file() else None

    # --------------------------------------------------------------------------------- tokens
    def pieces(self, ids: list[int]) -> list[dict]:
        """Each token's id, its label (as ``tinylm attention`` writes it) and its text."""
        return [
            {"id": int(i), "piece": label, "text": self.tokenizer.decode([int(i)])}
            for i, label in zip(ids, token_labels(self.tokenizer, ids))
        ]

    def check_ids(self, ids: list[int], param: str) -> None:
        outside = [i for i in ids if not 0 <= i < self.vocab_size]
        if outside:
            raise APIError(
                400,
                f"{param}: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})",
                param,
                "invalid_token",
            )

    # ------------------------------------------------------------------- on the model's thread
    async def on_model_thread(self, fn, *args, param: str = "text"):
        """``fn(self, *args)`` on the model's task thread, taking turns with the decoding steps (the
        model is used by one thread at a time), in whichever process holds the model. ``fn`` is a
        module-level function or the name of a ServedModel method: with an engine process it
        travels there pickled, with ``args``, and the engine's own ServedModel stands in for
        ``self``. A TinyLMError becomes a 400 naming the request's field ``param``."""
        if isinstance(fn, str):  # a method by name: ServedModel's own function pickles, a bound method would not
            fn = getattr(ServedModel, fn)
        try:
            return await asyncio.wrap_future(self.scheduler.call(fn, self, *args))
        except TinyLMError as exc:
            raise bad(param, str(exc)) from exc
        except ValueError as exc:  # knobs that leave no token allowed at some step name themselves
            raise APIError(400, str(exc), None, "invalid_value") from exc

    def score(self, text: str, max_tokens: int | None = None) -> dict:
        """Per-token log probabilities of ``text`` from the start token, and the metrics of
        ``tinylm evaluate`` (token perplexity, bits per byte, word perplexity); more than
        ``max_tokens`` tokens to score is a 413."""
        start = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
        ids = start + list(self.tokenizer.encode(text))
        if len(ids) < 2:
            raise TinyLMError("the text encodes to no token to score")
        if max_tokens is not None:
            check_scored(len(ids) - 1, max_tokens, "text")
        logprobs = self.sequence_logprobs(ids).logprobs.tolist()
        m = evaluate_texts(self.model, self.tokenizer, [text], score_batch(self.context_length, self.vocab_size))
        finite = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in m.items()}
        return {"tokens": self.pieces(ids[1:]), "token_logprobs": logprobs, "metrics": finite}

    def sequence_logprobs(self, ids: list[int], top: int = 0) -> ScoredTokens:
        """log p(ids[t] | ids[:t]) and the ``top`` most likely (id, log p) for t >= 1, with the
        strided windows ``tinylm evaluate`` uses for a text longer than the context."""
        return self.rows_logprobs([ids], top)[0]

    def rows_logprobs(self, rows: list[list[int]], top: int = 0) -> list[ScoredTokens]:
        """``sequence_logprobs`` of several rows, their windows scored in batches (right-padded:
        a causal model's positions never see the padding after them)."""
        windows = [
            (r, inputs, targets)
            for r, ids in enumerate(rows)
            for inputs, targets in document_windows(ids, self.context_length)
        ]
        parts: list[list[ScoredTokens]] = [[] for _ in rows]
        k = min(top, self.vocab_size)
        batch = score_batch(self.context_length, self.vocab_size)
        with torch.inference_mode():
            for b in range(0, len(windows), batch):
                chunk = windows[b : b + batch]
                logits, _ = self.model(pad_rows([inputs for _, inputs, _ in chunk], PAD_ID))
                logp = torch.log_softmax(logits.float(), dim=-1)
                for j, (r, _, targets) in enumerate(chunk):
                    pos = [p for p, t in enumerate(targets) if t != IGNORE_INDEX]
                    parts[r].append(scored_tokens(logp[j, pos], [targets[p] for p in pos], k))
        return [ScoredTokens.join(p, k) for p in parts]

    def stop_tokens(self, choices: list, top: int = 0) -> list[tuple[int, float, list]]:
        """(id, log p, the ``top`` alternatives) of the stop token that ended each choice: the
        scheduler ends a row on it without emitting it, and OpenAI's logprobs list it last. The id
        is the one the decoder reported (``choice.stop_id``); where none was reported (a beam), the
        likeliest of the choice's stop ids after its tokens."""
        rows = [(c.prompt_ids + c.tokens)[-self.context_length :] for c in choices]
        k = min(top, self.vocab_size)
        batch = max(1, SCORED_FLOATS // (self.context_length * self.vocab_size))
        stops = []
        with torch.inference_mode():
            for b in range(0, len(rows), batch):
                logits, _ = self.model(pad_rows(rows[b : b + batch], PAD_ID))
                for j, c in enumerate(choices[b : b + batch]):
                    logp = torch.log_softmax(logits[j, len(rows[b + j]) - 1].float(), dim=-1)
                    stop = c.stop_id if c.stop_id is not None else max(c.cfg.stop_ids, key=lambda i: float(logp[i]))
                    values, ids = logp.topk(k)
                    stops.append((stop, float(logp[stop]), list(zip(ids.tolist(), values.tolist()))))
        return stops

    def fit_text(self, text: str) -> tuple[list[int], list[str]]:
        """The start token and ``text``'s ids, and the warnings: a text longer than the context keeps
        its last tokens after the start token (the prompt rule)."""
        start = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
        ids = list(self.tokenizer.encode(text))
        keep = self.context_length - len(start)
        if len(ids) <= keep:
            return start + ids, []
        return start + ids[-keep:], [
            f"the text is {len(start) + len(ids)} tokens, longer than the context "
            f"({self.context_length}); showing its last {keep} after the start token"
        ]

    def attention(self, text: str) -> dict:
        """The maps of ``tinylm attention``, of the text ``fit_text`` keeps."""
        ids, notes = self.fit_text(text)
        if notes:
            maps = attention_maps_of_ids(self.model, self.tokenizer, ids, text)
        else:  # as `tinylm attention` draws them (a text that encodes to no token is refused there)
            maps = attention_maps(self.model, self.tokenizer, text)
        return {
            "tokens": maps.tokens,
            "n_layers": maps.n_layers,
            "n_heads": maps.n_heads,
            "weights": [np.round(w, 5).tolist() for w in maps.weights],
            "warnings": notes,
        }


def model_specs(
    checkpoints: list[str],
    tokenizers: list[str],
    max_batch: int,
    names: list[str] | None = None,
    dtype: InferenceDtype = "float32",
    compile: bool = False,
) -> dict[str, ModelSpec]:
    """Every ``--checkpoint`` as a ModelSpec, named after its run (or the i-th ``--name``); the i-th
    ``--tokenizer`` goes with the i-th checkpoint (``none`` for one that brings its own tokenizer)."""
    if not checkpoints:
        raise TinyLMError("give at least one --checkpoint")
    if tokenizers and len(tokenizers) != len(checkpoints):
        raise TinyLMError(
            f"{len(tokenizers)} --tokenizer for {len(checkpoints)} --checkpoint: give one per "
            "checkpoint, in the same order ('none' for a checkpoint that brings its own tokenizer)"
        )
    names = list(names or [])
    if names and len(names) != len(checkpoints):
        raise TinyLMError(
            f"{len(names)} --name for {len(checkpoints)} --checkpoint: give one per checkpoint, in the same order"
        )
    for n in names:
        if not n or n.strip() != n or "/" in n:
            raise TinyLMError(f"--name {n!r}: a model name is not empty, without '/' or surrounding spaces")
    if len(set(names)) != len(names):
        raise TinyLMError(f"--name {' '.join(names)}: the names must be distinct")
    specs: dict[str, ModelSpec] = {}
    for i, path in enumerate(checkpoints):
        tok = tokenizers[i] if tokenizers else None
        name = names[i] if names else model_name(path, set(specs))
        specs[name] = ModelSpec(str(path), None if tok in (None, "none") else tok, max_batch, dtype, compile)
    return specs


def load_models(checkpoints: list[str], tokenizers: list[str], max_batch: int, **options) -> dict[str, ServedModel]:
    """``model_specs(..., **options)``'s models loaded in this process, each decoding on its own thread."""
    specs = model_specs(checkpoints, tokenizers, max_batch, **options)
    return {name: ServedModel.load(spec, name) for name, spec in specs.items()}
