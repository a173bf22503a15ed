"""``RemoteModule``: an ``nn.Module`` that lives on another worker (SPEC 1.4).

What runs where: the constructor sends ``_create_module`` to the owner with ``rpc.remote`` and
keeps the module's RRef; ``forward`` / ``forward_async`` send ``_remote_forward`` (a Python
function, so distributed autograd always records it: gradients flow back to the owner's
parameters); ``remote_parameters`` returns RRefs made on the owner, ready for
``DistributedOptimizer``. A creation error (``module_cls`` failed, or did not return a module)
is kept on the owner and raised by the first use, with its original type.

A RemoteModule pickles only through RPC (a reducer registered with the wire pickler carries the
worker, the device and a fork of the module's RRef), so it can be sent to a third worker and
used there; plain ``pickle`` / ``torch.save`` refuse it, as in the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .._rpc._api import get_worker_info, remote, rpc_async, rpc_sync
from .._rpc._core import current_agent, require_agent, rref_limit
from .._rpc._rrefs._rref import RRef
from .._wire._pickler import SKIPPED, extracting_tensors, register_reducer
from ._remote_device import parse_remote_device

__all__ = ["RemoteModule"]

#: nn.Module methods a RemoteModule refuses (the reference's list).
_UNSUPPORTED = (
    "register_buffer",
    "register_parameter",
    "add_module",
    "apply",
    "cuda",
    "ipu",
    "xpu",
    "cpu",
    "type",
    "float",
    "double",
    "half",
    "bfloat16",
    "to",
    "register_backward_hook",
    "register_forward_pre_hook",
    "register_forward_hook",
    "state_dict",
    "load_state_dict",
    "named_parameters",
    "buffers",
    "named_buffers",
    "children",
    "named_children",
    "modules",
    "named_modules",
    "requires_grad_",
    "zero_grad",
    "share_memory",
    "extra_repr",
)


# -- functions run on the owner ----------------------------------------------------------------
def _check_device(device: torch.device) -> None:
    """A clear error when the owner lacks the device (instead of torch's deep one from ``.to``)."""
    if device.type != "cuda":
        return
    me = get_worker_info().name
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"RemoteModule: worker {me} has no CUDA device (torch.cuda.is_available() is "
            f"False there), so the module cannot be placed on {device}"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise RuntimeError(
            f"RemoteModule: worker {me} has {count} CUDA device(s), so the module cannot be "
            f"placed on {device}"
        )


def _create_module(
    module_cls: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], device: str
) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}."
        )
    _check_device(torch.device(device))
    module.to(device)
    return module


def _remote_forward(
    module_rref: RRef[nn.Module],
    device: str,
    is_device_map_set: bool,
    *args: Any,
    **kwargs: Any,
) -> Any:
    module = module_rref.local_value()
    target = torch.device(device)
    if target.type == "cpu":
        return module(*args, **kwargs)

    # On an accelerator: inputs move to the module's device; without a device map only CPU
    # tensors may cross the wire, so outputs come back to the CPU (autograd follows both moves).
    def to_device(value: Any) -> Any:
        return value.to(target) if isinstance(value, torch.Tensor) else value

    def to_cpu(value: Any) -> Any:
        return value.cpu() if isinstance(value, torch.Tensor) else value

    args, kwargs = tree_map(to_device, (args, kwargs))
    out = module(*args, **kwargs)
    return out if is_device_map_set else tree_map(to_cpu, out)


def _param_rrefs(module_rref: RRef[nn.Module], recurse: bool) -> list[RRef[nn.Parameter]]:
    return [RRef(param) for param in module_rref.local_value().parameters(recurse)]


def _set_training(module_rref: RRef[nn.Module], mode: bool) -> None:
    module_rref.local_value().train(mode)


def _raise_not_supported(name: str) -> NoReturn:
    raise ValueError(f"Method ``{name}`` not supported for RemoteModule")


