"""Issue 23 side by side with torch's RPC: the same program runs on ``torch.distributed.rpc``
(TensorPipe) and on ``distgrad.rpc``, and each test compares one observation -- remote error
text, ``rpc_async`` to a dead peer, ``rpc._wait_all``, RRefs shipped by hand with
``_serialize`` / ``_deserialize``, GIL profiling, ``TensorPipeAgent`` and
``_server_process_global_profile`` (items 1-4 and 9)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests._harness import run_workers
from tests.e2e.test_torch_parity import Outcome
from tests.e2e.test_torch_parity import observe as _observe

pytestmark = pytest.mark.timeout(300)  # the first test runs the program twice (torch, distgrad)

_impl: dict[str, Any] = {}


def _rpc() -> Any:
    return _impl["rpc"]


def observe(call: Callable[[], Any]) -> Outcome:
    """``test_torch_parity.observe``, with torch's RPC futures (``torch._C.Future``, not
    ``torch.futures.Future`` instances) recorded as futures too."""
    return _observe(lambda: _plain(call()))


def _plain(value: Any) -> Any:
    return torch.futures.Future() if isinstance(value, torch._C.Future) else value


def fails() -> None:
    raise ValueError("first line\nsecond line")


def sleeps(seconds: float) -> int:
    time.sleep(seconds)
    return 1


def add(a: Any, b: Any) -> Any:
    return a + b


def fetches(data: tuple[Any, ...]) -> list[float]:
    """Rebuild an RRef shipped by hand as plain data, and fetch its value."""
    return _rpc().RRef._deserialize(data).to_here().tolist()  # type: ignore[no-any-return]


def exits_soon() -> None:
    """End this process abruptly a moment after answering (a worker that dies)."""
    threading.Timer(0.3, os._exit, (0,)).start()


def run(rank: int, world_size: int, *, impl: str, port: int) -> dict[str, Outcome]:
    """One worker: init; rank 0 makes every call (worker1 dies at the end); shut down."""
    if impl == "torch":
        import torch.distributed.rpc as rpc
    else:
        import distgrad.rpc as rpc
    _impl["rpc"] = rpc
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=20)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    if rank != 0:
        time.sleep(60)  # until rank 0 ends this process (exits_soon)
        return {}
    record: dict[str, Outcome] = {}

    def case(name: str, call: Callable[[], Any]) -> None:
        record[name] = observe(call)

    peer = "worker1"
    # item 3: the remote error's text
    case("error_text", lambda: rpc.rpc_sync(peer, fails))
    # item 1: rpc._wait_all ends at the first failure
    started = time.monotonic()

    def wait_all_block() -> None:
        with rpc.api._wait_all():
            rpc.rpc_async(peer, sleeps, (4.0,))
            rpc.rpc_async(peer, fails)

    case("wait_all", wait_all_block)
    record["wait_all_fast"] = {"value": time.monotonic() - started < 2.0}
    # item 4: RRefs shipped by hand
    mine = rpc.RRef(torch.ones(2))
    case("serialize_owner", lambda: [type(x).__name__ for x in mine._serialize()])
    theirs = rpc.remote(peer, add, (torch.ones(2), 1))
    theirs.to_here()
    case("serialize_user_kind", lambda: theirs._serialize()[6])
    case("deserialize_elsewhere", lambda: rpc.rpc_sync(peer, fetches, (mine._serialize(),)))
    case("deserialize_own", lambda: rpc.RRef._deserialize(mine._serialize()).is_owner())
    # item 9: the agent's class, GIL profiling, the server-side global profiler
    agent = rpc.api._get_current_rpc_agent()
    case("tensorpipe_agent", lambda: isinstance(agent, rpc.TensorPipeAgent))
    rpc.enable_gil_profiling(True)
    for i in range(5):
        rpc.rpc_sync(peer, add, (i, 1))
    case("gil_keys", lambda: sorted(agent.get_debug_info()))
    case("gil_value", lambda: float(agent.get_debug_info()["agent.gil_average_wait_time_us"]) >= 0)

    def server_profile() -> list[list[str]]:
        x, y = torch.tensor(1), torch.tensor(2)
        outer = rpc.remote(peer, rpc._server_process_global_profile)
        outer.rpc_sync().__enter__()
        rpc.rpc_sync(peer, torch.add, (x, y))
        inner = rpc.remote(peer, rpc._server_process_global_profile)
        inner.rpc_sync().__enter__()
        rpc.rpc_sync(peer, torch.sub, (x, y))
        inner.rpc_sync().__exit__(None, None, None)
        outer.rpc_sync().__exit__(None, None, None)
        ops = {"aten::add", "aten::sub"}
        return [
            sorted(ops & {e.key for e in profile.rpc_sync().key_averages()})
            for profile in (outer, inner)
        ]

    case("server_profile", server_profile)
    # item 2: rpc_async to a peer that died
    rpc.rpc_sync(peer, exits_soon)
    time.sleep(2.0)
    case("dead_rpc_async", lambda: rpc.rpc_async(peer, add, (1, 2)))
    future = None
    try:
        future = rpc.rpc_async(peer, add, (1, 2))
    except Exception:
        pass
    if future is not None:
        outcome = observe(future.wait)
        record["dead_wait"] = {k: outcome.get(k) for k in ("raised", "is_runtime_error")}
        record["dead_wait"]["raised"] = "value" not in outcome
    rpc.shutdown(graceful=False)
    return record


_records: dict[str, dict[str, Outcome]] = {}


def record_of(impl: str) -> dict[str, Outcome]:
    if impl not in _records:
        results = run_workers(run, 2, init=False, timeout=100, kwargs={"impl": impl}, may_die={1})
        _records[impl] = results[0]
    return _records[impl]


@pytest.fixture(scope="module")
def both() -> tuple[dict[str, Outcome], dict[str, Outcome]]:
    """What torch's RPC did, then what distgrad's did."""
    return record_of("torch"), record_of("distgrad")


def _same(both: tuple[dict[str, Outcome], dict[str, Outcome]], case: str) -> Outcome:
    theirs, ours = both[0][case], both[1][case]
    assert ours == theirs, f"{case}:\n torch:    {theirs}\n distgrad: {ours}"
    return ours


def test_remote_error_text_has_torchs_line_breaks(both: Any) -> None:
    """A remote ValueError's message reads as torch's from "On WorkerInfo" to the traceback:
    ``repr(e)`` with its newline decoded (torch adds "ValueError: " in front, distgrad not)."""
    texts = []
    for record in both:
        outcome = record["error_text"]
        assert outcome["raised"] == "builtins.ValueError", outcome
        message = outcome["message"]
        texts.append(message[message.index("On WorkerInfo") : message.index("Traceback")])
    assert (
        texts[1]
        == texts[0]
        == ("On WorkerInfo(id=1, name=worker1):\nValueError('first line\nsecond line')\n")
    )


def test_wait_all_block_raises_the_first_failure_at_once(both: Any) -> None:
    """``with rpc.api._wait_all():`` raises the failed call's ValueError without waiting for the
    4 s call beside it, as torch's."""
    for record in both:
        assert record["wait_all"]["raised"] == "builtins.ValueError", record["wait_all"]
    _same(both, "wait_all_fast")
    assert both[1]["wait_all_fast"] == {"value": True}


