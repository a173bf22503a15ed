"""Which agent the calling thread belongs to, stored below the agent: the process's
(``init_rpc``), or, in an in-memory world where several agents share the process, the one the
thread is bound to.

Only storage lives here (this module imports nothing of the agent, so the agent and the layer
registry can both read it); the typed accessors -- ``current_agent``, ``require_agent``,
``bind_thread``, ``set_current_agent`` -- are in ``_agent``.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["current", "thread_binding"]

#: The process's agent (``init_rpc``; ``None`` before and after). Written by
#: ``_agent.set_current_agent`` only.
process: Any = None


class _ThreadAgent(threading.local):
    agent: Any = None  # class default: an unbound thread reads None


#: The agent the calling thread belongs to, where several share the process (else None).
thread_binding = _ThreadAgent()


def current() -> Any:
    """The calling thread's agent: the one it is bound to, else the process's (or None)."""
    bound = thread_binding.agent
    return bound if bound is not None else process
