"""The GPU check's pre-flight (under 30 s): what the machine is, and the three things most
likely to fail the first time, each tried alone so one failure does not hide the others.

1. versions: Python, torch, CUDA, the driver, the GPU;
2. pinned host memory read across processes: CUDA's staging buffers (and a DataLoader's
   pinned batches) are sent by reference between same-host workers; some drivers map pinned
   memory so that ``process_vm_readv`` fails (EFAULT). Prints what the sender's probe
   (``_memory.readable``) says, and what a child process's read really does, for pinned and
   for ordinary memory;
3. torch's device-aware future extracting tensors from a result that holds a distgrad RRef
   (an in-process group on the in-memory transport).

One line per finding, ``ok`` / ``FAIL`` first; exit status 1 if any line failed.
Usage: ``python scripts/gpu_preflight.py`` (``PYTHONPATH`` with ``src``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import torch

failed = False


def report(ok: bool, what: str) -> None:
    global failed
    failed = failed or not ok
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)


def step(name: str, fn: Callable[[], None]) -> None:
    started = time.monotonic()
    try:
        fn()
    except Exception:
        report(False, f"{name}: {traceback.format_exc(limit=3).strip()}")
    print(f"     ({name}: {time.monotonic() - started:.1f} s)", flush=True)


def versions() -> None:
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        check=False,
        capture_output=True,
        text=True,
        timeout=10,
    )
    report(
        torch.cuda.is_available(),
        f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"GPUs {torch.cuda.device_count()}, nvidia-smi: {smi.stdout.strip() or smi.stderr.strip()}",
    )


_READER = """
import hashlib, sys
from distgrad._transport._memory import read_memory
pid, address, size = (int(a) for a in sys.argv[1:4])
buf = bytearray(size)
try:
    read_memory(pid, address, memoryview(buf))
except OSError as exc:
    print("error", exc)
else:
    print("read", hashlib.sha256(buf).hexdigest())
"""


def cross_process_reads() -> None:
    from distgrad._transport import _memory
    from distgrad._wire._frames import buffer_address

    if not _memory.available():
        report(False, "cross-memory reads are not available here (not Linux, or turned off)")
        return
    size = 8 << 20
    for kind in ("pinned", "pageable"):
        t = torch.randint(0, 255, (size,), dtype=torch.uint8)
        if kind == "pinned":
            t = t.pin_memory()
        view = memoryview(t.numpy())
        probe = _memory.readable(view)
        want = hashlib.sha256(bytes(view)).hexdigest()
        child = subprocess.run(
            [sys.executable, "-c", _READER, str(os.getpid()), str(buffer_address(view)), str(size)],
            check=False,
            capture_output=True,
            text=True,
            timeout=20,
        )
        out = child.stdout.strip() or child.stderr.strip()[-300:]
        read_ok = out == f"read {want}"
        # what matters: the probe never says yes where the read fails (that would drop a link)
        report(
            probe == read_ok or not probe,
            f"{kind} host memory: sender's probe says {'readable' if probe else 'unreadable'}, "
            f"a child's read: {'ok' if read_ok else out}",
        )


def future_extraction() -> None:
    import distgrad.rpc as rpc
    from distgrad._testing._world import open_world

    def body(rank: int) -> str:
        if rank != 0:
            return ""
        rref = rpc.remote("worker1", torch.add, (torch.ones(2), 1))
        future: torch.futures.Future[object] = torch.futures.Future(devices=["cuda:0"])
        future.set_result([rref, torch.ones(2, device="cuda:0")])
        chained = future.then(lambda f: f.value()[0])
        value = chained.wait().to_here()
        return str(value.tolist())

    with open_world(2) as world:
        got = world.run(body)[0]
    report(got == "[2.0, 2.0]", f"device-aware future with a distgrad RRef in its value: {got}")


def main() -> int:
    started = time.monotonic()
    step("versions", versions)
    if torch.cuda.is_available():
        step("pinned memory across processes", cross_process_reads)
        step("future extraction", future_extraction)
    print(f"pre-flight: {'FAILED' if failed else 'passed'} in {time.monotonic() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
