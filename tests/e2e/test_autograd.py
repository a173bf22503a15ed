"""Distributed autograd end to end: real workers, gradients checked against local autograd."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from tests._harness import run_workers as run_cluster

pytestmark = pytest.mark.timeout(120)


# -- functions the workers call on each other --------------------------------------------------
def my_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def scaled(a: torch.Tensor, k: float) -> torch.Tensor:
    return a * k


def nested_add(dst: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync(dst, my_add, (a * 2, b))


def chain(path: list[str], x: torch.Tensor) -> torch.Tensor:
    """x -> tanh at each hop along ``path``."""
    y = torch.tanh(x) * 1.5
    if not path:
        return y
    return rpc.rpc_sync(path[0], chain, (path[1:], y))


def reentrant_b1(x: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync("worker0", reentrant_a2, (x * 2,)) * 3


def reentrant_a2(y: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync("worker1", reentrant_b2, (y + 1, y))


def reentrant_b2(w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return w * y


def embedding_lookup(weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.embedding(idx, weight, sparse=True)


class SimulatedError(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise ValueError("Simulate error on backward pass")


def failing_backward(x: torch.Tensor) -> torch.Tensor:
    return SimulatedError.apply(x)


def hop(dst: str, x: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync(dst, failing_backward, (x * 1,))


class DieInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        os.kill(os.getpid(), signal.SIGKILL)
        return grad


def dying_backward(x: torch.Tensor) -> torch.Tensor:
    return DieInBackward.apply(x) * 2


def hop_to_dying(x: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync("worker2", dying_backward, (x,))


def context_count() -> int:
    return dist_autograd._get_debug_info()["num_autograd_contexts"]


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _leaves(*shape: int, n: int = 2) -> list[torch.Tensor]:
    return [torch.randn(*shape, requires_grad=True) for _ in range(n)]


def _local_grads(loss_fn, leaves: list[torch.Tensor]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    return list(torch.autograd.grad(loss_fn(*copies), copies))


def _check(
    grads: dict[torch.Tensor, torch.Tensor],
    leaves: list[torch.Tensor],
    expected: list[torch.Tensor],
) -> None:
    assert len(grads) == len(leaves)
    for leaf, want in zip(leaves, expected, strict=True):
        got = grads[leaf]
        torch.testing.assert_close(
            got.to_dense() if got.is_sparse else got, want.to_dense() if want.is_sparse else want
        )
        assert leaf.grad is None, "distributed backward must not touch .grad"


# -- worker programs ------------------------------------------------------------------------------
def parity_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "idle"
    torch.manual_seed(0)
    a, b = _leaves(3, 3)
    cases = {
        "builtin rpc_sync": (
            lambda a, b: (rpc.rpc_sync("worker1", torch.add, (a, b)) ** 2).sum(),
            lambda a, b: ((a + b) ** 2).sum(),
        ),
        "udf rpc_sync": (
            lambda a, b: (rpc.rpc_sync("worker1", my_add, (a, b)) * a).sum(),
            lambda a, b: ((a + b) * a).sum(),
        ),
        "udf rpc_async": (
            lambda a, b: (rpc.rpc_async("worker2", my_add, (a, b)).wait() * b).sum(),
            lambda a, b: ((a + b) * b).sum(),
        ),
        "builtin rpc_async": (
            lambda a, b: rpc.rpc_async("worker1", torch.mul, (a, b)).wait().sum(),
            lambda a, b: (a * b).sum(),
        ),
        "kwargs": (
            lambda a, b: rpc.rpc_sync("worker2", scaled, (a,), {"k": 3.0}).sum() + b.sum(),
            lambda a, b: (a * 3.0).sum() + b.sum(),
        ),
        "call to self": (
            lambda a, b: (rpc.rpc_sync("worker0", my_add, (a, b)) * b).sum(),
            lambda a, b: ((a + b) * b).sum(),
        ),
        "same tensor sent several times": (
            lambda a, b: (
                rpc.rpc_sync("worker1", my_add, (a, a)) * rpc.rpc_sync("worker2", my_add, (a, b))
            ).sum(),
            lambda a, b: ((a + a) * (a + b)).sum(),
        ),
        "intermediate shared by several sends": (
            lambda a, b: sum(
                rpc.rpc_sync(f"worker{1 + k % 2}", scaled, (torch.tanh(a) * b, float(k))).sum()
                for k in range(4)
            ),
            lambda a, b: sum((torch.tanh(a) * b * float(k)).sum() for k in range(4)),
        ),
        "nested 0->1->2": (
            lambda a, b: (rpc.rpc_sync("worker1", nested_add, ("worker2", a, b)) * a).sum(),
            lambda a, b: ((a * 2 + b) * a).sum(),
        ),
        "chain over 4 workers": (
            lambda a, b: (
                rpc.rpc_sync("worker1", chain, (["worker2", "worker3", "worker0"], a)) * b
            ).sum(),
            lambda a, b: (_local_chain(a, 4) * b).sum(),
        ),
    }
    for name, (dist_loss, local_loss) in cases.items():
        with dist_autograd.context() as cid:
            loss = dist_loss(a, b)
            dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
        try:
            _check(grads, [a, b], _local_grads(local_loss, [a, b]))
        except AssertionError as exc:
            raise AssertionError(f"case {name!r}: {exc}") from exc
    return "ok"


def _local_chain(x: torch.Tensor, hops: int) -> torch.Tensor:
    for _ in range(hops):
        x = torch.tanh(x) * 1.5
    return x


def test_gradients_match_local_autograd() -> None:
    """Builtins, UDFs, sync/async, kwargs, self calls, repeated and shared sends, nested chains
    over 4 workers: every gradient equals single-process autograd's, and .grad stays None."""
    results = run_cluster(parity_program, 4, timeout=90)
    assert results[0] == "ok"


