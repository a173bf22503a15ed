"""The pickler of the user's choice (``pickler=`` / torch's ``rpc.api._use_rpc_pickler``):
dill and cloudpickle carry lambdas, closures and ``__main__`` classes with tensors inside, the
tensors out of band (never copied into the pickle stream); RRefs keep their reducer; a pickler
that raises, returns garbage or lacks pickle's shape is refused when chosen; the default comes
back when the choice ends."""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest
import torch

import distgrad.rpc as rpc
from distgrad._testing._world import open_world, world_options
from distgrad._wire import _pickler
from distgrad._wire._choice import current_pickler, set_pickler
from distgrad.rpc.api import _use_rpc_pickler
from distgrad.rpc.internal import _internal_rpc_pickler, _InternalRPCPickler

dill = pytest.importorskip("dill")
cloudpickle = pytest.importorskip("cloudpickle")


def _main_class() -> type:
    """A class as a script's ``__main__`` defines it (plain pickle cannot send it)."""

    class Accumulator:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def total(self) -> float:
            return float(self.t.sum())

    Accumulator.__module__ = "__main__"
    Accumulator.__qualname__ = "Accumulator"
    return Accumulator


@pytest.fixture(autouse=True)
def default_pickler_after() -> Any:
    yield
    set_pickler(None)


@pytest.mark.parametrize("library", ["dill", "cloudpickle"])
def test_lambdas_closures_and_main_classes_travel_with_their_tensors_out_of_band(
    library: str,
) -> None:
    choice = {"dill": dill, "cloudpickle": cloudpickle}[library]
    set_pickler(choice)
    t = torch.randn(1 << 15)
    scale = 2.5
    cls = _main_class()
    cases = {
        "lambda": (lambda x: x + 1, t),
        "closure": (lambda x: x * scale, t),
        "main class": (cls, t),
    }
    for name, (fn, tensor) in cases.items():
        encoded = _pickler.encode((fn, (tensor,), {}))
        assert tensor.numpy().tobytes() not in encoded.meta, name  # not copied in the stream
        assert sum(b.raw().nbytes for b in encoded.buffers) == tensor.nbytes, name
        func, args, _ = _pickler.loads(
            encoded.meta, [b.raw() for b in encoded.buffers], encoded.flags
        )
        result = func(*args)
        want = cases[name][0](tensor)
        if name == "main class":
            assert result.total() == pytest.approx(want.total())
        else:
            assert torch.equal(result, want)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        set_pickler(None)
        _pickler.encode((lambda x: x, (t,), {}))  # the default pickler cannot


def test_a_chosen_pickler_runs_rpcs_with_rrefs_and_closures() -> None:
    """In a group whose workers chose dill: a closure as the called function, an RRef in the
    arguments (its reducer still forks it), results back; the default returns at shutdown."""
    options = world_options()
    options.pickler = dill
    offset = 10.0

    def body(rank: int) -> Any:
        if rank != 0:
            return None
        ref = rpc.remote("worker1", torch.add, (torch.ones(3), 1))
        return rpc.rpc_sync("worker1", lambda r: r.to_here() + offset, (ref,))

    with open_world(2, options=options) as world:
        assert current_pickler() is dill
        value = world.run(body)[0]
    assert current_pickler() is None
    assert torch.equal(value, torch.full((3,), 12.0))


class _Raising(pickle.Pickler):
    def dump(self, obj: Any) -> None:
        raise OSError("the disk is full")


class _Garbage:
    Pickler = pickle.Pickler

    class Unpickler(pickle.Unpickler):
        def load(self) -> Any:
            return {"text": "something else", "tensor": torch.zeros(1)}


def test_bad_picklers_are_refused_when_chosen() -> None:
    """A pickler that raises, one that gives back something else, and an object without
    pickle's shape are refused -- at ``init_rpc`` (the options) and by ``_use_rpc_pickler`` --
    with the cause; nothing is left chosen."""
    with pytest.raises(ValueError, match="failed a round trip: OSError"):
        set_pickler(type("M", (), {"Pickler": _Raising}))
    with pytest.raises(ValueError, match="did not give back what it pickled"):
        set_pickler(_Garbage)
    with pytest.raises(TypeError, match="pickle's shape"):
        set_pickler(object())
    options = world_options()
    options.pickler = _Garbage
    with pytest.raises(ValueError, match="did not give back"), open_world(1, options=options):
        pass
    assert current_pickler() is None


def test_torchs_use_rpc_pickler_takes_a_subclass_that_chooses_the_library() -> None:
    """torch's shape (``_InternalRPCPickler`` with ``_pickler(f)`` / ``_unpickler(f)``, as
    verl's backend uses): chosen inside the block, the default after it; a subclass that
    overrides ``serialize`` is refused, naming what to override instead."""

    class DillPickler(_InternalRPCPickler):
        def _pickler(self, f: io.BytesIO) -> Any:
            return dill.Pickler(f)

        def _unpickler(self, f: io.BytesIO) -> Any:
            return dill.Unpickler(f)

    chosen = DillPickler()
    with _use_rpc_pickler(chosen):
        assert current_pickler() is chosen
        assert rpc.api._default_pickler is chosen
        encoded = _pickler.encode((lambda: 1, (), {}))
        assert _pickler.loads(encoded.meta, [], encoded.flags)[0]() == 1
    assert current_pickler() is None and rpc.api._default_pickler is _internal_rpc_pickler
    with _use_rpc_pickler(_internal_rpc_pickler):
        assert current_pickler() is None

    class Overriding(_InternalRPCPickler):
        def serialize(self, obj: Any) -> tuple[bytes, list[torch.Tensor]]:
            return b"", []

    refused = pytest.raises(TypeError, match=r"overrides serialize\(\).*_pickler\(f\)")
    with refused, _use_rpc_pickler(Overriding()):
        pass
