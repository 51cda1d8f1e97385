"""Data: corpora -> cleaning -> splits -> token caches -> batches."""

from tinylm.data.cleaning import CleanOptions, CleanReport, clean_documents
from tinylm.data.corpora import (
    load_shakespeare,
    load_text_file,
    load_tinystories,
    load_tinystories_hub,
    read_tinystories_json,
    read_tinystories_text,
)
from tinylm.data.splits import split_chunks, split_documents
from tinylm.data.tokens import Batches, TokenSplit, encode_split, load_split

__all__ = [
    "CleanOptions",
    "CleanReport",
    "clean_documents",
    "load_shakespeare",
    "load_text_file",
    "load_tinystories",
    "load_tinystories_hub",
    "read_tinystories_json",
    "read_tinystories_text",
    "split_chunks",
    "split_documents",
    "Batches",
    "TokenSplit",
    "encode_split",
    "load_split",
]
