"""A served model: loaded as ``tinylm generate`` loads it, named, with its scheduler, and what it
answers besides completions (model card, tokens, per-token scores, attention maps).

Scores go through ``evaluation.perplexity`` (the numbers of ``tinylm evaluate``), attention maps
through ``evaluation.plots.attention_maps`` (the numbers of ``tinylm attention``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tinylm.constants import IGNORE_INDEX
from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import document_windows, evaluate_texts
from tinylm.evaluation.plots import attention_maps, attention_maps_of_ids, token_labels
from tinylm.evaluation.report import read_json
from tinylm.interop.loading import load_any_checkpoint
from tinylm.serving.completions import APIError
from tinylm.serving.scheduler import Scheduler
from tinylm.training.metrics import read_metrics


def model_name(path: str, taken: set[str]) -> str:
    """``runs/demo`` -> demo, ``stories260K.bin`` -> stories260K, ``runs/demo/checkpoints/best`` ->
    demo; a second model of the same name gets ``-2``."""
    p = Path(path)
    parts = [x for x in p.parts if x not in ("checkpoints", "best", "last", "/", ".")]
    base = Path(parts[-1]).stem if parts else "model"
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
class ServedModel:
    name: str
    path: str
    model: torch.nn.Module
    tokenizer: object
    source: dict
    scheduler: Scheduler
    created: int

    @classmethod
    def load(cls, path: str, tokenizer_path: str | None, name: str, max_batch: int) -> "ServedModel":
        model, tokenizer, source = load_any_checkpoint(path, tokenizer_path)
        model.eval()
        return cls(name, str(path), model, tokenizer, source, Scheduler(model, max_batch, name), int(time.time()))

    @property
    def context_length(self) -> int:
        return self.model.config.context_length

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    # ---------------------------------------------------------------------------- model card
    def card(self) -> dict:
        config = dataclasses.asdict(self.model.config)
        card = {"format": self.source.get("format"), "path": self.path, "parameters": self.model.num_parameters(),
                "config": {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))},
                "tokenizer": {"type": getattr(self.tokenizer, "type_name", type(self.tokenizer).__name__),
                              "vocab_size": self.tokenizer.vocab_size, "bos_id": self.tokenizer.bos_id,
                              "stop_ids": list(self.tokenizer.stop_ids)},
                "run": None}
        meta = self.source.get("meta") or {}
        if meta:
            card["checkpoint"] = {k: meta[k] for k in ("step", "tokens", "val_loss", "best_val_loss") if k in meta}
        run = find_run_dir(Path(self.path))
        if run is not None:
            rows = read_metrics(run / "metrics.csv")
            curve = [{k: r.get(k) for k in ("step", "train_loss", "val_loss")} for r in rows]
            card["run"] = {"dir": run.name, "steps": len(rows), "curves": curve,
                           "curves_png": (run / "curves.png").is_file(),
                           "last": rows[-1] if rows else None, "eval": self._run_eval(run)}
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
        return [{"id": int(i), "piece": label, "text": self.tokenizer.decode([int(i)])}
                for i, label in zip(ids, token_labels(self.tokenizer, ids))]

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param,
                           "invalid_token")

    # ------------------------------------------------------------------- on the model's thread
    def score(self, text: str) -> dict:
        """Per-token log probabilities of ``text`` from the start token, and the metrics of
        ``tinylm evaluate`` (token perplexity, bits per byte, word perplexity)."""
        start = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
        ids = start + list(self.tokenizer.encode(text))
        if len(ids) < 2:
            raise TinyLMError("the text encodes to no token to score")
        logprobs = [lp for lp, _ in self.sequence_logprobs(ids)]
        m = evaluate_texts(self.model, self.tokenizer, [text])
        finite = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in m.items()}
        return {"tokens": self.pieces(ids[1:]), "token_logprobs": logprobs, "metrics": finite}

    def sequence_logprobs(self, ids: list[int], top: int = 0) -> list[tuple[float, list[tuple[int, float]]]]:
        """(log p(ids[t] | ids[:t]), the ``top`` most likely (id, log p)) for t >= 1, with the
        strided windows ``tinylm evaluate`` uses for a text longer than the context."""
        out = []
        with torch.inference_mode():
            for inputs, targets in document_windows(ids, self.context_length):
                logits, _ = self.model(torch.tensor([inputs]))
                logp = torch.log_softmax(logits[0].float(), dim=-1)
                for pos, target in enumerate(targets):
                    if target != IGNORE_INDEX:
                        values, top_ids = logp[pos].topk(min(top, logp.shape[-1]))
                        out.append((float(logp[pos, target]), list(zip(top_ids.tolist(), values.tolist()))))
        return out

    def attention(self, text: str) -> dict:
        """The maps of ``tinylm attention``; a text longer than the context keeps its last tokens
        after the start token (the prompt rule), with a warning."""
        start = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
        ids = list(self.tokenizer.encode(text))
        notes = []
        if len(start) + len(ids) <= self.context_length:
            maps = attention_maps(self.model, self.tokenizer, text)
        else:
            keep = self.context_length - len(start)
            notes.append(f"the text is {len(start) + len(ids)} tokens, longer than the context "
                         f"({self.context_length}); showing its last {keep} after the start token")
            maps = attention_maps_of_ids(self.model, self.tokenizer, start + ids[-keep:], text)
        return {"tokens": maps.tokens, "n_layers": maps.n_layers, "n_heads": maps.n_heads,
                "weights": [np.round(w, 5).tolist() for w in maps.weights], "warnings": notes}


def load_models(checkpoints: list[str], tokenizers: list[str], max_batch: int) -> dict[str, ServedModel]:
    """Every ``--checkpoint``, named; the i-th ``--tokenizer`` goes with the i-th checkpoint
    (``none`` for one that brings its own tokenizer)."""
    if not checkpoints:
        raise TinyLMError("give at least one --checkpoint")
    if tokenizers and len(tokenizers) != len(checkpoints):
        raise TinyLMError(f"{len(tokenizers)} --tokenizer for {len(checkpoints)} --checkpoint: give one per "
                          "checkpoint, in the same order ('none' for a checkpoint that brings its own tokenizer)")
    models: dict[str, ServedModel] = {}
    for i, path in enumerate(checkpoints):
        tok = tokenizers[i] if tokenizers else None
        name = model_name(path, set(models))
        models[name] = ServedModel.load(path, None if tok in (None, "none") else tok, name, max_batch)
    return models
