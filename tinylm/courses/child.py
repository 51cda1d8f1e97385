"""The student's process: ``python -S child.py FD SETTINGS_JSON``, run from a copy of this file
(``sandbox.RUNNER_FILES``) in a folder where tinylm cannot be imported.

It puts the folders holding torch and numpy on its path (``-S`` loads no site-packages, so no
``.pth`` file and no editable install of tinylm is on it), imports torch, sets its limits (hard:
soft = hard, so the student cannot lift them), loads the adapter, says "ready" (or why it could not
load) on the socket ``FD``, then answers one request per part until tinylm closes the socket. The
student's exceptions become replies ("error", with the type, message and the adapter's line); a
hang or a crash is seen by ``sandbox`` from outside.

Tests import ``answer`` from ``tinylm.courses.child`` to judge an adapter in their own process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import signal
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType

if __name__ == "__main__":  # the runner: the site-packages folders it is given, before torch is imported
    sys.path.extend(json.loads(sys.argv[2])["site"])

import torch  # noqa: E402  (after the path is set, above)

if __package__:  # imported from tinylm, by tests
    from tinylm.courses.calls import describe_exception, receive, run_call, send
else:  # the runner's copy: calls.py lies beside it
    from calls import describe_exception, receive, run_call, send


def address_space_in_use() -> int:
    """Bytes of address space this process has mapped (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * resource.getpagesize()
    except OSError:
        return 0


def limit_resources(settings: dict) -> list[str]:
    """Hard limits (soft = hard: a process can lower its hard limit, never raise it back without
    CAP_SYS_RESOURCE, which the namespace sandbox drops): address space, what torch has mapped
    already plus ``memory_bytes`` (a CPU build of torch maps a few hundred MB at import, whatever
    the student does); CPU seconds in all (then SIGXCPU ends the process); the size of a file it
    writes; open files; processes and threads (``processes``, 0 for none: RLIMIT_NPROC counts every
    process of the user, so it is set only inside the sandbox's own user namespace); no core file.
    Returns the limits the platform refused (macOS has no RLIMIT_AS)."""
    wanted = [
        ("memory", resource.RLIMIT_AS, address_space_in_use() + settings["memory_bytes"]),
        ("CPU time", resource.RLIMIT_CPU, settings["cpu_seconds"]),
        ("file size", resource.RLIMIT_FSIZE, settings["file_bytes"]),
        ("open files", resource.RLIMIT_NOFILE, settings["open_files"]),
        ("core files", resource.RLIMIT_CORE, 0),
    ]
    if settings["processes"]:
        wanted.append(("processes", resource.RLIMIT_NPROC, settings["processes"]))
    refused = []
    for name, which, value in wanted:
        _, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            refused.append(name)
    return refused


def load_adapter(path: str) -> ModuleType:
    """The adapter as a module named ``adapter``; its folder goes on sys.path so that it can
    import the student's other files."""
    sys.path.insert(0, str(Path(path).parent))
    spec = importlib.util.spec_from_file_location("adapter", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["adapter"] = module  # dataclasses and pickling look their module up by name
    spec.loader.exec_module(module)
    return module


def leftover_processes() -> list[int]:
    """In the sandbox's own PID namespace (where bubblewrap's init is 1 and this process 2), the
    processes still running beside this one: what a part started and did not wait for."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, os.getpid()):
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # it ended meanwhile
        if state != "Z":  # a zombie has ended; only its exit status is left
            found.append(int(name))
    return found


def end_leftovers(reply: dict) -> dict:
    """The reply, or an error when the part left processes running: they are killed, and waited
    for (a killed process takes a moment to end), so that the next part starts alone."""
    left = leftover_processes()
    if not left:
        return reply
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for _ in range(100):
        if not leftover_processes():
            break
        time.sleep(0.02)
    return {
        "status": "error",
        "error": f"the part left {len(left)} process(es) running; a part must wait for what it starts",
    }


def answer(module, request: dict, adapter: str) -> dict:
    """The reply to one request: "ok" with the output and gradients, "not implemented" (no such
    function, or it raises NotImplementedError, as the template's do), or "error"."""
    fn = getattr(module, request["function"], None)
    if not callable(fn):
        return {"status": "not implemented"}
    try:
        measure, count, rows = (request.get(k, False) for k in ("measure", "count", "rows"))
        reply = run_call(fn, request["calls"], request["grad"], request["projection"], measure, count, rows)
        return {"status": "ok", **reply}
    except NotImplementedError:
        return {"status": "not implemented"}
    except (Exception, SystemExit) as exc:  # the student's code, whatever it raises
        return {"status": "error", "error": describe_exception(exc, adapter)}


def main(argv: list[str]) -> int:
    conn, settings = Connection(int(argv[0])), json.loads(argv[1])
    adapter = settings["adapter"]
    torch.set_num_threads(1)  # parts are small; one thread keeps CPU time close to wall time
    refused = limit_resources(settings)
    if refused:
        print(f"tinylm check: this platform refused the limits on {', '.join(refused)}", file=sys.stderr)
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
        reply = answer(module, request, adapter)
        send(conn, end_leftovers(reply) if settings["own_pids"] else reply)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
