"""The student's process seen from tinylm: started on the first part, given one request at a time,
and ended and started afresh after a part hangs or kills it, so that the other parts still run.

The process is ``python -m tinylm.courses.child`` (not multiprocessing's spawn, which would first
re-run the ``tinylm`` script and import every command), joined to tinylm by a socket pair. Its
limits: a wall-clock ``timeout`` per part (seconds), ``memory_bytes`` of address space beyond what
importing torch maps, and a CPU-time budget for the whole process. These limits keep a hang or a
runaway allocation from stopping a class's checks; they are not a security boundary (the student's
code can read and write files as the user running ``tinylm check``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import tinylm
from tinylm.courses.calls import receive, send

STARTUP_SECONDS = 60.0  # importing torch and the adapter, on a busy machine, beside the part's own timeout
DEFAULT_MEMORY_BYTES = 4 << 30
TIMED_OUT, DIED = object(), object()  # what _receive returns instead of a message


def process_end(code: int | None) -> str:
    """How a process ended, in words."""
    if code is None:
        return "still running"
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"
    reason = {"SIGXCPU": ": its CPU time ran out", "SIGKILL": ": killed, out of memory?"}.get(name, "")
    return f"signal {name}{reason}"


class Sandbox:
    """One adapter's process; ``call`` returns the child's reply, or a reply saying it timed out or
    died. A context manager: the process ends with the block."""

    def __init__(self, adapter: Path, timeout: float, memory_bytes: int, cpu_seconds: int):
        self.adapter, self.timeout = adapter, timeout
        self.memory_bytes, self.cpu_seconds = memory_bytes, cpu_seconds
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.load_error: str | None = None  # an adapter that cannot load fails every part the same way

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, request: dict) -> dict:
        if self.process is None and self.load_error is None:
            self._start()
        if self.load_error is not None:
            return {"status": "error", "error": self.load_error}
        try:
            send(self.conn, request)
        except OSError:  # the process ended between two parts
            pass
        reply = self._receive(self.timeout)
        if reply is TIMED_OUT:
            self.close()
            return {"status": "timed out", "error": f"after {self.timeout:g} s"}
        if reply is DIED:
            return {"status": "error", "error": f"the adapter's process died ({process_end(self.close(grace=5))})"}
        return reply

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        package_root = str(Path(tinylm.__file__).resolve().parents[1])  # the child imports this same tinylm
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
        }
        argv = [str(theirs.fileno()), str(self.adapter), str(self.memory_bytes), str(self.cpu_seconds)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tinylm.courses.child", *argv],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=2,  # the student's prints go to stderr: stdout holds tinylm check's results
            env=env,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        hello = self._receive(STARTUP_SECONDS + self.timeout)
        if hello is TIMED_OUT:
            self.load_error = f"the adapter did not load within {STARTUP_SECONDS + self.timeout:g} s"
        elif hello is DIED:
            self.load_error = f"the adapter's process died while loading ({process_end(self.close(grace=5))})"
        elif hello["status"] != "ready":
            self.load_error = f"the adapter failed to load: {hello['error']}"
        if self.load_error is not None:
            self.close()

    def _receive(self, timeout: float):
        """The next message, TIMED_OUT, or DIED (the socket closed, or bytes that are no message)."""
        if not self.conn.poll(timeout):
            return TIMED_OUT
        try:
            return receive(self.conn)
        except (EOFError, OSError, RuntimeError, ValueError):
            return DIED

    def close(self, grace: float = 0.0) -> int | None:
        """End the process and return how it ended: one whose socket closed gets ``grace`` seconds
        to finish dying of its own cause (a signal, an exit code) before it is killed."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.process is None:
            return None
        process, self.process = self.process, None
        try:
            return process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait(timeout=30)
