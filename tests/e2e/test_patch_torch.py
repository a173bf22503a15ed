"""The switch (docs/libraries.md): with ``DISTGRAD_PATCH_TORCH=1`` every Python process that
inherits it runs distgrad's RPC under torch's names; without it nothing changes. Each test runs
in child processes started as with an installed distgrad (tests/_patching.py), so this test
process is never patched."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from tests._harness import free_port
from tests._patching import REPO, patch_env, run_python

PROGRAM = REPO / "tests" / "e2e" / "torch_program.py"

# every way a library reaches torch's RPC; printed as "label=module-or-class-name"
_NAMES = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed.rpc as rpc
    from torch.distributed import rpc as rpc2
    import torch.distributed.rpc.api as api
    from torch.distributed.rpc import functions, constants, backend_registry, options, internal
    import torch.distributed.rpc._testing as testing
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.optim.optimizer import DistributedOptimizer as Opt2
    from torch.distributed.nn import RemoteModule
    from torch.distributed.nn.api.remote_module import RemoteModule as RM2
    import torch.distributed.nn.api.remote_module as remote_module
    from torch._C._distributed_rpc import PyRRef, _is_current_rpc_agent_set
    import distgrad
    found = {
        "rpc": rpc.__name__, "rpc2": rpc2.__name__, "attr": torch.distributed.rpc.__name__,
        "api": api.__name__, "functions": functions.__name__, "constants": constants.__name__,
        "backend_registry": backend_registry.__name__, "options": options.__name__,
        "internal": internal.__name__, "testing": testing.__name__,
        "autograd": dist_autograd.__name__, "attr_autograd": torch.distributed.autograd.__name__,
        "optimizer": DistributedOptimizer.__module__, "optimizer2": Opt2.__module__,
        "remote_module": RemoteModule.__module__, "remote_module2": RM2.__module__,
        "remote_module_mod": remote_module.__name__, "pyrref": PyRRef.__module__,
        "agent_set": _is_current_rpc_agent_set(), "available": rpc.is_available(),
        "patched": distgrad.patched(),
        "ddp_rref": torch.nn.parallel.distributed.RRef.__module__,
        "jit_rref": torch._jit_internal.RRef.__module__,
        "jit_is_rref": torch.jit.annotations.is_rref(rpc.RRef[int]),
    }
    print(repr(found))
    """
)

DISTGRAD = {
    "rpc": "distgrad.rpc",
    "rpc2": "distgrad.rpc",
    "attr": "distgrad.rpc",
    "api": "distgrad.rpc.api",
    "functions": "distgrad.rpc.functions",
    "constants": "distgrad.rpc.constants",
    "backend_registry": "distgrad.rpc.backend_registry",
    "options": "distgrad.rpc.options",
    "internal": "distgrad.rpc.internal",
    "testing": "distgrad.rpc._testing",
    "autograd": "distgrad.autograd",
    "attr_autograd": "distgrad.autograd",
    "optimizer": "distgrad.optim",
    "optimizer2": "distgrad.optim",
    "remote_module": "distgrad.nn",
    "remote_module2": "distgrad.nn",
    "remote_module_mod": "distgrad.nn.api.remote_module",
    "pyrref": "distgrad.rpc",
    "agent_set": False,
    "available": True,
    "patched": True,
    "ddp_rref": "distgrad.rpc",
    "jit_rref": "distgrad.rpc",
    "jit_is_rref": True,
}


