"""Tensors as torch's RPC hands them over, side by side (issue 23, items 5 and 7): the same
program runs on ``torch.distributed.rpc`` and on ``distgrad.rpc`` (two workers each, over
sockets), and the tests compare what each observed -- the layout a view arrives with, which
received tensors share a storage, what a write through a received view reaches, and whether
a context's gradients alias each other or the user's tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distgrad.autograd
import distgrad.rpc
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(150)

Record = dict[str, Any]


def layout(*tensors: torch.Tensor) -> Record:
    """How tensors arrived: strides, offsets, storage sizes, values, which share a storage,
    lazy conjugate / negative bits."""
    pointers = [t.untyped_storage().data_ptr() for t in tensors]
    return {
        "bits": [(t.is_conj(), t.is_neg()) for t in tensors],
        "strides": [tuple(t.stride()) for t in tensors],
        "offsets": [t.storage_offset() for t in tensors],
        "storage_bytes": [t.untyped_storage().nbytes() for t in tensors],
        "values": [t.resolve_conj().resolve_neg().tolist() for t in tensors],
        "shared_with": [pointers.index(p) for p in pointers],
    }


def write_through(view: torch.Tensor, whole: torch.Tensor) -> Record:
    """Write through a received view; report what the other received tensor then holds."""
    view.fill_(-1)
    return {"whole_after": whole.tolist(), "view_after": view.tolist()}


def echo(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tensors


_kept: list[torch.Tensor] = []


class SameForBoth(torch.autograd.Function):
    """``a + b`` whose backward returns one tensor (kept by the user) for both inputs."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = grad * 2
        _kept.append(out)
        return out, out


def times(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


def program(rank: int, world_size: int, *, impl: str, port: int) -> Record:
    """One worker of the compared program (rank 0 calls, rank 1 serves)."""
    if impl == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
    else:
        dist_autograd = distgrad.autograd  # type: ignore[assignment]
        rpc = distgrad.rpc  # type: ignore[no-redef]
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    record: Record = {}
    if rank == 0:
        t = torch.arange(24.0).reshape(4, 6)
        big = torch.arange(4096.0).reshape(64, 64)  # 16 KiB
        complex_t = torch.complex(torch.arange(12.0), torch.arange(12.0) + 1).reshape(3, 4)
        cases = {
            "narrow": (t.narrow(1, 2, 2),),
            "views_and_base": (t.narrow(1, 2, 2), t.narrow(1, 0, 2), t),
            "base_then_views": (t, t[1], t.t()),
            "transposed": (t.t(),),
            "row": (t[1],),
            "expanded": (torch.ones(3, 1).expand(3, 5),),
            "big_narrow": (big.narrow(1, 2, 2),),
            "big_most_rows": (big[:40],),
            "big_every_other_row": (big[::2],),
            "big_transposed_window": (big[:20].t(),),
            "conjugate": (complex_t.conj(), complex_t.conj()[:, 1:3]),
            "negative": (complex_t.conj().imag,),
            "big_conjugate_slice": (torch.complex(big, big).conj()[:2],),
        }
        for name, tensors in cases.items():
            record[f"to_peer {name}"] = rpc.rpc_sync("worker1", layout, tensors)
            record[f"to_self {name}"] = rpc.rpc_sync("worker0", layout, tensors)
        returned = rpc.rpc_sync("worker1", echo, (t.narrow(1, 2, 2), t))
        record["returned"] = layout(*returned)
        for dst in ("worker0", "worker1"):
            record[f"write {dst}"] = rpc.rpc_sync(dst, write_through, (t.narrow(1, 2, 2), t))
        record["sender_after_writes"] = t.tolist()
        _kept.clear()
        with dist_autograd.context() as context_id:
            a = torch.ones(3, requires_grad=True)
            b = torch.ones(3, requires_grad=True)
            y = rpc.rpc_sync("worker1", times, (SameForBoth.apply(a, b), 3.0))
            dist_autograd.backward(context_id, [y.sum()])
            grads = dist_autograd.get_gradients(context_id)
            ga, gb, kept = grads[a], grads[b], _kept[0]
            record["one_grad_for_two"] = {
                "a_aliases_b": ga.data_ptr() == gb.data_ptr(),
                "a_is_kept": ga.data_ptr() == kept.data_ptr(),
                "b_is_kept": gb.data_ptr() == kept.data_ptr(),
                "values": [ga.tolist(), gb.tolist()],
            }
    rpc.shutdown()
    return record


_records: dict[str, Record] = {}


def record_of(impl: str) -> Record:
    if impl not in _records:
        _records[impl] = run_workers(program, 2, init=False, timeout=90, kwargs={"impl": impl})[0]
    return _records[impl]


@pytest.fixture(scope="module")
def both() -> tuple[Record, Record]:
    """What torch's RPC observed, then distgrad's."""
    return record_of("torch"), record_of("distgrad")


VIEW_CASES = [
    "narrow",
    "views_and_base",
    "base_then_views",
    "transposed",
    "row",
    "expanded",
    "big_narrow",
    "big_most_rows",
    "big_every_other_row",
    "big_transposed_window",
    "conjugate",
    "negative",
    "big_conjugate_slice",
]


@pytest.mark.parametrize("to", ["to_peer", "to_self"])
@pytest.mark.parametrize("case", VIEW_CASES)
def test_a_view_arrives_laid_out_as_torchs(both: tuple[Record, Record], to: str, case: str) -> None:
    """A view sent in a call (to a peer, and to this worker itself) arrives with torch's
    strides, storage offset, storage size and values, sharing a storage with the same other
    tensors of the message as torch's."""
    theirs, ours = (record[f"{to} {case}"] for record in both)
    assert ours == theirs


def test_a_returned_view_arrives_laid_out_as_torchs(both: tuple[Record, Record]) -> None:
    """A view and its base in a response arrive as torch's: strides, offset, one storage."""
    assert both[1]["returned"] == both[0]["returned"]


@pytest.mark.parametrize("dst", ["worker0", "worker1"])
def test_a_write_through_a_received_view_reaches_what_torchs_does(
    both: tuple[Record, Record], dst: str
) -> None:
    """A write through a received view shows in the message's other tensors on its storage
    (as in torch), and never in the sender's tensors."""
    assert both[1][f"write {dst}"] == both[0][f"write {dst}"]
    expected = torch.arange(24.0).reshape(4, 6).tolist()
    assert both[0]["sender_after_writes"] == both[1]["sender_after_writes"] == expected


def test_one_gradient_for_two_inputs_aliases_nothing_as_torchs(
    both: tuple[Record, Record],
) -> None:
    """A custom Function's backward returning one tensor for two inputs: neither context
    gradient aliases the other or the returned tensor, as in torch's context."""
    theirs, ours = (record["one_grad_for_two"] for record in both)
    assert ours == theirs
    assert not any(ours[key] for key in ("a_aliases_b", "a_is_kept", "b_is_kept"))
