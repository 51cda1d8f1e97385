"""Pretrained word vectors -> the model's token embedding matrix.

Sources (``EmbeddingsConfig.kind``):

- ``vec``: a FastText/word2vec text file (header "count dim", then "word v1 ... vdim" per line),
  streamed; only the rows of vocabulary words are parsed and kept.
- ``bin``: a Facebook FastText binary model, through the ``fasttext`` package (gensim's reader
  when it is not installed); out-of-vocabulary words get FastText's subword vector, exactly
  what ``get_word_vector`` returns (mean of the word's character n-gram vectors).
- ``gensim``: a saved gensim ``KeyedVectors`` (or ``FastText`` model, whose keyed vectors also
  compose OOV words from subwords).
- ``train``: no file; FastText vectors are trained with gensim on the training token stream
  (``vector_size`` = the embedding width, one worker, seeded) so the pipeline runs offline.
- ``auto``: by file suffix (.vec/.txt -> vec, .bin -> bin, anything else -> gensim).

The matrix: ``<pad>`` row zero; other special tokens small noise; vocabulary tokens found in
the source take their vector (exact key, then stripped, then lowercased); the rest take the
subword vector (``oov="subword"``, when the source has subwords) or noise (``oov="noise"``).
Noise is N(0, std) with std = ``noise_std`` or, by default, the standard deviation of the
vectors found (so random rows have the scale of real ones).

When the vectors' width differs from ``model.d_model``, set ``model.d_embed`` to that width: the
model then embeds into d_embed and a learned ``embed_proj`` Linear maps to d_model (output-layer
weight tying is impossible then and ``model.tie_weights`` must be false). ``freeze`` stops
gradients into the embedding matrix (the projection still learns).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, get_args

import numpy as np
import torch

from tinylm.config import EmbeddingKind, EmbeddingOOV
from tinylm.errors import TinyLMError

log = logging.getLogger(__name__)


@dataclass
class VectorSource:
    """Vectors for some words, and optionally a subword model for any other word."""

    dim: int
    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    subword: Callable[[str], np.ndarray | None] | None = None
    name: str = ""


# ------------------------------------------------------------------------------------ readers
def read_vec(path: str | Path, keep: Iterable[str] | None = None) -> VectorSource:
    """Stream a ``.vec`` text file, keeping only the words in ``keep`` (all when None)."""
    path = Path(path)
    if not path.is_file():
        raise TinyLMError(f"vector file {path} does not exist")
    wanted = None if keep is None else set(keep)
    vectors: dict[str, np.ndarray] = {}
    with open(path, encoding="utf-8", errors="strict", newline="\n") as fh:
        try:
            header = fh.readline()
        except UnicodeDecodeError as exc:
            raise TinyLMError(f"{path} is not a UTF-8 .vec text file ({exc.reason})") from exc
        parts = header.split()
        if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[1]) < 1:
            raise TinyLMError(
                f"{path}: line 1 must be the header 'count dim' (two integers), got {header.strip()[:60]!r}"
            )
        count, dim = int(parts[0]), int(parts[1])
        rows, lineno = 0, 1
        try:
            for lineno, line in enumerate(fh, start=2):
                fields = line.rstrip("\r\n").rstrip(" ").split(" ")
                if fields == [""]:
                    continue  # a blank line (e.g. at the end)
                if len(fields) != dim + 1:
                    raise TinyLMError(
                        f"{path}: line {lineno} has {len(fields) - 1} values, expected {dim} (ragged row)"
                    )
                rows += 1
                word = fields[0]
                if wanted is None or word in wanted:
                    try:
                        vectors.setdefault(word, np.asarray(fields[1:], dtype=np.float32))
                    except ValueError as exc:
                        raise TinyLMError(f"{path}: line {lineno} has a value that is not a number ({exc})") from exc
        except UnicodeDecodeError as exc:
            raise TinyLMError(f"{path}: line {lineno + 1} is not UTF-8 ({exc.reason})") from exc
    if rows != count:
        raise TinyLMError(f"{path}: the header announces {count} vectors but the file holds {rows} (truncated?)")
    return VectorSource(dim, vectors, None, name=f"vec:{path.name}")


def write_vec(path: str | Path, words: list[str], matrix: np.ndarray) -> None:
    """Write vectors in the ``.vec`` text format (for exporting and for tests)."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"{len(words)} {matrix.shape[1]}\n")
        for w, row in zip(words, matrix):
            fh.write(w + " " + " ".join(f"{x:.6g}" for x in row) + "\n")


