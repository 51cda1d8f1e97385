"""Tokenizers with one interface: train / encode / decode / save / load.

Specials ``<pad> <unk> <sos> <eos>`` are ids 0-3 in every tinylm tokenizer (tinylm.constants).
"""

from tinylm.tokenizers.base import Tokenizer
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.char import CharTokenizer
from tinylm.tokenizers.io import TOKENIZER_TYPES, load_tokenizer, new_tokenizer, train_from_config
from tinylm.tokenizers.llama2c import Llama2cTokenizer
from tinylm.tokenizers.word import WordTokenizer
from tinylm.tokenizers.word_bpe import WordBPETokenizer

__all__ = [
    "Tokenizer",
    "BPETokenizer",
    "CharTokenizer",
    "WordTokenizer",
    "WordBPETokenizer",
    "Llama2cTokenizer",
    "load_tokenizer",
    "new_tokenizer",
    "train_from_config",
    "TOKENIZER_TYPES",
]