def special_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "idle"
    torch.manual_seed(1)
    a, b = _leaves(4)
    # unused RPC results: the reference hangs forever here
    with dist_autograd.context() as cid:
        used = rpc.rpc_sync("worker1", my_add, (a, b))
        rpc.rpc_sync("worker2", scaled, (a, 5.0))  # result never used by the loss
        rpc.rpc_async("worker1", my_add, (b, b)).wait()  # nor this one
        loss = (used * used).sum()
        dist_autograd.backward(cid, [loss])
        _check(
            dist_autograd.get_gradients(cid),
            [a, b],
            _local_grads(lambda a, b: ((a + b) ** 2).sum(), [a, b]),
        )
    # retain_graph: two passes accumulate (2x), a third pass without it frees the graph
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", my_add, (a * a, b))
        loss = (y * y).sum()
        dist_autograd.backward(cid, [loss], retain_graph=True)
        dist_autograd.backward(cid, [loss], retain_graph=True)
        expected = _local_grads(lambda a, b: ((a * a + b) ** 2).sum(), [a, b])
        _check(dist_autograd.get_gradients(cid), [a, b], [2 * g for g in expected])
    # re-entrant A -> B -> A -> B
    x = torch.randn(3, requires_grad=True)
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync("worker1", reentrant_b1, (x,))
        dist_autograd.backward(cid, [out.sum()])
        _check(
            dist_autograd.get_gradients(cid),
            [x],
            _local_grads(lambda x: ((x * 2 + 1) * (x * 2) * 3).sum(), [x]),
        )
    # sparse (embedding-style) gradients for a table owned here, looked up remotely
    weight = torch.randn(10, 3, requires_grad=True)
    idx = torch.tensor([1, 3, 3, 7])
    with dist_autograd.context() as cid:
        rows = rpc.rpc_sync("worker2", embedding_lookup, (weight, idx))
        dist_autograd.backward(cid, [(rows * rows).sum()])
        got = dist_autograd.get_gradients(cid)[weight]
        assert got.layout == torch.sparse_coo
        want = _local_grads(
            lambda w: (torch.nn.functional.embedding(idx, w, sparse=True) ** 2).sum(), [weight]
        )[0]
        torch.testing.assert_close(got.to_dense(), want.to_dense())
    # mixed requires_grad: only grad-requiring leaves appear
    c = torch.randn(4)
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync("worker1", my_add, (a, c)).sum()
        dist_autograd.backward(cid, [loss])
        grads = dist_autograd.get_gradients(cid)
        assert list(grads) == [a]
    return "ok"


def test_unused_results_retain_graph_reentrant_sparse() -> None:
    """Unused RPC results finish (no hang); retain_graph passes accumulate; re-entrant chains
    do not deadlock; sparse gradients; leaves without requires_grad never appear."""
    assert run_cluster(special_program, 3, timeout=90)[0] == "ok"


def _square_norm(t: torch.Tensor) -> torch.Tensor:
    return (t * t.conj()).real.sum() if t.is_complex() else (t * t).sum()


