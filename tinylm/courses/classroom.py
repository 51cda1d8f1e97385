"""A teacher's view: `tinylm check --class DIR` checks every student of DIR (``DIR/NAME/adapter.py``
or ``DIR/NAME.py``) and writes one table (``check.md``, ``check.html``, ``check.json``,
``check.csv`` in DIR): a row per student, a column per part, the number of students passing each
part and making each mistake, and with ``--data`` the protocol's numbers (``courses.evaluate``).
`tinylm check --init DIR` writes the kit a student starts from.

Students run ``jobs`` at a time, each in its own sandboxed process (``sandbox``) that sees only
its own folder (or file): a hang, a crash, an exception or a runaway allocation is that student's
cell. Each student's verdicts are written to ``DIR/check-results/NAME.json`` (and Gradescope's
``DIR/check-results/gradescope/NAME/results.json``) as soon as that student is done, so a run
stopped half-way keeps them and ``resume`` skips them.
"""

from __future__ import annotations

import csv
import html
import io
import json
import os
import sys
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from tinylm.courses import adapter_template
from tinylm.courses.check import PASSING, PartResult, check_adapter, passed, select_parts
from tinylm.courses.evaluate import evaluate_adapter, finite
from tinylm.errors import TinyLMError

REPORT_NAMES = ("check.md", "check.html", "check.json", "check.csv")
RESULTS = "check-results"  # the folder in DIR that holds each student's verdicts, prints and Gradescope file
CELL = {"ok": "ok", "not implemented": "-", "error": "error", "timed out": "timeout"}
NUMBERS = (("bpb", "bits/byte", "{:.4f}"), ("token_ppl", "token ppl", "{:.2f}"), ("word_ppl", "word ppl", "{:.2f}"))


@dataclass
class Student:
    name: str
    adapter: Path
    visible: Path  # what of DIR its process sees: its folder, or its one file
    results: list[PartResult] = field(default_factory=list)
    numbers: dict | None = None  # the protocol's, with --data
    numbers_error: str | None = None
    seconds: float = 0.0  # wall-clock time of its check

    @property
    def passed(self) -> int:
        return sum(r.status == "ok" for r in self.results)


@dataclass(frozen=True)
class ClassRun:
    parts: list[str] | None = None  # default: every part
    timeout: float = 30.0  # seconds per part
    memory_bytes: int | None = None  # default: the sandbox's
    texts: list[str] | None = None  # --data: the protocol's texts
    jobs: int = 0  # students checked at once; 0: the number of CPUs
    budget: float | None = None  # seconds per student, all parts together
    resume: bool = False  # keep the verdicts already in DIR/check-results (same parts, same seed)
    seed: int = 0  # the run's inputs (check.make_case)


def cell(result: PartResult) -> str:
    """One table cell: ok, the named mistake (x key), x for an unnamed difference, -> part for a
    difference that follows from another part's, error, timeout, -."""
    if result.because:
        return f"-> {result.because}"
    if result.status == "differs":
        return f"x {result.mistake}" if result.mistake else "x"
    return CELL[result.status]


def find_adapters(directory: str | Path) -> list[Student]:
    """The students of ``directory``: each folder holding an adapter.py, and each .py file."""
    root = Path(directory)
    if not root.is_dir():
        raise TinyLMError(
            f"class directory {root} does not exist" if not root.exists() else f"{root} is not a directory"
        )
    found = [Student(p.parent.name, p, p.parent) for p in root.glob("*/adapter.py") if p.is_file()]
    found += [Student(p.stem, p, p) for p in root.glob("*.py") if p.is_file()]
    names = Counter(s.name for s in found)
    twice = sorted(name for name, n in names.items() if n > 1)
    if twice:
        raise TinyLMError(f"{', '.join(twice)} hand(s) in both a folder and a file in {root}: keep one")
    if not found:
        raise TinyLMError(
            f"no student in {root}: give one folder per student holding its adapter.py (DIR/NAME/adapter.py), "
            "or one file per student (DIR/NAME.py)"
        )
    return sorted(found, key=lambda s: s.name)