def read_fasttext_bin(path: str | Path, keep: Iterable[str] | None = None) -> VectorSource:
    """A Facebook FastText ``.bin``: in-vocabulary vectors plus subword vectors for any word."""
    path = Path(path)
    if not path.is_file():
        raise TinyLMError(f"FastText model {path} does not exist")
    try:
        import fasttext  # deferred: optional (the fasttext-numpy2 wheel)
    except ImportError:
        fasttext = None
    if fasttext is not None:
        fasttext.FastText.eprint = lambda *args, **kwargs: None  # silence its load_model notice
        try:
            model = fasttext.load_model(str(path))
        except ValueError as exc:
            raise TinyLMError(f"{path} is not a FastText .bin model ({exc})") from exc
        words = set(model.words)
        get = model.get_word_vector
        known = {w: np.asarray(get(w), dtype=np.float32) for w in (keep if keep is not None else words) if w in words}
        return VectorSource(
            model.get_dimension(), known, lambda w: np.asarray(get(w), dtype=np.float32), name=f"fasttext:{path.name}"
        )
    from gensim.models.fasttext import load_facebook_vectors  # deferred: gensim is optional and slow to import

    try:
        kv = load_facebook_vectors(str(path))
    except Exception as exc:  # gensim raises assorted errors on a wrong file
        raise TinyLMError(f"{path} is not a FastText .bin model ({type(exc).__name__}: {exc})") from exc
    return _from_keyed_vectors(kv, keep, f"gensim-fasttext:{path.name}")


def read_gensim(path: str | Path, keep: Iterable[str] | None = None) -> VectorSource:
    """A saved gensim ``KeyedVectors`` (or a whole ``FastText``/``Word2Vec`` model)."""
    path = Path(path)
    if not path.is_file():
        raise TinyLMError(f"gensim vectors {path} do not exist")
    from gensim.models import KeyedVectors  # deferred: gensim is optional and slow to import
    from gensim.utils import SaveLoad  # deferred with the line above

    try:
        obj = SaveLoad.load(str(path))
    except Exception as exc:
        raise TinyLMError(f"{path} is not a saved gensim KeyedVectors/model ({type(exc).__name__}: {exc})") from exc
    kv = obj if isinstance(obj, KeyedVectors) else getattr(obj, "wv", None)
    if not isinstance(kv, KeyedVectors):
        raise TinyLMError(f"{path} holds a {type(obj).__name__}, not gensim KeyedVectors")
    return _from_keyed_vectors(kv, keep, f"gensim:{path.name}")


def _from_keyed_vectors(kv, keep: Iterable[str] | None, name: str) -> VectorSource:
    from gensim.models.fasttext import FastTextKeyedVectors  # deferred: gensim is optional and slow to import

    words = kv.key_to_index
    known = {
        w: np.asarray(kv.get_vector(w), dtype=np.float32) for w in (keep if keep is not None else words) if w in words
    }

    def from_subwords(w: str) -> np.ndarray | None:
        try:
            return np.asarray(kv.get_vector(w), dtype=np.float32)
        except KeyError:  # no n-gram of the word is known
            return None

    has_subwords = isinstance(kv, FastTextKeyedVectors) and getattr(kv, "bucket", 0)
    return VectorSource(kv.vector_size, known, from_subwords if has_subwords else None, name=name)


