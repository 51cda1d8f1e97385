"""`tinylm tokenizer-stats`: how a tokenizer treats each split of a corpus.

Per (tokenizer, split): vocabulary size, documents, words (whitespace-separated), tokens,
tokens per word, bytes per token, ``<unk>`` rate (share of tokens that are ``<unk>``), and the
reconstruction check (share of documents with ``decode(encode(doc)) == doc`` exactly).

Tokenizers come from files (tinylm JSON, llama2.c ``tokenizer.bin``, or a run directory holding
``tokenizer.json``) or are trained on the first ``--data`` split with ``--train TYPE:VOCAB``
(``bpe:1260`` = 1,000 merges; ``word:5000``; ``char:0``), which makes the usual "tokens per word
at 1,000 / 2,000 / 3,000 merges" table one command.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tinylm.errors import TinyLMError

COLUMNS = ("tokenizer", "split", "vocab_size", "documents", "words", "tokens", "tokens_per_word",
           "bytes_per_token", "unk_rate", "roundtrip_exact")


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
        "vocab_size": tokenizer.vocab_size, "documents": len(docs), "words": n_words, "tokens": n_tokens,
        "tokens_per_word": n_tokens / n_words if n_words else 0.0,
        "bytes_per_token": n_bytes / n_tokens if n_tokens else 0.0,
        "unk_rate": n_unk / n_tokens if n_tokens else 0.0,
        "roundtrip_exact": exact / len(docs) if docs else 1.0,
    }


def load_any_tokenizer(spec: str):
    """A tokenizer from a file or a run directory (its tokenizer.json)."""
    from tinylm.tokenizers import load_tokenizer

    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    return load_tokenizer(path)


def train_spec(spec: str, docs: list[str]):
    """``TYPE:VOCAB`` (e.g. ``bpe:1260``) trained on ``docs``."""
    from tinylm.tokenizers import new_tokenizer

    kind, _, vocab = spec.partition(":")
    try:
        vocab_size = int(vocab) if vocab else 0
    except ValueError:
        raise TinyLMError(f"--train {spec!r}: the vocabulary size after ':' must be an integer") from None
    return new_tokenizer(kind).train(docs, vocab_size)


def parse_data(specs: list[str]) -> dict[str, list[str]]:
    """``[name=]path`` arguments -> documents per split name (default names: the file stems)."""
    from tinylm.data.corpora import load_text_file

    splits: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).stem, spec
        if not Path(path).is_file():
            raise TinyLMError(f"data file {path} does not exist")
        docs = [d for d in load_text_file(path) if d]
        if not docs:
            raise TinyLMError(f"data file {path} holds no text")
        splits[name] = docs
    return splits


def collect(tokenizers: dict[str, object], splits: dict[str, list[str]]) -> list[dict]:
    rows = []
    for tname, tok in tokenizers.items():
        for sname, docs in splits.items():
            rows.append({"tokenizer": tname, "split": sname, **split_stats(tok, docs)})
    return rows


def format_table(rows: list[dict]) -> str:
    header = ["tokenizer", "split", "vocab", "docs", "words", "tokens", "tok/word", "bytes/tok", "unk %", "exact %"]
    body = [[r["tokenizer"], r["split"], f"{r['vocab_size']:,}", f"{r['documents']:,}", f"{r['words']:,}",
             f"{r['tokens']:,}", f"{r['tokens_per_word']:.3f}", f"{r['bytes_per_token']:.3f}",
             f"{100 * r['unk_rate']:.2f}", f"{100 * r['roundtrip_exact']:.1f}"] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(str(x).rjust(w) if i > 1 else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))
             for row in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("tokenizer-stats", help="vocabulary, tokens per word, bytes per token, <unk> rate, round trip")
    p.add_argument("--tokenizer", action="append", default=[], metavar="T",
                   help="tokenizer file (tinylm JSON or llama2.c tokenizer.bin) or run directory; repeatable")
    p.add_argument("--train", action="append", default=[], metavar="TYPE:VOCAB",
                   help="train a tokenizer on the first --data split, e.g. bpe:1260 (1,000 merges); repeatable")
    p.add_argument("--data", action="append", required=True, metavar="[NAME=]FILE",
                   help="a split's text file (.txt, .jsonl, TinyStories format); repeatable, e.g. --data train=a.txt")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.set_defaults(func=cmd_tokenizer_stats)


def cmd_tokenizer_stats(args) -> int:
    if not args.tokenizer and not args.train:
        raise TinyLMError("give at least one --tokenizer FILE or --train TYPE:VOCAB")
    splits = parse_data(args.data)
    tokenizers: dict[str, object] = {}
    for spec in args.tokenizer:
        tokenizers[spec] = load_any_tokenizer(spec)
    first = next(iter(splits.values()))
    for spec in args.train:
        tokenizers[spec] = train_spec(spec, first)
    rows = collect(tokenizers, splits)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        print(format_table(rows))
    return 0
