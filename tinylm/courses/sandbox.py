"""The student's process seen from tinylm: started on the first part, given one request at a time,
and ended and started afresh after a part hangs or kills it, so that the other parts still run.

Where bubblewrap works (Linux with user namespaces; ``make test`` installs it), the process runs in
a namespace sandbox: its own user, PID, network, IPC and UTS namespaces, no capabilities, and a
file system holding only the system's libraries, the Python install, the folders holding torch
and numpy (read-only, tinylm masked), the student's adapter (read-only) and a private /tmp that is
deleted with it. It cannot see tinylm, the teacher's files or other students, signal tinylm, reach
the network, or leave a process behind (the PID namespace dies with it). Elsewhere the same
process runs without the namespaces (``boundary`` says so once, in plain words): the limits still
hold, but it can read and write what the user running tinylm can, and signal tinylm.

Either way the process is ``python -S child.py`` from a copy of the runner's three files
(``RUNNER_FILES``), so tinylm is not on its path, joined to tinylm by a socket pair. Its limits
(``Limits``): a wall-clock ``timeout`` per part, and hard rlimits set before the student's code
loads (``child.limit_resources``); where cgroups can be made (root), a pids and a memory cgroup
cap all its processes together; a reply over ``reply_bytes`` is refused unread, and its prints are
kept up to ``output_bytes``.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import BinaryIO

from tinylm.courses import calls as calls_module
from tinylm.courses import child as child_module
from tinylm.courses.calls import receive, send
from tinylm.training import memory as memory_module

STARTUP_SECONDS = 60.0  # importing torch and the adapter, on a busy machine, beside the part's own timeout
DEFAULT_MEMORY_BYTES = 4 << 30
TIMED_OUT, DIED, TOO_BIG, NO_REPLY = object(), object(), object(), object()  # what _receive returns instead of a reply
RUNNER_FILES = {  # the files the student's process runs (each imports only torch and its neighbours)
    "child.py": Path(child_module.__file__),
    "calls.py": Path(calls_module.__file__),
    "memory.py": Path(memory_module.__file__),
}
REPLY_STATUSES = ("ready", "ok", "not implemented", "error")
SANDBOX_ENV = "TINYLM_CHECK_SANDBOX"  # "process": skip the namespace sandbox (its tests, a machine without it)
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_KNOBS = {"pids": ("pids.max",), "memory": ("memory.limit_in_bytes", "memory.max")}  # v1's, v2's
CGROUP_MEMORY_SLACK = 1 << 30  # what the process holds besides the student's memory: torch, its libraries


@dataclass(frozen=True)
class Limits:
    timeout: float = 30.0  # wall-clock seconds per request
    memory_bytes: int = DEFAULT_MEMORY_BYTES  # address space beyond what importing torch maps
    cpu_seconds: int = 3600  # CPU time of the whole process
    file_bytes: int = 64 << 20  # the largest file it may write
    open_files: int = 256
    processes: int = 64  # processes and threads (torch's pool included)
    reply_bytes: int = 64 << 20  # the largest reply tinylm reads
    output_bytes: int = 1 << 20  # the student's prints kept; the rest is read and dropped


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
    reason = {
        "SIGXCPU": ": its CPU time ran out",
        "SIGKILL": ": killed, by its own code or for want of memory",
        "SIGXFSZ": ": it wrote a file over the size limit",
    }.get(name, "")
    return f"signal {name}{reason}"


# ------------------------------------------------------------------------------ the boundary
def system_binds() -> list[str]:
    """bubblewrap arguments for the system's libraries and the Python install, read-only."""
    argv = []
    for top in ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]  # where the loader finds the libraries
    python = Path(os.path.realpath(sys.executable))
    for folder in sorted({sys.base_prefix, str(python.parent)}):
        if folder != "/usr" and not folder.startswith("/usr/"):
            argv += ["--ro-bind", folder, folder]
    return argv


def site_folders() -> list[str]:
    """The folders holding torch and numpy (this environment's site-packages)."""
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