def train_fasttext(
    sentences: list[list[str]],
    vector_size: int,
    seed: int = 0,
    epochs: int = 5,
    window: int = 5,
    min_count: int = 1,
    bucket: int = 200_000,
) -> VectorSource:
    """FastText vectors trained with gensim (one worker: reproducible for a seed). ``bucket``
    n-gram slots instead of FastText's 2M: at d_model 256 the default would take 2 GB."""
    from gensim.models import FastText  # deferred: gensim is optional and slow to import

    if not sentences or not any(sentences):
        raise TinyLMError("cannot train FastText vectors on an empty corpus")
    # gensim seeds each word's initial vector with hashfxn(word + seed); the default, Python's
    # hash(), changes between processes, so a stable hash is what makes the vectors reproducible
    model = FastText(
        vector_size=vector_size,
        window=window,
        min_count=min_count,
        workers=1,
        seed=seed,
        sg=1,
        min_n=3,
        max_n=6,
        bucket=bucket,
        hashfxn=_stable_hash,
    )
    model.build_vocab(corpus_iterable=sentences)
    model.train(corpus_iterable=sentences, total_examples=len(sentences), epochs=epochs)
    return _from_keyed_vectors(model.wv, None, f"gensim-fasttext-trained(dim={vector_size})")


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def load_vectors(kind: str, path: str | None, keep: Iterable[str] | None = None) -> VectorSource:
    """Read vectors of ``kind`` (see module doc) from ``path``."""
    if kind not in get_args(EmbeddingKind) or kind in ("none", "train"):
        raise TinyLMError(f"embeddings.kind={kind!r} does not read a file; choose one of auto, vec, bin, gensim")
    if not path:
        raise TinyLMError(f"embeddings.kind={kind} needs embeddings.path")
    if kind == "auto":
        suffix = Path(path).suffix.lower()
        kind = {".vec": "vec", ".txt": "vec", ".bin": "bin"}.get(suffix, "gensim")
    reader = {"vec": read_vec, "bin": read_fasttext_bin, "gensim": read_gensim}[kind]
    return reader(path, keep)


# ------------------------------------------------------------------------------------- matrix
def vocabulary_keys(tokenizer) -> list[str | None]:
    """The string of every token id to look vectors up by; None for special tokens."""
    special = {getattr(tokenizer, name, None) for name in ("pad_id", "unk_id", "sos_id", "eos_id")}
    if not special - {None}:  # a tokenizer without these attributes keeps its specials first
        special = set(range(len(tokenizer.special_tokens)))
    return [None if i in special else tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]


def _candidates(key: str) -> list[str]:
    """The strings to look ``key`` up by, in order: as is, stripped, lowercased, both (no repeats)."""
    return list(dict.fromkeys([key] + [k for k in (key.strip(), key.lower(), key.strip().lower()) if k]))


@dataclass
class EmbeddingReport:
    vocab_size: int
    dim: int
    found: int  # vector taken from the source
    subword: int  # composed from character n-grams (FastText)
    random: int  # noise
    specials: int
    source: str = ""

    @property
    def coverage(self) -> float:
        """Share of non-special tokens with a found vector."""
        words = self.vocab_size - self.specials
        return self.found / words if words else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "coverage": round(self.coverage, 6)}

    def line(self) -> str:
        words = self.vocab_size - self.specials
        return (
            f"embeddings from {self.source}: {self.found}/{words} found ({100 * self.coverage:.1f}%), "
            f"{self.subword} from subwords, {self.random} random, dim {self.dim}"
        )


