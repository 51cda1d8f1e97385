"""Tokenizer benchmark: tinylm BPE against Hugging Face `tokenizers`' BPE trainer, measured in the
same run on the same documents, vocabulary size and pre-tokenisation (GPT-2 regex + bytes), plus
tinylm's word and char tokenizers (and the llama2.c tok512 reader when it is on disk).

Data: ../shared/data/tinystories/{train,valid}.txt relative to the repository (read-only, not part
of the repo), or --data-dir DIR holding train.txt and valid.txt. Training runs alternate
tinylm / HF (A B A B ...); medians are reported.

    python benchmarks/bench_tokenizers.py [--quick] [--json PATH] [--vocab 4096] [--threads 2]

Columns: system, vocab_size, train_seconds, encode_mb_per_s (second pass over the validation
stories: piece caches filled), encode_cold_mb_per_s (first pass of a freshly loaded tokenizer),
tokens_per_word, roundtrip_exact (share of validation stories decoded back exactly), and the
ratios train_ratio / encode_ratio / encode_cold_ratio against HF.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 MB of training text, one run per system (< 60 s)")
    p.add_argument("--json", metavar="PATH", help="also write the table as a JSON list of rows")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3, help="training runs per BPE system (alternated)")
    p.add_argument("--threads", type=int, default=2, help="threads for HF tokenizers (rayon) and torch")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=SHARED / "data/tinystories",
        help="directory with train.txt and valid.txt (TinyStories format)",
    )
    p.add_argument(
        "--tok512",
        type=Path,
        default=SHARED / "anchors/llama2c/tok512.bin",
        help="llama2.c tokenizer.bin for the extra llama2.c row (skipped when absent)",
    )
    return p.parse_args(argv)


def read_stories(path: Path, limit_bytes: int | None = None) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if limit_bytes:
        text = text[:limit_bytes]
    return [s.strip() for s in text.split("<|endoftext|>") if s.strip()]


def encode_speed(encode, docs: list[str], reps: int = 1) -> float:
    """MB/s over all docs (median of ``reps``)."""
    n_bytes = sum(len(d.encode()) for d in docs)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        encode(docs)
        times.append(time.perf_counter() - t)
    return n_bytes / statistics.median(times) / 1e6


def quality(encode_one, decode, docs: list[str]) -> tuple[float, float]:
    tokens = words = exact = 0
    for d in docs:
        ids = encode_one(d)
        tokens += len(ids)
        words += len(d.split())
        exact += decode(ids) == d
    return tokens / words, exact / len(docs)


def hf_trainer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def train(docs):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2 regex
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab,
            show_progress=False,
            special_tokens=["<pad>", "<unk>", "<sos>", "<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(docs, trainer)
        return tok

    return train


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # before `tokenizers` starts its pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import torch

    torch.set_num_threads(args.threads)
    from tinylm.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer
    from tinylm.tokenizers.hf_interop import byte_to_unicode

    train_path, valid_path = args.data_dir / "train.txt", args.data_dir / "valid.txt"
    if not train_path.is_file() or not valid_path.is_file():
        print(
            f"benchmark data not found in {args.data_dir} (by default this benchmark reads "
            f"../shared/data/tinystories relative to the repository; or pass --data-dir)"
        )
        return 1
    train_docs = read_stories(train_path, 1_000_000 if args.quick else None)
    valid_docs = read_stories(valid_path)
    reps = 1 if args.quick else args.reps
    mb = sum(len(d.encode()) for d in train_docs) / 1e6
    print(
        f"training text: {mb:.2f} MB ({len(train_docs):,} stories); encode/quality on {len(valid_docs):,} "
        f"validation stories; vocab {args.vocab}; {reps} run(s) per BPE system, alternated; "
        f"HF rayon threads {args.threads}, tinylm single-threaded Python"
    )

    hf_train = hf_trainer(args.vocab)
    times = {"tinylm_bpe": [], "hf_tokenizers_bpe": []}
    tl = hf = None
    for _ in range(reps):  # A B A B
        t = time.perf_counter()
        tl = BPETokenizer().train(train_docs, args.vocab)
        times["tinylm_bpe"].append(time.perf_counter() - t)
        t = time.perf_counter()
        hf = hf_train(train_docs)
        times["hf_tokenizers_bpe"].append(time.perf_counter() - t)
    assert hf.get_vocab_size() == tl.vocab_size == args.vocab

    rows = []
    # encoding the validation stories, alternated: "cold" = first pass of a freshly loaded tokenizer
    # (tinylm's piece cache empty; HF's BPE cache empty), "warm" = second pass (caches filled)
    speeds = {k: {"cold": [], "warm": []} for k in ("tinylm_bpe", "hf_tokenizers_bpe")}
    hf_json = hf.to_str()
    from tokenizers import Tokenizer as HFTokenizer

    for _ in range(reps):
        fresh = BPETokenizer(tl.merges, tl.pattern)
        for phase in ("cold", "warm"):
            speeds["tinylm_bpe"][phase].append(encode_speed(lambda docs: [fresh.encode(d) for d in docs], valid_docs))
        fresh_hf = HFTokenizer.from_str(hf_json)
        for phase in ("cold", "warm"):
            speeds["hf_tokenizers_bpe"][phase].append(
                encode_speed(lambda docs: fresh_hf.encode_batch(docs, add_special_tokens=False), valid_docs)
            )
    for name, tok_encode, tok_decode, size, train_times in (
        ("tinylm_bpe", tl.encode, tl.decode, tl.vocab_size, times["tinylm_bpe"]),
        (
            "hf_tokenizers_bpe",
            lambda d: hf.encode(d, add_special_tokens=False).ids,
            hf.decode,
            hf.get_vocab_size(),
            times["hf_tokenizers_bpe"],
        ),
    ):
        tpw, exact = quality(tok_encode, tok_decode, valid_docs)
        rows.append(
            {
                "system": name,
                "vocab_size": size,
                "train_seconds": statistics.median(train_times),
                "encode_mb_per_s": statistics.median(speeds[name]["warm"]),
                "encode_cold_mb_per_s": statistics.median(speeds[name]["cold"]),
                "tokens_per_word": tpw,
                "roundtrip_exact": exact,
            }
        )
    # how many learned tokens the two trainers share (tie-breaking differs, so not all)
    table = byte_to_unicode()
    hf_vocab = set(hf.get_vocab())
    shared = sum("".join(table[b] for b in tl.token_bytes[i]) in hf_vocab for i in range(260, tl.vocab_size))
    merge_overlap = shared / max(tl.vocab_size - 260, 1)

    for name, make in (("tinylm_word", lambda: WordTokenizer()), ("tinylm_char", lambda: CharTokenizer())):
        t = time.perf_counter()
        tok = make().train(train_docs, args.vocab if name == "tinylm_word" else None)
        train_s = time.perf_counter() - t
        speed = encode_speed(lambda docs: [tok.encode(d) for d in docs], valid_docs, reps)
        tpw, exact = quality(tok.encode, tok.decode, valid_docs)
        rows.append(
            {
                "system": name,
                "vocab_size": tok.vocab_size,
                "train_seconds": train_s,
                "encode_mb_per_s": speed,
                "encode_cold_mb_per_s": None,
                "tokens_per_word": tpw,
                "roundtrip_exact": exact,
            }
        )

    tok512 = args.tok512
    if tok512.is_file():
        from tinylm.tokenizers.llama2c import Llama2cTokenizer

        l2c = Llama2cTokenizer.from_file(tok512)
        speed = encode_speed(lambda docs: [l2c.encode(d) for d in docs], valid_docs, 1)
        tpw, exact = quality(l2c.encode, l2c.decode, valid_docs)
        rows.append(
            {
                "system": "tinylm_llama2c_tok512",
                "vocab_size": l2c.vocab_size,
                "train_seconds": None,
                "encode_mb_per_s": speed,
                "encode_cold_mb_per_s": None,
                "tokens_per_word": tpw,
                "roundtrip_exact": exact,
            }
        )
    else:
        print(f"(llama2.c tok512.bin not found at {tok512}; row skipped)")

    hf_row = rows[1]
    for r in rows:
        r["train_ratio"] = r["train_seconds"] / hf_row["train_seconds"] if r["train_seconds"] else None
        r["encode_ratio"] = r["encode_mb_per_s"] / hf_row["encode_mb_per_s"]
        cold = r["encode_cold_mb_per_s"]
        r["encode_cold_ratio"] = cold / hf_row["encode_cold_mb_per_s"] if cold else None
    print_table(rows)
    tl_row = rows[0]
    print(
        f"\ntinylm BPE training time / HF: {tl_row['train_ratio']:.2f}x (target <= 2x); "
        f"tinylm encode {tl_row['encode_mb_per_s']:.1f} MB/s warm, {tl_row['encode_cold_mb_per_s']:.1f} cold "
        f"(target >= 5); "
        f"{100 * merge_overlap:.1f}% of tinylm's learned tokens are also in HF's vocabulary"
    )
    print("train runs (s): " + "; ".join(f"{k} " + ", ".join(f"{x:.2f}" for x in v) for k, v in times.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def print_table(rows: list[dict]) -> None:
    header = [
        "system",
        "vocab_size",
        "train_seconds",
        "train_ratio",
        "encode_mb_per_s",
        "encode_ratio",
        "encode_cold_mb_per_s",
        "encode_cold_ratio",
        "tokens_per_word",
        "roundtrip_exact",
    ]

    def fmt(v):
        if v is None:
            return "-"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    body = [[fmt(r[h]) for h in header] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    for i, line in enumerate([header, *body]):
        print("  ".join(x.ljust(w) if j == 0 else x.rjust(w) for j, (x, w) in enumerate(zip(line, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    sys.exit(main())
