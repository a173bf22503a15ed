"""Tensor payloads over real sockets: echoed through another worker, they come back bit-exact."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

import distgrad.rpc as rpc
from tests._harness import run_workers
from tests._needs import needs
from tests._tensors import DTYPES, random_tensor, same_bits

pytestmark = pytest.mark.timeout(90)


def echo(x: object) -> object:
    return x


def describe(x: torch.Tensor) -> tuple[object, ...]:
    """What the callee sees of a tensor."""
    return (
        x.dtype,
        tuple(x.shape),
        x.stride() if x.layout == torch.strided else None,
        x.requires_grad,
        type(x).__name__,
        x.is_sparse,
    )


def same_object(a: object, b: object) -> bool:
    return a is b


def echo_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    peer = "worker1"
    # 64 MiB of random bytes, both ways, sync and async
    big = torch.randint(0, 256, (64 * 1024 * 1024,), dtype=torch.uint8)
    back = rpc.rpc_sync(peer, echo, (big,))
    assert back.dtype == torch.uint8 and back.shape == big.shape
    assert torch.equal(back, big), "64 MiB echo differs"
    assert back.data_ptr() != big.data_ptr()
    assert torch.equal(rpc.rpc_async(peer, echo, (big,)).wait(), big)
    del back
    # every dtype, bit for bit (NaN payloads included), plus 0-dim and empty
    for i, dtype in enumerate(DTYPES):
        for shape in ((33, 17), (), (0, 4)):
            x = random_tensor(dtype, shape, seed=i)
            y = rpc.rpc_sync(peer, echo, (x,))
            assert same_bits(x, y), (dtype, shape)
    # views: strides kept for transposes, values for everything
    base = torch.randn(64, 48, dtype=torch.float64)
    t = base.t()
    y = rpc.rpc_sync(peer, echo, (t,))
    assert torch.equal(y, t) and y.stride() == t.stride(), y.stride()
    assert rpc.rpc_sync(peer, describe, (t,))[2] == (1, 48)
    views = [base[::3, 1::5], base[7], base[:, 9], base[10:20], base.unsqueeze(0).expand(4, 64, 48)]
    for view in views:
        y = rpc.rpc_sync(peer, echo, (view,))
        assert y.shape == view.shape and torch.equal(y, view)
    expanded = torch.randn(5, 1).expand(5, 4096)
    y = rpc.rpc_sync(peer, echo, (expanded,))
    assert torch.equal(y, expanded) and y.stride() == (1, 0)
    # sparse COO, coalesced and not
    indices = torch.tensor([[0, 0, 2, 3], [1, 1, 0, 4]])
    raw = torch.sparse_coo_tensor(indices, torch.randn(4), (4, 5), check_invariants=True)
    for sparse in (raw, raw.coalesce()):
        y = rpc.rpc_sync(peer, echo, (sparse,))
        assert y.is_sparse and y.is_coalesced() == sparse.is_coalesced()
        assert torch.equal(y._indices(), sparse._indices())
        assert torch.equal(y.to_dense(), sparse.to_dense())
    # requires_grad, nn.Parameter
    leaf = torch.randn(3, requires_grad=True)
    dtype, shape, _stride, requires_grad, kind, _ = rpc.rpc_sync(peer, describe, (leaf,))
    assert (dtype, shape, requires_grad, kind) == (torch.float32, (3,), True, "Tensor")
    param = torch.nn.Parameter(torch.randn(2, 2))
    assert rpc.rpc_sync(peer, describe, (param,))[3:5] == (True, "Parameter")
    got = rpc.rpc_sync(peer, echo, (param,))
    assert isinstance(got, torch.nn.Parameter) and torch.equal(got.detach(), param.detach())
    # one tensor twice in a message stays one object, on the callee and back
    x = torch.randn(10)
    assert rpc.rpc_sync(peer, same_object, (x, x)) is True
    assert rpc.rpc_sync(peer, same_object, (x, x.clone())) is False
    a, b = rpc.rpc_sync(peer, echo, ((x, x),))
    assert a is b and torch.equal(a, x)
    # tensors inside nested containers and a module's state
    nested = {"a": [base, (leaf.detach(), "text")], "b": None, "c": {"k": x}}
    got = rpc.rpc_sync(peer, echo, (nested,))
    assert torch.equal(got["a"][0], base) and got["a"][1][1] == "text" and got["b"] is None
    assert torch.equal(got["c"]["k"], x)
    state = torch.nn.Linear(8, 3).state_dict()
    got = rpc.rpc_sync(peer, echo, (state,))
    assert list(got) == list(state) and all(torch.equal(got[k], state[k]) for k in state)
    # many tensors in one message
    many = [torch.full((i % 7,), float(i)) for i in range(1000)]
    got = rpc.rpc_sync(peer, echo, (many,))
    assert len(got) == 1000 and all(torch.equal(g, m) for g, m in zip(got, many, strict=True))
    return "ok"


def test_tensor_echo_is_bit_exact() -> None:
    """A 64 MiB tensor, every dtype (0-dim and empty too), non-contiguous and expanded views,
    sparse COO (coalesced or not), requires_grad, nn.Parameter, a tensor shared twice, nested
    containers and 1000 tensors in one message come back exactly as sent."""
    assert run_workers(echo_program, 2, timeout=75) == {0: "ok", 1: "served"}


def make_bytes(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def make_text(n: int) -> str:
    return "x" * n


def over_the_limit(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    too_big = 2 * 1024 * 1024
    with pytest.raises(RuntimeError, match="maximum message size"):
        rpc.rpc_sync("worker1", echo, (make_bytes(too_big),))
    assert rpc.rpc_sync("worker1", echo, ("small",)) == "small"  # the peer is still usable
    with pytest.raises(RuntimeError, match="maximum message size"):
        rpc.rpc_sync("worker1", make_bytes, (too_big,))
    assert rpc.rpc_sync("worker1", echo, ("small",)) == "small"
    # plain messages (a string: the lean paths) are held to the limit too, both ways
    with pytest.raises(RuntimeError, match="maximum message size"):
        rpc.rpc_sync("worker1", echo, ("x" * too_big,))
    with pytest.raises(RuntimeError, match="maximum message size"):
        rpc.rpc_sync("worker1", make_text, (too_big,))
    assert rpc.rpc_sync("worker1", echo, ("small",)) == "small"
    return "ok"


def test_message_above_the_maximum_fails_that_call_only() -> None:
    """A request or a response above max_message_size fails that call with an error naming
    the limit; the two workers keep talking afterwards."""
    results = run_workers(over_the_limit, 2, timeout=60, options={"max_message_size": 1024 * 1024})
    assert results == {0: "ok", 1: "served"}


def fetch_big_from(dst: str, n: int) -> str:
    """On the worker with the small limit: ask ``dst`` for ``n`` bytes; return the error."""
    try:
        rpc.rpc_sync(dst, make_bytes, (n,))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def fetch_text_from(dst: str, n: int) -> str:
    """As :func:`fetch_big_from`, for a plain result (a string)."""
    try:
        rpc.rpc_sync(dst, make_text, (n,))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def ask(dst: str, back: str) -> object:
    return rpc.rpc_sync(back, echo, ("back",))


def receiver_limit(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    too_big = 2 * 1024 * 1024
    # worker1 alone has the 1 MiB limit: it receives a request above it
    with pytest.raises(RuntimeError, match=r"maximum message size of worker worker1 \(rank 1\)"):
        rpc.rpc_sync("worker1", echo, (make_bytes(too_big),))
    # and a response above it
    assert "maximum message size" in rpc.rpc_sync("worker1", fetch_big_from, ("worker0", too_big))
    # the same with plain messages (a string: the lean paths)
    with pytest.raises(RuntimeError, match=r"maximum message size of worker worker1 \(rank 1\)"):
        rpc.rpc_sync("worker1", echo, ("x" * too_big,))
    assert "maximum message size" in rpc.rpc_sync("worker1", fetch_text_from, ("worker0", too_big))
    # both still talk, both ways
    assert rpc.rpc_sync("worker1", echo, ("small",)) == "small"
    assert rpc.rpc_sync("worker1", ask, ("worker1", "worker0")) == "back"
    return "ok"


def test_message_above_only_the_receivers_maximum() -> None:
    """With the limit set on the receiving worker only, an oversized request or response
    fails that call with an error naming the limit (each worker publishes its limit with its
    address, and senders check against it); both workers keep talking both ways."""
    results = run_workers(
        receiver_limit, 2, timeout=60, rank_options={1: {"max_message_size": 1024 * 1024}}
    )
    assert results == {0: "ok", 1: "served"}


def crossing_transfers(rank: int, world_size: int) -> str:
    peer = f"worker{1 - rank}"
    gen = torch.Generator().manual_seed(rank)
    sent = [
        torch.randint(0, 256, (8 * 1024 * 1024 + i,), dtype=torch.uint8, generator=gen)
        for i in range(4)
    ]
    small = [torch.randn(100) for _ in range(20)]
    futures = [rpc.rpc_async(peer, echo, (t,)) for t in sent]
    small_futures = [rpc.rpc_async(peer, echo, (t,)) for t in small]  # queued behind big ones
    for t, fut in zip(sent, futures, strict=True):
        assert torch.equal(fut.wait(), t)
    for t, fut in zip(small, small_futures, strict=True):
        assert torch.equal(fut.wait(), t)
    return "ok"


def test_large_transfers_crossing_both_ways_over_tcp() -> None:
    """Over TCP (Unix sockets off), both workers at once send four 8 MiB tensors and 20 small
    ones to the other and get them all back exactly (partial writes, queued frames, both
    directions busy)."""
    results = run_workers(crossing_transfers, 2, timeout=60, env={"DISTGRAD_UNIX_SOCKETS": "0"})
    assert results == {0: "ok", 1: "ok"}


def device_tensor(device: str) -> torch.Tensor:
    return torch.ones(3, device=device)


def device_tensors_refused(rank: int, world_size: int, device: str) -> str:
    if rank != 0:
        return "served"
    on_device = torch.ones(3, device=device)
    expected = (
        "TensorPipe RPC backend only supports CPU tensors by default, please move your tensors "
        "to CPU before sending them over RPC, or call `set_device_map` on "
        "`TensorPipeRpcBackendOptions` to explicitly configure device mapping. Request device "
        f"mapping is not available for destination worker1, but found tensor on device: {device}"
    )
    with pytest.raises(RuntimeError) as request_error:
        rpc.rpc_sync("worker1", echo, (on_device,))
    assert str(request_error.value) == expected.replace(f"{device}", str(on_device.device))
    with pytest.raises(RuntimeError, match="Response device mapping is not available for "
                       "destination worker0, but found tensor on device"):  # fmt: skip
        rpc.rpc_sync("worker1", device_tensor, (device,))
    # the peer and the connection are fine
    assert torch.equal(rpc.rpc_sync("worker1", echo, (torch.ones(3),)), torch.ones(3))
    return "ok"


def test_non_cpu_tensors_get_the_reference_error() -> None:
    """A tensor on another device (meta here; CUDA takes the same path) in a request or a
    response fails that call with the reference's CPU-only error; the peer keeps serving."""
    assert run_workers(device_tensors_refused, 2, kwargs={"device": "meta"})[0] == "ok"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_get_the_reference_error() -> None:
    """The same with a CUDA tensor (skipped without a GPU)."""
    assert run_workers(device_tensors_refused, 2, kwargs={"device": "cuda"})[0] == "ok"


