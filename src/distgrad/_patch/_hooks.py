"""One import hook (a ``sys.meta_path`` finder) for the switch, standard library only:

- *aliases*: a torch module name that is distgrad's (``torch.distributed.rpc.api`` ->
  ``distgrad.rpc.api``) imports distgrad's module and binds it under torch's name too, the
  same module object, so ``import``, ``from ... import`` and attribute access all agree;
- *after-import fixups*: when a torch module finishes loading (``torch`` itself,
  ``torch.distributed.optim``, ...), a callback runs on it.
"""

from __future__ import annotations

# Imported at interpreter start-up when the variable is set: only modules every interpreter
# has loaded by then (importlib.abc and typing would cost tens of milliseconds here).
import _thread
import importlib
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    Callback = Callable[[ModuleType], None]

__all__ = ["after_import", "alias"]


class _AliasLoader:
    """Loads a torch name as an already-imported distgrad module (no code runs)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped torch's name on __spec__: the module keeps its own
        module.__spec__ = self.spec


class _Finder:
    """The ``sys.meta_path`` finder (a MetaPathFinder by protocol)."""

    def __init__(self) -> None:
        self.lock = _thread.RLock()
        self.exact: dict[str, str] = {}
        self.prefixes: dict[str, str] = {}
        self.after: dict[str, list[Callback]] = {}

    def target(self, fullname: str) -> str | None:
        """distgrad's name for ``fullname``, or ``None`` when it is not an alias."""
        target = self.exact.get(fullname)
        if target is not None:
            return target
        for prefix, replacement in self.prefixes.items():
            if fullname.startswith(prefix):
                return replacement + fullname[len(prefix) :]
        return None

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        name = self.target(fullname)
        if name is not None:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as error:
                if error.name != name:
                    raise
                raise ModuleNotFoundError(
                    f"No module named {fullname!r}: distgrad stands in for torch's RPC in this "
                    f"process (DISTGRAD_PATCH_TORCH / distgrad.patch_torch()) and has no "
                    f"{name!r} (docs/libraries.md)",
                    name=fullname,
                ) from None
            return ModuleSpec(fullname, _AliasLoader(module))  # type: ignore[arg-type]
        with self.lock:
            callbacks = self.after.pop(fullname, None)
        if callbacks is None:
            return None
        spec = _find_elsewhere(self, fullname, path, target)
        loader = spec.loader if spec is not None else None
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            with self.lock:  # not a loader we can follow: try again at the next import
                self.after.setdefault(fullname, []).extend(callbacks)
            return spec
        _run_after(loader, callbacks)
        return spec


def _find_elsewhere(
    finder: _Finder, fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> ModuleSpec | None:
    """The spec the other finders give (what the import would have used without us)."""
    for other in list(sys.meta_path):
        find = getattr(other, "find_spec", None)
        if other is finder or find is None:
            continue
        spec: ModuleSpec | None = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _run_after(loader: Any, callbacks: list[Callback]) -> None:
    """Make ``loader`` run ``callbacks`` on the module once it has loaded it (once)."""
    original = loader.exec_module

    def exec_module(module: ModuleType) -> None:
        try:
            original(module)
        finally:
            try:
                del loader.exec_module  # the loader is itself again
            except AttributeError:
                pass
        for callback in callbacks:
            callback(module)

    loader.exec_module = exec_module


_finder = _Finder()
_install_lock = _thread.allocate_lock()


def _install() -> None:
    with _install_lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def _loaded(name: str) -> ModuleType | None:
    """``sys.modules[name]`` once it has finished loading, else ``None``."""
    module = sys.modules.get(name)
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None
    return module


def after_import(name: str, callback: Callback) -> None:
    """Run ``callback(module)`` when module ``name`` has been imported (now if it has)."""
    module = _loaded(name)
    if module is not None:
        callback(module)
        return
    with _finder.lock:
        _finder.after.setdefault(name, []).append(callback)
    _install()


def alias(exact: dict[str, str], prefixes: dict[str, str]) -> None:
    """From now on, importing a torch name in ``exact`` (or under a prefix in ``prefixes``)
    gives distgrad's module of the mapped name."""
    with _finder.lock:
        _finder.exact.update(exact)
        _finder.prefixes.update(prefixes)
    _install()


def target(fullname: str) -> str | None:
    """distgrad's module name for torch's ``fullname`` once aliased, else ``None``."""
    return _finder.target(fullname)