def build_embedding_matrix(
    tokenizer,
    source: VectorSource,
    oov: str = "subword",
    noise_std: float | None = None,
    seed: int = 0,
    pad_id: int | None = 0,
) -> tuple[np.ndarray, EmbeddingReport]:
    """(vocab_size, dim) float32 matrix for ``tokenizer``'s ids, and how each row was filled."""
    if oov not in get_args(EmbeddingOOV):
        raise TinyLMError(f"embeddings.oov={oov!r} is not one of {', '.join(get_args(EmbeddingOOV))}")
    keys = vocabulary_keys(tokenizer)
    dim = source.dim
    matrix = np.zeros((len(keys), dim), dtype=np.float32)
    kinds = np.zeros(len(keys), dtype=np.int8)  # 0 special, 1 found, 2 subword, 3 random
    for i, key in enumerate(keys):
        if key is None:
            continue
        for cand in _candidates(key):
            vec = source.vectors.get(cand)
            if vec is not None:
                matrix[i], kinds[i] = vec, 1
                break
        if kinds[i] == 0 and oov == "subword" and source.subword is not None and key.strip():
            vec = source.subword(key.strip())
            if vec is not None and np.any(vec):
                matrix[i], kinds[i] = vec, 2
        if kinds[i] == 0:
            kinds[i] = 3
    real = matrix[(kinds == 1) | (kinds == 2)]
    std = noise_std if noise_std is not None else (float(real.std()) if real.size else 0.02)
    rng = np.random.default_rng(seed)
    noisy = (kinds == 3) | (kinds == 0)
    matrix[noisy] = rng.normal(0.0, std, size=(int(noisy.sum()), dim)).astype(np.float32)
    if pad_id is not None and 0 <= pad_id < len(keys) and keys[pad_id] is None:
        matrix[pad_id] = 0.0
    counts = [int((kinds == k).sum()) for k in (1, 2, 3, 0)]  # found, subword, random, specials
    return matrix, EmbeddingReport(len(keys), dim, *counts, source.name)


# ------------------------------------------------------------------------------ into the model
def token_sentences(ids: np.ndarray, tokenizer, max_len: int = 1000) -> list[list[str]]:
    """The token stream as gensim sentences of token strings (cut at specials and every max_len;
    ``<unk>`` stays in as a word so that its neighbours keep their context)."""
    keys = vocabulary_keys(tokenizer)
    unk = getattr(tokenizer, "unk_id", None)
    if unk is not None and 0 <= unk < len(keys):
        keys[unk] = "<unk>"
    sentences, current = [], []
    for i in np.asarray(ids).tolist():
        key = keys[i] if 0 <= i < len(keys) else None
        if key is None or len(current) >= max_len:
            if current:
                sentences.append(current)
            current = [] if key is None else [key]
        else:
            current.append(key)
    if current:
        sentences.append(current)
    return sentences


def _trained_matrix_cache(cache_dir: Path, train_ids: np.ndarray, tokenizer, width: int, emb_cfg) -> Path:
    """Where vectors trained on this token stream with these settings are kept (one file per key)."""
    key = {
        "ids": zlib.crc32(np.ascontiguousarray(train_ids).tobytes()),
        "n": int(len(train_ids)),
        "vocab": zlib.crc32("\n".join(str(k) for k in vocabulary_keys(tokenizer)).encode("utf-8", "replace")),
        "width": width,
        "seed": emb_cfg.seed,
        "epochs": emb_cfg.train_epochs,
        "window": emb_cfg.train_window,
        "min_count": emb_cfg.train_min_count,
        "oov": emb_cfg.oov,
        "noise_std": emb_cfg.noise_std,
    }
    digest = zlib.crc32(json.dumps(key, sort_keys=True).encode()) & 0xFFFFFFFF
    return Path(cache_dir) / f"fasttext-trained-{digest:08x}.npz"


