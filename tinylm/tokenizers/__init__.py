"""Tokenizers with one interface: train / encode / decode / save / load.

Specials ``<pad> <unk> <sos> <eos>`` are ids 0-3 in every tinylm tokenizer.
"""
from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import EOS_ID, PAD_ID, SOS_ID, UNK_ID, Tokenizer, load_tokenizer
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.char import CharTokenizer
from tinylm.tokenizers.llama2c import Llama2cTokenizer
from tinylm.tokenizers.word import WordTokenizer

TOKENIZER_TYPES = {"bpe": BPETokenizer, "char": CharTokenizer, "word": WordTokenizer}


def new_tokenizer(kind: str, **options) -> Tokenizer:
    """An untrained tokenizer of the named type ("bpe", "char" or "word")."""
    if kind not in TOKENIZER_TYPES:
        raise TinyLMError(f"unknown tokenizer type {kind!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    return TOKENIZER_TYPES[kind](**options)


def train_from_config(tok_cfg, texts) -> Tokenizer:
    """Train the tokenizer a ``TokenizerConfig`` describes (with the options of its type)."""
    kind = tok_cfg.type
    if kind == "word":
        tok = new_tokenizer(kind, lowercase=tok_cfg.lowercase, keep_punctuation=getattr(tok_cfg, "keep_punctuation", True),
                            splitter=getattr(tok_cfg, "splitter", "regex"))
        return tok.train(texts, tok_cfg.vocab_size, min_count=getattr(tok_cfg, "min_count", 1))
    if kind == "bpe":
        return new_tokenizer(kind, pattern=getattr(tok_cfg, "pattern", "gpt2")).train(texts, tok_cfg.vocab_size)
    return new_tokenizer(kind).train(texts, tok_cfg.vocab_size)


__all__ = ["Tokenizer", "BPETokenizer", "CharTokenizer", "WordTokenizer", "Llama2cTokenizer", "load_tokenizer",
           "new_tokenizer", "train_from_config", "TOKENIZER_TYPES", "PAD_ID", "UNK_ID", "SOS_ID", "EOS_ID"]
