"""Every command the documentation shows is checked against the real CLI.

The pages are README.md and docs/*.md (docs/notes/ is a record of past work and is left alone).
Commands live in fenced ```bash blocks; a line continued with a backslash is one command.

* `tinylm ...` (or `.venv/bin/tinylm ...`, or `torchrun ... -m tinylm.cli ...`) is parsed by the
  real parser (`tinylm.cli.build_parser`), and its configuration is built and checked the way the
  command builds it: `build_config` for demo/prepare/train (then the model's shapes are resolved),
  `load_experiment_config` for experiments, `load_study_config` for study, a validated
  `GenerationConfig` for generate. A renamed flag, an unknown preset or a bad override key in the
  docs fails here.
* `make TARGET` must name a Makefile target (and `make demo ARGS="..."` must parse as `tinylm demo`).
* `.venv/bin/python benchmarks/X.py --flag ...` must name a script that defines each flag.
* A block whose fence follows the line `<!-- tested: runs -->` is also run end to end, as a bash
  script in a temporary directory with the virtualenv's `bin` first on PATH (the slow test):
  README.md's blocks first (they make `runs/demo-quick`), then docs/*.md in name order.

Numbers typed into prose carry the file and key they were read from, right after the number (its
unit may sit between them): in Markdown an HTML comment, which renders as nothing,
`10.71<!-- docs/results/tinystories-assignment/tinylm-settings/eval.json#eval.valid.token_ppl -->`;
in a preset's YAML comment the same in parentheses, `28.5 (docs/results/x/eval.json#train_seconds /60)`.
* The path is from the repository root. JSON and YAML: keys, list indices, `[a.b]` for a key with
  dots in it, `[field=value]` for the one list item whose field has that value. CSV and Markdown
  are read as a list of rows (Markdown: every table's, a header repeated in one table named
  `header (2)`), picked the same way, `[col=value,col2=value2]`. A cell or string holding several
  numbers takes `[i]`, its i-th. A key `/regex/` takes its first match in the file's text, or that
  match's first group: a number in a generated page's prose (a YAML marker holds no parentheses).
* A trailing `/N` or `*N` scales the file's value (seconds to minutes, a share to a percentage).
* The rule: the number as written equals the file's value rounded to the decimals written (within
  half a unit of its last digit, so 0.0715 may be written 0.071 or 0.072, and 0.07147 only 0.071).
README.md, docs/*.md, docs/results/**/*.md and tinylm/presets/*.yaml are searched (docs/notes/
records past work and is left alone).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import functools
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNS_MARK = "<!-- tested: runs -->"
# the programs a documented command line may start with; anything else in a bash block is a typo
PROGRAMS = (
    "cmake",
    "tar",
    "tinylm",
    ".venv/bin/tinylm",
    "make",
    "torchrun",
    ".venv/bin/python",
    "python",
    "bash",
    "printf",
    "pip",
    "vllm",
    "lm_eval",
)
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)")
# a command line (not an error message such as "tinylm train: error: ...") outside a bash block
STRAY_COMMAND = re.compile(r"^\s*(\$\s+)?(\.venv/bin/)?tinylm\s+(?![\w-]+:)[\w-]+")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    runs: bool


@dataclass
class Command:
    where: str  # page:line
    text: str
    argv: list[str]


def read_blocks(page: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """Fenced blocks of a page, and the lines outside them (with their numbers)."""
    blocks, outside = [], []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            outside.append((i + 1, lines[i]))
            i += 1
            continue
        ticks, lang, start = m.group(2), m.group(3).lower(), i
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != ticks:
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{page.name}:{start + 1}: code block never closed"
        blocks.append(Block(page, start + 1, lang, "\n".join(body), prev == RUNS_MARK))
        i += 1
    return blocks, outside


def block_commands(block: Block) -> list[Command]:
    """Logical command lines of a bash block: continuations joined, comments and blanks skipped."""
    out, pending, first = [], "", 0
    for n, raw in enumerate(block.text.splitlines(), start=block.line + 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if not pending:
            first = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        out.append(Command(f"{block.page.name}:{first}", text, shlex.split(text, comments=True)))
    assert not pending, f"{block.page.name}:{first}: command ends with a backslash"
    return out


ALL_BLOCKS = [b for page in PAGES for b in read_blocks(page)[0]]
BASH_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell")]
COMMANDS = [c for b in BASH_BLOCKS for c in block_commands(b)]
RUN_BLOCKS = [b for b in BASH_BLOCKS if b.runs]


# ------------------------------------------------------------------------------- the checks
@functools.lru_cache(maxsize=None)
def parser():
    from tinylm.cli import build_parser

    return build_parser()


@pytest.fixture(scope="module", autouse=True)
def _presets_read_once():
    """About 80 commands name the same five presets; read each file once (a fresh copy per call)."""
    import tinylm.config as config

    cached = functools.lru_cache(maxsize=None)(config.load_config_file)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "load_config_file", lambda spec: copy.deepcopy(cached(str(spec))))
        yield


def parse_tinylm(argv: list[str]):
    """(namespace, overrides) the way `tinylm.cli.main` reads argv; fails on what it would refuse."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns, extra = parser().parse_known_args(argv)
    except SystemExit as exc:
        if exc.code in (0, None) and any(a in ("-h", "--help", "--version") for a in argv):
            return None, []
        pytest.fail(f"the parser refused it: {err.getvalue().strip()}")
    overrides = list(getattr(ns, "overrides", None) or [])
    if extra:
        if not hasattr(ns, "overrides") or not all("=" in a and not a.startswith("-") for a in extra):
            pytest.fail(f"unrecognized arguments: {' '.join(extra)}")
        overrides += extra
    return ns, overrides


