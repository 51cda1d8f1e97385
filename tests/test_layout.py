"""The package's layout, read from the source with `ast` (nothing under tinylm/ is imported):
no import cycles between modules, argparse only in the CLI, a small top level, tinylm imports at
the top of their module, and every deferred third-party import saying why it is deferred."""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tinylm"
MAX_TOP_LEVEL_MODULES = 5  # besides __init__.py; the rest lives in the stage packages


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. tinylm.models.gpt
    line: int
    end_line: int
    names: tuple[str, ...]  # the modules named, absolute: ("torch.nn",) or ("tinylm.config",)
    froms: tuple[str, ...]  # for `from X import a, b`: ("a", "b"); empty for `import X`
    in_function: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, importer: str) -> str:
    if not node.level:
        return node.module or ""
    is_package = modules()[importer].name == "__init__.py"
    base = importer.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports_in(tree: ast.AST, importer: str) -> list[Import]:
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.append(
                    Import(
                        importer, child.lineno, child.end_lineno, tuple(a.name for a in child.names), (), in_function
                    )
                )
            elif isinstance(child, ast.ImportFrom):
                found.append(
                    Import(
                        importer,
                        child.lineno,
                        child.end_lineno,
                        (_absolute(child, importer),),
                        tuple(a.name for a in child.names),
                        in_function,
                    )
                )
            elif isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):  # imports are statements
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return found


@cache
def source(name: str) -> str:
    return modules()[name].read_text(encoding="utf-8")


@cache
def imports() -> tuple[Import, ...]:
    return tuple(
        i for name in modules() for i in _imports_in(ast.parse(source(name), filename=str(modules()[name])), name)
    )


@cache
def comment_lines(name: str) -> frozenset[int]:
    """Lines holding a comment (a real `#` comment token, not a '#' inside a string)."""
    tokens = tokenize.generate_tokens(io.StringIO(source(name)).readline)
    return frozenset(t.start[0] for t in tokens if t.type == tokenize.COMMENT)


def _where(i: Import) -> str:
    return f"{modules()[i.module].relative_to(ROOT)}:{i.line}"


def targets(i: Import) -> list[str]:
    """The tinylm modules an import statement runs: `from X import name` is X.name when that is a
    module, X otherwise; a package counts as its __init__."""
    known = modules()
    if not i.froms:
        return [n for n in i.names if n.split(".")[0] == "tinylm"]
    (base,) = i.names
    if base.split(".")[0] != "tinylm":
        return []
    subs = [f"{base}.{n}" for n in i.froms if f"{base}.{n}" in known]
    return subs + ([base] if len(subs) < len(i.froms) else [])


