"""The decoding step's attention on the CPU in C (``cpu_attention.c``), for float32.

Why C: a decoding step's attention is one query row per head over a few dozen cached slots. As
``torch.baddbmm`` that is hundreds of tiny matrix products a step (rows times heads, twice per
layer), each paying a library call's setup, and every slot of every row is read even where the
row's mask hides it (rows joining a running batch leave their leading slots hidden). At 32 clients
those products were 29% of the server's engine (docs/notes/issue-41.md). The C loops
go through the slots each row sees, eight at a time through fused multiply-adds, and skip the
slots it does not (whatever those hold: they score -inf).

The source is compiled on first use with the machine's C compiler (``cc``, or ``$CC``) for the
CPU it runs on (``-march=native``) into ``~/.cache/tinylm/kernels`` (``$TINYLM_CACHE``), one file
per source, compiler and CPU, and loaded with ``ctypes`` (a call releases the GIL). Loading a
library runs its code as the user who loads it, so only a file this user owns, in a folder only
this user can write, is ever loaded: the cache folder is created private (0700), and where it
cannot be written, or others may write it, the loops are built into a private temporary folder
of this process's own (never a shared folder whose file names anyone can compute and plant).
Where no compiler is found or the build fails, ``attend`` returns None and the caller's batched
products (``gpt.step_attention_products``) run instead; ``TINYLM_CPU_ATTENTION=0`` asks for them
always (comparisons, tests).

The softmax is computed in the same pass (an 8-wide exponential, about 1e-7 relative error; the
sum divided out at the end): its numbers differ from ``torch.softmax``'s in the last bits, as any
two summation orders do.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_suffix(".c")
SWITCH = "TINYLM_CPU_ATTENTION"  # "0": never use the C loops


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def _cpu_signature() -> str:
    """What the build depends on besides the source and compiler: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n" + "\n".join(wanted)


def _build(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # then renamed: a reader never sees half a file
        part = Path(tmp) / out.name
        cmd = [compiler, "-O3", "-march=native", "-shared", "-fPIC", "-o", str(part), str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-500:] or f"{compiler} exited {done.returncode}")
        os.replace(part, out)


def _only_ours(path: Path) -> bool:
    """Whether ``path`` (not followed if a link) is this user's, and no one else may write it."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not stat.S_ISLNK(st.st_mode)


def _private_cache() -> Path | None:
    """The kernel cache folder, created private; None where it cannot be, or others may write it."""
    cache = Path(os.environ.get("TINYLM_CACHE", Path.home() / ".cache" / "tinylm")) / "kernels"
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return cache if _only_ours(cache) else None


def _built(compiler: str, name: str) -> Path:
    """The library file, built first where it is not there yet, in a folder only this user can
    write: the cache folder, or else a temporary folder of this process's own."""
    folder = _private_cache()
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix="tinylm-kernels-"))  # 0700, a name no one can guess
        atexit.register(shutil.rmtree, folder, True)
        log.info("the kernel cache cannot be written or is not private: building the C loops in %s", folder)
    path = folder / name
    if not path.exists():
        _build(compiler, path)
    if not _only_ours(path):
        raise RuntimeError(f"{path} is not this user's own file, or others may write it: not loaded")
    return path


