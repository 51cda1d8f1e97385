"""The verdict on each part of a student's adapter: ok, differs (with the mistake named when one of
``parts``' usual mistakes gives the student's output), not implemented, error, or timed out.

For each part: its seeded inputs, tinylm's output and gradients on them, the student's from the
sandboxed process, and a comparison at the part's tolerance, output first, then each gradient.
"""

from __future__ import annotations

import json
import math
import secrets
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch

from tinylm.courses.calls import Calls, run_call
from tinylm.courses.parts import (
    BUILDS_ON,
    FLOPS_RATIO,
    MEMORY_RATIO,
    NOT_CHECKPOINTED,
    ONE_BATCH,
    PARTS,
    PARTS_BY_NAME,
    PREFIX_RECOMPUTED,
    Mistake,
    Part,
    Tolerance,
    mistake_pairs,
)
from tinylm.courses.sandbox import DEFAULT_MEMORY_BYTES, STARTUP_SECONDS, Limits, Sandbox
from tinylm.errors import TinyLMError

# tinylm's side of a part (its reference, the mistakes it tries) runs one student at a time: torch's
# checkpointing and autograd hooks keep global state that two threads of --jobs would share
REFERENCE_LOCK = threading.Lock()
PASSING = ("ok", "not implemented")  # the statuses that let `tinylm check` exit 0 (with one ok at least)


@dataclass
class PartResult:
    part: str
    status: str  # ok, differs, not implemented, error, timed out
    detail: str = ""
    mistake: str | None = None  # the key of the named mistake
    max_error: float | None = None
    because: str | None = None  # the part it builds on whose difference explains this one (BUILDS_ON)

    def line(self, width: int = 30) -> str:
        if self.status == "ok" and self.detail:
            verdict = f"ok ({self.detail})"
        elif self.status in ("ok", "not implemented"):
            verdict = self.status
        elif self.because:
            verdict = f"differs {self.detail}"
        elif self.status == "timed out":
            verdict = f"timed out {self.detail}"
        else:
            verdict = f"{self.status}: {self.detail}"
        return f"{self.part:<{width}} {verdict}"

    def as_json(self) -> dict:
        data = asdict(self)
        if data["max_error"] is not None and not math.isfinite(data["max_error"]):
            data["max_error"] = str(data["max_error"])  # JSON has no inf or nan
        return data


@dataclass(frozen=True)
class Case:
    """A part's inputs and tinylm's answer on them; ``request`` is what the student's process gets."""

    calls: Calls
    request: dict
    expected: dict
    baseline_bytes: float | None = None  # activations the same computation keeps without checkpointing
    baseline_flops: float | None = None  # matrix-product flops of tinylm's own computation (Part.flops_baseline)


def canonical_output(part: Part, calls: Calls, output: Any) -> Any:
    """Each call's output in the form the part compares (``Part.canonical``); TypeError when the
    output cannot be read so."""
    if len(calls) < 2:
        return part.canonical(output)
    if not isinstance(output, list) or len(output) != len(calls):
        raise TypeError(f"expected one output per call ({len(calls)})")
    return [part.canonical(o) for o in output]


def make_case(part: Part, seed: int = 0) -> Case:
    """The part's inputs drawn with the run's ``seed`` (each run draws its own: answers recorded
    on one run fail the next; 0 gives the inputs the tests know)."""
    gen = torch.Generator().manual_seed((part.seed + seed) % 2**63)
    calls = part.inputs(gen)
    projection = None
    if part.grad:  # a fixed random direction of the output's shape (calls.py says why not a plain sum)
        shape = run_call(part.reference, calls)["output"].shape
        projection = torch.randn(shape, generator=gen)
    expected = run_call(part.reference, calls, list(part.grad), projection)
    expected["output"] = canonical_output(part, calls, expected["output"])
    measure, count = part.memory_baseline is not None, part.flops_baseline is not None
    request = {
        "function": part.function,
        "calls": calls,
        "grad": list(part.grad),
        "projection": projection,
        "measure": measure,
        "count": count,
        "rows": part.batch_rows is not None,
    }
    baseline = None
    if measure:
        baseline = float(run_call(part.memory_baseline, calls, list(part.grad), projection, True)["saved_bytes"])
    flops = float(run_call(part.flops_baseline, calls, count=True)["flops"]) if count else None
    return Case(calls, request, expected, baseline, flops)