def _names(env: dict[str, str], prelude: str = "") -> dict[str, object]:
    result = run_python(prelude + _NAMES, env)
    assert result.returncode == 0, result.stderr
    found: dict[str, object] = eval(result.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hide", [False, True], ids=["torch-rpc", "torch-rpc-hidden"])
def test_every_path_to_torch_rpc_is_distgrads(hide: bool) -> None:
    """With the variable set, every import form and the C extension's names give distgrad's,
    also on a torch whose RPC is hidden."""
    assert _names(patch_env(patch=True, hide_torch_rpc=hide)) == DISTGRAD


@pytest.mark.timeout(120)
def test_patch_torch_after_torch_and_a_library_imported_it() -> None:
    """``distgrad.patch_torch()`` called late rebinds names a module took from torch's RPC
    (as PyG takes ``_is_current_rpc_agent_set``); a second call changes nothing."""
    prelude = textwrap.dedent(
        """
        import types, sys, torch
        import torch.distributed.rpc as early_rpc
        lib = types.ModuleType("somelib")
        exec("from torch._C._distributed_rpc import _is_current_rpc_agent_set, PyRRef\\n"
             "from torch.distributed.rpc import RRef, rpc_async\\n"
             "from torch.distributed.optim import DistributedOptimizer\\n"
             "from torch.distributed.nn import RemoteModule", lib.__dict__)
        sys.modules["somelib"] = lib
        import distgrad
        assert not distgrad.patched()
        distgrad.patch_torch(); distgrad.patch_torch()
        assert lib.RRef is lib.PyRRef is sys.modules["distgrad.rpc"].RRef, lib.RRef
        assert lib.rpc_async.__module__.startswith("distgrad"), lib.rpc_async
        assert lib._is_current_rpc_agent_set.__module__.startswith("distgrad")
        assert lib.DistributedOptimizer.__module__ == "distgrad.optim"
        assert lib.RemoteModule.__module__ == "distgrad.nn"
        assert early_rpc.__name__ == "distgrad.rpc"
        """
    )
    assert _names(patch_env(patch=False), prelude) == DISTGRAD


@pytest.mark.timeout(120)
def test_unset_changes_nothing() -> None:
    """Without the variable, torch's modules are torch's, and importing distgrad (the hook's
    package) imports neither torch nor distgrad's RPC."""
    code = textwrap.dedent(
        """
        import sys
        import distgrad
        assert "torch" not in sys.modules and "distgrad.rpc" not in sys.modules
        import torch.distributed.rpc as rpc, torch.distributed.autograd as ag
        from torch._C._distributed_rpc import PyRRef
        print(rpc.__name__, ag.__name__, PyRRef.__module__, distgrad.patched())
        """
    )
    result = run_python(code, patch_env(patch=False))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "torch.distributed.rpc",
        "torch.distributed.autograd",
        "torch._C._distributed_rpc",
        "False",
    ]


@pytest.mark.timeout(120)
def test_a_failing_patch_warns_and_the_process_runs() -> None:
    """A patch that fails at start-up is one warning; the interpreter and torch still work."""
    code = textwrap.dedent(
        """
        import warnings
        import distgrad._patch._api as p
        from distgrad._patch import _startup
        def boom(): raise OSError("disk on fire")
        p.patch_torch = boom
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _startup.patch_now()
        print(len(caught), caught[0].category.__name__, "disk on fire" in str(caught[0].message))
        import torch.distributed.rpc as rpc
        print(rpc.__name__)
        """
    )
    result = run_python(code, patch_env(patch=False))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "RuntimeWarning", "True", "torch.distributed.rpc"]