def transport_statistics() -> dict[str, Any]:
    return dataclasses.asdict(rpc._get_current_rpc_agent().statistics())


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def direct_reads_program(rank: int, world_size: int) -> dict[str, int] | str:
    if rank != 0:
        return "served"
    mine, theirs = transport_statistics(), rpc.rpc_sync("worker1", transport_statistics)
    gen = torch.Generator().manual_seed(0)
    # past 4 MiB and past the default ring's limit (half its 8 MiB): by reference where reads work
    big = torch.randn((1 << 20) + 4096, generator=gen)
    small = torch.randn(100, generator=gen)  # inline
    view = torch.randn(2048, 600, generator=gen).t()  # 4.7 MiB, sent as the view it is
    back = rpc.rpc_sync("worker1", echo, ((big, small, [view]),))
    assert torch.equal(back[0], big) and torch.equal(back[1], small)
    assert torch.equal(back[2][0], view) and back[2][0].stride() == view.stride()
    back[0].add_(1)  # what came back is this worker's own copy
    assert not torch.equal(back[0], big)
    # many in flight at once, each reply computed from its own request
    inputs = [torch.full((1_100_000,), float(i)) for i in range(8)]
    futures = [rpc.rpc_async("worker1", double, (x,)) for x in inputs]
    for x, fut in zip(inputs, futures, strict=True):
        assert torch.equal(fut.wait(), x * 2)
    # the sender changes its tensor after the call completed: the receiver kept what it read
    big.zero_()
    assert torch.equal(rpc.rpc_sync("worker1", echo, (big,)), torch.zeros_like(big))
    after_mine, after_theirs = transport_statistics(), rpc.rpc_sync("worker1", transport_statistics)
    key = "bytes_read_directly"
    return {"worker0": after_mine[key] - mine[key], "worker1": after_theirs[key] - theirs[key]}