# -- the module ----------------------------------------------------------------------------------
class RemoteModule(nn.Module):
    """A module created on another worker; ``forward`` runs there (torch's ``RemoteModule``).

    Args:
        remote_device (str): ``"<worker_name>/<device>"`` or ``"rank:<rank>/<device>"``; the device
            is optional (default ``"cpu"``), e.g. ``"ps0"``, ``"ps0/cpu"``, ``"rank:1/cuda:0"``.
        module_cls (Callable): the class (or factory) of the module, called on the owner as
            ``module_cls(*args, **kwargs)``; it must be importable there.
        args (tuple, optional): positional arguments of ``module_cls``.
        kwargs (dict, optional): keyword arguments of ``module_cls``.
        _module_interface_cls: TorchScript interface (torch); must be ``None``.

    ``forward(*args, **kwargs)`` (and calling the module) blocks; ``forward_async`` returns a
    ``torch.futures.Future``. Inside a distributed autograd context both are recorded, so
    ``dist_autograd.backward`` reaches the owner's parameters; optimize them with
    ``DistributedOptimizer(optim_cls, rm.remote_parameters(), ...)``. Most other ``nn.Module``
    methods raise ``ValueError`` (as the reference). A RemoteModule can be passed to other
    workers in RPC arguments and results (it refers to the same module); Python ``pickle``
    refuses it.

    Raises:
        AssertionError: RPC is not initialized ("RemoteModule only works in RPC.").
        ValueError: ``remote_device`` names no worker (the expected forms are given).
        RuntimeError: no worker of that name or rank exists.
        NotImplementedError: ``_module_interface_cls`` was given (TorchScript cannot take
            distgrad's RRefs).
        Exception: (at the first use) what ``module_cls(*args, **kwargs)`` raised on the
            owner, with its original type; the constructor does not wait for the module.

    Example:
        # Two workers; the module lives on worker1.

        # on worker 0
        import torch
        import distgrad.rpc as rpc
        from distgrad.nn import RemoteModule

        rpc.init_rpc("worker0", rank=0, world_size=2)
        linear = RemoteModule("worker1/cpu", torch.nn.Linear, args=(20, 30))
        out = linear(torch.randn(128, 20))  # runs on worker1, shape (128, 30)
        fut = linear.forward_async(torch.randn(128, 20))
        out2 = fut.wait()
        rpc.shutdown()

        # on worker 1
        import distgrad.rpc as rpc

        rpc.init_rpc("worker1", rank=1, world_size=2)
        rpc.shutdown()

    Differences from torch: no TorchScript variant (``_module_interface_cls`` raises
    ``NotImplementedError``); the owner calls
    the module (``module(*args)``, so forward hooks registered on the owner run), not
    ``module.forward``; ``train(mode)`` honours ``mode`` and returns this RemoteModule (the
    reference always calls ``train()`` and returns a copy of the remote module); ``repr()``
    works (the reference's raises, through ``extra_repr``).
    """

    on: str | int
    device: str
    is_device_map_set: bool
    is_scriptable: bool
    module_rref: RRef[nn.Module]

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., Any],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        _module_interface_cls: Any = None,
    ) -> None:
        super().__init__()
        if _module_interface_cls is not None:
            raise rref_limit("RemoteModule with a TorchScript _module_interface_cls")
        self._prepare_init(remote_device)
        self.is_scriptable = False
        self.module_rref = remote(
            self.on,
            _create_module,
            (module_cls, tuple(args) if args is not None else (), dict(kwargs or {}), self.device),
        )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_reducer(cls, _reduce_remote_module)  # the pickler dispatches on exact types

    def _prepare_init(self, remote_device: str) -> None:
        if not current_agent() is not None:
            raise AssertionError("RemoteModule only works in RPC.")
        on, device = parse_remote_device(remote_device)
        if on is None:
            raise ValueError(
                f"remote_device {remote_device!r} names no worker: use "
                "'<workername>/<device>' or 'rank:<rank>/<device>'"
            )
        agent = require_agent()
        worker = agent.get_worker_info(on)  # an unknown worker fails here, as the reference
        self.on = on
        self.device = str(device)
        self.is_device_map_set = bool(agent.options.device_maps.get(worker.name))

    @staticmethod
    def init_from_module_rref(
        remote_device: str, module_rref: RRef[nn.Module], _module_interface_cls: Any = None
    ) -> RemoteModule:
        """A RemoteModule for a module that already exists on its owner (torch's
        ``RemoteModule.init_from_module_rref``): several RemoteModules, on several workers,
        may share one module (a parameter server's model, say).

        Args:
            remote_device (str): ``"<worker_name>/<device>"`` naming the RRef's owner.
            module_rref (RRef[nn.Module]): an RRef to the module, e.g. ``rpc.RRef(model)``
                made on the owner, or ``other.get_module_rref()``.
            _module_interface_cls: TorchScript interface (torch); must be ``None``.

        Returns:
            RemoteModule: calls go to the module ``module_rref`` refers to.

        Raises:
            NotImplementedError: ``_module_interface_cls`` was given (TorchScript cannot take
                distgrad's RRefs).
            AssertionError, ValueError, RuntimeError: as the constructor, for RPC not
                initialized and a bad ``remote_device``.

        Example:
            # defined on both workers, run on worker1 (the trainer):
            def train_with(model_rref):
                model = RemoteModule.init_from_module_rref("worker0/cpu", model_rref)
                return model(torch.randn(3, 4))  # runs on worker0


            # on the parameter server, worker0: share its model with the trainer
            model_rref = rpc.RRef(torch.nn.Linear(4, 2))
            rpc.rpc_sync("worker1", train_with, args=(model_rref,))
        """
        if _module_interface_cls is not None:
            raise rref_limit("RemoteModule with a TorchScript _module_interface_cls")
        module: RemoteModule = object.__new__(RemoteModule)
        nn.Module.__init__(module)
        module._prepare_init(remote_device)
        module.is_scriptable = False
        module.module_rref = module_rref
        return module

    # -- remote calls ----------------------------------------------------------------------------
    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future[Any]:
        """Run the module on its owner without waiting; a future of the result.

        The arguments travel to the owner (tensors moved to the module's device there), the
        owner calls ``module(*args, **kwargs)`` and the result comes back (moved to the CPU).
        Inside a distributed autograd context the call is recorded.

        Args:
            *args, **kwargs: the module's arguments.

        Returns:
            torch.futures.Future: completes with the module's output, or with the error it
            raised on the owner (original type).

        Example:
            fut = linear.forward_async(torch.randn(128, 20))
            out = fut.wait()
        """
        return rpc_async(
            self.module_rref.owner(),
            _remote_forward,
            (self.module_rref, self.device, self.is_device_map_set, *args),
            kwargs,
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module on its owner and return its output, blocking (also what calling the
        RemoteModule does).

        Args:
            *args, **kwargs: the module's arguments.

        Returns:
            The module's output (tensors on the CPU).

        Raises:
            Exception: what the module raised on the owner, with its original type.
            PeerFailureError: the owner died.

        Example:
            out = linear(torch.randn(128, 20))  # the same as linear.forward(...)
        """
        return self.forward_async(*args, **kwargs).wait()

    def remote_parameters(self, recurse: bool = True) -> list[RRef[nn.Parameter]]:
        """RRefs to the module's parameters, on its owner (for ``DistributedOptimizer``).

        Args:
            recurse (bool): include the parameters of submodules (as
                ``nn.Module.parameters``).

        Returns:
            list[RRef[nn.Parameter]]: one RRef per parameter, owned by the module's worker.

        Example:
            opt = DistributedOptimizer(torch.optim.SGD, linear.remote_parameters(), lr=0.05)
        """
        return rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))  # type: ignore[no-any-return]

    def get_module_rref(self) -> RRef[nn.Module]:
        """The RRef to the module on its owner.

        Returns:
            RRef[nn.Module]: usable for ``init_from_module_rref`` on other workers, or for
            ``rref.rpc_sync().method(...)`` calls on the module itself.
        """
        return self.module_rref

    def train(self, mode: bool = True) -> RemoteModule:
        """Set the remote module's training mode, on its owner.

        Args:
            mode (bool): ``True`` for training, ``False`` for evaluation.

        Returns:
            RemoteModule: this RemoteModule (torch's returns a copy of the remote module).

        Raises:
            ValueError: ``mode`` is not a ``bool``.
        """
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        rpc_sync(self.module_rref.owner(), _set_training, (self.module_rref, mode))
        self.training = mode
        return self

    def eval(self) -> RemoteModule:
        """Set the remote module to evaluation mode: ``train(False)``.

        Returns:
            RemoteModule: this RemoteModule.
        """
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Not supported for RemoteModule, as in torch: the parameters live on the owner.

        Args:
            recurse (bool): ignored.

        Raises:
            ValueError: always; use :meth:`remote_parameters`.
        """
        raise ValueError(
            "Method ``parameters`` not supported for RemoteModule. Please use "
            "``remote_parameters`` instead."
        )

    # -- pickling ----------------------------------------------------------------------------------
    def __reduce_ex__(self, protocol: Any) -> Any:
        if extracting_tensors():  # a device-aware future looking for tensors: none here
            return SKIPPED
        return super().__reduce_ex__(protocol)

    def __getstate__(self) -> NoReturn:
        raise RuntimeError(
            "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled "
            "when using RPC"
        )

    def __setstate__(self, state: Any) -> NoReturn:
        raise RuntimeError(
            "Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled "
            "when using RPC"
        )

    def __repr__(self) -> str:
        rref = self.__dict__.get("module_rref")
        return (
            f"{type(self).__name__}(on={self.__dict__.get('on')!r}, "
            f"device={self.__dict__.get('device')!r}, module_rref={rref})"
        )


def _unsupported(name: str) -> Callable[..., NoReturn]:
    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> NoReturn:
        _raise_not_supported(name)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = "Not supported for RemoteModule (raises ``ValueError``), as in torch."
    return method


for _name in _UNSUPPORTED:
    setattr(RemoteModule, _name, _unsupported(_name))


# -- pickling through RPC ------------------------------------------------------------------------
def _reduce_remote_module(module: RemoteModule) -> tuple[Any, tuple[Any, ...]]:
    state = module.__dict__
    return _rebuild_remote_module, (
        type(module),
        state["on"],
        state["device"],
        state["is_device_map_set"],
        state["is_scriptable"],
        state.get("training", True),
        state["module_rref"],  # pickled by the same pickler: a fork of the RRef
    )


def _rebuild_remote_module(
    cls: type[RemoteModule],
    on: str | int,
    device: str,
    is_device_map_set: bool,
    is_scriptable: bool,
    training: bool,
    module_rref: RRef[nn.Module],
) -> RemoteModule:
    module: RemoteModule = object.__new__(cls)
    nn.Module.__init__(module)
    module.on = on
    module.device = device
    module.is_device_map_set = is_device_map_set
    module.is_scriptable = is_scriptable
    module.training = training
    module.module_rref = module_rref
    return module


register_reducer(RemoteModule, _reduce_remote_module)
