"""What the ``DISTGRAD_PATCH_TORCH`` start-up hook (``distgrad-patch-torch.pth``) costs.

Two throw-away virtual environments over this interpreter's packages differ only in the hook:
``plain`` (a ``.pth`` putting ``src/`` and this interpreter's site-packages on the path) and
``hook`` (the same, plus the repository's ``src/distgrad-patch-torch.pth``, processed by
``site`` as an installed distgrad's is). Each case runs a fresh interpreter ``--runs`` times,
the two sides alternating run by run (so drift on a busy machine hits both alike), and reports
the median and the quartiles of the wall time:

* ``python -c pass``, variable unset: the hook's cost to every Python process;
* ``python -c pass``, ``DISTGRAD_PATCH_TORCH=1``: installing the torch import hook;
* ``python -c "import torch"``, variable set vs not: patching torch when it is imported.

It also times the ``.pth`` line itself in-process with the variable unset (``timeit``), the
floor of what the hook can cost when unset.

Usage: python benchmarks/startup_bench.py [--runs N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PTH = REPO / "src" / "distgrad-patch-torch.pth"


def _make_env(root: Path, name: str, hook: bool) -> Path:
    """A venv without pip over this interpreter's packages; returns its python."""
    path = root / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    paths = [str(REPO / "src"), sysconfig.get_paths()["purelib"]]
    Path(purelib, "_bench_paths.pth").write_text("\n".join(paths) + "\n")
    if hook:
        Path(purelib, PTH.name).write_text(PTH.read_text())
    return python


def _time(python: Path, code: str, patch: bool) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTGRAD_")}
    env.pop("PYTHONPATH", None)
    if patch:
        env["DISTGRAD_PATCH_TORCH"] = "1"
    start = time.perf_counter()
    subprocess.run([str(python), "-c", code], env=env, check=True)
    return time.perf_counter() - start


def _summary(samples: list[float]) -> dict[str, float]:
    q1, med, q3 = statistics.quantiles(samples, n=4)
    return {"median_ms": med * 1e3, "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3}


def _line_cost_ns() -> float:
    line = PTH.read_text().strip()
    saved = os.environ.pop("DISTGRAD_PATCH_TORCH", None)
    try:
        number = 200_000
        return timeit.timeit(line, number=number) / number * 1e9
    finally:
        if saved is not None:
            os.environ["DISTGRAD_PATCH_TORCH"] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per side (default 20)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    # (name, code, plain side's patch flag, hook side's patch flag)
    cases = [
        ("python -c pass, unset", "pass", False, False),
        ("python -c pass, DISTGRAD_PATCH_TORCH=1", "pass", False, True),
        ("python -c 'import torch', DISTGRAD_PATCH_TORCH=1", "import torch", False, True),
    ]
    results: dict[str, object] = {"pth_line_unset_ns": _line_cost_ns(), "runs": args.runs}
    with tempfile.TemporaryDirectory() as tmp:
        plain = _make_env(Path(tmp), "plain", hook=False)
        hook = _make_env(Path(tmp), "hook", hook=True)
        for name, code, plain_patch, hook_patch in cases:
            _time(plain, code, plain_patch)  # warm the page cache for both sides
            _time(hook, code, hook_patch)
            a: list[float] = []
            b: list[float] = []
            for i in range(args.runs):
                order = [(a, plain, plain_patch), (b, hook, hook_patch)]
                for samples, python, patch in order if i % 2 == 0 else order[::-1]:
                    samples.append(_time(python, code, patch))

            sa, sb = _summary(a), _summary(b)
            results[name] = {"without_hook": sa, "with_hook": sb}
            diff = sb["median_ms"] - sa["median_ms"]
            print(
                f"{name:52s} without hook {sa['median_ms']:7.1f} ms "
                f"[{sa['q1_ms']:.1f}-{sa['q3_ms']:.1f}]   with hook {sb['median_ms']:7.1f} ms "
                f"[{sb['q1_ms']:.1f}-{sb['q3_ms']:.1f}]   diff {diff:+.1f} ms"
            )
    print(f"the .pth line itself, variable unset: {results['pth_line_unset_ns']:.0f} ns")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