# ------------------------------------------------------------------------------ comparing
@dataclass(frozen=True)
class Mismatch:
    message: str
    max_error: float
    label: str = ""  # where: "[3]['weight']" (the first index is the call, for a part called several times)


def flatten(tree: Any, label: str = "") -> dict[str, Any]:
    """Tensors in nested dicts and lists by their place: ``[0]['weight']``."""
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flatten(value, f"{label}[{key!r}]").items()}
    if isinstance(tree, list):
        return {k: v for i, value in enumerate(tree) for k, v in flatten(value, f"{label}[{i}]").items()}
    return {label: tree}


def mismatch(actual: Any, expected: Any, tolerance: Tolerance, what: str = "output") -> Mismatch | None:
    """None when every tensor of ``actual`` is within tolerance of ``expected`` (nan matching nan,
    inf matching the same inf), else the first tensor that is not, with its largest error."""
    got, want = flatten(actual), flatten(expected)
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        return Mismatch(f"{what} is not shaped as expected (missing {missing}, unexpected {extra})", math.inf)
    for label, e in want.items():
        a = got[label]
        if not isinstance(e, torch.Tensor) or not isinstance(a, torch.Tensor):  # text, bytes
            if type(a) is not type(e) or a != e:
                return Mismatch(f"{what}{label} is {short(a)}, tinylm's is {short(e)}", math.inf, label)
            continue
        if tuple(a.shape) != tuple(e.shape):
            return Mismatch(f"{what}{label} has shape {tuple(a.shape)}, expected {tuple(e.shape)}", math.inf, label)
        a64, e64 = a.double(), e.double()
        close = torch.isclose(a64, e64, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=True)
        if bool(close.all()):
            continue
        error = torch.where(close, 0.0, (a64 - e64).abs().nan_to_num(nan=math.inf, posinf=math.inf))
        flat = int(error.argmax())
        index = [int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(error.shape))] if error.dim() else []
        at = f"{what}{label}{index if index else ''}"
        worst = float(error.reshape(-1)[flat])
        return Mismatch(
            f"max abs error {worst:.3g} at {at} (yours {float(a64.reshape(-1)[flat]):.6g}, "
            f"tinylm's {float(e64.reshape(-1)[flat]):.6g})",
            worst,
            label,
        )
    return None


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gradient_mismatch(got: dict, want: dict, tolerance: Tolerance) -> Mismatch | None:
    for name, expected in want.items():
        actual = got.get(name)
        if actual is None:
            return Mismatch(
                f"no gradient reaches {name}: is the output cut off from autograd (.detach, numpy)?", math.inf
            )
        wrong = mismatch(actual, expected, tolerance, f"the gradient of {name}")
        if wrong is not None:
            return wrong
    return None


def call_note(calls: Calls, label: str) -> str:
    """For a part called several times, which call a mismatch is in and its plain arguments."""
    if len(calls) < 2 or not label.startswith("["):
        return ""
    i = int(label[1 : label.index("]")])
    plain = ", ".join(f"{k}={v}" for k, v in calls[i].items() if isinstance(v, (int, float)))
    return f" (call {i}: {plain})"


def named_mistake(part: Part, case: Case, output: Any) -> Mistake | None:
    """The first of the part's usual mistakes whose output, on the same inputs, is the student's;
    else the first two of them made at once (``parts.mistake_pairs``)."""
    for candidate in (*part.mistakes, *mistake_pairs(part.mistakes)):
        theirs = canonical_output(part, case.calls, run_call(candidate.fn, case.calls)["output"])
        if mismatch(output, theirs, part.tolerance) is None:
            return candidate
    return None


def same_gradients(got: dict, want: dict, tolerance: Tolerance) -> bool:
    """The same gradients for the same arguments, a gradient that does not reach an argument
    (None) counting as zeros: autograd gives either, depending on how the graph was cut."""
    if set(got) != set(want):
        return False
    for name, expected in want.items():
        actual = got[name]
        if actual is None and expected is None:
            continue
        actual = torch.zeros_like(expected) if actual is None else actual
        expected = torch.zeros_like(actual) if expected is None else expected
        if mismatch(actual, expected, tolerance) is not None:
            return False
    return True


