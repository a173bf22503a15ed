"""The pickler of the user's choice and the allow-list's unpicklers (``set_pickler``,
``set_guard``), for the tensor-aware pickler (``_pickler``).

A process pickles its messages with its chosen pickler (any object with pickle's shape: dill
and cloudpickle carry lambdas, closures and ``__main__`` classes) and unpickles every received
stream with that pickler's Unpickler, guarded by the allow-list (``_guard``) if it has one.
The default -- C ``pickle``, no allow-list -- costs one attribute read per message.
"""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch

from ._guard import Guard

__all__ = [
    "OWN_REDUCERS",
    "ChosenPicklers",
    "current_guard",
    "current_pickler",
    "fresh",
    "restricted_loads",
    "set_guard",
    "set_pickler",
    "state",
]

#: distgrad's own reducers of each kind of stream (without copyreg's), filled by ``_pickler``:
#: layered over a chosen pickler's own table
OWN_REDUCERS: dict[str, dict[type, Callable[[Any], Any]]] = {
    "payload": {},
    "table": {},
    "routed": {},
}


def fresh(
    kind: type[pickle.Pickler],
) -> tuple[io.BytesIO, list[pickle.PickleBuffer], pickle.Pickler]:
    """A new pickler of ``kind`` (protocol 5) over a new file, collecting its out-of-band
    buffers."""
    file = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    return file, buffers, kind(file, protocol=5, buffer_callback=buffers.append)


class ChosenPicklers:
    """Picklers derived from a user's choice (:func:`set_pickler`): its ``Pickler`` class with
    distgrad's reducers layered over its own table, fresh for each message. Tensors still go
    out of band (protocol 5), RRefs and distgrad's objects keep their reducers."""

    def __init__(self, base: type[pickle.Pickler]) -> None:
        inherited = getattr(base, "dispatch_table", None) or copyreg.dispatch_table

        def derive(kind: str) -> type[pickle.Pickler]:
            table = collections.ChainMap(OWN_REDUCERS[kind], inherited)
            return type(f"_Chosen{kind.title()}Pickler", (base,), {"dispatch_table": table})

        self.payload, self.inline, self.routed = (derive(k) for k in ("payload", "table", "routed"))

    def acquire(
        self, table: bool
    ) -> tuple[io.BytesIO, list[pickle.PickleBuffer], pickle.Pickler, bool]:
        return (*fresh(self.inline if table else self.payload), False)

    def release(self) -> None:
        """(Nothing is reused.)"""

    def release_table(self) -> None:
        """(Nothing is reused.)"""


class _Choice:
    """This process's picklers: the default ones, or a user's (``set_pickler``), and the
    unpickler every received stream goes through (guarded by an allow-list, ``set_guard``)."""

    choice: Any = None
    picklers: ChosenPicklers | None = None
    unpickler_base: type[pickle.Unpickler] = pickle.Unpickler
    #: ``None``: plain ``pickle.loads`` (the default's fast path)
    unpickler: type[pickle.Unpickler] | None = None
    table_unpickler: type[pickle.Unpickler] = pickle.Unpickler
    guard: Guard | None = None


state = _Choice()


def _classes_of(choice: Any) -> tuple[type[pickle.Pickler], type[pickle.Unpickler]]:
    """The Pickler and Unpickler classes of a pickler choice: a module or object with pickle's
    shape (``Pickler`` and, optionally, ``Unpickler`` classes: pickle, dill, cloudpickle), or
    an object whose ``_pickler(f)`` / ``_unpickler(f)`` make them (torch's
    ``_InternalRPCPickler`` subclasses, as in pytorch/pytorch#153808)."""
    pickler_cls: Any = getattr(choice, "Pickler", None)
    unpickler_cls: Any = getattr(choice, "Unpickler", None) or pickle.Unpickler
    make = getattr(choice, "_pickler", None)
    if pickler_cls is None and callable(make):
        pickler_cls = type(make(io.BytesIO()))
        unmake = getattr(choice, "_unpickler", None)
        if callable(unmake):
            unpickler_cls = type(unmake(io.BytesIO(pickle.dumps(None))))
    shaped = (
        isinstance(pickler_cls, type)
        and callable(getattr(pickler_cls, "dump", None))
        and isinstance(unpickler_cls, type)
        and callable(getattr(unpickler_cls, "load", None))
    )
    if not shaped:
        raise TypeError(
            "the RPC pickler must have pickle's shape -- a Pickler class (and optionally an "
            "Unpickler class), as the pickle, dill and cloudpickle modules have, or "
            f"_pickler(f) / _unpickler(f) methods -- got {choice!r}"
        )
    return pickler_cls, unpickler_cls


def set_pickler(choice: Any) -> Any:
    """Pickle this process's messages with ``choice`` (``None`` or ``pickle``: the default);
    return the previous choice. Checked by a round trip of a dict holding a tensor: a pickler
    that raises or returns something else is refused here, with the cause."""
    previous = state.choice
    if choice is None or choice is pickle:
        state.choice, state.picklers, state.unpickler_base = None, None, pickle.Unpickler
    else:
        pickler_cls, unpickler_cls = _classes_of(choice)
        picklers = ChosenPicklers(pickler_cls)
        probe = {"tensor": torch.arange(4.0), "text": "probe"}
        try:
            file, buffers, pickler = fresh(picklers.inline)
            pickler.dump(probe)
            back = unpickler_cls(io.BytesIO(file.getvalue()), buffers=buffers).load()
            ok = back["text"] == "probe" and torch.equal(back["tensor"], torch.arange(4.0))
        except Exception as exc:
            raise ValueError(f"the RPC pickler {choice!r} failed a round trip: {exc!r}") from exc
        if not ok:
            raise ValueError(f"the RPC pickler {choice!r} did not give back what it pickled")
        state.choice, state.picklers, state.unpickler_base = choice, picklers, unpickler_cls
    _derive_unpicklers()
    return previous


def current_pickler() -> Any:
    """The choice :func:`set_pickler` made (``None``: the default)."""
    return state.choice


def set_guard(guard: Guard | None) -> None:
    """Check every stream this process receives against ``guard`` (``None``: no allow-list)."""
    state.guard = guard
    _derive_unpicklers()


def current_guard() -> Guard | None:
    """The allow-list received streams are checked against, if any."""
    return state.guard


def _guarded(base: type[pickle.Unpickler], guard: Guard) -> type[pickle.Unpickler]:
    class _Guarded(base):  # type: ignore[valid-type,misc]
        def find_class(self, module: str, name: str) -> Any:
            return guard.find_class(module, name, super().find_class)

    return _Guarded


def _derive_unpicklers() -> None:
    guard, base = state.guard, state.unpickler_base
    if guard is None:
        state.unpickler = None if base is pickle.Unpickler else base
        state.table_unpickler = pickle.Unpickler
    else:
        state.unpickler = _guarded(base, guard)
        state.table_unpickler = _guarded(pickle.Unpickler, guard)


def restricted_loads(data: bytes) -> Any:
    """``pickle.loads(data)`` of something a peer sent outside a message's payload (an error
    reply's exception type), under this process's allow-list if it has one."""
    guard = state.guard
    if guard is None:
        return pickle.loads(data)
    return _guarded(pickle.Unpickler, guard)(io.BytesIO(data)).load()