def saved_verdicts(path: Path, parts: list[str], seed: int) -> list[PartResult] | None:
    """A student's verdicts from an earlier run of the same parts and seed, else None."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if data.get("seed") != seed or [p["part"] for p in data.get("parts", [])] != parts:
        return None
    return [
        PartResult(**{**p, "max_error": None if p["max_error"] is None else float(p["max_error"])})
        for p in data["parts"]
    ]


def saved_seed(directory: str | Path) -> int | None:
    """The seed of the verdicts an earlier run left in ``DIR/check-results`` (what --resume
    continues without --seed), or None."""
    for path in sorted((Path(directory) / RESULTS).glob("*.json")):
        try:
            return int(json.loads(path.read_text(encoding="utf-8"))["seed"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def gradescope(student: Student, seed: int) -> dict:
    """Gradescope's autograder results.json: one test per part, 1 point each."""
    tests = [
        {
            "name": r.part,
            "score": float(r.status == "ok"),
            "max_score": 1.0,
            "status": "passed" if r.status == "ok" else "failed",
            "output": r.line(),
        }
        for r in student.results
    ]
    return {
        "score": float(student.passed),
        "max_score": float(len(tests)),
        "output": f"tinylm check, seed {seed} (tinylm check --seed {seed} repeats its inputs)",
        "tests": tests,
    }


def write_student(results_dir: Path, student: Student, seed: int) -> None:
    """The student's verdicts and Gradescope file, each written whole (a file then renamed), so
    that a run killed while writing leaves the old file or the new one."""
    data = {
        "name": student.name,
        "seed": seed,
        "seconds": round(student.seconds, 2),
        "passed": passed(student.results),
        "parts": [r.as_json() for r in student.results],
    }
    folder = results_dir / "gradescope" / student.name
    folder.mkdir(parents=True, exist_ok=True)
    for path, value in (
        (results_dir / f"{student.name}.json", data),
        (folder / "results.json", gradescope(student, seed)),
    ):
        partial = path.with_suffix(".part")
        partial.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
        partial.replace(path)


def check_student(student: Student, run: ClassRun, parts: list[str], results_dir: Path) -> Student:
    """One student's verdicts (and numbers), written as soon as they are known; its prints go to
    ``check-results/NAME.log``."""
    start = time.monotonic()
    memory = {} if run.memory_bytes is None else {"memory_bytes": run.memory_bytes}
    with open(results_dir / f"{student.name}.log", "wb") as log:
        verdicts = check_adapter(
            student.adapter,
            parts,
            run.timeout,
            **memory,
            visible=student.visible,
            output=log,
            budget=run.budget,
            seed=run.seed,
        )
        try:
            student.results = list(verdicts)
        except Exception as exc:  # a fault in tinylm's own code: this student's cells say so, the class goes on
            traceback.print_exc()
            detail = f"tinylm failed on this student ({type(exc).__name__}: {exc}); please report it"
            student.results = [PartResult(name, "error", detail) for name in parts]
        if run.texts:  # the student's model, in the sandbox too
            try:
                student.numbers = evaluate_adapter(
                    student.adapter, run.texts, **memory, trusted=False, visible=student.visible, output=log
                )
            except TinyLMError as exc:
                student.numbers_error = str(exc)
    student.seconds = time.monotonic() - start
    write_student(results_dir, student, run.seed)
    return student


def check_class(directory: str | Path, run: ClassRun) -> list[Student]:
    """Every student's verdicts (and the protocol's numbers on ``run.texts``), ``run.jobs`` at a
    time, progress on stderr as each finishes."""
    parts = [p.name for p in select_parts(run.parts)]
    students = find_adapters(directory)
    results_dir = Path(directory) / RESULTS
    results_dir.mkdir(exist_ok=True)
    todo = []
    for student in students:
        saved = saved_verdicts(results_dir / f"{student.name}.json", parts, run.seed) if run.resume else None
        if saved is None or run.texts:
            todo.append(student)
        else:
            student.results = saved
    if len(todo) < len(students):
        print(f"resume: {len(students) - len(todo)} student(s) already checked, {len(todo)} to go", file=sys.stderr)
    with ThreadPoolExecutor(max_workers=run.jobs or os.cpu_count() or 1) as pool:
        futures = [pool.submit(check_student, s, run, parts, results_dir) for s in todo]
        for future in as_completed(futures):
            s = future.result()
            print(f"{s.name}: {s.passed}/{len(s.results)} parts ok ({s.seconds:.1f} s)", file=sys.stderr, flush=True)
    return students


