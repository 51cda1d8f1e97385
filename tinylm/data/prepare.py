"""`tinylm prepare`: corpus -> cleaned splits -> tokenizer -> token caches, reused when unchanged."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tinylm.config import DataConfig, RunConfig, check_config
from tinylm.data.augment import augment_mojibake
from tinylm.data.cleaning import clean_documents
from tinylm.data.corpora import HUB_TINYSTORIES, load_shakespeare, load_text_file, load_tinystories
from tinylm.data.splits import split_chunks, split_documents
from tinylm.data.tokens import TokenSplit, encode_split, load_split
from tinylm.errors import TinyLMError
from tinylm.tokenizers import Tokenizer, load_tokenizer, train_from_config

log = logging.getLogger(__name__)


@dataclass
class PreparedData:
    """What `prepare` leaves for training and evaluation: the tokenizer and the token caches."""

    tokenizer: Tokenizer
    tokenizer_path: Path
    splits: dict[str, TokenSplit]
    report: dict
    data_dir: Path | None = None  # the token caches (and what is derived from them, e.g. trained vectors)


def load_raw_documents(data: DataConfig) -> dict[str, list[str]]:
    """The corpus as documents per split: explicit files when given, else a split of ``train``."""
    src = data.source
    if src == "shakespeare":
        docs = list(load_shakespeare(data.train).values())
        given = {}
    elif src == "tinystories":
        docs = load_tinystories(data.train or HUB_TINYSTORIES, "train", data.hub_story_limit)
        given = {
            name: load_tinystories(getattr(data, name), name, data.hub_story_limit)
            for name in ("valid", "test")
            if getattr(data, name)
        }
    else:  # text
        docs = load_text_file(data.train)
        given = {name: load_text_file(getattr(data, name)) for name in ("valid", "test") if getattr(data, name)}
    if data.max_documents:
        docs = docs[: data.max_documents]
    if "valid" in given:
        return {"train": docs, **given}
    test_fraction = 0.0 if "test" in given else data.test_fraction
    out = (
        split_chunks(docs, data.valid_fraction, test_fraction)
        if data.split_by == "chunk"
        else split_documents(docs, data.valid_fraction, test_fraction, seed=0)
    )
    out.update(given)
    return {k: v for k, v in out.items() if v}


def _fingerprint(cfg: RunConfig) -> str:
    payload = {"data": dataclasses.asdict(cfg.data), "tokenizer": dataclasses.asdict(cfg.tokenizer)}
    payload["data"].pop("batching")  # batching is decided at training time, not in the cache
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def prepare(cfg: RunConfig, out_dir: str | Path) -> PreparedData:
    """Write ``tokenizer.json``, ``data/*.bin`` and ``prepare.json`` into ``out_dir``."""
    check_config(cfg)  # a config built in code is checked like a loaded one, before any data is read
    out_dir = Path(out_dir)
    data_dir = out_dir / "data"
    report_path = out_dir / "prepare.json"
    tok_path = out_dir / "tokenizer.json"
    fp = _fingerprint(cfg)
    if report_path.is_file() and tok_path.is_file():
        report = json.loads(report_path.read_text())
        if report.get("fingerprint") == fp:
            splits = {name: load_split(data_dir, name) for name in report["splits"]}
            log.info(f"prepare: reusing the token cache in {data_dir}")
            return PreparedData(load_tokenizer(tok_path), tok_path, splits, report, data_dir)

    raw = load_raw_documents(cfg.data)
    cleaned, clean_reports = {}, {}
    for name, docs in raw.items():
        cleaned[name], rep = clean_documents(docs, cfg.data)
        clean_reports[name] = dataclasses.asdict(rep)
        log.info(f"prepare: {name}: {rep.summary()}")
        if not cleaned[name]:
            raise TinyLMError(f"the {name} split is empty after cleaning ({rep.summary()})")
    augmented = 0
    if cfg.data.mojibake_fraction:  # the training split only: evaluation scores the files as they are
        cleaned["train"], augmented = augment_mojibake(cleaned["train"], cfg.data.mojibake_fraction, seed=0)
        log.info(f"prepare: train: {augmented} documents rewritten with mojibake punctuation")

    tokenizer = (
        load_tokenizer(cfg.tokenizer.path) if cfg.tokenizer.path else train_from_config(cfg.tokenizer, cleaned["train"])
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(tok_path)
    log.info(f"prepare: {cfg.tokenizer.type} tokenizer with {tokenizer.vocab_size} tokens -> {tok_path}")

    splits = {name: encode_split(name, docs, tokenizer, data_dir) for name, docs in cleaned.items()}
    report = {
        "fingerprint": fp,
        "splits": list(splits),
        "cleaning": clean_reports,
        "tokens": {n: s.n_tokens for n, s in splits.items()},
        "documents": {n: s.n_docs for n, s in splits.items()},
        "bytes": {n: s.n_bytes for n, s in splits.items()},
        "vocab_size": tokenizer.vocab_size,
    }
    if cfg.data.mojibake_fraction:
        report["augmentation"] = {"mojibake_fraction": cfg.data.mojibake_fraction, "documents_changed": augmented}
    if hasattr(tokenizer, "unk_rate"):
        report["unk_rate_valid"] = tokenizer.unk_rate(cleaned.get("valid", []))
    report_path.write_text(json.dumps(report, indent=2))
    for n, s in splits.items():
        log.info(f"prepare: {n}: {s.n_docs} documents, {s.n_tokens:,} tokens, {s.n_bytes:,} bytes")
    return PreparedData(tokenizer, tok_path, splits, report, data_dir)
