"""How a tokenizer treats each split of a corpus (`tinylm tokenizer-stats`).

Per (tokenizer, split): vocabulary size, documents, words (whitespace-separated), tokens,
tokens per word, bytes per token, ``<unk>`` rate (share of tokens that are ``<unk>``), and the
reconstruction check (share of documents with ``decode(encode(doc)) == doc`` exactly).

Tokenizers come from files (tinylm JSON, llama2.c ``tokenizer.bin``, or a run directory holding
``tokenizer.json``) or are trained on the first ``--data`` split with ``--train TYPE:VOCAB``
(``bpe:1260`` = 1,000 merges; ``word:5000``; ``char:0``), which makes the usual "tokens per word
at 1,000 / 2,000 / 3,000 merges" table one command.
"""

from __future__ import annotations

from tabulate import tabulate

from tinylm.errors import TinyLMError
from tinylm.tokenizers.io import new_tokenizer


def split_stats(tokenizer, docs: list[str]) -> dict:
    """The statistics of one tokenizer on one list of documents."""
    unk = getattr(tokenizer, "unk_id", None)
    n_words = n_tokens = n_bytes = n_unk = exact = 0
    for doc in docs:
        ids = tokenizer.encode(doc)
        n_tokens += len(ids)
        n_words += len(doc.split())
        n_bytes += len(doc.encode("utf-8", "surrogatepass"))
        if unk is not None:
            n_unk += sum(1 for i in ids if i == unk)
        exact += tokenizer.decode(ids) == doc
    return {
        "vocab_size": tokenizer.vocab_size,
        "documents": len(docs),
        "words": n_words,
        "tokens": n_tokens,
        "tokens_per_word": n_tokens / n_words if n_words else 0.0,
        "bytes_per_token": n_bytes / n_tokens if n_tokens else 0.0,
        "unk_rate": n_unk / n_tokens if n_tokens else 0.0,
        "roundtrip_exact": exact / len(docs) if docs else 1.0,
    }


def train_spec(spec: str, docs: list[str]):
    """``TYPE:VOCAB`` (e.g. ``bpe:1260``) trained on ``docs``."""
    kind, _, vocab = spec.partition(":")
    try:
        vocab_size = int(vocab) if vocab else 0
    except ValueError:
        raise TinyLMError(f"--train {spec!r}: the vocabulary size after ':' must be an integer") from None
    return new_tokenizer(kind).train(docs, vocab_size)


def collect(tokenizers: dict[str, object], splits: dict[str, list[str]]) -> list[dict]:
    return [
        {"tokenizer": tname, "split": sname, **split_stats(tok, docs)}
        for tname, tok in tokenizers.items()
        for sname, docs in splits.items()
    ]


def format_table(rows: list[dict]) -> str:
    numbers = ("vocab_size", "documents", "words", "tokens", "tokens_per_word", "bytes_per_token")
    body = [
        [r["tokenizer"], r["split"], *(r[k] for k in numbers), 100 * r["unk_rate"], 100 * r["roundtrip_exact"]]
        for r in rows
    ]
    return tabulate(
        body,
        ["tokenizer", "split", "vocab", "docs", "words", "tokens", "tok/word", "bytes/tok", "unk %", "exact %"],
        floatfmt=("", "", ",", ",", ",", ",", ".3f", ".3f", ".2f", ".1f"),
        intfmt=",",
    )