def number_cells(student: Student) -> list[str]:
    if student.numbers is None:
        return ["-"] * (len(NUMBERS) + 1)
    values = [fmt.format(student.numbers[key]) for key, _, fmt in NUMBERS]
    speedup = student.numbers.get("kv_speedup")
    return values + ["-" if speedup is None else f"{speedup:.2f}x"]


def table_rows(students: list[Student], with_numbers: bool) -> tuple[list[str], list[list[str]]]:
    parts = [r.part for r in students[0].results]
    header = ["student", "parts ok", *parts]
    header += [title for _, title, _ in NUMBERS] + ["KV speed-up"] if with_numbers else []
    rows = []
    for s in students:
        row = [s.name, f"{s.passed}/{len(s.results)}", *(cell(r) for r in s.results)]
        rows.append(row + number_cells(s) if with_numbers else row)
    return header, rows


def passing_row(students: list[Student]) -> list[str]:
    """Per part, how many students pass it: the table's last row."""
    per_part = zip(*(s.results for s in students))
    counts = [f"{sum(r.status == 'ok' for r in column)}/{len(students)}" for column in per_part]
    return ["students passing", f"{sum(passed(s.results) for s in students)}/{len(students)} pass all", *counts]


def mistake_counts(students: list[Student]) -> list[tuple[str, list[str], int]]:
    """Each named mistake, the parts it was named in, and how many students made it, most first."""
    parts_of: dict[str, list[str]] = {}
    made: dict[str, set[str]] = {}
    for s in students:
        for r in s.results:
            if r.status == "differs" and r.mistake:
                parts_of.setdefault(r.mistake, [])
                parts_of[r.mistake] += [] if r.part in parts_of[r.mistake] else [r.part]
                made.setdefault(r.mistake, set()).add(s.name)
    return sorted(((k, parts_of[k], len(made[k])) for k in made), key=lambda m: (-m[2], m[0]))


def csv_text(students: list[Student], with_numbers: bool) -> str:
    header, rows = table_rows(students, with_numbers)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([header, *rows])
    return out.getvalue()


def details(students: list[Student]) -> list[tuple[str, list[str]]]:
    """Each student's verdicts that are not ok, as `tinylm check` prints them."""
    out = []
    for s in students:
        lines = [r.line() for r in s.results if r.status not in PASSING]
        lines += [f"protocol: {s.numbers_error}"] if s.numbers_error else []
        out.append((s.name, lines))
    return out


def markdown(students: list[Student], with_numbers: bool) -> str:
    header, rows = table_rows(students, with_numbers)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    counts = passing_row(students)
    lines += ["| " + " | ".join(counts + [""] * (len(header) - len(counts))) + " |"]
    lines += [
        "",
        "ok: within tinylm's tolerance; x key: differs, equal to the usual mistake named; x: differs "
        "(no known mistake); -> part: differs where that part, which it builds on, differs (fix that first); "
        "error, timeout; -: not implemented.",
        "",
    ]
    counted = mistake_counts(students)
    if counted:
        lines += ["| mistake | named in | students |", "|---|---|---|"]
        lines += [f"| {key} | {', '.join(parts)} | {n} |" for key, parts, n in counted]
        lines += [""]
    for name, wrong in details(students):
        if wrong:
            lines += [f"**{name}**", "", "```text", *wrong, "```", ""]
    return "\n".join(lines)