def _run_program(tmp_path: Path, env: dict[str, str]) -> list[dict[str, object]]:
    out = tmp_path / "out"
    out.mkdir()
    result = run_python([str(PROGRAM), str(free_port()), str(out)], env, timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("patch", "hide"),
    [(True, False), (True, True), (False, False)],
    ids=["distgrad", "distgrad-torch-rpc-hidden", "torch"],
)
def test_unmodified_torch_program_trains(tmp_path: Path, patch: bool, hide: bool) -> None:
    """An unmodified torch program (torch's imports only, torch.multiprocessing.spawn children)
    trains as single-process autograd does, on distgrad under the switch (also with torch's
    RPC hidden) and on torch's own RPC without it; the private names libraries call agree."""
    reports = _run_program(tmp_path, patch_env(patch=patch, hide_torch_rpc=hide))
    expected = "distgrad.rpc" if patch else "torch.distributed.rpc"
    for report in reports:
        assert report["rpc_module"] == expected
        assert report["autograd_module"] == (
            "distgrad.autograd" if patch else "torch.distributed.autograd"
        )
        assert report["agent_set"] is True and report["agent_set_after"] is False
        assert report["gathered"] == {"worker0": 0, "worker1": 1}
    first = reports[0]
    assert first["optimizer"].startswith("distgrad" if patch else "torch")
    assert max(first["loss_diffs"] + first["grad_diffs"] + first["param_diffs"]) < 1e-6
    assert first["rref_is_pyrref"] is True
    assert first["to_here_unbound"] == [2.0, 2.0]
    assert first["owner_unbound"] == "worker1"
    assert first["rpc_async_int"] == [2.0, 2.0] and first["rpc_sync_int"] == [2.0]
    assert first["require_initialized"] == "ran"
    assert first["all_gather_states"] == ["dict", False]


