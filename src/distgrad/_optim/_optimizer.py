"""``DistributedOptimizer``: one local optimizer per parameter owner, stepped over RPC with the
gradients of a distributed autograd context (SPEC 1.3).

What runs where: the constructor groups the parameter RRefs by owner and asks every owner at
once (``rpc_async``) to build a :class:`_LocalOptimizer` over its own parameters; the caller
keeps an RRef to each. ``step(context_id)`` asks every owner at once to step its optimizer with
the gradients that context accumulated on that owner. Errors come back with their original
type and message; when several owners fail, the last one seen is raised (as the reference).

The reference runs SGD, Adam and six other classes as TorchScript functional optimizers and
every other class through ``_LocalOptimizer``; distgrad always uses the ``_LocalOptimizer``
path, which is numerically the same (see :meth:`_LocalOptimizer.step` for the ``.grad``
details).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._autograd._context import CONTAINER
from .._autograd._hooks import GRAD_LOCK
from .._rpc._api import rpc_async
from .._rpc._core import WorkerInfo
from .._rpc._rrefs._rref import RRef

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """An optimizer over parameters this worker owns (lives on the owner, behind an RRef)."""

    # One lock for every local optimizer of the process: two optimizers may share tensors, and
    # ``.grad`` is set on every tensor of a context, not only on this optimizer's parameters.
    # The backward engine holds it too while it lends ``.grad`` to AccumulateGrad hooks.
    global_lock = GRAD_LOCK

    def __init__(
        self,
        optim_cls: type[torch.optim.Optimizer],
        local_params_rref: list[RRef[torch.Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self._local_params = [rref.local_value() for rref in local_params_rref]
        self.optim = optim_cls(self._local_params, *args, **kwargs)

    def step(self, autograd_ctx_id: int) -> None:
        """Apply the gradients of context ``autograd_ctx_id`` on this worker and step.

        As the reference's ``_LocalOptimizer``: under the process-wide lock, ``param.grad =
        grad`` for every tensor with a gradient in the context, then ``optim.step()``; the
        ``.grad`` attributes keep those gradients afterwards. Beyond the reference: this
        optimizer's parameters with *no* gradient in the context get ``.grad = None`` first, so a
        gradient left by an earlier step is never applied twice (the reference's functional
        path, its default for SGD, Adam, ..., skips such parameters too).
        """
        grads = CONTAINER.retrieve_context(autograd_ctx_id).gradients()
        with _LocalOptimizer.global_lock:
            for param in self._local_params:
                if param not in grads:
                    param.grad = None
            for param, grad in grads.items():
                param.grad = grad
            self.optim.step()


def _new_local_optimizer(
    optim_cls: type[torch.optim.Optimizer],
    local_params_rref: list[RRef[torch.Tensor]],
    *args: Any,
    **kwargs: Any,
) -> RRef[_LocalOptimizer]:
    return RRef(_LocalOptimizer(optim_cls, local_params_rref, *args, **kwargs))


def _local_optimizer_step(local_optim_rref: RRef[_LocalOptimizer], autograd_ctx_id: int) -> None:
    local_optim_rref.local_value().step(autograd_ctx_id)


def _wait_for_all(futures: list[torch.futures.Future[Any]]) -> list[Any]:
    """Wait for every future (even after one failed); raise the last exception seen."""
    exception: Exception | None = None
    results: list[Any] = []
    for future in futures:
        try:
            results.append(future.wait())
        except Exception as exc:
            results.append(exc)
            exception = exc
    if exception is not None:
        raise exception
    return results


class DistributedOptimizer:
    """Optimize parameters spread over workers: one ``optimizer_class`` instance per owner
    (torch's ``DistributedOptimizer``).

    Args:
        optimizer_class: any ``torch.optim.Optimizer`` subclass (``SGD``, ``Adam``, your own);
            it must be importable on the owners.
        params_rref: RRefs to the parameters to optimize (local or remote, e.g. from
            ``RemoteModule.remote_parameters()`` or ``[RRef(p) for p in local.parameters()]``).
        *args, **kwargs: passed to ``optimizer_class`` on each owner.

    ``step(context_id)`` applies, on every owner, the gradients that the distributed autograd
    context accumulated there. Steps from several trainers are serialized per owner, in no
    guaranteed order across owners (as the reference). Optimizer state (momentum, Adam's
    moments) lives on the owners and persists across steps. The constructor blocks until
    every owner has built its optimizer.

    Raises:
        Exception: what ``optimizer_class(params, *args, **kwargs)`` raised on an owner (e.g.
            ``ValueError: Invalid learning rate``), with its original type; the last one when
            several owners failed.
        PeerFailureError: an owner died while its optimizer was being built.

    Example:
        # The trainer, worker0; worker1 holds the layer and only serves.

        # on worker 0
        import torch
        import distgrad.autograd as dist_autograd
        import distgrad.rpc as rpc
        from distgrad.nn import RemoteModule
        from distgrad.optim import DistributedOptimizer

        rpc.init_rpc("worker0", rank=0, world_size=2)
        layer = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 1))
        opt = DistributedOptimizer(torch.optim.SGD, layer.remote_parameters(), lr=0.05)
        with dist_autograd.context() as context_id:
            loss = layer(torch.randn(8, 4)).pow(2).mean()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)  # SGD on worker1, with the context's gradients there
        rpc.shutdown()

        # on worker 1
        import distgrad.rpc as rpc

        rpc.init_rpc("worker1", rank=1, world_size=2)
        rpc.shutdown()

    Differences from torch: no TorchScript functional optimizers (numerically equivalent);
    parameters without a gradient in the stepped context are skipped even when an earlier
    step left their ``.grad`` set (the reference's ``_LocalOptimizer`` would apply it again).
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: Iterable[RRef[Any]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        per_worker: dict[WorkerInfo, list[RRef[Any]]] = {}
        for param in params_rref:
            per_worker.setdefault(param.owner(), []).append(param)
        self.optimizer_class = optimizer_class
        futures = [
            rpc_async(
                worker, _new_local_optimizer, args=(optimizer_class, rrefs, *args), kwargs=kwargs
            )
            for worker, rrefs in per_worker.items()
        ]
        self.remote_optimizers: list[RRef[_LocalOptimizer]] = _wait_for_all(futures)

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with the gradients of ``context_id`` (torch's
        ``DistributedOptimizer.step``); blocks until every owner is done.

        On each owner, under a process-wide lock, every parameter with a gradient in the
        context gets it as ``.grad`` (those without one get ``.grad = None``), then the local
        optimizer steps. The owners step concurrently.

        Args:
            context_id (int): the distributed autograd context whose gradients to apply; it
                must exist here and on every owner (it does on the owners that took part in
                the forward pass).

        Raises:
            RuntimeError: the context does not exist here or on an owner ("Could not find
                autograd context with id: N").
            Exception: what an owner's ``optimizer.step()`` raised, with its original type
                (the last one when several failed); the other owners still stepped.
            PeerFailureError: an owner died.

        Example:
            # on the trainer, after dist_autograd.backward(context_id, [loss]):
            opt.step(context_id)
        """
        CONTAINER.retrieve_context(context_id)  # raises for an unknown context
        futures = [
            rpc_async(optimizer.owner(), _local_optimizer_step, args=(optimizer, context_id))
            for optimizer in self.remote_optimizers
        ]
        _wait_for_all(futures)

    def __repr__(self) -> str:
        owners = ", ".join(rref.owner_name() for rref in self.remote_optimizers)
        return f"DistributedOptimizer({self.optimizer_class.__name__}, owners=[{owners}])"
