"""The student's process: ``python -m tinylm.courses.child FD ADAPTER MEMORY_BYTES CPU_SECONDS``.

It limits its own memory and CPU time, loads the adapter, says "ready" (or why it could not load)
on the socket ``FD``, then answers one request per part until tinylm closes the socket. The
student's exceptions become replies ("error", with the type, message and the adapter's line);
a hang or a crash is seen by ``sandbox`` from outside. The student's prints go to stderr (the
sandbox starts this process with stdout on it), so that ``tinylm check``'s stdout holds results.
"""

from __future__ import annotations

import importlib.util
import resource
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType

import torch

from tinylm.courses.calls import describe_exception, receive, run_call, send


def address_space_in_use() -> int:
    """Bytes of address space this process has mapped (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * resource.getpagesize()
    except OSError:
        return 0


def limit_resources(memory_bytes: int, cpu_seconds: int) -> None:
    """Address space: what torch has mapped already plus ``memory_bytes`` (a CPU build of torch
    maps a few hundred MB at import, whatever the student does); CPU time: ``cpu_seconds`` in
    all, then the kernel ends the process (SIGXCPU); no core file. A limit the platform refuses
    (macOS has no RLIMIT_AS) is left as it was."""
    wanted = (
        (resource.RLIMIT_AS, address_space_in_use() + memory_bytes),
        (resource.RLIMIT_CPU, cpu_seconds),
        (resource.RLIMIT_CORE, 0),
    )
    for which, value in wanted:
        _, hard = resource.getrlimit(which)
        soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            pass


def load_adapter(path: str) -> ModuleType:
    """The adapter as a module named ``adapter``; its folder goes on sys.path so that it can
    import the student's other files."""
    sys.path.insert(0, str(Path(path).parent))
    spec = importlib.util.spec_from_file_location("adapter", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["adapter"] = module  # dataclasses and pickling look their module up by name
    spec.loader.exec_module(module)
    return module


def answer(module, request: dict, adapter: str) -> dict:
    """The reply to one request: "ok" with the output and gradients, "not implemented" (no such
    function, or it raises NotImplementedError, as the template's do), or "error"."""
    fn = getattr(module, request["function"], None)
    if not callable(fn):
        return {"status": "not implemented"}
    try:
        reply = run_call(fn, request["calls"], request["grad"], request["projection"], request.get("measure", False))
        return {"status": "ok", **reply}
    except NotImplementedError:
        return {"status": "not implemented"}
    except (Exception, SystemExit) as exc:  # the student's code, whatever it raises
        return {"status": "error", "error": describe_exception(exc, adapter)}


def main(argv: list[str]) -> int:
    fd, adapter, memory_bytes, cpu_seconds = int(argv[0]), argv[1], int(argv[2]), int(argv[3])
    conn = Connection(fd)
    torch.set_num_threads(1)  # parts are small; one thread keeps CPU time close to wall time
    limit_resources(memory_bytes, cpu_seconds)
    try:
        module = load_adapter(adapter)
    except BaseException as exc:  # a syntax error, a failing import, exit() at the top of the file
        send(conn, {"status": "error", "error": describe_exception(exc, adapter)})
        return 0
    send(conn, {"status": "ready"})
    while True:
        try:
            request = receive(conn)
        except EOFError:  # tinylm is done
            return 0
        send(conn, answer(module, request, adapter))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