@pytest.mark.timeout(120)
def test_distgrad_run_patch_torch_and_the_init_log_line(tmp_path: Path) -> None:
    """``distgrad run --patch-torch`` runs a torch-only script's workers on distgrad, and each
    worker's ``init_rpc`` logs which RPC runs."""
    script = tmp_path / "torch_workers.py"
    script.write_text(
        textwrap.dedent(
            """
            import logging, sys
            logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
            import torch.distributed.rpc as rpc
            import os
            rpc.init_rpc(f"w{os.environ['RANK']}")
            print("RPC", sys.modules["torch.distributed.rpc"].__name__, os.environ["RANK"])
            rpc.shutdown()
            """
        )
    )
    result = run_python(
        ["-m", "distgrad", "run", "--patch-torch", "-n", "2", str(script)],
        patch_env(patch=False),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert f"RPC distgrad.rpc {rank}" in result.stdout, result.stdout
        assert (
            f"init_rpc: worker 'w{rank}' (rank {rank}) runs distgrad's RPC; "
            "torch.distributed.rpc is distgrad's (patched)"
        ) in result.stdout, result.stdout


_FORKSERVER_CHILD = textwrap.dedent(
    """
    import multiprocessing as mp
    import sys


    def child(queue):
        import torch.distributed.rpc as rpc

        queue.put(rpc.__name__)


    if __name__ == "__main__":
        assert "torch" not in sys.modules  # the child gets the switch from its own start-up
        ctx = mp.get_context("forkserver")
        queue = ctx.Queue()
        proc = ctx.Process(target=child, args=(queue,))
        proc.start()
        print("CHILD", queue.get(timeout=100))
        proc.join(30)
    """
)

_TORCHRUN_WORKER = textwrap.dedent(
    """
    import os, sys
    import torch.distributed.rpc as rpc
    print("WORKER", os.environ["RANK"], rpc.__name__, flush=True)
    """
)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launch", ["forkserver", "torchrun"])
def test_children_inherit_the_switch(tmp_path: Path, launch: str) -> None:
    """A multiprocessing forkserver child and torchrun's workers, started from a process
    with the variable set, get distgrad under torch's name."""
    script = tmp_path / "launch.py"
    if launch == "forkserver":
        script.write_text(_FORKSERVER_CHILD)
        args = [str(script)]
        expected = ["CHILD distgrad.rpc"]
    else:
        script.write_text(_TORCHRUN_WORKER)
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        args += [str(script)]
        expected = ["WORKER 0 distgrad.rpc", "WORKER 1 distgrad.rpc"]
    result = run_python(args, patch_env(patch=True), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith(expected[0][:6]))
    assert lines == expected, result.stdout + result.stderr


@pytest.mark.timeout(120)
def test_a_broken_install_warns_and_the_interpreter_starts(tmp_path: Path) -> None:
    """With the variable set and distgrad not importable, the start-up hook's line warns once
    and the interpreter starts and runs torch's own RPC."""
    broken = tmp_path / "broken"
    (broken / "distgrad").mkdir(parents=True)
    (broken / "distgrad" / "__init__.py").write_text("raise ImportError('broken install')\n")
    env = patch_env(patch=True)
    boot, rest = env["PYTHONPATH"].split(os.pathsep, 1)
    env["PYTHONPATH"] = os.pathsep.join([boot, str(broken), rest])
    result = run_python("import torch.distributed.rpc as rpc; print(rpc.__name__)", env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torch.distributed.rpc"]
    assert result.stderr.count("RuntimeWarning: distgrad: DISTGRAD_PATCH_TORCH is set") == 1
    assert "ImportError('broken install')" in result.stderr


@pytest.mark.timeout(180)
def test_torchs_own_rpc_test_modules_import_under_the_switch() -> None:
    """torch's RPC test modules -- rpc_test, dist_autograd_test, faulty_agent_rpc_test and
    remote_module_test -- import under the switch (they import torch's private names:
    ``_thread_local_var``, ``_use_rpc_pickler``, ``_wait_all``, ``_internal_rpc_pickler``,
    ``_REMOTE_MODULE_PICKLED_ATTRIBUTES``, ``_RemoteModule``), and see distgrad's objects."""
    pytest.importorskip("expecttest")  # (torch's test modules need it: the test extra has it)
    code = textwrap.dedent(
        """
        import torch.testing._internal.distributed.rpc.rpc_test as rpc_test
        import torch.testing._internal.distributed.rpc.dist_autograd_test as autograd_test
        import torch.testing._internal.distributed.rpc.faulty_agent_rpc_test as faulty
        import torch.testing._internal.distributed.nn.api.remote_module_test as rm_test
        from torch.distributed.rpc.api import _thread_local_var, _use_rpc_pickler, _wait_all
        from torch.distributed.rpc.internal import _internal_rpc_pickler
        print(rpc_test.rpc.__name__, autograd_test.dist_autograd.__name__,
              type(_internal_rpc_pickler).__module__, rm_test.RemoteModule.__module__,
              faulty.rpc.__name__)
        """
    )
    result = run_python(code, patch_env(patch=True), timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [
        "distgrad.rpc",
        "distgrad.autograd",
        "distgrad.rpc.internal",
        "distgrad.nn",
        "distgrad.rpc",
    ]


@pytest.mark.timeout(120)
def test_torch_futures_wait_all_and_collect_all_stop_at_the_first_failed_rpc() -> None:
    """Under the switch, ``torch.futures.wait_all`` and ``collect_all`` over distgrad futures
    end with the first failure's error while a slow call is still running, as torch's do with
    its own futures (unpatched, torch's C++ wait cannot see a Python future's failure)."""
    code = textwrap.dedent(
        f"""
        import operator, time, torch
        import torch.distributed.rpc as rpc
        opts = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:{free_port()}")
        rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=opts)
        for combine in ("wait_all", "collect_all"):
            slow = rpc.rpc_async("worker0", time.sleep, (10,))
            failing = rpc.rpc_async("worker0", operator.truediv, (1, 0))
            try:
                if combine == "wait_all":
                    torch.futures.wait_all([slow, failing])
                else:
                    torch.futures.collect_all([slow, failing]).wait()
            except ZeroDivisionError:
                print(combine, "raised", "slow-running" if not slow.done() else "slow-done")
        done = torch.futures.wait_all([rpc.rpc_async("worker0", operator.add, (1, 2))])
        print("values", done)
        rpc.shutdown(graceful=False)
        """
    )
    result = run_python(code, patch_env(patch=True), timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "wait_all raised slow-running",
        "collect_all raised slow-running",
        "values [3]",
    ]