def library_name(compiler: str) -> str:
    """The library's file name: one per source, compiler version and CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), version, _cpu_signature()]).encode()).hexdigest()[:16]
    return f"cpu_attention-{key}.so"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled loops, built on first use; None where they cannot be built here."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler found: decoding attention uses torch's batched products")
        return None
    try:
        lib = ctypes.CDLL(str(_built(compiler, library_name(compiler))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("the C decoding attention did not build (%s): torch's batched products run instead", exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    f32 = ctypes.c_float
    # q, keys, values, bias, out; BH, G, S, D, strides; scale; new keys, values, slot; rows, slots, heads
    lib.decode_attention.argtypes = [ptr] * 5 + [i64] * 6 + [f32, ptr, ptr, i64, ptr, ptr, i64]
    lib.decode_attention.restype = ctypes.c_int
    return lib


def _fits(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, per_bias: int) -> bool:
    """Float32 on the CPU, no gradient wanted, and the shapes and layouts the loops read (they
    read raw memory: a shape that does not match would read past a tensor). ``per_bias``: query
    rows per row of ``bias`` (1, or a prompt token's heads)."""
    f32 = torch.float32
    return (
        q.dtype is f32
        and keys.dtype is f32
        and values.dtype is f32
        and bias.dtype is f32
        and q.is_cpu
        and keys.is_cpu
        and values.is_cpu
        and bias.is_cpu
        and not (q.requires_grad or keys.requires_grad or values.requires_grad)
        and q.dim() == 3
        and values.shape == keys.shape
        and q.shape[2] == keys.shape[2]
        and keys.stride()[1:] == (keys.shape[2], 1)
        and values.stride() == keys.stride()
        and bias.dim() == 3
        and bias.shape == (q.shape[0] // per_bias, 1, keys.shape[1])
        and q.shape[0] == bias.shape[0] * per_bias
        and bias.stride(-1) == 1
    )


def _index_fits(index: torch.Tensor, count: int, below: int) -> bool:
    """An int64 CPU vector of ``count`` entries, each in [0, below): the loops index raw memory
    with it."""
    return (
        index.dtype is torch.int64
        and index.is_cpu
        and index.dim() == 1
        and index.numel() == count
        and index.is_contiguous()
        and count > 0
        and 0 <= int((bounds := torch.aminmax(index)).min) <= int(bounds.max) < below
    )


def _new_rows(
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor], BH: int, D: int, S: int, tokens: int
) -> tuple | None:
    """The new keys and values as (BH, D) float32 rows, contiguous, and their slot: an int (one
    slot for every row), or with ``tokens`` prompt tokens, their slots (tokens,); None where they
    do not fit (another dtype or device, gradients, another size, a slot outside the S read)."""
    new_keys, new_values, slot = new  # checked one by one: this runs in every layer of every step
    if not (
        new_keys.dtype is torch.float32
        and new_values.dtype is torch.float32
        and new_keys.is_cpu
        and new_values.is_cpu
        and not (new_keys.requires_grad or new_values.requires_grad)
        and new_keys.numel() == BH * D == new_values.numel()
    ):
        return None
    if tokens:
        at = slot if _index_fits(slot, tokens, S) else None
    else:
        at = int(slot) if slot.numel() == 1 else -1
        at = at if 0 <= at < S else None
    if at is None:
        return None
    return new_keys.reshape(BH, D).contiguous(), new_values.reshape(BH, D).contiguous(), at


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """softmax(scale q keys^T + bias) values for q (BH, G, D), keys and values (BH, S, D) (views
    whose slots are D floats apart: the cache's first S slots) and the additive ``bias`` (BH, 1,
    S); None where the C loops do not apply (another dtype or device, gradients, torch.compile
    tracing, no compiler), and then the caller computes it, having changed nothing.

    ``new``, (new keys, new values, slot (1,)), BH D elements each: the step's own keys and values,
    written into slot ``slot`` of ``keys`` and ``values`` in the same pass (each row's write then
    costs no wait of its own: its line is asked for while the row before is worked on).

    ``rows`` (P,): the query rows are P prompt tokens', token-major (BH = P kv heads, the heads
    a kv head serves as G), and token i reads and writes cache row ``rows[i]`` (keys and values:
    (cache rows kv heads, S, D)) with bias row i (bias (P, 1, S)); ``new``'s slot is then each
    token's slot (P,). A prompt's tokens come in order: each reads the keys its earlier tokens
    wrote in the same pass."""
    # is_compiling first: a step being compiled traces none of the checks after it
    if torch.compiler.is_compiling() or not enabled():
        return None
    (BH, G, D), S = q.shape, keys.shape[1]
    heads = 1 if rows is None else BH // max(rows.numel(), 1)  # query rows per bias row
    if not _fits(q, keys, values, bias, heads):
        return None
    if rows is not None and not (keys.shape[0] % heads == 0 and _index_fits(rows, BH // heads, keys.shape[0] // heads)):
        return None
    written = None if new is None else _new_rows(new, BH, D, S, 0 if rows is None else rows.numel())
    if new is not None and written is None:
        return None
    lib = library()
    if lib is None:
        return None
    q = q.contiguous()
    out = torch.empty(BH, G, D)
    new_k, new_v, slot, slots = None, None, -1, None
    if written is not None:  # one slot for every row, or each prompt token's own
        new_k, new_v = written[0].data_ptr(), written[1].data_ptr()
        slot, slots = (-1, written[2].data_ptr()) if rows is not None else (written[2], None)
    tokens = (None, None, 0) if rows is None else (rows.data_ptr(), slots, heads)
    args = (BH, G, S, D, keys.stride(0), bias.stride(0), scale, new_k, new_v, slot, *tokens)
    if lib.decode_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), bias.data_ptr(), out.data_ptr(), *args):
        raise MemoryError(f"no memory for the attention scores of {S} slots")
    return out