def named_gradient_mistake(part: Part, case: Case, grads: dict) -> Mistake | None:
    """The first usual mistake whose gradients, on the same inputs, are the student's."""
    for candidate in part.mistakes:
        theirs = run_call(candidate.fn, case.calls, list(part.grad), case.request["projection"])
        if same_gradients(grads, theirs["grads"], part.tolerance):
            return candidate
    return None


def flops_verdict(part: Part, case: Case, reply: dict) -> PartResult:
    """For a part that must not redo work (``Part.flops_baseline``), ok only when its matrix
    products take at most FLOPS_RATIO of tinylm's flops."""
    done, baseline = float(reply.get("flops", math.inf)), case.baseline_flops
    ratio = done / baseline if baseline else math.inf
    measured = f"{done:,.0f} flops in matrix products, {ratio:.2f}x tinylm's {baseline:,.0f}"
    if ratio <= FLOPS_RATIO:
        return PartResult(part.name, "ok", measured)
    key, says = PREFIX_RECOMPUTED
    return PartResult(part.name, "differs", f"yours equals {says} ({measured})", key, ratio)


def rows_verdict(part: Part, reply: dict) -> PartResult:
    """For a part that accumulates (``Part.batch_rows``), ok only when no matrix product took the
    whole batch's rows at once."""
    largest = int(float(reply.get("rows", math.inf)))
    if largest < part.batch_rows:
        return PartResult(part.name, "ok")
    key, says = ONE_BATCH
    detail = f"yours equals {says} (a matrix product took {largest} rows; the whole batch has {part.batch_rows})"
    return PartResult(part.name, "differs", detail, key, float(largest))


def memory_verdict(part: Part, case: Case, reply: dict) -> PartResult:
    """ok, or for a part that must recompute (``Part.memory_baseline``), ok only when it keeps at
    most MEMORY_RATIO of the activations the plain computation keeps for backward; for a part that
    must not redo work or must accumulate, see ``flops_verdict`` and ``rows_verdict``."""
    if case.baseline_flops is not None:
        return flops_verdict(part, case, reply)
    if part.batch_rows is not None:
        return rows_verdict(part, reply)
    if case.baseline_bytes is None:
        return PartResult(part.name, "ok")
    kept, baseline = float(reply.get("saved_bytes", math.inf)), case.baseline_bytes
    ratio = kept / baseline if baseline else math.inf
    measured = (
        f"activations kept for backward: {kept:,.0f} bytes, {ratio:.2f}x the {baseline:,.0f} of the same "
        f"computation without checkpointing"
    )
    if ratio <= MEMORY_RATIO:
        return PartResult(part.name, "ok", measured)
    key, says = NOT_CHECKPOINTED
    return PartResult(part.name, "differs", f"yours equals {says} ({measured})", key, ratio)


def judge(part: Part, case: Case, reply: dict) -> PartResult:
    """A part's verdict from the student's reply (child.answer's dict, or the sandbox's)."""
    status = reply["status"]
    if status != "ok":
        return PartResult(part.name, status, reply.get("error", ""))
    try:
        output = canonical_output(part, case.calls, reply["output"])
    except TypeError as exc:
        return PartResult(part.name, "differs", f"the output cannot be read: {exc}", None, math.inf)
    wrong = mismatch(output, case.expected["output"], part.tolerance)
    if wrong is None:
        wrong_grad = gradient_mismatch(reply["grads"], case.expected["grads"], part.tolerance)
        if wrong_grad is None:
            return memory_verdict(part, case, reply)
        found = named_gradient_mistake(part, case, reply["grads"])
        if found is not None:
            return PartResult(part.name, "differs", f"yours equals {found.says}", found.key, wrong_grad.max_error)
        return PartResult(
            part.name, "differs", f"the output is right; {wrong_grad.message}", None, wrong_grad.max_error
        )
    found = named_mistake(part, case, output)
    if found is not None:
        return PartResult(part.name, "differs", f"yours equals {found.says}", found.key, wrong.max_error)
    return PartResult(part.name, "differs", wrong.message + call_note(case.calls, wrong.label), None, wrong.max_error)


