"""One call of a part, the same in the student's process and in tinylm's: the inputs copied, the
gradients of a fixed projection of the output taken, the result reduced to tensors, and the bytes
that carry requests and replies between the two processes.

A part is called with keyword arguments (``calls``: one dict per call; a schedule is called once
per step). For a part that trains, ``grad`` names the arguments whose gradients are compared: a
tensor argument, or a dict of tensors (every tensor in it). The scalar that is differentiated is
``(output * projection).sum()`` with ``projection`` a fixed random tensor, not ``output.sum()``:
a softmax row sums to 1 whatever its inputs, so the gradient of a plain sum is zero and would
hide every mistake in it.
"""

from __future__ import annotations

import contextlib
import io
import numbers
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

if __package__:  # tinylm.courses.calls, in tinylm's process
    from tinylm.training.memory import ActivationMeter
else:  # the sandbox's copy (sandbox.RUNNER_FILES): tinylm is not importable there, memory.py lies beside it
    from memory import ActivationMeter

Calls = list[dict[str, Any]]


def clone_tree(value: Any) -> Any:
    """A deep copy of tensors in dicts, lists and tuples: a function that changes its inputs in
    place (``p.sub_(...)``) must not change the inputs the next function is given."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_tree(v) for v in value)
    return value


def to_plain(value: Any) -> Any:
    """A part's return value as tensors in dicts and lists (numbers become float64 tensors), or a
    TypeError saying what came back instead."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (str, bytes)):  # text and a tokenizer's byte strings
        return value
    if isinstance(value, numbers.Real):
        return torch.tensor(float(value), dtype=torch.float64)
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if hasattr(value, "__array__"):  # a numpy array
        return torch.as_tensor(value)
    if value is None:
        raise TypeError("returned None (a missing return statement?)")
    raise TypeError(
        f"returned a {type(value).__name__}; a part returns tensors, numbers, str, bytes, or lists, tuples, "
        "dicts of them"
    )


def mark_leaves(kwargs: dict[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
    """Replace the arguments ``names`` (tensors, or dicts of tensors) by copies that require
    gradients; returns them by display name (``x``, ``weights['q_proj.weight']``)."""
    leaves = {}
    for name in names:
        value = kwargs[name]
        if isinstance(value, torch.Tensor):
            kwargs[name] = leaves[name] = value.detach().clone().requires_grad_()
        elif isinstance(value, dict):
            copy = dict(value)
            for key, tensor in value.items():
                if isinstance(tensor, torch.Tensor):
                    copy[key] = leaves[f"{name}[{key!r}]"] = tensor.detach().clone().requires_grad_()
            kwargs[name] = copy
    return leaves


def gradients(output: Any, projection: torch.Tensor, leaves: dict[str, torch.Tensor]) -> dict[str, Any]:
    """d (output * projection).sum() / d leaf, for each leaf; None where no gradient reaches it.
    An output of the wrong shape gets no gradients: the output's own comparison reports it."""
    if not isinstance(output, torch.Tensor) or output.shape != projection.shape:
        return {}
    if not output.requires_grad:
        return {name: None for name in leaves}
    found = torch.autograd.grad((output * projection).sum(), list(leaves.values()), allow_unused=True)
    return {name: None if g is None else g.detach() for name, g in zip(leaves, found)}


class ProductRows(TorchDispatchMode):
    """The largest row or inner dimension of any matrix product's left operand inside the block: a
    product over a whole batch's rows at once shows gradient accumulation that was not done."""

    PRODUCTS = {"mm", "bmm", "addmm", "baddbmm"}

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.PRODUCTS:
            left = args[1] if name.startswith(("addmm", "baddbmm")) else args[0]
            self.largest = max(self.largest, *left.shape[-2:])
        return func(*args, **(kwargs or {}))


def meters(count: bool, rows: bool) -> tuple[contextlib.AbstractContextManager, Callable[[], dict]]:
    """The context that measures a call without gradients, and what it measured: "flops" (with
    ``count``), "rows" (with ``rows``: ``ProductRows``), as float64 tensors."""
    flops, largest = FlopCounterMode(display=False) if count else None, ProductRows() if rows else None
    stack = contextlib.ExitStack()
    for meter in (flops, largest):
        if meter is not None:
            stack.enter_context(meter)

    def found() -> dict:
        values = {"flops": flops.get_total_flops() if flops else None, "rows": largest.largest if largest else None}
        return {k: torch.tensor(float(v), dtype=torch.float64) for k, v in values.items() if v is not None}

    return stack, found


def run_call(
    fn: Callable,
    calls: Calls,
    grad: list[str] = (),
    projection: torch.Tensor | None = None,
    measure: bool = False,
    count: bool = False,
    rows: bool = False,
) -> dict:
    """``fn`` on each call's arguments: {"output": the output (a list of outputs for several
    calls), "grads": {argument: gradient}} (gradients only with ``grad``, for a single call).
    With ``measure``, also "saved_bytes": what autograd keeps for backward once the forward is
    done, the inputs and weights not counted (gradient checkpointing keeps less). With ``count``
    (a part without ``grad``), also "flops": the floating-point operations of its matrix products
    (torch's FlopCounterMode), all calls together (a KV cache does fewer than a forward over the
    whole prefix at each step). With ``rows``, also "rows": ``ProductRows``' largest dimension."""
    calls = clone_tree(calls)
    if not grad:
        context, measured = meters(count, rows)
        with torch.enable_grad(), context:  # a part may differentiate inside (gradient accumulation)
            outputs = [to_plain(fn(**kwargs)) for kwargs in calls]
        return {"output": outputs if len(outputs) > 1 else outputs[0], "grads": {}, **measured()}
    (kwargs,) = calls
    leaves = mark_leaves(kwargs, list(grad))
    with torch.enable_grad():
        if measure:
            with ActivationMeter(exclude=leaves.values()) as meter:
                output = fn(**kwargs)
            saved = {"saved_bytes": torch.tensor(float(meter.live_bytes), dtype=torch.float64)}
        else:
            output, saved = fn(**kwargs), {}
        grads = gradients(output, projection, leaves)
    return {"output": to_plain(output), "grads": grads, **saved}


def describe_exception(exc: BaseException, adapter: str | Path) -> str:
    """``Type: message``, and the adapter's line it came from: what the student needs, never a
    traceback through tinylm."""
    lines = str(exc).strip().splitlines()
    text = type(exc).__name__ + (f": {lines[0][:300]}" if lines else "")
    adapter = Path(adapter).resolve()
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == adapter]
    if frames:
        text += f" ({adapter.name} line {frames[-1].lineno}, in {frames[-1].name})"
    return text


# ------------------------------------------------------------------------------ the wire
def send(conn, message: dict) -> None:
    """One message (tensors, numbers, strings in dicts and lists) as torch.save's bytes."""
    buffer = io.BytesIO()
    torch.save(message, buffer)
    conn.send_bytes(buffer.getvalue())


def receive(conn, max_bytes: int | None = None) -> dict:
    """The next message; ``weights_only`` loading, so bytes from the student's process cannot run
    code in tinylm's. A message over ``max_bytes`` is refused from its length header, before it is
    read (OSError), so that a huge reply cannot fill tinylm's memory."""
    return torch.load(io.BytesIO(conn.recv_bytes(max_bytes)), weights_only=True)
