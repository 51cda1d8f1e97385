"""Token datasets: encode once, cache as a memmap beside a JSON meta file, draw batches.

On disk a split is ``NAME.bin`` (uint16 when the vocabulary fits, else uint32) holding, for each
document, ``<sos> tokens <eos>``, plus ``NAME.offsets.npy`` (where each document starts; one
extra entry for the end) and ``NAME.meta.json`` (counts, bytes and words of the text, dtype).

Batches are deterministic functions of (seed, step): row r of step s is the same whether it is
drawn by one process or by one of several ranks, which is what makes resume exact and data
parallel runs equal to a single process with a bigger batch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tinylm.constants import IGNORE_INDEX, PAD_ID
from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer


@dataclass
class TokenSplit:
    name: str
    ids: np.ndarray  # the token stream (memmap)
    offsets: np.ndarray  # (n_docs + 1,) start of each document in ``ids``
    n_bytes: int  # UTF-8 bytes of the documents' text
    n_words: int  # whitespace-separated words of the documents' text

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def n_docs(self) -> int:
        return int(self.offsets.shape[0] - 1)

    def document(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]


def encode_split(name: str, docs: list[str], tokenizer: Tokenizer, out_dir: str | Path) -> TokenSplit:
    """Encode ``docs`` and write the split's three files (atomically) into ``out_dir``."""
    if not docs:
        raise TinyLMError(f"the {name} split holds no documents")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    pieces = [np.asarray([tokenizer.sos_id, *tokenizer.encode(doc), tokenizer.eos_id], dtype=dtype) for doc in docs]
    offsets = np.cumsum([0, *map(len, pieces)])
    stream = np.concatenate(pieces)
    _atomic_save(out_dir / f"{name}.bin", stream.tobytes())
    np.save(out_dir / f"{name}.offsets.npy", np.asarray(offsets, dtype=np.int64))
    meta = {
        "name": name,
        "dtype": np.dtype(dtype).name,
        "n_tokens": int(stream.size),
        "n_docs": len(docs),
        # of the text the tokens stand for (normalised by a normalising tokenizer such as word_bpe)
        "n_bytes": sum(len(tokenizer.represented(d).encode("utf-8")) for d in docs),
        "n_words": sum(len(tokenizer.represented(d).split()) for d in docs),
        "vocab_size": tokenizer.vocab_size,
    }
    _atomic_save(out_dir / f"{name}.meta.json", json.dumps(meta, indent=2).encode())
    return load_split(out_dir, name)