def check_model_shapes(cfg) -> None:
    model = cfg.model
    if not model.vocab_size:
        model = dataclasses.replace(model, vocab_size=max(cfg.tokenizer.vocab_size, 300))
    model.resolved()


def check_config(ns, overrides: list[str]) -> None:
    """Build and check the configuration the command would run with."""
    from tinylm.config import build_config

    name = ns.command
    if name in ("demo", "prepare", "train"):
        if getattr(ns, "resume", None):  # the checkpoint's config, then these overrides
            cfg = build_config(ns.config, overrides, quick=ns.quick) if ns.config else build_config(None, overrides)
        else:
            cfg = build_config(ns.config, overrides, quick=ns.quick)
        check_model_shapes(cfg)
    elif name == "experiments":
        from tinylm.studies.tinystories import load_experiment_config

        cfg, _ = load_experiment_config(ns.config, overrides, quick=ns.quick)
        check_model_shapes(cfg)
    elif name == "study":
        from tinylm.studies.study_config import load_study_config

        load_study_config(ns.config, overrides, quick=ns.quick)
    elif name == "generate":
        from tinylm.cli import GenerateOptions, decoding_config, options_from

        a = options_from(ns, GenerateOptions)
        decoding_config(a).validate()
        assert a.prompt or a.prompts_file, "generate needs --prompt or --prompts-file"
        assert not (a.stream and a.beam_width > 1), "--stream does not work with --beam-width > 1"


def check_tinylm(argv: list[str]) -> None:
    ns, overrides = parse_tinylm(argv)
    if ns is not None:
        check_config(ns, overrides)


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([\w-]+)\s*:(?!=)", text, re.M))


def check_command(cmd: Command) -> None:
    argv = cmd.argv
    program = argv[0]
    assert program in PROGRAMS, f"unexpected program {program!r} (a typo, or add it to PROGRAMS)"
    if program in ("tinylm", ".venv/bin/tinylm"):
        check_tinylm(argv[1:])
    elif program == "torchrun":
        assert "-m" in argv and argv[argv.index("-m") + 1] == "tinylm.cli", "torchrun must run -m tinylm.cli"
        check_tinylm(argv[argv.index("-m") + 2 :])
    elif program == "make":
        targets = [a for a in argv[1:] if "=" not in a]
        vars_ = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
        missing = [t for t in targets if t not in makefile_targets()]
        assert targets and not missing, f"no Makefile target {missing or '(none given)'}"
        if "demo" in targets and "ARGS" in vars_:
            check_tinylm(["demo", *shlex.split(vars_["ARGS"])])
    elif program in (".venv/bin/python", "python", "bash") and len(argv) > 1 and argv[1].startswith("benchmarks/"):
        script = ROOT / argv[1]
        assert script.is_file(), f"{argv[1]} does not exist"
        source = script.read_text(encoding="utf-8")
        for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
            assert f'"{flag}"' in source, f"{argv[1]} has no option {flag}"
    elif program in (".venv/bin/python", "python"):
        pytest.fail("a python command that is not a benchmark script: document it as a ```python block")


