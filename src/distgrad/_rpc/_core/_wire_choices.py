"""What an agent's options choose for the wire, for the whole process: the pickler
(``pickler=``) and the allow-list (``allowed_calls`` / ``allowed_classes``, or the
environment). Installed when the agent is made -- so a bad choice fails ``init_rpc`` with its
cause -- and undone when it stops (if nothing replaced it meanwhile)."""

from __future__ import annotations

from typing import Any

from ... import _config
from ..._wire._choice import current_guard, current_pickler, set_guard, set_pickler
from ..._wire._guard import Guard
from ._options import TensorPipeRpcBackendOptions

__all__ = ["WireChoices", "guard_from"]


def guard_from(options: TensorPipeRpcBackendOptions) -> Guard | None:
    """The allow-list ``options`` and the environment ask for (``None``: none)."""
    calls: list[Any] | None = getattr(options, "allowed_calls", None)
    classes: list[Any] | None = getattr(options, "allowed_classes", None)
    env_calls = _config.env_str(_config.ENV_ALLOWED_CALLS)
    env_classes = _config.env_str(_config.ENV_ALLOWED_CLASSES)
    if calls is None and env_calls is not None:
        calls = env_calls.split(",")
    if classes is None and env_classes is not None:
        classes = env_classes.split(",")
    if calls is None and classes is None:
        return None
    return Guard(calls or (), classes or ())


class WireChoices:
    """The pickler and allow-list one agent installed (restored by :meth:`undo`)."""

    def __init__(self, options: TensorPipeRpcBackendOptions) -> None:
        guard = guard_from(options)  # (raises for a name that does not exist)
        pickler = getattr(options, "pickler", None)
        self._pickler: Any = None
        self._previous_pickler: Any = None
        if pickler is not None:
            self._previous_pickler = set_pickler(pickler)
            self._pickler = pickler
        self._guard = guard
        self._previous_guard = current_guard()
        if guard is not None:
            set_guard(guard)

    @property
    def guard(self) -> Guard | None:
        """The allow-list this agent enforces (``None``: none)."""
        return self._guard if self._guard is not None else current_guard()

    def undo(self) -> None:
        """Put back what was there before, where this agent's choice is still in place."""
        if self._guard is not None and current_guard() is self._guard:
            set_guard(self._previous_guard)
        if self._pickler is not None and current_pickler() is self._pickler:
            set_pickler(self._previous_pickler)