# ---------------------------------------------------------------------------------- running
def select_parts(names: list[str] | None) -> list[Part]:
    if not names:
        return list(PARTS)
    unknown = [n for n in names if n not in PARTS_BY_NAME]
    if unknown:
        raise TinyLMError(f"unknown part(s) {', '.join(unknown)}; the parts are {', '.join(PARTS_BY_NAME)}")
    return [PARTS_BY_NAME[n] for n in names]


def check_adapter(
    adapter: str | Path,
    parts: list[str] | None = None,
    timeout: float = 30.0,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    visible: Path | None = None,
    output: BinaryIO | None = None,
    budget: float | None = None,
    seed: int = 0,
) -> Iterator[PartResult]:
    """Each chosen part's verdict, as soon as it is known. The adapter runs in its own process
    (``sandbox``): ``timeout`` seconds per part and ``budget`` seconds in all, ``memory_bytes`` of
    memory; it sees ``visible`` (default: its folder) and prints to ``output`` (None: dropped).
    ``seed``: the run's inputs (``make_case``)."""
    path = Path(adapter)
    if not path.is_file():
        raise TinyLMError(f"adapter file {path} does not exist" if not path.exists() else f"{path} is not a file")
    chosen = select_parts(parts)
    cpu_seconds = int(STARTUP_SECONDS + timeout * len(chosen)) + 1  # a budget no honest run reaches
    limits = Limits(timeout=timeout, memory_bytes=memory_bytes, cpu_seconds=cpu_seconds)
    return _verdicts(Sandbox(path.resolve(), limits, visible, output), chosen, budget, seed)


def _verdicts(sandbox: Sandbox, parts: list[Part], budget: float | None, seed: int) -> Iterator[PartResult]:
    deadline = math.inf if budget is None else time.monotonic() + budget
    so_far: dict[str, PartResult] = {}
    with sandbox:
        for part in parts:
            left = deadline - time.monotonic()
            if left <= 0:
                yield PartResult(part.name, "timed out", f"(the student's {budget:g} s ran out before this part)")
                continue
            sandbox.timeout = min(sandbox.limits.timeout, left)
            with REFERENCE_LOCK:
                case = make_case(part, seed)
            reply = sandbox.call(case.request)  # the student's side: several students' at once
            with REFERENCE_LOCK:
                so_far[part.name] = explained(judge(part, case, reply), so_far)
            yield so_far[part.name]


def root_cause(name: str, so_far: dict[str, PartResult]) -> PartResult | None:
    """The first part ``name`` builds on (through parts not checked this run too) that did not
    pass while everything it builds on did: where a student should look first."""
    for base in BUILDS_ON.get(name, ()):
        result = so_far.get(base)
        if result is not None and result.status in PASSING:
            continue
        deeper = root_cause(base, so_far)
        if deeper is not None or result is not None:
            return deeper or result
    return None


def explained(result: PartResult, so_far: dict[str, PartResult]) -> PartResult:
    """A part that differs with no mistake of its own (none named, or the one named in a part it
    builds on) says which part to fix first, so that one mistake is one red cell."""
    if result.status != "differs":
        return result
    root = root_cause(result.part, so_far)
    if root is None or result.mistake not in (None, root.mistake):
        return result
    detail = f"because `{root.part}` differs: fix that first ({result.detail})"
    return replace(result, detail=detail, because=root.part)


def passed(results: list[PartResult]) -> bool:
    """Every part ok or not implemented, and one ok at least: a template left as it is fails."""
    return all(r.status in PASSING for r in results) and any(r.status == "ok" for r in results)


def summary(results: list[PartResult]) -> str:
    counts = {
        s: sum(r.status == s for r in results) for s in ("ok", "differs", "error", "timed out", "not implemented")
    }
    return ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no parts checked"


def fresh_seed() -> int:
    """A run's seed, from the operating system's randomness (not torch's, which tests seed)."""
    return secrets.randbelow(2**31)


def write_json(path: str | Path, adapter: str | Path, results: list[PartResult], seed: int = 0) -> None:
    data = {
        "adapter": str(adapter),
        "seed": seed,
        "passed": passed(results),
        "parts": [r.as_json() for r in results],
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