@pytest.mark.parametrize(
    "case",
    ["serialize_owner", "serialize_user_kind", "deserialize_elsewhere", "deserialize_own"],
)
def test_rrefs_shipped_by_hand(both: Any, case: str) -> None:
    """``RRef._serialize()`` gives torch's 7-tuple (six ints and the type), ``"PyObject"``
    for a Python function's result; ``RRef._deserialize`` on another worker reaches the value,
    and on the owner gives back the owner RRef -- as torch's."""
    assert "value" in _same(both, case)


@pytest.mark.parametrize("case", ["tensorpipe_agent", "gil_keys", "gil_value", "server_profile"])
def test_profiling_and_agent_names(both: Any, case: str) -> None:
    """The current agent is a ``rpc.TensorPipeAgent``; ``rpc.enable_gil_profiling(True)``
    adds ``agent.gil_average_wait_time_us`` to torch's debug keys; a server-side global
    profiler opened through an RRef sees the ops it served, nested ranges apart."""
    assert "value" in _same(both, case)


def test_rpc_async_to_a_dead_peer_returns_a_failed_future(both: Any) -> None:
    """``rpc_async`` to a worker that died returns a future (it does not raise at the call);
    its ``wait()`` raises a RuntimeError -- as torch's (the messages differ: TensorPipe's
    "eof", distgrad's names the peer)."""
    assert _same(both, "dead_rpc_async") == {"value": "a Future"}
    assert _same(both, "dead_wait") == {"raised": True, "is_runtime_error": True}
