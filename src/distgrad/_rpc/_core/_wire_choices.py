"""What an agent's options choose for the wire, for the whole process: the pickler
(``pickler=``) and the allow-list (``allowed_calls`` / ``allowed_classes``, or the
environment). Installed when the agent is made -- so a bad choice fails ``init_rpc`` with its
cause -- and undone when it stops (if nothing replaced it meanwhile)."""

from __future__ import annotations

import threading
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
    """The pickler and allow-list one agent installed. Agents of one process (an in-memory
    world) may each install theirs: the last one started is in force, and when an agent
    stops the latest of those still running takes over (or what was there before any)."""

    _active: list[WireChoices] = []  # (the process's agents that installed something, in order)
    _before: tuple[Any, Guard | None] = (None, None)
    _lock = threading.Lock()

    def __init__(self, options: TensorPipeRpcBackendOptions) -> None:
        self.guard = guard_from(options)  # (raises for a name that does not exist)
        self.pickler: Any = getattr(options, "pickler", None)
        if self.pickler is None and self.guard is None:
            return
        with WireChoices._lock:
            if not WireChoices._active:
                WireChoices._before = (current_pickler(), current_guard())
            if self.pickler is not None:
                set_pickler(self.pickler)  # (raises for a pickler that fails its round trip)
            if self.guard is not None:
                set_guard(self.guard)
            WireChoices._active.append(self)

    def undo(self) -> None:
        """Stop being in force (idempotent)."""
        with WireChoices._lock:
            if self not in WireChoices._active:
                return
            WireChoices._active.remove(self)
            pickler, guard = WireChoices._before
            for choices in WireChoices._active:
                pickler = choices.pickler if choices.pickler is not None else pickler
                guard = choices.guard if choices.guard is not None else guard
            set_pickler(pickler)
            set_guard(guard)