def bwrap_argv(visible: Path, runner: Path, tmp: Path) -> list[str]:
    """bubblewrap's command line up to the program: what the student's process sees."""
    argv = ["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    argv += ["--clearenv", "--setenv", "OMP_NUM_THREADS", "1", "--setenv", "HOME", "/tmp"]
    argv += ["--setenv", "TMPDIR", "/tmp", "--setenv", "PATH", "/usr/bin:/bin"]
    # the private /tmp first: what is bound after it shows through it, so a Python or a checkout
    # that lives under the temporary folder (a CI's clone) is still there
    argv += ["--proc", "/proc", "--dev", "/dev", "--bind", str(tmp), "/tmp", *system_binds()]
    for folder in site_folders():
        argv += ["--ro-bind", folder, folder]
        if os.path.isdir(os.path.join(folder, "tinylm")):  # a non-editable install of tinylm: hidden
            argv += ["--tmpfs", os.path.join(folder, "tinylm")]
    argv += ["--ro-bind", str(runner), "/runner"]
    folder = visible if visible.is_dir() else visible.parent
    argv += ["--ro-bind", str(visible), str(visible), "--chdir", str(folder)]
    return argv


@functools.cache
def boundary() -> str:
    """ "bubblewrap" where the namespace sandbox starts here, else "process" (said once on stderr,
    with the reason)."""
    reason = None
    if os.environ.get(SANDBOX_ENV) == "process":
        reason = f"{SANDBOX_ENV}=process asks for no namespace sandbox"
    elif shutil.which("bwrap") is None:
        reason = "bubblewrap (bwrap) is not installed"
    else:
        with tempfile.TemporaryDirectory(prefix="tinylm-probe-") as root:
            argv = bwrap_argv(Path(root), Path(root), Path(root)) + [os.path.realpath(sys.executable), "-S", "-c", ""]
            try:
                probe = subprocess.run(argv, capture_output=True, text=True, timeout=60)
                failed = probe.returncode != 0 and (probe.stderr.strip()[:200] or f"exit code {probe.returncode}")
            except (OSError, subprocess.TimeoutExpired) as exc:
                failed = str(exc)
            if failed:
                reason = f"bubblewrap does not start here ({failed})"
    if reason is None:
        return "bubblewrap"
    print(
        f"tinylm check: {reason}. Each student's code runs in a plain process with hard limits on memory, "
        "CPU time, file size and open files, but it can read and write your files and signal tinylm: "
        "install bubblewrap (apt-get install bubblewrap) for the sandbox.",
        file=sys.stderr,
    )
    return "process"


def cgroup_parents(controller: str) -> list[Path]:
    """Where a cgroup for ``controller`` may be made: under this process's own cgroup (so that the
    sandbox stays inside whatever bounds tinylm), in cgroup v1's hierarchy, then v2's."""
    places = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return places
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            places.append(CGROUP_ROOT / controller / path.lstrip("/"))
        elif controllers == "" and (CGROUP_ROOT / "cgroup.controllers").exists():  # v2 mounted alone
            places.append(CGROUP_ROOT / path.lstrip("/"))
    return places


def sweep_stale(parent: Path) -> None:
    """Remove the empty cgroups that a tinylm killed outright (SIGKILL) left in ``parent``: a
    minute old at least, since one being set up is empty for a moment."""
    for group in parent.glob("tinylm-check-*"):
        try:
            if time.time() - group.stat().st_mtime > 60 and not (group / "cgroup.procs").read_text().strip():
                group.rmdir()
        except OSError:
            continue


def limit_cgroup(controller: str, value: int) -> Path | None:
    """A new cgroup whose ``controller`` limit is ``value`` (its folder), or None where none can be
    made (not root, no such controller, a cgroup v2 tree not delegated)."""
    for parent in cgroup_parents(controller):
        sweep_stale(parent)
        group = parent / f"tinylm-check-{uuid.uuid4().hex[:12]}"
        try:
            group.mkdir()
        except OSError:
            continue
        for knob in CGROUP_KNOBS[controller]:
            if not (group / knob).exists():  # a cgroup file system makes its knobs; a plain folder has none
                continue
            try:
                (group / knob).write_text(str(value))
                return group
            except OSError:
                continue
        group.rmdir()
    return None


def remove_cgroup(group: Path) -> None:
    """Kill what is left in ``group`` (the sandbox's processes only) and remove it."""
    for _ in range(50):
        try:
            for pid in (group / "cgroup.procs").read_text().split():
                os.kill(int(pid), signal.SIGKILL)
            group.rmdir()
            return
        except (OSError, ValueError):
            time.sleep(0.1)


def relay(pipe: BinaryIO, sink: BinaryIO | None, limit: int) -> None:
    """Copy the student's prints to ``sink`` up to ``limit`` bytes, then read and drop the rest
    (a process that prints without end neither blocks nor fills tinylm's memory or disk)."""
    kept = 0
    while chunk := pipe.read1(65536):
        if sink is None or kept >= limit:
            continue
        try:
            sink.write(chunk[: limit - kept])
            kept += len(chunk)
            if kept >= limit:
                sink.write(b"\n[tinylm check: the adapter's further output is dropped]\n")
            sink.flush()
        except (OSError, ValueError):  # the sink was closed (a process that outlived its check): drop the rest
            sink = None
    pipe.close()


def well_formed(message) -> bool:
    """A reply as ``child`` sends it: a status, and with "ok" an output and a dict of gradients."""
    if not isinstance(message, dict) or message.get("status") not in REPLY_STATUSES:
        return False
    if message["status"] == "ok":
        return "output" in message and isinstance(message.get("grads"), dict)
    return isinstance(message.get("error", ""), str)


def remove_tree(root: Path) -> None:
    """Remove the sandbox's folder, even where the student took the permissions off its files."""

    def unlock(function, path, _):
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        function(path)

    try:
        shutil.rmtree(root, onerror=unlock)
    except OSError:  # what cannot be unlocked is left, rather than the class run stopped
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------ the process
class Sandbox:
    """One adapter's process; ``call`` returns the child's reply, or a reply saying it timed out,
    died or answered too much. A context manager: the process, its processes and its folder end
    with the block. ``visible``: what of the teacher's files it sees (default: the adapter's
    folder); ``output``: where its prints go (None: dropped); ``trusted``: tinylm importable and
    the environment kept, in the plain process (``tinylm evaluate --adapter``, whose adapter may
    wrap a tinylm checkpoint)."""

    def __init__(
        self,
        adapter: Path,
        limits: Limits,
        visible: Path | None = None,
        output: BinaryIO | None = None,
        trusted: bool = False,
    ):
        self.adapter, self.limits, self.output, self.trusted = adapter, limits, output, trusted
        self.visible = (visible or adapter.parent).resolve()  # bubblewrap binds absolute paths
        self.kind = "process" if trusted else boundary()
        self.timeout = limits.timeout
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.root: Path | None = None  # the runner's files and the student's /tmp
        self.cgroups: list[Path] = []  # pids and memory, where they can be made
        self.relay: threading.Thread | None = None
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
        if reply is TOO_BIG:
            self.close()
            return {"status": "error", "error": f"the reply is over the limit of {self.limits.reply_bytes:,} bytes"}
        if reply is DIED:
            return {"status": "error", "error": f"the adapter's process died ({process_end(self.close(grace=5))})"}
        if reply is NO_REPLY or reply["status"] == "ready":
            self.close()
            return {"status": "error", "error": "the adapter's process sent something that is not a reply"}
        return reply

    def _command(self, runner: Path, fd: int) -> tuple[list[str], dict, dict]:
        """The command line, its environment and the runner's settings."""
        limits, python = self.limits, os.path.realpath(sys.executable)
        site = site_folders()
        if self.trusted:  # the child imports this same tinylm
            site.append(str(Path(calls_module.__file__).resolve().parents[2]))
        settings = {
            "adapter": str(self.adapter),
            "memory_bytes": limits.memory_bytes,
            "cpu_seconds": limits.cpu_seconds,
            "file_bytes": limits.file_bytes,
            "open_files": limits.open_files,
            "processes": limits.processes if self.kind == "bubblewrap" else 0,
            "own_pids": self.kind == "bubblewrap",  # its own PID namespace: any other process is the student's
            "site": site,
        }
        if self.kind == "process":
            env = dict(os.environ) if self.trusted else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            env.update(OMP_NUM_THREADS="1", TMPDIR=str(self.root / "tmp"), HOME=str(self.root / "tmp"))
            return [python, "-S", str(runner / "child.py"), str(fd)], env, settings
        command = bwrap_argv(self.visible, runner, self.root / "tmp") + [python, "-S", "/runner/child.py", str(fd)]
        groups = (
            limit_cgroup("pids", limits.processes),
            limit_cgroup("memory", limits.memory_bytes + CGROUP_MEMORY_SLACK),
        )
        self.cgroups = [g for g in groups if g is not None]
        if self.cgroups:  # the shell joins the cgroups, then becomes bubblewrap: every process is in them
            joins = "".join(f"echo $$ > {shlex.quote(str(g / 'cgroup.procs'))} && " for g in self.cgroups)
            command = ["/bin/sh", "-c", joins + 'exec "$@"', "sh", *command]
        return command, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, settings

    def _start(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="tinylm-check-"))
        runner = self.root / "runner"
        runner.mkdir()
        (self.root / "tmp").mkdir()
        for name, source in RUNNER_FILES.items():
            shutil.copyfile(source, runner / name)
        ours, theirs = socket.socketpair()
        command, env, settings = self._command(runner, theirs.fileno())
        self.process = subprocess.Popen(
            [*command, json.dumps(settings)],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.visible if self.visible.is_dir() else self.visible.parent,
            start_new_session=True,  # its process group is killed with it
        )
        theirs.close()
        self.relay = threading.Thread(
            target=relay, args=(self.process.stdout, self.output, self.limits.output_bytes), daemon=True
        )
        self.relay.start()
        self.conn = Connection(ours.detach())
        self._hello()

    def _hello(self) -> None:
        hello = self._receive(STARTUP_SECONDS + self.timeout)
        if hello is TIMED_OUT:
            self.load_error = f"the adapter did not load within {STARTUP_SECONDS + self.timeout:g} s"
        elif hello is DIED or hello is TOO_BIG or hello is NO_REPLY:
            self.load_error = f"the adapter's process died while loading ({process_end(self.close(grace=5))})"
        elif hello["status"] != "ready":
            self.load_error = f"the adapter failed to load: {hello.get('error', 'it answered before it loaded')}"
        if self.load_error is not None:
            self.close()

    def _receive(self, timeout: float):
        """The next reply, TIMED_OUT, TOO_BIG, DIED (the socket closed), or NO_REPLY (bytes that are
        no message, or a message not shaped as ``child`` shapes its replies: the student's code can
        write to the socket too)."""
        if not self.conn.poll(timeout):
            return TIMED_OUT
        try:
            message = receive(self.conn, self.limits.reply_bytes)
        except OSError as exc:
            return TOO_BIG if "bad message length" in str(exc) else DIED  # CPython's words for an oversized one
        except EOFError:
            return DIED
        except Exception:  # bytes torch cannot load as a message (weights_only): the student's, not child's
            return NO_REPLY
        return message if well_formed(message) else NO_REPLY

    def close(self, grace: float = 0.0) -> int | None:
        """End the process, everything it started and its folder, and return how it ended: one
        whose socket closed gets ``grace`` seconds to finish dying of its own cause (a signal, an
        exit code) before it is killed."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.process is None:
            return None
        process, self.process = self.process, None
        try:
            code = process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            code = None
        try:  # the session it was started in: what the student started and left behind, in the plain process
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
        code = process.wait(timeout=30) if code is None else code
        if self.kind == "bubblewrap" and code > 128:  # bubblewrap exits 128 + the signal that ended the program
            code = 128 - code
        self.relay.join(timeout=5)
        for group in self.cgroups:
            remove_cgroup(group)
        self.cgroups = []
        remove_tree(self.root)
        return code