def load_split(data_dir: str | Path, name: str) -> TokenSplit:
    data_dir = Path(data_dir)
    meta_path = data_dir / f"{name}.meta.json"
    if not meta_path.is_file():
        raise TinyLMError(f"no prepared {name} split in {data_dir}; run `tinylm prepare` first")
    meta = json.loads(meta_path.read_text())
    ids = np.memmap(data_dir / f"{name}.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["n_tokens"],))
    offsets = np.load(data_dir / f"{name}.offsets.npy")
    return TokenSplit(name, ids, offsets, meta["n_bytes"], meta["n_words"])


def _atomic_save(path: Path, payload: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def pad_rows(rows, value: int, length: int | None = None, left: bool = False) -> torch.Tensor:
    """A (len(rows), length) LongTensor holding each row of ids at its start (at its end with
    ``left``) and ``value`` elsewhere; ``length`` defaults to the longest row."""
    rows = [torch.as_tensor(r, dtype=torch.long) for r in rows]
    length = max(len(r) for r in rows) if length is None else length
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, r in enumerate(rows):
        if left:
            out[i, length - len(r) :] = r
        else:
            out[i, : len(r)] = r
    return out


class Batches:
    """Teacher-forcing batches (input ``t[:-1]``, target ``t[1:]``) from one split.

    mode "packed": windows of ``context_length + 1`` tokens at random places in the stream
    (documents run into each other, separated by ``<eos> <sos>``), nanoGPT style.
    mode "stories": one document per row from its ``<sos>``, right-padded; padding targets are
    IGNORE_INDEX so they add nothing to the loss. A document longer than the context gives a
    random window of itself.
    Rows are drawn with replacement at every step, unless ``epoch_rows`` is set (``train.epochs``):
    then each epoch visits every story (or non-overlapping packed window) once, in a seeded order.
    """

    def __init__(
        self, split: TokenSplit, context_length: int, mode: str = "packed", seed: int = 0, epoch_rows: int | None = None
    ):
        if mode not in ("packed", "stories"):
            raise TinyLMError(f"data.batching={mode!r} is not one of packed, stories")
        if split.n_tokens < context_length + 1:
            raise TinyLMError(
                f"the {split.name} split has {split.n_tokens} tokens, fewer than one context window "
                f"({context_length + 1}); use more data or a smaller model.context_length"
            )
        self.split, self.T, self.mode, self.seed = split, context_length, mode, seed
        self._ids = torch.from_numpy(np.asarray(split.ids, dtype=np.int64))
        self._starts = torch.from_numpy(split.offsets[:-1].astype(np.int64))
        self._lengths = torch.from_numpy(np.diff(split.offsets).astype(np.int64))
        # epochs: every unit (a story, or a non-overlapping packed window) once per epoch, in a fresh
        # seeded order, ``epoch_rows`` units per step; a last partial batch is dropped
        self.epoch_rows = epoch_rows
        self._n_units = split.n_docs if mode == "stories" else (split.n_tokens - 1) // context_length
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation of the units)
        if epoch_rows is not None and not 1 <= epoch_rows <= self._n_units:
            unit = "stories" if mode == "stories" else "context windows"
            raise TinyLMError(
                f"an epoch of the {split.name} split has {self._n_units} {unit}, fewer than the "
                f"{epoch_rows} rows of one step; lower train.batch_size"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self._n_units // self.epoch_rows if self.epoch_rows else 0

    def epoch_units(self, step: int, row_start: int, n_rows: int) -> torch.Tensor:
        epoch, i = divmod(step, self.steps_per_epoch)
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + 2**41 + epoch)
            self._order = (epoch, torch.randperm(self._n_units, generator=g))
        first = i * self.epoch_rows + row_start
        return self._order[1][first : first + n_rows]

    def get(self, step: int, row_start: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``row_start .. row_start + n_rows`` of the global batch of ``step``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n_total = row_start + n_rows
        T = self.T
        if self.mode == "packed":
            if self.epoch_rows:
                starts = self.epoch_units(step, row_start, n_rows) * T
            else:
                starts = torch.randint(0, self.split.n_tokens - T, (n_total,), generator=g)[row_start:]
            rows = self._ids[starts[:, None] + torch.arange(T + 1)]
            return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        if self.epoch_rows:
            docs = self.epoch_units(step, row_start, n_rows)
        else:
            docs = torch.randint(0, self.split.n_docs, (n_total,), generator=g)[row_start:]
        # window offsets from their own generator: drawn from ``g`` after the n_total document
        # draws, row r's offset would depend on the batch size (ranks / accumulation would differ)
        g_frac = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 2**40)
        frac = torch.rand(n_total, generator=g_frac)[row_start:]
        seqs = []
        for d, u in zip(docs.tolist(), frac.tolist()):
            start, length = int(self._starts[d]), int(self._lengths[d])
            if length > T + 1:
                start += int(u * (length - T))
                length = T + 1
            seqs.append(self._ids[start : start + length])
        return pad_rows([s[:-1] for s in seqs], PAD_ID, T), pad_rows([s[1:] for s in seqs], IGNORE_INDEX, T)

    def sequential(self, batch_size: int):
        """Non-overlapping packed windows in order (for a quick validation loss)."""
        T = self.T
        n_windows = (self.split.n_tokens - 1) // T
        for b in range(0, n_windows, batch_size):
            idx = torch.arange(b, min(b + batch_size, n_windows))[:, None] * T + torch.arange(T + 1)
            rows = self._ids[idx]
            yield rows[:, :-1], rows[:, 1:]
