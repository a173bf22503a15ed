"""The allow-list: what a worker lets its peers make it unpickle and run (off by default).

torch's RPC (and distgrad without an allow-list) lets any member of the group -- anyone who
holds the cluster secret -- run any function on any other member and unpickle any class there
(CVE-2024-5480: ``eval`` over RPC). A worker given an allow-list (``allowed_calls`` /
``allowed_classes`` in its options, or ``DISTGRAD_ALLOWED_CALLS`` / ``DISTGRAD_ALLOWED_CLASSES``)
enforces it on everything it receives:

* **Unpickling** (:class:`Guard.find_class`): every global a pickle stream names -- functions,
  classes, the callables its REDUCE opcodes call -- must be allowed *before* its module is
  imported: a module that is neither loaded already nor under an allowed name is never
  imported. A global is allowed when it is one of distgrad's own (the message layers'
  functions and classes), a torch value or rebuild function from a short fixed list, a safe
  builtin (containers, exception classes), or named by the worker's lists. ``getattr`` (which
  pickle uses for methods, e.g. ``torch.add``) is replaced by one that refuses dunder names and
  returns only what is itself allowed. Module objects are never returned.
* **Calling** (:meth:`Guard.check_call`): the function a request asks to run must be one of
  distgrad's internal handlers (private functions of its message layers) or named by
  ``allowed_calls``.

A rule is a callable or class (its own module and qualified name), a dotted name
(``"pkg.mod.func"``, ``"torch.add"``; checked to exist when the guard is made), or a prefix
``"pkg.*"`` (everything defined in ``pkg`` and its submodules). A refusal raises
:class:`RefusedError`, which names the global and the rule; the serving side answers it as the
call's error and keeps the connection.

A pickler that sends code by value (dill, cloudpickle: lambdas, closures, ``__main__``) is at
odds with an allow-list: such code is rebuilt by the pickler's own functions, which are refused
unless listed -- and listing them allows any code.
"""

from __future__ import annotations

import builtins
import collections
import importlib
import sys
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._errors import DistgradError

__all__ = ["Guard", "RefusedError", "qualified_name"]

