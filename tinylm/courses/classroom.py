"""A teacher's view: `tinylm check --class DIR` checks every ``DIR/*/adapter.py`` and writes one
table (``check.md``, ``check.html``, ``check.json`` in DIR): a row per student, a column per part,
and with ``--data`` the protocol's numbers (``courses.evaluate``). `tinylm check --init DIR` writes
the kit a student starts from.

Each adapter runs in its own sandboxed process (``sandbox``), one after the other: a hang, a crash,
an exception or a runaway allocation in one part is that part's cell, and the next student's
check starts in a fresh process.
"""

from __future__ import annotations

import html
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tinylm.courses import adapter_template
from tinylm.courses.check import PASSING, PartResult, check_adapter, select_parts
from tinylm.courses.evaluate import evaluate_adapter, finite
from tinylm.errors import TinyLMError

REPORT_NAMES = ("check.md", "check.html", "check.json")
CELL = {"ok": "ok", "not implemented": "-", "error": "error", "timed out": "timeout"}
NUMBERS = (("bpb", "bits/byte", "{:.4f}"), ("token_ppl", "token ppl", "{:.2f}"), ("word_ppl", "word ppl", "{:.2f}"))


@dataclass
class Student:
    name: str
    adapter: Path
    results: list[PartResult] = field(default_factory=list)
    numbers: dict | None = None  # the protocol's, with --data
    numbers_error: str | None = None

    @property
    def passed(self) -> int:
        return sum(r.status == "ok" for r in self.results)


def cell(result: PartResult) -> str:
    """One table cell: ok, the named mistake (x key), x for an unnamed difference, error, timeout, -."""
    if result.status == "differs":
        return f"x {result.mistake}" if result.mistake else "x"
    return CELL[result.status]


def find_adapters(directory: str | Path) -> list[tuple[str, Path]]:
    root = Path(directory)
    if not root.is_dir():
        raise TinyLMError(
            f"class directory {root} does not exist" if not root.exists() else f"{root} is not a directory"
        )
    found = sorted((p.parent.name, p) for p in root.glob("*/adapter.py") if p.is_file())
    if not found:
        raise TinyLMError(f"no DIR/*/adapter.py in {root}: one folder per student, each holding its adapter.py")
    return found


def check_class(
    directory: str | Path,
    parts: list[str] | None = None,
    timeout: float = 30.0,
    memory_bytes: int | None = None,
    texts: list[str] | None = None,
) -> list[Student]:
    """Every student's verdicts (and the protocol's numbers on ``texts``), progress on stderr."""
    chosen = select_parts(parts)
    memory = {} if memory_bytes is None else {"memory_bytes": memory_bytes}
    students = []
    for name, adapter in find_adapters(directory):
        student = Student(name, adapter)
        student.results = list(check_adapter(adapter, [p.name for p in chosen], timeout, **memory))
        if texts:
            try:
                student.numbers = evaluate_adapter(adapter, texts, **memory)
            except TinyLMError as exc:
                student.numbers_error = str(exc)
        print(f"{name}: {student.passed}/{len(student.results)} parts ok", file=sys.stderr, flush=True)
        students.append(student)
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
    lines += [
        "",
        "ok: within tinylm's tolerance; x key: differs, equal to the usual mistake named; x: differs "
        "(no known mistake); error, timeout; -: not implemented.",
        "",
    ]
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
                "parts": [r.as_json() for r in s.results],
                **({"protocol": finite(s.numbers)} if s.numbers else {}),
                **({"protocol_error": s.numbers_error} if s.numbers_error else {}),
            }
            for s in students
        ],
    }
    texts = (markdown(students, with_numbers), html_page(students, with_numbers), json.dumps(data, indent=1) + "\n")
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

Your code runs in its own process with a time limit per part and a memory limit; printing is
fine (it goes to stderr).
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