def dtype_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "idle"
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64):
        a = torch.randn(5, dtype=dtype, requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", scaled, (a, 2.0))
            dist_autograd.backward(cid, [_square_norm(y)])
            got = dist_autograd.get_gradients(cid)[a]
        want = _local_grads(lambda t: _square_norm(t * 2.0), [a])[0]
        assert got.dtype == dtype
        torch.testing.assert_close(got, want)
    return "ok"


def test_every_floating_dtype() -> None:
    """Gradients of every floating dtype (and complex) cross the wire and match local ones."""
    assert run_cluster(dtype_program, 2, timeout=60)[0] == "ok"


def error_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "idle"
    x = torch.randn(4, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", hop, ("worker2", x))
        with pytest.raises(RuntimeError) as info:
            dist_autograd.backward(cid, [y.sum()])
        assert str(info.value) == (
            "Error on Node 0: Error on Node 1: Error on Node 2: Simulate error on backward pass"
        )
        # the context survives the error, and backward can be retried on it
        dist_autograd._retrieve_context(cid)
        z = rpc.rpc_sync("worker1", my_add, (x, x))
        dist_autograd.backward(cid, [z.sum()])
        torch.testing.assert_close(dist_autograd.get_gradients(cid)[x], torch.full((4,), 2.0))
    # validation errors of the reference
    with dist_autograd.context() as cid:
        with pytest.raises(
            RuntimeError, match=re.escape("No tensors provided for gradient computation.")
        ):
            dist_autograd.backward(cid, [])
        with pytest.raises(RuntimeError, match="requires_grad not set on root"):
            dist_autograd.backward(cid, [torch.ones(1)])
        with pytest.raises(
            RuntimeError, match=re.escape(" is not a scalar, all roots need to be scalar")
        ):
            dist_autograd.backward(cid, [torch.ones(2, requires_grad=True) * 2])
        with pytest.raises(
            RuntimeError, match=re.escape(" does not have a valid gradient function.")
        ):
            dist_autograd.backward(cid, [torch.ones(1, requires_grad=True)])
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 424242"):
        dist_autograd.backward(424242, [x.sum()])
    return "ok"


def test_error_chain_and_retry() -> None:
    """An error two hops away arrives as the reference's exact chain; the context survives and
    a retry succeeds; root validation errors match the reference."""
    assert run_cluster(error_program, 3, timeout=60)[0] == "ok"


def killed_program(rank: int, world_size: int) -> str:
    if rank == 0:
        x = torch.randn(4, requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", hop_to_dying, (x,))
            started = time.monotonic()
            with pytest.raises(RuntimeError, match=r"Error on Node 0: .*worker2") as info:
                dist_autograd.backward(cid, [y.sum()])
            elapsed = time.monotonic() - started
            assert elapsed < 5.0, f"took {elapsed:.1f}s: {info.value}"
        rpc.shutdown(graceful=False)
        return "ok"
    time.sleep(8)  # worker2 dies during the pass; the others just stay up for it
    rpc.shutdown(graceful=False)
    return "ok"


def test_worker_killed_during_backward() -> None:
    """A worker killed during backward fails the pass within the failure-detection bound, with
    an error naming it."""
    results = run_cluster(killed_program, 3, timeout=60, shutdown=False, may_die=frozenset({2}))
    assert results[0] == "ok"


def cleanup_program(rank: int, world_size: int, steps: int) -> dict[str, int]:
    if rank == 0:
        a = torch.randn(64, requires_grad=True)
        rss_before = 0
        for step in range(steps):
            if step == steps // 10:
                rss_before = rss_kib()
            with dist_autograd.context() as cid:
                y = rpc.rpc_sync(f"worker{1 + step % (world_size - 1)}", my_add, (a, a))
                z = rpc.rpc_sync(
                    f"worker{1 + (step + 1) % (world_size - 1)}", nested_add, ("worker0", y, a)
                )
                dist_autograd.backward(cid, [z.sum()])
        rss_after = rss_kib()
        deadline = time.monotonic() + 10
        counts = [rpc.rpc_sync(f"worker{r}", context_count) for r in range(world_size)]
        while sum(counts) and time.monotonic() < deadline:
            time.sleep(0.05)
            counts = [rpc.rpc_sync(f"worker{r}", context_count) for r in range(world_size)]
        return {"contexts": sum(counts), "rss_growth_kib": rss_after - rss_before}
    return {}


def test_contexts_released_everywhere_and_memory_flat() -> None:
    """After many steps with RPCs in contexts (incl. nested calls), every worker is back to 0
    contexts and the driver's memory has not grown."""
    steps = int(os.environ.get("DISTGRAD_SOAK_STEPS", "2000"))
    result = run_cluster(cleanup_program, 3, timeout=300, kwargs={"steps": steps})[0]
    assert result["contexts"] == 0
    assert result["rss_growth_kib"] < 20 * 1024, result


HEARTBEAT_S = 0.25
#: allowance for load on top of one heartbeat interval (a loaded 2-core host delays ticks)
SLACK_S = 1.0
#: how long worker0 sends worker1 nothing after leaving the context: longer than the bound,
#: so the release that shutdown would bring cannot pass for the heartbeat's
QUIET_S = 3.0


def quiet_cleanup_program(rank: int, world_size: int) -> float:
    """worker0 runs one step and then sends worker1 nothing; worker1 watches its own count.
    Each returns a ``time.monotonic()`` (one clock for the machine's processes): worker0 when
    it left the context, worker1 when the context was gone there."""
    if rank == 0:
        x = torch.randn(4, requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", my_add, (x, x))
            dist_autograd.backward(cid, [y.sum()])
        left = time.monotonic()
        time.sleep(QUIET_S)  # no traffic to worker1 meanwhile
        return left
    deadline = time.monotonic() + 20
    while context_count() == 0:  # the step has not reached this worker yet
        assert time.monotonic() < deadline, "the step never came"
        time.sleep(0.005)
    while context_count() != 0:
        assert time.monotonic() < deadline, "the context was never released here"
        time.sleep(0.005)
    return time.monotonic()


def test_cleanup_that_waits_for_traffic_goes_out_with_the_heartbeat() -> None:
    """Leaving a context tells its peers with this worker's next message to them (no write of
    its own); when none comes, the heartbeat tick sends it: the peer's context is gone within
    one heartbeat interval (0.25 s, +1 s for load) of worker0 leaving the block, long before
    worker0's next traffic (its shutdown, 3 s later)."""
    options = {"heartbeat_interval": HEARTBEAT_S, "peer_timeout": 10.0}
    results = run_cluster(quiet_cleanup_program, 2, timeout=60, options=options)
    took = results[1] - results[0]
    print(f"released {took:.3f} s after worker0 left the context")  # (shown with -s)
    assert 0 < took < HEARTBEAT_S + SLACK_S, took


def introspection_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return dist_autograd._get_debug_info()["num_autograd_contexts"]
    t1, t2 = _leaves(3)
    with dist_autograd.context() as cid:
        assert isinstance(cid, int) and cid >> 48 == 0
        with (
            pytest.raises(
                RuntimeError,
                match=re.escape("Already have an autograd context id for this thread."),
            ),
            dist_autograd.context(),
        ):
            pass
        rpc.rpc_sync("worker1", my_add, (t1, t2))
        rpc.rpc_sync("worker1", torch.add, (torch.ones(1), 1))  # builtin, no grad: not recorded
        ctx = dist_autograd._current_context()
        sends = list(ctx._send_functions().values())
        recvs = list(ctx._recv_functions().values())
        assert len(sends) == 1 and len(recvs) == 1
        assert sends[0].name() == "torch::distributed::autograd::SendRpcBackward"
        assert recvs[0].name() == "torch::distributed::autograd::RecvRpcBackward"
        assert [fn.variable for fn, _ in sends[0].next_functions] == [t1, t2]
        assert ctx._known_worker_ids() == {1}
        assert next(iter(ctx._recv_functions())) == 1 << 48  # worker1's counter answered
        assert dist_autograd._get_max_id() == (1 << 48) - 1
        remote = rpc.rpc_sync("worker1", dist_autograd._get_debug_info)
        assert remote["num_autograd_contexts"] == 1
    with pytest.raises(RuntimeError, match="Could not find autograd context with id"):
        dist_autograd._retrieve_context(cid)
    return "ok"


def test_introspection_matches_reference() -> None:
    """Context ids, send/recv functions (names, edges, message-id order), known workers, the
    nested-context error and the builtin-without-grad rule."""
    assert run_cluster(introspection_program, 2, timeout=60)[0] == "ok"


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(1.0)
        return grad


def slow_backward(x: torch.Tensor) -> torch.Tensor:
    return SlowBackward.apply(x)


def released_program(rank: int, world_size: int) -> str:
    if rank != 0:
        rpc.api._barrier()
        return "served"
    import threading

    x = torch.randn(4, requires_grad=True)
    cid = dist_autograd._new_context()._context_id()
    y = rpc.rpc_sync("worker1", slow_backward, (x,))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            dist_autograd.backward(cid, [y.sum()])
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.3)  # worker1 is inside its slow backward now
    dist_autograd._release_context(cid)
    thread.join(10)
    assert not thread.is_alive(), "backward must end when its context is released"
    assert errors and "Could not find autograd context with id" in str(errors[0])
    # both workers are fine and serve new passes
    with dist_autograd.context() as again:
        z = rpc.rpc_sync("worker1", my_add, (x, x))
        dist_autograd.backward(again, [z.sum()])
        torch.testing.assert_close(dist_autograd.get_gradients(again)[x], torch.full((4,), 2.0))
    rpc.api._barrier()
    return "ok"


def test_context_released_during_backward() -> None:
    """Releasing a context while its backward runs fails the pass with the reference's error,
    crashes nothing, and the workers keep serving new passes."""
    assert run_cluster(released_program, 2, timeout=60) == {0: "ok", 1: "served"}
