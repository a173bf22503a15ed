"""One distributed autograd context as this worker sees it (:class:`DistAutogradContext`): the
send and recv functions its RPCs attached, the workers it talked to, the gradients accumulated
into it. The container that owns contexts is ``_context``'s."""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

__all__ = ["DistAutogradContext"]


def _node(record: Any) -> Any:
    """The autograd node of an engine record (records carry it as ``.node``)."""
    return getattr(record, "node", record)


_storage_use_count: Any = getattr(torch._C, "_storage_Use_Count", None)
_counts = _storage_use_count is not None and hasattr(torch.Tensor, "_use_count")


def _uses(tensor: torch.Tensor) -> int:
    """How many C++ owners ``tensor``'s ``TensorImpl`` has (its Python object is one)."""
    return int(tensor._use_count())  # type: ignore[attr-defined]


def _storage_refs(tensor: torch.Tensor) -> int:
    """How many tensors (C++ ``TensorImpl``s) hold ``tensor``'s storage, counting the
    temporary storage object of this very call."""
    return int(_storage_use_count(tensor.untyped_storage()._cdata))


def _base_refs(view: torch.Tensor) -> int:
    """The Python references to ``view``'s base, counting this call's own."""
    return sys.getrefcount(view._base)


class _Alone:
    """The counts that mean "nothing else": measured once on fresh tensors through the very
    helpers that :func:`_taken` uses, so they follow torch's and CPython's bookkeeping
    instead of guessing it."""

    def __init__(self) -> None:
        fresh = torch.ones(2, 2)
        self.storage = _storage_refs(fresh)
        view = torch.ones(2, 2).t()
        self.view_storage = _storage_refs(view)
        self.base_uses = _uses(view._base)  # type: ignore[arg-type]
        self.base_refs = _base_refs(view)
        indices = torch.zeros(1, 1, dtype=torch.long)
        sparse = torch.sparse_coo_tensor(indices, torch.ones(1, 2), (2, 2), check_invariants=False)
        del indices
        self.sparse_part = _storage_refs(sparse._indices())


_ALONE: _Alone | None = None


def _alone() -> _Alone | None:
    global _ALONE
    if not _counts:
        return None  # (a torch without the counts: every first gradient is copied)
    if _ALONE is None:
        _ALONE = _Alone()
    return _ALONE


def _taken(grad: torch.Tensor, alone: _Alone) -> bool:
    """True if nothing but the caller's references reaches the dense ``grad``: one C++ owner
    (its Python object), and no tensor on its storage but itself and -- for a view -- its
    base, which nothing else references either."""
    if grad._use_count() != 1:  # type: ignore[attr-defined]
        return False
    if not grad._is_view():
        return int(_storage_use_count(grad.untyped_storage()._cdata)) == alone.storage
    base = grad._base
    assert base is not None
    if _uses(base) != alone.base_uses:
        return False
    del base
    return _base_refs(grad) == alone.base_refs and _storage_refs(grad) == alone.view_storage


def _calibrate_refs() -> tuple[int, int]:
    """The Python references, counted as the loops of
    :meth:`DistAutogradContext.accumulate_grads` count them, to a ``(variable, grad)`` pair
    that only its list refers to and to its gradient: measured in a loop of the same shape
    (so the interpreter's own bookkeeping is measured, not assumed)."""
    pairs = [(None, torch.zeros(1))]
    for pair in pairs:
        _variable, given = pair
        return sys.getrefcount(pair), sys.getrefcount(given)
    raise AssertionError("unreachable")


#: (references to a pair, to its gradient) when nothing but the caller's list holds them
_ALONE_REFS = _calibrate_refs()