def _reads_possible() -> bool:
    """Whether sibling processes may read each other's memory here (Yama may forbid it)."""
    from distgrad._transport import _memory

    if not _memory.available():
        return False
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip() or 0)
    except OSError:
        return True
    return scope == 0 or (scope < 3 and os.geteuid() == 0)


NO_READS = "this host does not let sibling processes read each other's memory"


@pytest.mark.parametrize(
    "reads", [pytest.param("on", marks=needs(None if _reads_possible() else NO_READS)), "off"]
)
def test_large_tensors_between_same_host_workers_are_read_directly(reads: str) -> None:
    """Between workers on one host, tensors of 4 MiB and more that the shared-memory ring cannot
    hold are read from the sender's memory (one copy, not two through the socket): with that on,
    each worker read them directly; with DISTGRAD_CROSS_MEMORY=0 everything goes through the
    socket. Results are identical."""
    env = {"DISTGRAD_CROSS_MEMORY": "0"} if reads == "off" else {}
    results = run_workers(direct_reads_program, 2, timeout=60, env=env)
    assert results[1] == "served"
    read = results[0]
    assert isinstance(read, dict)
    if reads == "off":
        assert read == {"worker0": 0, "worker1": 0}
        return
    big, view, doubled = ((1 << 20) + 4096) * 4, 2048 * 600 * 4, 8 * 1_100_000 * 4
    # worker1 read the requests' tensors and worker0 the replies' (the small one went inline)
    assert read == {"worker0": 2 * big + view + doubled, "worker1": 2 * big + view + doubled}