def _train_matrix(tokenizer, emb_cfg, train_ids, width: int, cache_dir) -> tuple[np.ndarray, EmbeddingReport, dict]:
    """FastText trained on the training split (or read back from the cache); the matrix, its
    report, and how it was obtained (seconds spent training, or the cache file)."""
    if train_ids is None:
        raise TinyLMError("embeddings.kind=train needs the training token stream")
    cache = _trained_matrix_cache(cache_dir, train_ids, tokenizer, width, emb_cfg) if cache_dir is not None else None
    if cache is not None and cache.is_file():
        with np.load(cache, allow_pickle=False) as f:
            report = EmbeddingReport(**json.loads(str(f["report"])))
            info = {"cached": cache.name, "train_seconds": float(f["train_seconds"])}
            return f["matrix"], report, info
    t0 = time.perf_counter()
    source = train_fasttext(
        token_sentences(train_ids, tokenizer),
        width,
        seed=emb_cfg.seed,
        epochs=emb_cfg.train_epochs,
        window=emb_cfg.train_window,
        min_count=emb_cfg.train_min_count,
    )
    seconds = time.perf_counter() - t0
    matrix, report = build_embedding_matrix(
        tokenizer, source, emb_cfg.oov, emb_cfg.noise_std, emb_cfg.seed, pad_id=getattr(tokenizer, "pad_id", 0)
    )
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.stem}.{os.getpid()}.tmp.npz")  # ranks may write at once
        np.savez(tmp, matrix=matrix, report=json.dumps(dataclasses.asdict(report)), train_seconds=seconds)
        os.replace(tmp, cache)
    log.info(f"embeddings: FastText ({width}-d) trained on the training split in {seconds:.1f} s")
    return matrix, report, {"cached": None, "train_seconds": seconds}


def apply_pretrained_embeddings(
    model,
    tokenizer,
    emb_cfg,
    train_ids: np.ndarray | None = None,
    out_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> EmbeddingReport | None:
    """Fill ``model.tok_emb`` from the source ``emb_cfg`` describes (None when kind is "none");
    writes ``embeddings.json`` (the coverage report) into ``out_dir`` when given. Vectors trained
    on the split (kind "train") are kept in ``cache_dir`` and reused by runs on the same tokens."""
    kind = emb_cfg.kind
    if kind == "none":
        return None
    width = int(model.tok_emb.weight.shape[1])
    if emb_cfg.freeze and getattr(model, "lm_head", None) is not None and model.lm_head.weight is model.tok_emb.weight:
        raise TinyLMError(
            "embeddings.freeze=true with model.tie_weights=true would freeze the output layer too; "
            "set model.tie_weights=false"
        )
    info: dict = {}
    if kind == "train":
        matrix, report, info = _train_matrix(tokenizer, emb_cfg, train_ids, width, cache_dir)
    else:
        keys = {c for k in vocabulary_keys(tokenizer) if k is not None for c in _candidates(k)}
        source = load_vectors(kind, emb_cfg.path, keys)
        if source.dim != width:
            d_model = getattr(getattr(model, "config", None), "d_model", width)
            raise TinyLMError(
                f"the vectors are {source.dim}-dimensional but the model's token embedding is {width}-dimensional; "
                f"set model.d_embed={source.dim} (a learned projection to d_model={d_model}, needs "
                f"model.tie_weights=false) or model.d_model={source.dim}"
            )
        matrix, report = build_embedding_matrix(
            tokenizer, source, emb_cfg.oov, emb_cfg.noise_std, emb_cfg.seed, pad_id=getattr(tokenizer, "pad_id", 0)
        )
    with torch.no_grad():
        weight = model.tok_emb.weight
        weight.copy_(torch.from_numpy(matrix).to(device=weight.device, dtype=weight.dtype))
    model.tok_emb.weight.requires_grad_(not emb_cfg.freeze)
    log.info(report.line() + (" (frozen)" if emb_cfg.freeze else ""))
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        record = {
            **report.as_dict(),
            **info,
            "kind": kind,
            "path": emb_cfg.path,
            "freeze": emb_cfg.freeze,
            "oov": emb_cfg.oov,
        }
        (Path(out_dir) / "embeddings.json").write_text(json.dumps(record, indent=1))
    return report