# ------------------------------------------------------------------- numbers checked against files
NUMBER_PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "results").rglob("*.md")),
    *sorted((ROOT / "tinylm" / "presets").glob("*.yaml")),
]
SOURCE = r"[\w./-]+\.(?:json|csv|md|yaml)#"
# Markdown hides the marker in a comment; a YAML comment shows it in parentheses
MARKERS = {".md": re.compile(rf"<!--\s*({SOURCE}.*?)\s*-->"), ".yaml": re.compile(rf"\(({SOURCE}[^()]*)\)")}
REF = re.compile(r"(?P<path>[\w./-]+)#(?P<key>.+?)(?:\s+(?P<op>[*/])\s*(?P<by>\d+(?:\.\d+)?(?:e\d+)?))?")
# the number just before a marker: bold and a unit of up to three letters (0.28x, 3.23M, 553 MiB) may follow it;
# a minus after a space or bracket is its sign, after anything else a dash (0.3-1.8%)
WRITTEN = re.compile(r"((?:(?<![^\s(\[])-)?(?<![\w.])\d[\d,]*(?:\.\d+)?)(?:\*\*)?\s?[A-Za-z%]{0,3}\s?$")
NUMBERS_IN_TEXT = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def table_cells(line: str) -> list[str]:
    return [c.strip().replace("**", "").replace("`", "") for c in line.strip().strip("|").split("|")]


def table_headers(line: str) -> list[str]:
    """A table's headers; one that repeats an earlier one is numbered (`bpb` then `bpb (2)`)."""
    headers: list[str] = []
    for h in table_cells(line):
        headers.append(f"{h} ({headers.count(h) + 1})" if h in headers else h)
    return headers


def markdown_table_rows(text: str) -> list[dict]:
    """Every row of every table of a Markdown page, as {header: cell} (cells without ** and `)."""
    rows: list[dict] = []
    lines = text.splitlines()
    for i in range(1, len(lines)):
        if not re.fullmatch(r"\s*\|?\s*:?-{3,}.*\|.*", lines[i]) or "|" not in lines[i - 1]:
            continue
        headers = table_headers(lines[i - 1])
        for line in lines[i + 1 :]:
            if not line.strip().startswith("|"):
                break
            rows.append(dict(zip(headers, table_cells(line))))
    return rows


@functools.lru_cache(maxsize=None)
def number_source(path: Path):
    """A marker's file as data: JSON or YAML as read, CSV as its rows, Markdown as its tables' rows."""
    from tinylm.evaluation.report import read_json, read_yaml

    if path.suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    if path.suffix == ".md":
        return markdown_table_rows(path.read_text(encoding="utf-8"))
    data = read_json(path) if path.suffix == ".json" else read_yaml(path)
    if data is None:
        raise LookupError(f"{path.name} does not parse")
    return data


def key_step(data, segment: str):
    """One step of a marker's key: a dict key, a list index, a [field=value] pick, or a string's i-th number."""
    inner = segment[1:-1] if segment.startswith("[") else segment
    if isinstance(data, str):
        numbers = NUMBERS_IN_TEXT.findall(data)
        if not re.fullmatch(r"-?\d+", inner) or not -len(numbers) <= int(inner) < len(numbers):
            raise LookupError(f"{data!r} has no number [{inner}]")
        return numbers[int(inner)]
    if isinstance(data, list) and "=" in inner:
        wanted = dict(part.split("=", 1) for part in re.split(r",(?=[^,=]+=)", inner))
        hits = [x for x in data if isinstance(x, dict) and all(str(x.get(f)) == v for f, v in wanted.items())]
        if len(hits) != 1:
            raise LookupError(f"{len(hits)} items match [{inner}], not one")
        return hits[0]
    if isinstance(data, list) and re.fullmatch(r"-?\d+", inner) and -len(data) <= int(inner) < len(data):
        return data[int(inner)]
    if isinstance(data, dict) and inner in data:
        return data[inner]
    raise LookupError(f"no key {segment}")


