"""Hoarder: forks 8 children that each take 300 MB at once, each within its own memory limit,
2.4 GB together."""

# ruff: noqa: F821  (the helpers come from the shared answer this file executes first)
from pathlib import Path

_SHARED = Path(__file__).resolve().parent / "student_adapter.py"  # copied beside it by the tests
exec(compile(_SHARED.read_text(encoding="utf-8"), str(_SHARED), "exec"))

import os  # noqa: E402


def run_linear(x, weight, bias):
    ready_read, ready_write = os.pipe()  # each child says it holds its 300 MB ...
    go_read, go_write = os.pipe()  # ... and holds it until every one does (all at once, however busy the machine)
    children = []
    for _ in range(8):
        pid = os.fork()
        if pid == 0:
            os.close(go_write)
            held = torch.ones(75_000_000)  # 300 MB, touched
            os.write(ready_write, b"1")
            os.close(ready_write)
            os.read(go_read, 1)  # returns when the parent closes go_write
            os._exit(0 if held.sum() > 0 else 1)
        children.append(pid)
    os.close(ready_write)
    os.close(go_read)
    ready = 0
    while ready < 8 and os.read(ready_read, 1):  # b"" once every child has said so or ended
        ready += 1
    os.close(go_write)
    ended = [os.waitpid(pid, 0)[1] for pid in children]
    if any(ended):
        raise RuntimeError(f"{sum(map(bool, ended))} of the 8 children did not finish")
    return x @ weight.T + bias
