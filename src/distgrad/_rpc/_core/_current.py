"""Which agent the calling thread belongs to: the process's (``init_rpc``), or, in an
in-memory world where several agents share the process, the one the thread is bound to."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._agent import RpcAgent

__all__ = ["bind_thread", "current_agent", "require_agent", "set_current_agent", "thread_binding"]

_current: RpcAgent | None = None


class _ThreadAgent(threading.local):
    agent: RpcAgent | None = None  # class default: an unbound thread reads None


#: The agent the calling thread belongs to, where several share the process (else None).
thread_binding = _ThreadAgent()


def current_agent() -> RpcAgent | None:
    """The agent of the calling thread: the one it is bound to (in-memory worlds), else the
    process's (``init_rpc``)."""
    bound = thread_binding.agent
    return bound if bound is not None else _current


def bind_thread(agent: RpcAgent | None) -> RpcAgent | None:
    """Make ``agent`` the calling thread's agent (``None``: unbind); returns the previous one."""
    previous = thread_binding.agent
    thread_binding.agent = agent
    return previous


def set_current_agent(agent: RpcAgent | None) -> None:
    """Make ``agent`` the process's agent (``init_rpc``; ``None`` at shutdown)."""
    global _current
    _current = agent


def require_agent() -> RpcAgent:
    """The calling thread's agent, or torch's error when RPC is not initialized."""
    agent = current_agent()
    if agent is None:
        raise RuntimeError(
            "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
        )
    return agent