def marked_value(ref: str, root: Path = ROOT) -> float:
    """The number a marker's reference ('path#key', maybe ' /60') names in its file."""
    m = REF.fullmatch(ref.strip())
    if not m:
        raise LookupError(f"not a reference: {ref!r}")
    if not (root / m["path"]).is_file():
        raise LookupError(f"no file {m['path']}")
    key = m["key"]
    if len(key) > 2 and key[0] == key[-1] == "/":  # a number in a generated page's prose
        try:
            found = re.search(key[1:-1], (root / m["path"]).read_text(encoding="utf-8"))
        except re.error as exc:
            raise LookupError(f"{key} is not a regex: {exc}") from None
        if not found:
            raise LookupError(f"{key} is not in {m['path']}")
        value = found.group(1) if found.groups() else found.group(0)
    else:
        value = number_source(root / m["path"])
        for segment in re.findall(r"\[[^\]]*\]|[^.\[\]]+", key):
            value = key_step(value, segment)
    if isinstance(value, str):
        numbers = NUMBERS_IN_TEXT.findall(value)
        if len(numbers) != 1:
            raise LookupError(f"{value!r} holds {len(numbers)} numbers; pick one with [i]")
        value = float(numbers[0].replace(",", ""))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LookupError(f"{value!r} is not a number")
    if m["op"]:
        value = value * float(m["by"]) if m["op"] == "*" else value / float(m["by"])
    return float(value)


def check_marked_line(where: str, line: str, root: Path = ROOT, kind: str = ".md") -> tuple[int, list[str]]:
    """(markers found, what is wrong with them) on one line of a page (kind: its suffix)."""
    wrong = []
    found = 0
    for m in MARKERS[kind].finditer(line):
        found += 1
        ref = m.group(1)
        num = WRITTEN.search(line[: m.start()])
        if not num:
            wrong.append(f"{where}: no number just before the marker {ref}")
            continue
        written = num.group(1)
        decimals = len(written.partition(".")[2])
        try:
            value = marked_value(ref, root)
        except LookupError as exc:
            wrong.append(f"{where}: {written} names {ref}: {exc}")
            continue
        if abs(float(written.replace(",", "")) - value) > 0.5 * 10**-decimals + 1e-9 * max(1.0, abs(value)):
            wrong.append(f"{where}: written {written}, {ref} holds {value:.6g} ({value:.{decimals}f} as written)")
    return found, wrong


def check_marked_numbers(pages: list[Path], root: Path = ROOT) -> tuple[dict[str, int], list[str]]:
    """Markers per page and every disagreement, for the pages given."""
    counts, wrong = {}, []
    for page in pages:
        name = str(page.relative_to(root))
        counts[name] = 0
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
            found, bad = check_marked_line(f"{name}:{n}", line, root, page.suffix)
            counts[name] += found
            wrong += bad
    return counts, wrong


# ------------------------------------------------------------------------------------ tests
def test_pages_exist_and_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stages = [
        "data",
        "tokenizers",
        "models",
        "training",
        "generation",
        "evaluation",
        "studies",
        "interop",
        "tinystories-cpu-1h",
    ]
    for stage in stages:
        assert (ROOT / "docs" / f"{stage}.md").is_file(), stage
        assert f"(docs/{stage}.md" in readme, f"README.md does not link docs/{stage}.md"
    assert len(readme.splitlines()) < 200