#: distgrad's modules whose functions and classes travel in its own messages
_INTERNAL_PREFIXES = (
    "distgrad._wire.",
    "distgrad._devices.",
    "distgrad._rpc.",
    "distgrad._autograd.",
    "distgrad._optim.",
    "distgrad._nn.",
    "distgrad._profiler.",
    "distgrad._observe.",
    "distgrad.rpc.",
    "distgrad.autograd.",
    "distgrad.nn.",
    "distgrad.optim.",
)
_SAFE_BUILTINS = frozenset(
    {
        "object", "set", "frozenset", "list", "dict", "tuple", "slice", "range", "complex",
        "bytearray", "bytes", "str", "int", "float", "bool", "NotImplemented", "Ellipsis",
    }
)  # fmt: skip
_SAFE_GLOBALS = frozenset(
    {
        ("copyreg", "_reconstructor"),
        ("copyreg", "__newobj__"),
        ("copyreg", "__newobj_ex__"),
        ("collections", "OrderedDict"),
        ("collections", "deque"),
        ("collections", "Counter"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch", "Tensor"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
    }
)
_TORCH_VALUES = (torch.dtype, torch.device, torch.layout, torch.memory_format)


class RefusedError(DistgradError):
    """A peer's message named something this worker's allow-list does not allow."""


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a function or class as pickle names it (a bound method: its
    function's)."""
    obj = getattr(obj, "__func__", obj)
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return f"{module}.{name}" if module else str(name)


def _is_internal(name: str) -> bool:
    return name.startswith(_INTERNAL_PREFIXES)


class _Rules:
    """Names and prefixes of one list, checked to exist."""

    def __init__(self, entries: Iterable[Any], what: str) -> None:
        self.names: set[str] = set()
        self.prefixes: list[str] = []
        #: classes that hold an allowed builtin method (``torch.add`` is pickled as
        #: ``getattr(torch._C._VariableFunctionsClass, "add")``): loadable for that lookup
        self.holders: list[Any] = []
        for entry in entries:
            if isinstance(entry, str):
                self._add_text(entry.strip(), what)
            elif callable(entry):
                self._add_object(entry)
            else:
                raise TypeError(f"{what}: {entry!r} is neither a callable, a class nor a name")

    def _add_text(self, text: str, what: str) -> None:
        if not text:
            return
        if text.endswith(".*"):
            module = text[:-2]
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ValueError(
                    f"{what} names {text!r}, but {module!r} cannot be imported: {exc}"
                ) from exc
            self.prefixes.append(module + ".")
            return
        self._add_object(_resolve(text, what))
        self.names.add(text)

    def _add_object(self, obj: Any) -> None:
        self.names.add(qualified_name(obj))
        if isinstance(obj, type):
            return
        try:  # pickle's own reduction: a method found by getattr on the class that holds it
            reduced = obj.__reduce_ex__(5)
        except Exception:
            return
        if isinstance(reduced, tuple) and len(reduced) == 2 and reduced[0] is getattr:
            holder = reduced[1][0]
            if isinstance(holder, type):
                self.holders.append(holder)

    def match(self, name: str, module: str) -> bool:
        return name in self.names or (module + ".").startswith(tuple(self.prefixes))

    def may_import(self, module: str) -> bool:
        if (module + ".").startswith(tuple(self.prefixes)):
            return True
        return any(name.startswith(module + ".") for name in self.names)


def _resolve(text: str, what: str) -> Any:
    parts = text.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            break
        if isinstance(obj, types.ModuleType):
            break
        return obj
    raise ValueError(f"{what} names {text!r}, which does not exist (or is a module: use 'pkg.*')")


class Guard:
    """One worker's allow-list (see the module's docstring)."""

    def __init__(self, calls: Iterable[Any] = (), classes: Iterable[Any] = ()) -> None:
        self.calls = _Rules(calls, "allowed_calls")
        self.classes = _Rules(classes, "allowed_classes")
        self._lock = threading.Lock()
        #: refusals so far, by the name refused
        self.refused: collections.Counter[str] = collections.Counter()

    def __repr__(self) -> str:
        return (
            f"Guard(calls={sorted(self.calls.names)}+{self.calls.prefixes}, "
            f"classes={sorted(self.classes.names)}+{self.classes.prefixes})"
        )

    def refuse(self, name: str, why: str) -> RefusedError:
        with self._lock:
            self.refused[name] += 1
        return RefusedError(
            f"refused {why} {name}: not in this worker's allow-list (allowed_calls / "
            "allowed_classes in its options, or DISTGRAD_ALLOWED_CALLS / DISTGRAD_ALLOWED_CLASSES)"
        )

    # -- unpickling ------------------------------------------------------------------------------
    def find_class(self, module: str, name: str, load: Callable[[str, str], Any]) -> Any:
        """What an unpickler's ``find_class(module, name)`` returns under this guard;
        ``load`` is the unpickler's own lookup."""
        full = f"{module}.{name}"
        if module == "builtins" and name == "getattr":
            return self._getattr
        if (module, name) in _SAFE_GLOBALS:
            return load(module, name)
        if module == "builtins":
            obj = getattr(builtins, name, None)
            if name in _SAFE_BUILTINS or (isinstance(obj, type) and issubclass(obj, BaseException)):
                return obj
            raise self.refuse(full, "to unpickle")
        if not (
            module in sys.modules
            or _is_internal(module + ".")
            or self.calls.may_import(module)
            or self.classes.may_import(module)
        ):
            raise self.refuse(full, "to import for")
        obj = load(module, name)
        if not self.allowed(obj, full):
            raise self.refuse(full, "to unpickle")
        return obj

    def allowed(self, obj: Any, full: str | None = None) -> bool:
        """Whether a peer may make this worker build or call ``obj``."""
        if isinstance(obj, types.ModuleType):
            return False
        if isinstance(obj, _TORCH_VALUES):
            return True
        if isinstance(obj, type) and issubclass(obj, BaseException):
            return True  # (an error reply's type: building an exception runs no peer's code)
        name = qualified_name(obj)
        module = getattr(getattr(obj, "__func__", obj), "__module__", None) or ""
        if _is_internal(name):
            return True
        for rules in (self.calls, self.classes):
            if rules.match(name, module) or (full is not None and full in rules.names):
                return True
            if any(obj is holder for holder in rules.holders):
                return True
        return False

    def _getattr(self, target: Any, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise self.refuse(f"{qualified_name(target)}.{attribute}", "to look up")
        value = getattr(target, attribute)
        if not self.allowed(value, f"{qualified_name(target)}.{attribute}"):
            raise self.refuse(f"{qualified_name(target)}.{attribute}", "to unpickle")
        return value

    # -- calling ---------------------------------------------------------------------------------
    def check_call(self, func: Any) -> None:
        """Raise :class:`RefusedError` unless a peer may ask this worker to run ``func``."""
        target = getattr(func, "_wrapped_async_rpc_function", func)
        name = qualified_name(target)
        module = getattr(getattr(target, "__func__", target), "__module__", None) or ""
        if _is_internal(name) and name.rsplit(".", 1)[-1].startswith("_"):
            return  # one of distgrad's own handlers
        if self.calls.match(name, module):
            return
        raise self.refuse(name, "to run")
