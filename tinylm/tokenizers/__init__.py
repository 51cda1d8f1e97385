"""Tokenizers with one interface: train / encode / decode / save / load.

Specials ``<pad> <unk> <sos> <eos>`` are ids 0-3 in every tinylm tokenizer.
"""
from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import EOS_ID, PAD_ID, SOS_ID, UNK_ID, Tokenizer, load_tokenizer
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.char import CharTokenizer
from tinylm.tokenizers.word import WordTokenizer

TOKENIZER_TYPES = {"bpe": BPETokenizer, "char": CharTokenizer, "word": WordTokenizer}


def new_tokenizer(kind: str, **options) -> Tokenizer:
    """An untrained tokenizer of the named type ("bpe", "char" or "word")."""
    if kind not in TOKENIZER_TYPES:
        raise TinyLMError(f"unknown tokenizer type {kind!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    return TOKENIZER_TYPES[kind](**options)


__all__ = ["Tokenizer", "BPETokenizer", "CharTokenizer", "WordTokenizer", "load_tokenizer",
           "new_tokenizer", "TOKENIZER_TYPES", "PAD_ID", "UNK_ID", "SOS_ID", "EOS_ID"]