def _first(variable: torch.Tensor, grad: torch.Tensor, owned: bool) -> torch.Tensor:
    """A variable's first stored gradient: ``grad`` itself where it may be taken over (``owned``:
    the caller holds the only Python reference), else a copy."""
    alone = _alone() if owned else None
    if grad.layout == torch.sparse_coo:
        return _first_sparse(grad, alone)
    if grad.layout != torch.strided:
        return grad.clone()
    if (
        alone is not None
        and grad.is_contiguous()
        and grad.stride() == variable.stride()
        # (whole storage: a slice would keep a larger storage alive)
        and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
        and _taken(grad, alone)
    ):
        return grad
    return grad.clone(memory_format=torch.contiguous_format)


def _first_sparse(grad: torch.Tensor, alone: _Alone | None) -> torch.Tensor:
    """A first sparse COO gradient: its indices and values taken over where they are
    contiguous and nothing else holds their storage (an embedding's gradient shares its
    indices with the lookup's index tensor, which the user holds), copied otherwise."""
    if alone is None or _uses(grad) != 1:
        return grad.clone()
    indices, values = grad._indices(), grad._values()
    kept_indices = indices.is_contiguous() and _storage_refs(indices) == alone.sparse_part
    kept_values = values.is_contiguous() and _storage_refs(values) == alone.sparse_part
    if kept_indices and kept_values:
        return grad
    return torch.sparse_coo_tensor(
        indices if kept_indices else indices.clone(),
        values if kept_values else values.clone(),
        grad.shape,
        is_coalesced=grad.is_coalesced(),
        check_invariants=False,
    )