def package_map() -> dict[str, list[str]]:
    """README's "Map of the package": each entry under ``tinylm/`` (``cli.py``, ``data/``) -> the
    names it lists: comma-separated, each a module, preset or folder (``static/``) that may carry a
    gloss in parentheses; a package may open with the command it serves (``"`tinylm serve`: "``)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Map of the package", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    entries: dict[str, str] = {}
    name = None
    for line in block.splitlines():
        top = re.match(r"^  (\S+)\s+(.*)$", line)
        if top:
            name = top.group(1)
            entries[name] = top.group(2)
        elif line.startswith("    ") and name is not None:
            entries[name] += " " + line.strip()
        else:
            name = None  # tinylm/ itself, and the folders beside it
    listed = {}
    for name, text in entries.items():
        while re.search(r"\([^()]*\)", text):
            text = re.sub(r"\s*\([^()]*\)", "", text)
        text = re.sub(r"^`[^`]*`:\s*", "", text)
        listed[name] = [item.strip() for item in text.split(",")] if name.endswith("/") else []
    return listed


def test_the_package_map_names_every_module_and_only_modules():
    package = ROOT / "tinylm"
    listed = package_map()
    files = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    folders = {f"{p.name}/" for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert {n for n in listed if not n.endswith("/")} == files, "README's map: the modules directly in tinylm/"
    assert {n for n in listed if n.endswith("/")} == folders, "README's map: the folders in tinylm/"
    for folder, names in listed.items():
        if not folder.endswith("/"):
            continue
        where = package / folder
        odd = [n for n in names if not re.fullmatch(r"[\w-]+/?", n)]
        assert not odd, f"README's map, {folder}: {odd} are not names (a gloss goes in parentheses)"
        if folder == "presets/":
            present = {p.stem for p in where.glob("*.yaml")}
        else:
            present = {p.stem for p in where.glob("*.py") if p.name != "__init__.py"} | {
                f"{p.name}/" for p in where.iterdir() if p.is_dir() and p.name != "__pycache__"
            }
        assert sorted(names) == sorted(present), (
            f"README's map, {folder}: missing {sorted(present - set(names))}, "
            f"not in the tree {sorted(set(names) - present)}, listed twice "
            f"{sorted(n for n in set(names) if names.count(n) > 1)}"
        )


def test_the_package_map_check_reads_glosses_and_folders():
    listed = package_map()
    assert "scheduler" in listed["serving/"] and "static/" in listed["serving/"]
    assert "load_any_checkpoint" not in listed["interop/"] and "loading" in listed["interop/"]
    assert listed["cli.py"] == [] and "tinystories-cpu-1h-r3" in listed["presets/"]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation other than '-' dropped, spaces to '-'."""
    heads = re.findall(r"^#+\s+(.*)$", page.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
                broken.append(f"{page.name}: {target}")
    assert not broken, "broken links: " + ", ".join(broken)


def test_every_command_is_in_a_checked_block():
    """A command shown outside a ```bash block would escape these tests."""
    stray = []
    for page in PAGES:
        blocks, outside = read_blocks(page)
        for b in blocks:
            if b.lang not in ("bash", "sh", "shell"):
                stray += [
                    f"{page.name}:{b.line} ({b.lang or 'no language'})"
                    for line in b.text.splitlines()
                    if STRAY_COMMAND.match(line)
                ]
        stray += [
            f"{page.name}:{n} (indented code)"
            for n, line in outside
            if line.startswith("    ") and STRAY_COMMAND.match(line)
        ]
    assert not stray, "commands outside ```bash blocks: " + ", ".join(stray)


ASSIGNMENT = "docs/results/tinystories-assignment"


def test_marked_numbers_agree_with_their_files():
    counts, wrong = check_marked_numbers(NUMBER_PAGES)
    assert not wrong, "numbers that differ from their files:\n" + "\n".join(wrong)
    # a marker syntax the pattern stopped reading would pass silently: the pages hold these many
    assert counts["docs/studies.md"] >= 300 and counts["tinylm/presets/tinystories-assignment.yaml"] >= 10, counts
    assert counts["tinylm/presets/shakespeare-report.yaml"] >= 5, counts


def test_a_wrong_number_planted_in_studies_md_is_caught():
    lines = (ROOT / "docs" / "studies.md").read_text(encoding="utf-8").splitlines()
    n = next(i for i, line in enumerate(lines) if "**valid perplexity 10.71<!--" in line)
    found, wrong = check_marked_line(f"studies.md:{n + 1}", lines[n].replace("10.71<!--", "10.72<!--"))
    assert found == 2 and wrong == [
        f"studies.md:{n + 1}: written 10.72, {ASSIGNMENT}/tinylm-settings/eval.json#eval.valid.token_ppl "
        "holds 10.7085 (10.71 as written)"
    ]


@pytest.mark.parametrize(
    "line, fails",
    [
        (f"perplexity 10.70<!-- {ASSIGNMENT}/tinylm-settings/eval.json#eval.valid.token_ppl -->", "written 10.70"),
        (f"k = 8's 48<!-- {ASSIGNMENT}/accumulation.json#rows[name=tokens_k8].optimizer_steps -->", "holds 47"),
        (f"# about 45 ({ASSIGNMENT}/eval.json#train_seconds /60) minutes", "written 45"),
        (f"25.66<!-- {ASSIGNMENT}/no-such.json#eval.valid.token_ppl -->", "no file"),
        (f"25.66<!-- {ASSIGNMENT}/eval.json#eval.valid.no_such_key -->", "no key no_such_key"),
        (f"1<!-- {ASSIGNMENT}/accumulation.json#rows[accum_steps=1].seconds -->", "2 items match"),
        (f"fast<!-- {ASSIGNMENT}/eval.json#tokens_per_s -->", "no number just before"),
        (f"2.5<!-- {ASSIGNMENT}/eval.json#eval.valid -->", "is not a number"),
    ],
)
def test_the_number_check_catches_mistakes(line, fails):
    found, wrong = check_marked_line("planted:1", line, kind=".yaml" if line.startswith("#") else ".md")
    assert found == 1 and len(wrong) == 1 and fails in wrong[0], wrong


def test_the_number_check_reads_each_kind_of_file(tmp_path):
    (tmp_path / "r.json").write_text('{"a.b": {"rows": [{"k": 1, "s": 2.345}, {"k": 2, "s": 1707.95}]}}')
    (tmp_path / "m.csv").write_text("step,loss\n10,3.2\n20,2.9\n")
    (tmp_path / "t.md").write_text(
        "# x\n\n| run | ppl | bpb | bpb |\n|---|---:|---|---|\n| small | 28.64 / 27.40 (not converged) | 2.2 | 1.7 |\n"
        "\nTotal 3960 s.\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "2.35<!-- r.json#[a.b].rows[k=1].s --> and 2.3<!-- r.json#[a.b].rows.0.s --> and "
        "**28.5** min<!-- r.json#[a.b].rows[-1].s /60 -->\n"
        "2.9<!-- m.csv#[step=20].loss --> then 27.40<!-- t.md#[run=small].ppl[1] --> | 27.4<!-- t.md#[0].ppl[1] -->\n"
        "2.34<!-- r.json#[a.b].rows[k=1].s --> (2.345 is 2.35 at 2 decimals; half a unit is allowed either way)\n"
        "2,800<!-- m.csv#[0].loss *1000 --> 2.34<!-- r.json#[a.b].rows[k=1].s /1 -->\n"
        "28.64<!-- t.md#/small \\| (\\d+\\.\\d+)/ --> 3<!-- t.md#/no such (\\d)/ -->\n"
        "1.7<!-- t.md#[run=small].bpb (2) --> and 66 min<!-- t.md#/Total \\d+ s/ /60 -->\n"
    )
    counts, wrong = check_marked_numbers([page], root=tmp_path)
    assert counts == {"page.md": 13}
    assert wrong == [
        "page.md:4: written 2,800, m.csv#[0].loss *1000 holds 3200 (3200 as written)",
        "page.md:5: 3 names t.md#/no such (\\d)/: /no such (\\d)/ is not in t.md",
    ]


def test_commands_were_found():
    programs = {c.argv[0] for c in COMMANDS}
    assert len(COMMANDS) > 40 and {"tinylm", "make", "torchrun"} <= programs
    assert RUN_BLOCKS and RUN_BLOCKS[0].page.name == "README.md"


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_documented_command(cmd):
    check_command(cmd)


@pytest.mark.parametrize(
    "argv, fails",
    [
        ("tinylm train --config no-such-preset", "no-such-preset"),
        ("tinylm train --config demo model.no_such_key=1", "no_such_key"),
        ("tinylm generate --checkpoint runs/demo --prompt x --tmperature 0", "--tmperature"),
        ("tinylm study shakespeare --quick no_such_field=1", "no_such_field"),
        ("tinylm experiments --config tinystories-assignment experiments.no_such=1", "no_such"),
        ("make no-such-target", "no-such-target"),
        (".venv/bin/python benchmarks/bench_training.py --no-such-flag", "--no-such-flag"),
    ],
)
def test_the_checks_catch_mistakes(argv, fails):
    cmd = Command("self-test", argv, shlex.split(argv))
    with pytest.raises((Exception, pytest.fail.Exception)) as info:
        check_command(cmd)
    assert fails in str(info.value)


@pytest.mark.slow
def test_runnable_blocks_run_end_to_end(tmp_path):
    """The blocks marked `<!-- tested: runs -->`, in order, in one temporary directory."""
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    order = sorted(RUN_BLOCKS, key=lambda b: (b.page.name != "README.md", b.page.name, b.line))
    for block in order:
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", block.text],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, (
            f"{block.page.name}:{block.line} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
        assert done.stdout.strip(), f"{block.page.name}:{block.line} printed nothing on stdout"