def import_graph() -> dict[str, dict[str, Import]]:
    """module -> {imported tinylm module -> the first statement importing it}, top-level and
    function-level imports alike."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules()}
    for i in imports():
        for target in targets(i):
            graph[i.module].setdefault(target, i)
    return graph


def strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; returns the components that hold a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cyclic = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        cyclic.append(sorted(component))
    return cyclic


def one_cycle(graph: dict[str, dict[str, Import]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    start, members = component[0], set(component)
    previous = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in graph[node]:
            if nxt == start:
                path = [node]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if nxt in members and nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start}")


def describe(graph: dict[str, dict[str, Import]], cycle: list[str]) -> str:
    steps = [f"{a} -> {b} ({_where(graph[a][b])})" for a, b in zip(cycle, cycle[1:])]
    return "import cycle: " + "; ".join(steps)


def test_the_checker_finds_cycles_and_resolves_imports():
    """The graph code on hand-made input, so a clean tree means something."""
    assert {"tinylm.cli", "tinylm.models", "tinylm.models.gpt"} <= set(modules())
    fake = Import("a", 1, 1, ("a",), (), False)
    graph = {"a": {"b": fake}, "b": {"c": fake}, "c": {"a": fake, "d": fake}, "d": {}, "e": {"e": fake}}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["e"]]
    assert one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert strongly_connected({"a": {"b": fake}, "b": {}}) == []
    tree = ast.parse(
        "from . import gpt, nothing\nfrom ..config import X\nimport tinylm.errors\n"
        "def f():\n    import numpy  # deferred: heavy\n"
    )
    found = _imports_in(tree, "tinylm.models.checkpoint")
    assert [targets(i) for i in found] == [
        ["tinylm.models.gpt", "tinylm.models"],
        ["tinylm.config"],
        ["tinylm.errors"],
        [],
    ]
    assert [i.in_function for i in found] == [False, False, False, True]
    init = _imports_in(ast.parse("from .gpt import GPT\nfrom . import checkpoint\n"), "tinylm.models")
    assert [targets(i) for i in init] == [["tinylm.models.gpt"], ["tinylm.models.checkpoint"]]


def test_no_import_cycles():
    graph = import_graph()
    assert sum(len(v) for v in graph.values()) > len(graph), "the graph should have edges"
    cycles = [describe(graph, one_cycle(graph, c)) for c in strongly_connected(graph)]
    assert not cycles, "\n".join(cycles)


def test_no_import_cycles_through_package_inits():
    """Importing tinylm.a.b runs tinylm/a/__init__.py first (when the importer is not inside
    tinylm.a): with those edges too, still no cycle."""
    graph = import_graph()
    with_inits = {m: dict(edges) for m, edges in graph.items()}
    for importer, edges in graph.items():
        for target, statement in edges.items():
            parts = target.split(".")
            for k in range(2, len(parts)):
                package = ".".join(parts[:k])
                if package in graph and not (importer + ".").startswith(package + "."):
                    with_inits[importer].setdefault(package, statement)
    cycles = [describe(with_inits, one_cycle(with_inits, c)) for c in strongly_connected(with_inits)]
    assert not cycles, "\n".join(cycles)


def test_every_tinylm_import_names_a_module_that_exists():
    known = modules()
    missing = [
        f"{_where(i)}: {n}" for i in imports() for n in i.names if n.split(".")[0] == "tinylm" and n not in known
    ]
    assert not missing, "\n".join(missing)


def test_only_the_cli_imports_argparse():
    offenders = [
        _where(i)
        for i in imports()
        if i.module != "tinylm.cli" and any(n == "argparse" or n.startswith("argparse.") for n in i.names)
    ]
    assert not offenders, "argparse outside tinylm/cli.py: " + ", ".join(offenders)


def test_the_top_level_holds_at_most_five_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules directly in tinylm/: {top}"


def deferred_server_import(i: Import) -> bool:
    """The CLI imports the server's modules (FastAPI, pydantic) inside `tinylm serve` only, so that
    every other command starts without them."""
    return i.module == "tinylm.cli" and all(t.startswith("tinylm.serving") for t in targets(i))


def test_tinylm_imports_are_at_the_top_of_the_module():
    deferred = [
        f"{_where(i)}: {', '.join(targets(i))}"
        for i in imports()
        if i.in_function and targets(i) and not deferred_server_import(i)
    ]
    assert not deferred, "function-level imports of tinylm modules (move them to the top):\n" + "\n".join(deferred)


def test_deferred_third_party_imports_say_why():
    """A function-level import of anything else needs a comment on its line or the line above."""
    silent = []
    for i in imports():
        if not i.in_function or targets(i):
            continue
        span = range(i.line - 1, i.end_line + 1)  # the line above, and the statement's own lines
        text = source(i.module).splitlines()
        if not any("#" in text[n - 1] for n in span) or not any(n in comment_lines(i.module) for n in span):
            silent.append(f"{_where(i)}: {', '.join(i.names)}")
    assert not silent, "function-level imports without a comment saying why they are deferred:\n" + "\n".join(silent)


# Bottom to top: a module may import tinylm modules of its own layer and of the layers before it.
LAYERS = (
    "errors constants",
    "config",
    "tokenizers",
    "data",
    "models",
    "training",
    "generation",
    "evaluation",
    "interop",
    "serving",
    "pipeline",
    "studies",
    "courses",
    "cli",
)
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names.split()}
MAX_FUNCTION_LINES = 80


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYER_OF[parts[1]] if len(parts) > 1 else -1  # tinylm/__init__.py sits below everything


def test_every_module_has_a_layer():
    unplaced = sorted({m.split(".")[1] for m in modules() if m != "tinylm"} - set(LAYER_OF))
    assert not unplaced, f"packages or modules without a layer in LAYERS: {unplaced}"


def test_each_layer_imports_only_the_layers_below_it():
    upward = [
        f"{_where(i)}: {i.module} imports {target}"
        for i in imports()
        for target in targets(i)
        if target != "tinylm" and layer(target) > layer(i.module)
    ]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import():
    fake = Import("tinylm.models.bigram", 1, 1, ("tinylm.training.optim",), ("lr_at",), False)
    assert layer(fake.module) < layer("tinylm.training.optim")
    assert layer("tinylm.cli") == len(LAYERS) - 1 and layer("tinylm.errors") == layer("tinylm.constants") == 0


def long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int, int]]:
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_is_longer_than_the_limit():
    assert long_functions(ast.parse("def f():\n" + "    x = 1\n" * 5), 5) == [("f", 1, 6)]
    found = [
        f"{modules()[m].relative_to(ROOT)}:{line} {name} ({n} lines)"
        for m in modules()
        for name, line, n in long_functions(ast.parse(source(m)), MAX_FUNCTION_LINES)
    ]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


# The options that change what the model computes: only the model's own modules implement them.
ARCHITECTURE_OPTIONS = {
    "positions",
    "rope_theta",
    "norm",
    "norm_eps",
    "ffn",
    "bias",
    "tie_weights",
    "d_embed",
    "attention",
    "qk_norm",
    "logit_softcap",
    "zero_init_out",
    "value_embeddings",
    "n_kv_heads",
    "d_attn",
    "d_ff",
    "dropout",
    "attn_dropout",
    "init",
}


def architecture_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Lines reading an architecture option off a model config (``<...>config.<option>``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ARCHITECTURE_OPTIONS:
            base = ast.unparse(node.value)
            if base.endswith("config") or base in ("cfg", "mc", "model_cfg"):
                found.append((node.lineno, f"{base}.{node.attr}"))
    return found


def test_no_architecture_option_is_read_in_generation_or_serving():
    assert architecture_reads(ast.parse("x = model.config.qk_norm\ny = cfg.temperature")) == [
        (1, "model.config.qk_norm")
    ]
    found = [
        f"{modules()[m].relative_to(ROOT)}:{line} {what}"
        for m in modules()
        if m.startswith(("tinylm.generation", "tinylm.serving"))
        for line, what in architecture_reads(ast.parse(source(m)))
    ]
    assert not found, "architecture options read outside the model (the model's modules implement them):\n" + "\n".join(
        found
    )