class DistAutogradContext:
    """One distributed autograd context on this worker.

    ``lock`` guards every mutable attribute. ``send_functions`` and ``recv_functions`` hold
    strong references: they keep the forward graph alive until the context is released.
    ``pass_state`` and ``ended_passes`` belong to the backward engine; this class only stores
    them.
    """

    def __init__(self, context_id: int) -> None:
        self.context_id: int = context_id
        self.lock = threading.RLock()
        self.known_worker_ids: set[int] = set()
        self.send_functions: dict[int, Any] = {}
        self.recv_functions: dict[int, Any] = {}
        self.pass_state: Any = None
        self.ended_passes: set[Any] = set()  # the ids of the passes over on this context
        # id(variable) -> (variable, grad). Tensors compare elementwise, so a dict keyed by the
        # tensors themselves is only safe for lookups by the very same object; keying by id and
        # keeping the variable alive here makes identity explicit (and the id stable).
        self._grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- torch-compatible introspection (SPEC 1.2) ----------------------------------------------
    def _context_id(self) -> int:
        """This context's id."""
        return self.context_id

    def _send_functions(self) -> dict[int, Any]:
        """The send functions (autograd nodes), ordered by ascending autograd message id."""
        with self.lock:
            return {k: _node(v) for k, v in sorted(self.send_functions.items())}

    def _recv_functions(self) -> dict[int, Any]:
        """The recv functions (autograd nodes), ordered by ascending autograd message id."""
        with self.lock:
            return {k: _node(v) for k, v in sorted(self.recv_functions.items())}

    def _known_worker_ids(self) -> set[int]:
        """The workers that were sent an autograd message of this context (a copy)."""
        with self.lock:
            return set(self.known_worker_ids)

    # -- recording -------------------------------------------------------------------------------
    def add_send_function(self, msg_id: int, node: Any) -> None:
        """Remember the send function of autograd message ``msg_id``."""
        with self.lock:
            self.send_functions[msg_id] = node

    def add_recv_function(self, msg_id: int, rec: Any) -> None:
        """Remember the recv function (record) of autograd message ``msg_id``."""
        with self.lock:
            self.recv_functions[msg_id] = rec

    def add_known_worker(self, worker_id: int) -> None:
        """Note that an autograd message of this context went to ``worker_id``."""
        with self.lock:
            self.known_worker_ids.add(worker_id)

    # -- gradients -------------------------------------------------------------------------------
    def accumulate_grad(self, variable: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` to the gradient accumulated for ``variable`` (by identity). The caller
        keeps ``grad``, so a first gradient is stored as a copy (see :meth:`accumulate_grads`)."""
        self.accumulate_grads([(variable, grad)])

    def accumulate_grads(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add each ``(variable, grad)``'s gradient to the one accumulated for ``variable``,
        under one lock.

        A first gradient is taken over without a copy only when nothing but its pair in
        ``pairs`` can reach it (:func:`_taken`): no other Python reference, no other C++ owner,
        no other tensor on its storage, laid out as its variable (torch's layout contract) and
        owning its whole storage -- as torch's ``AccumulateGrad`` steals an unreferenced
        gradient. The engine's gradients usually are such (a linear layer's weight gradient is
        a transposed view of a transposed result); one that the user's code still holds (a
        custom ``Function``'s backward returning one tensor for two inputs, a hook that saved
        it) is copied, so a stored gradient never aliases a user's tensor or another stored
        gradient. A sparse gradient is taken over with the indices and values that nothing
        else shares, the others copied. Later gradients are added out of place: a stored
        gradient is never modified, so one handed out by :meth:`gradients` stays valid. Sparse
        and dense gradients mix freely; the sum is sparse only when both are. (No
        ``torch.no_grad()`` needed, and it would cost 5 us a call: the gradients are detached,
        so nothing here is recorded.)"""
        alone_refs = _ALONE_REFS
        with self.lock:
            grads = self._grads
            for pair in pairs:
                variable, given = pair
                # only the list holds the pair, only the pair the gradient (_calibrate_refs)
                owned = (
                    sys.getrefcount(pair) <= alone_refs[0]
                    and sys.getrefcount(given) <= alone_refs[1]
                    and not given.requires_grad
                )
                grad = given.detach() if given.requires_grad else given
                entry = grads.get(id(variable))
                if entry is None:
                    total = _first(variable, grad, owned)
                else:
                    old = entry[1]
                    # torch implements add(dense, sparse) but not add(sparse, dense).
                    total = grad + old if old.is_sparse and not grad.is_sparse else old + grad
                grads[id(variable)] = (variable, total)

    def grads_of(self, variables: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The gradients accumulated so far for ``variables``, by ``id`` (those that have one)."""
        with self.lock:
            grads = self._grads
            keys = [id(variable) for variable in variables]
            return {key: grads[key][1] for key in keys if key in grads}

    def replace_grads(self, pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Set (not add) the gradients of ``(variable, grad)`` pairs; None drops one. What an
        ``AccumulateGrad`` hook left in ``.grad`` (DDP's average) replaces the context's value,
        as torch's ``runGradCallbackForVariable`` does. Taken over without a copy under the
        rules of :meth:`accumulate_grads` (a view of a DDP bucket, say, is copied)."""
        alone_refs = _ALONE_REFS
        with self.lock:
            grads = self._grads
            for pair in pairs:
                variable, given = pair
                if given is None:
                    grads.pop(id(variable), None)
                    continue
                # only the list holds the pair, only the pair the gradient (_calibrate_refs)
                owned = (
                    sys.getrefcount(pair) <= alone_refs[0]
                    and sys.getrefcount(given) <= alone_refs[1]
                    and not given.requires_grad
                )
                grad = given.detach() if given.requires_grad else given
                grads[id(variable)] = (variable, _first(variable, grad, owned))

    def gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        """A snapshot of the accumulated gradients, keyed by the variable tensors themselves.

        Tensors hash by identity and dict lookups try ``is`` before ``==``, so looking up the
        original tensor object works, and equal-valued tensors stay distinct keys.
        """
        with self.lock:
            return dict(self._grads.values())

    @property
    def accumulated_grads(self) -> dict[torch.Tensor, torch.Tensor]:
        """Same as :meth:`gradients` (a snapshot; accumulate with :meth:`accumulate_grad`)."""
        return self.gradients()

    def __repr__(self) -> str:
        with self.lock:
            return (
                f"<DistAutogradContext id={self.context_id} "
                f"workers={sorted(self.known_worker_ids)} sends={len(self.send_functions)} "
                f"recvs={len(self.recv_functions)} grads={len(self._grads)} "
                f"backward={'running' if self.pass_state is not None else 'idle'}>"
            )
