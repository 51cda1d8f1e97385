"""Making and loading tokenizers of every kind: one ``load_tokenizer(path)`` for all files.

A path may be a tinylm JSON tokenizer, a llama2.c ``tokenizer.bin``, a Hugging Face
``tokenizer.json`` (byte-level BPE, imported), or a run/checkpoint directory holding
``tokenizer.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tinylm.constants import SPECIAL_TOKENS
from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import FORMAT_NAME, FORMAT_VERSION, Tokenizer
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.char import CharTokenizer
from tinylm.tokenizers.hf_interop import import_hf
from tinylm.tokenizers.llama2c import Llama2cTokenizer, is_llama2c_file
from tinylm.tokenizers.word import WordTokenizer
from tinylm.tokenizers.word_bpe import WordBPETokenizer

TOKENIZER_TYPES = {"bpe": BPETokenizer, "char": CharTokenizer, "word": WordTokenizer, "word_bpe": WordBPETokenizer}


def new_tokenizer(kind: str, **options) -> Tokenizer:
    """An untrained tokenizer of the named type ("bpe", "char", "word" or "word_bpe")."""
    if kind not in TOKENIZER_TYPES:
        raise TinyLMError(f"unknown tokenizer type {kind!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    return TOKENIZER_TYPES[kind](**options)


def train_from_config(tok_cfg, texts) -> Tokenizer:
    """Train the tokenizer a ``TokenizerConfig`` describes (with the options of its type)."""
    kind = tok_cfg.type
    if kind == "word":
        tok = new_tokenizer(
            kind,
            lowercase=tok_cfg.lowercase,
            keep_punctuation=tok_cfg.keep_punctuation,
            splitter=tok_cfg.splitter,
            special_tokens=tuple(tok_cfg.special_tokens),
            specials_at=tok_cfg.specials_at,
            oov=tok_cfg.oov,
        )
        return tok.train(texts, tok_cfg.vocab_size, min_count=tok_cfg.min_count, oov_merges=tok_cfg.oov_merges)
    if tuple(tok_cfg.special_tokens) != SPECIAL_TOKENS or tok_cfg.specials_at != "start" or tok_cfg.oov != "unk":
        raise TinyLMError(
            f"tokenizer.special_tokens, tokenizer.specials_at and tokenizer.oov are word-level options; "
            f"the {kind} tokenizer keeps <pad> <unk> <sos> <eos> at ids 0-3"
        )
    if kind == "bpe":
        return new_tokenizer(kind, pattern=tok_cfg.pattern).train(texts, tok_cfg.vocab_size)
    if kind == "word_bpe":
        return new_tokenizer(kind, normalization=tok_cfg.normalization).train(
            texts, tok_cfg.vocab_size, merges=tok_cfg.merges
        )
    return new_tokenizer(kind).train(texts, tok_cfg.vocab_size)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load any tokenizer file tinylm reads (see the module notes); errors name what is wrong."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TinyLMError(f"tokenizer file {path} does not exist")
    if is_llama2c_file(path):  # a llama2.c tokenizer.bin (binary, not JSON)
        return Llama2cTokenizer.from_file(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise TinyLMError(f"tokenizer file {path} is not a tinylm JSON tokenizer ({exc})") from exc
    if isinstance(data, dict) and "model" in data and "pre_tokenizer" in data:
        return import_hf(path)  # a Hugging Face tokenizer.json
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise TinyLMError(f'{path} is not a tinylm tokenizer file (no "format": "{FORMAT_NAME}")')
    if data.get("version") != FORMAT_VERSION:
        raise TinyLMError(
            f"tokenizer file {path} has format version {data.get('version')}; "
            f"this tinylm reads version {FORMAT_VERSION}"
        )
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in TOKENIZER_TYPES:
        raise TinyLMError(f"unknown tokenizer type {kind!r} in {path} (known: {', '.join(TOKENIZER_TYPES)})")
    try:
        return TOKENIZER_TYPES[kind]._from_state(data)
    except TinyLMError as exc:
        raise TinyLMError(f"tokenizer file {path} is corrupt: {exc}") from exc
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # a field of the wrong shape
        raise TinyLMError(f"tokenizer file {path} is corrupt ({type(exc).__name__}: {exc})") from exc
