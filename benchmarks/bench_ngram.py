"""tinylm's n-gram LMs against KenLM on Shakespeare BPE tokens.

Both systems see the same token stream: BPE ids of each training chunk, written for KenLM as one
line of words ``t<id>`` per document (KenLM adds ``<s>``/``</s>``, tinylm reads ``<sos> .. <eos>``).
KenLM's ``lmplz`` estimates interpolated modified Kneser-Ney (orders 3 and 5) into an ARPA file
that the ``kenlm`` Python module queries; tinylm fits and scores the same stream with numpy.
Perplexity counts every token and the end of each document (``</s>`` / ``<eos>``). ``lmplz`` gets
``--vocab_pad V`` so that its uniform unigram term is 1/V like tinylm's.

Build KenLM first: ``bash benchmarks/setup_kenlm.sh`` (without it, the kenlm rows are skipped).
Timings: tinylm runs single-threaded numpy; lmplz uses its own threads (its default pipeline).
Systems alternate (tinylm, kenlm, tinylm, kenlm, ...) and the table shows medians.

    .venv/bin/python benchmarks/bench_ngram.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
from tinylm.constants import EOS_ID
from tinylm.data.corpora import load_shakespeare
from tinylm.data.splits import split_chunks
from tinylm.errors import TinyLMError
from tinylm.models.ngram import NGramLM
from tinylm.tokenizers import new_tokenizer
from tinylm.tokenizers.base import SOS_ID

LMPLZ = HERE / ".kenlm" / "bin" / "lmplz"


def token_streams(quick: bool):
    docs = list(load_shakespeare().values())
    if quick:
        docs = docs[:8]
    splits = split_chunks(docs, 0.1, 0.1)
    merges = 300 if quick else 1000
    tok = new_tokenizer("bpe").train(splits["train"], 260 + merges)
    enc = {name: [tok.encode(d) for d in splits[name]] for name in ("train", "valid", "test")}
    return tok, enc, merges


def as_stream(docs: list[list[int]]) -> np.ndarray:
    return np.concatenate([np.array([SOS_ID, *d, EOS_ID], dtype=np.int64) for d in docs])


def run_tinylm(order, smoothing, train, test, V, valid=None):
    t0 = time.perf_counter()
    lm = NGramLM(order, V, smoothing, k=0.1 if smoothing == "add_k" else 1.0).fit(train)
    if smoothing == "interpolated":
        lm.fit_weights(valid)  # not timed separately: part of estimating this model
    t_count = time.perf_counter() - t0
    t0 = time.perf_counter()
    nll, n = lm.score(test, score_eos=True)
    t_query = time.perf_counter() - t0
    return {"ppl": float(np.exp(nll / n)), "count_s": t_count, "query_s": t_query, "scored": n}


def run_kenlm(order, train_txt: Path, test_lines: list[str], V: int, workdir: Path, quick: bool):
    import kenlm

    arpa = workdir / f"o{order}.arpa"
    cmd = [
        str(LMPLZ),
        "-o",
        str(order),
        "--text",
        str(train_txt),
        "--arpa",
        str(arpa),
        "-S",
        "1G",
        "-T",
        str(workdir),
        "--vocab_pad",
        str(V),
    ]
    if quick:
        cmd.append("--discount_fallback")  # the quick corpus is small enough to lack some counts of counts
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_count = time.perf_counter() - t0
    model = kenlm.Model(str(arpa))
    t0 = time.perf_counter()
    log10 = sum(model.score(line, bos=True, eos=True) for line in test_lines)
    t_query = time.perf_counter() - t0
    scored = sum(len(line.split()) + 1 for line in test_lines)
    return {"ppl": float(10 ** (-log10 / scored)), "count_s": t_count, "query_s": t_query, "scored": scored}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 plays, 300 merges, one repeat (under 60 s)")
    ap.add_argument("--json", help="write the table as a JSON list of rows")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    try:
        tok, enc, merges = token_streams(args.quick)
    except TinyLMError as exc:
        print(f"bench_ngram: {exc}", file=sys.stderr)
        return 2
    V = tok.vocab_size
    train, valid, test = as_stream(enc["train"]), as_stream(enc["valid"]), as_stream(enc["test"])
    n_train = int(train.size)
    have_kenlm = LMPLZ.is_file()
    try:
        import kenlm  # noqa: F401
    except ImportError:
        have_kenlm = False
    print(
        f"Shakespeare, BPE {merges} merges (V={V}): train {n_train:,} tokens, test {test.size:,} tokens; "
        f"tinylm numpy 1 thread; {repeats} repeat(s), alternating systems"
    )
    if not have_kenlm:
        print("kenlm rows skipped: lmplz or the kenlm module is missing (run: bash benchmarks/setup_kenlm.sh)")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        train_txt = workdir / "train.txt"
        train_txt.write_text("\n".join(" ".join(f"t{i}" for i in d) for d in enc["train"] if d) + "\n")
        test_lines = [" ".join(f"t{i}" for i in d) for d in enc["test"] if d]
        for order in (3, 5):
            runs = {"tinylm": [], "kenlm": []}
            for _ in range(repeats):  # A B A B
                runs["tinylm"].append(run_tinylm(order, "kneser_ney", train, test, V))
                if have_kenlm:
                    runs["kenlm"].append(run_kenlm(order, train_txt, test_lines, V, workdir, args.quick))
            for system, rs in runs.items():
                if not rs:
                    continue
                rows.append(
                    {
                        "system": system,
                        "order": order,
                        "smoothing": "modified_kneser_ney",
                        "ppl": round(rs[0]["ppl"], 4),
                        "count_tokens_per_s": round(n_train / statistics.median(r["count_s"] for r in rs)),
                        "query_tokens_per_s": round(rs[0]["scored"] / statistics.median(r["query_s"] for r in rs)),
                    }
                )
        for order in (3, 5):
            for smoothing in ("add_k", "interpolated"):
                rs = [run_tinylm(order, smoothing, train, test, V, valid) for _ in range(repeats)]
                rows.append(
                    {
                        "system": "tinylm",
                        "order": order,
                        "smoothing": "add_k(0.1)" if smoothing == "add_k" else "interpolated(EM on valid)",
                        "ppl": round(rs[0]["ppl"], 4),
                        "count_tokens_per_s": round(n_train / statistics.median(r["count_s"] for r in rs)),
                        "query_tokens_per_s": round(rs[0]["scored"] / statistics.median(r["query_s"] for r in rs)),
                    }
                )

    ken = {(r["order"]): r for r in rows if r["system"] == "kenlm"}
    header = [
        "system",
        "order",
        "smoothing",
        "ppl",
        "ppl / kenlm",
        "count tok/s",
        "query tok/s",
        "count x kenlm",
        "query x kenlm",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        k = ken.get(r["order"]) if r["smoothing"] == "modified_kneser_ney" else None
        if k:
            r["ppl_ratio_vs_kenlm"] = round(r["ppl"] / k["ppl"], 5)
            r["count_speed_ratio_vs_kenlm"] = round(r["count_tokens_per_s"] / k["count_tokens_per_s"], 3)
            r["query_speed_ratio_vs_kenlm"] = round(r["query_tokens_per_s"] / k["query_tokens_per_s"], 3)
        cells = [
            r["system"],
            r["order"],
            r["smoothing"],
            f"{r['ppl']:.3f}",
            f"{r['ppl_ratio_vs_kenlm']:.5f}" if k else "-",
            f"{r['count_tokens_per_s']:,}",
            f"{r['query_tokens_per_s']:,}",
            f"{r['count_speed_ratio_vs_kenlm']:.2f}" if k else "-",
            f"{r['query_speed_ratio_vs_kenlm']:.2f}" if k else "-",
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