def html_page(students: list[Student], with_numbers: bool) -> str:
    header, rows = table_rows(students, with_numbers)

    def td(text: str) -> str:
        kind = "ok" if text == "ok" else "no" if text.startswith(("x", "error", "timeout")) else ""
        return f'<td class="{kind}">{html.escape(text)}</td>'

    body = "".join("<tr>" + "".join(td(c) for c in row) + "</tr>\n" for row in rows)
    body += "<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in passing_row(students)) + "</tr>\n"
    notes = "".join(
        f"<h3>{html.escape(name)}</h3><pre>{html.escape(chr(10).join(wrong))}</pre>\n"
        for name, wrong in details(students)
        if wrong
    )
    return (
        "<!doctype html>\n<meta charset=utf-8><title>tinylm check: the class</title>\n"
        "<style>body{font-family:sans-serif}td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}"
        "table{border-collapse:collapse}.ok{background:#dfd}.no{background:#fdd}</style>\n"
        f"<table><tr>{''.join(f'<th>{html.escape(h)}</th>' for h in header)}</tr>\n{body}</table>\n{notes}"
    )


def write_reports(directory: str | Path, students: list[Student], with_numbers: bool) -> list[Path]:
    root = Path(directory)
    data = {
        "parts": [r.part for r in students[0].results],
        "students": [
            {
                "name": s.name,
                "adapter": str(s.adapter.relative_to(root)),
                "parts_ok": s.passed,
                "passed": passed(s.results),
                "parts": [r.as_json() for r in s.results],
                **({"protocol": finite(s.numbers)} if s.numbers else {}),
                **({"protocol_error": s.numbers_error} if s.numbers_error else {}),
            }
            for s in students
        ],
    }
    texts = (
        markdown(students, with_numbers),
        html_page(students, with_numbers),
        json.dumps(data, indent=1) + "\n",
        csv_text(students, with_numbers),
    )
    paths = [root / name for name in REPORT_NAMES]
    for path, text in zip(paths, texts):
        path.write_text(text, encoding="utf-8")
    return paths


STUDENT_README = """# Your adapter for `tinylm check`

`adapter.py` holds one function per part of a language model (attention, a block, the whole LM,
AdamW, gradient accumulation and checkpointing, the KV cache, greedy and beam search, BPE, a word
vocabulary, n-gram smoothing, ...). Each function's docstring is its contract: the arguments'
shapes and dtypes, the weight names it receives, what it returns.

1. Replace each `raise NotImplementedError` with a call into your own code, written from PyTorch
   primitives. Keep the parameter names: arguments are passed by name. A function left as it is
   is reported "not implemented"; the others are still checked.
2. Check it, all parts or some:

       tinylm check adapter.py
       tinylm check adapter.py --parts transformer_lm,kv_cache

   Each part gets one line: `ok`, or `differs` with the mistake named when your output equals one
   of the usual wrong versions ("yours equals tinylm's attention without the 1/sqrt(d) scale"),
   else the largest error and where; `error` with your exception and its line; `timed out`.
3. Once your model is trained, fill the `model_*` functions at the end and score it on the
   course's protocol (bits per byte, perplexities, the KV cache's speed-up; BLEU with `--bleu`):

       tinylm evaluate --adapter adapter.py --data valid.txt
       tinylm evaluate --adapter adapter.py --data valid.txt --bleu --temperature 0

Your code runs in its own sandboxed process with a time limit per part and hard limits on memory,
CPU time, processes and file size. It can import torch, numpy, regex and Python's standard library
(not tinylm), read its own folder and write to /tmp; it has no network. Printing is fine (it goes
to stderr).
"""


def write_kit(directory: str | Path) -> list[Path]:
    """The adapter template and a README for students, in ``directory`` (created); never
    overwrites a file that is there."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    files = {
        root / "adapter.py": Path(adapter_template.__file__).read_text(encoding="utf-8"),
        root / "README.md": STUDENT_README,
    }
    existing = [str(p) for p in files if p.exists()]
    if existing:
        raise TinyLMError(f"{', '.join(existing)} already exist(s); --init writes into a new or empty directory")
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    return list(files)
