"""One distributed autograd context as this worker sees it (:class:`DistAutogradContext`): the
send and recv functions its RPCs attached, the workers it talked to, the gradients accumulated
into it. The container that owns contexts is ``_context``'s."""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["DistAutogradContext"]


def _node(record: Any) -> Any:
    """The autograd node of an engine record (records carry it as ``.node``)."""
    return getattr(record, "node", record)


class DistAutogradContext:
    """One distributed autograd context on this worker.

    ``lock`` guards every mutable attribute. ``send_functions`` and ``recv_functions`` hold
    strong references: they keep the forward graph alive until the context is released.
    ``pass_state`` and ``last_pass_id`` belong to the backward engine; this class only stores
    them.
    """

    def __init__(self, context_id: int) -> None:
        self.context_id: int = context_id
        self.lock = threading.RLock()
        self.known_worker_ids: set[int] = set()
        self.send_functions: dict[int, Any] = {}
        self.recv_functions: dict[int, Any] = {}
        self.pass_state: Any = None
        self.last_pass_id: Any = None
        # id(variable) -> (variable, grad). Tensors compare elementwise, so a dict keyed by the
        # tensors themselves is only safe for lookups by the very same object; keying by id and
        # keeping the variable alive here makes identity explicit (and the id stable).
        self._grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # storages of first gradients stored without a copy (see accumulate_grad)
        self._kept_storages: set[int] = set()

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
        """Add ``grad`` to the gradient accumulated for ``variable`` (by identity).

        The first dense gradient is stored as it is when it is laid out as the variable is and
        owns its whole storage alone -- the usual case: the weight gradient of a linear layer
        is a transposed view of a transposed result, contiguous -- and copied otherwise: when
        its strides differ from the variable's (torch's layout contract), when it is a slice of
        a larger storage (it would keep that alive), or when another stored gradient shares its
        storage (the engine hands the same tensor to both inputs of an addition: modifying one
        stored gradient in place must not change the other). A sparse one is copied. Later
        gradients are added out of place: a stored gradient is never modified, so one handed
        out by :meth:`gradients` stays valid. Sparse and dense gradients mix freely; the sum
        is sparse only when both are.
        """
        self.accumulate_grads([(variable, grad)])

    def accumulate_grads(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """:meth:`accumulate_grad` for several ``(variable, grad)`` pairs under one lock. (No
        ``torch.no_grad()`` needed, and it would cost 5 µs a call: the gradients are detached,
        so nothing here is recorded.)"""
        with self.lock:
            grads = self._grads
            for variable, given in pairs:
                grad = given.detach() if given.requires_grad else given
                entry = grads.get(id(variable))
                if entry is None:
                    total = self._first(variable, grad)
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
        as torch's ``runGradCallbackForVariable`` does. Kept without a copy under the rules of
        :meth:`accumulate_grad` (a view of a DDP bucket, say, is copied)."""
        with self.lock:
            grads = self._grads
            for variable, given in pairs:
                if given is None:
                    grads.pop(id(variable), None)
                    continue
                grad = given.detach() if given.requires_grad else given
                grads[id(variable)] = (variable, self._first(variable, grad))

    def _first(self, variable: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """A variable's first stored gradient: ``grad`` itself where it may be kept, else a copy."""
        if grad.layout != torch.strided:
            return grad.clone()  # sparse: owns its indices and values
        if self._can_keep(variable, grad):
            self._kept_storages.add(grad.data_ptr())
            return grad
        return grad.clone(memory_format=torch.contiguous_format)

    def _can_keep(self, variable: torch.Tensor, grad: torch.Tensor) -> bool:
        if not grad.is_contiguous() or grad.stride() != variable.stride():
            return False
        storage = grad.untyped_storage()
        if storage.nbytes() != grad.numel() * grad.element_size():
            return False  # (so its data starts where its storage does)
        return storage.data_ptr() not in self._kept_storages

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
