"""What a message is, in torch's terms: its message type name and the function it calls.

Only transports that choose messages by meaning (fault injection, ``wants_message_info``) ask;
the agent builds no description otherwise. Calls of user functions are ``PYTHON_CALL``, or
``SCRIPT_CALL`` for torch builtins and TorchScript functions; the RPC layer's own handlers and
those of the layers above declare their type with :func:`message_type` (``RREF_FORK_REQUEST``,
``BACKWARD_AUTOGRAD_REQ`` ...), or a function of their arguments when the type depends on
them (``remote()`` is ``SCRIPT_REMOTE_CALL`` or ``PYTHON_REMOTE_CALL`` by the function it runs).
A call that distributed autograd records is, as in torch, wrapped: ``FORWARD_AUTOGRAD_REQ``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..._transport._base import MessageInfo
from ._calls import is_builtin

__all__ = [
    "MESSAGE_TYPES",
    "describe_request",
    "describe_response",
    "function_name",
    "is_script",
    "message_type",
]

F = TypeVar("F", bound=Callable[..., Any])
#: A handler's type: a name, or a function of the call's arguments giving (name, target).
TypeOf = str | Callable[[tuple[Any, ...]], tuple[str, object]]

_RESPONSES = {
    "PYTHON_CALL": "PYTHON_RET",
    "SCRIPT_CALL": "SCRIPT_RET",
    "PYTHON_REMOTE_CALL": "REMOTE_RET",
    "SCRIPT_REMOTE_CALL": "REMOTE_RET",
    "PYTHON_RREF_FETCH_CALL": "PYTHON_RREF_FETCH_RET",
    "SCRIPT_RREF_FETCH_CALL": "SCRIPT_RREF_FETCH_RET",
    "RREF_FORK_REQUEST": "RREF_ACK",
    "RREF_CHILD_ACCEPT": "RREF_ACK",
    "RREF_USER_DELETE": "RREF_ACK",
    "RREF_BACKWARD_REQ": "RREF_BACKWARD_RESP",
    "BACKWARD_AUTOGRAD_REQ": "BACKWARD_AUTOGRAD_RESP",
    "CLEANUP_AUTOGRAD_CONTEXT_REQ": "CLEANUP_AUTOGRAD_CONTEXT_RESP",
    "RUN_WITH_PROFILING_REQ": "RUN_WITH_PROFILING_RESP",
}
#: Every request type distgrad sends (what torch's fault options may name).
MESSAGE_TYPES: frozenset[str] = frozenset([*_RESPONSES, "FORWARD_AUTOGRAD_REQ"])

_types: dict[object, TypeOf] = {}


def message_type(type_of: TypeOf) -> Callable[[F], F]:
    """Declare the message type of calls of the decorated handler."""

    def mark(fn: F) -> F:
        register_message_type(fn, type_of)
        return fn

    return mark


def register_message_type(fn: object, type_of: TypeOf) -> None:
    """:func:`message_type` for a function defined elsewhere."""
    _types[fn] = type_of


def is_script(func: object) -> bool:
    """True for what torch sends as a script call: builtins and TorchScript functions."""
    return is_builtin(func) or isinstance(func, torch.jit.ScriptFunction)


def function_name(func: object) -> str:
    """``module.qualname`` of a function (its ``repr`` if it has none)."""
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if qualname is None:
        return repr(func)
    module = getattr(func, "__module__", None)
    return f"{module}.{qualname}" if module else str(qualname)


def describe_request(func: object, args: tuple[Any, ...], *, wrapped: bool) -> MessageInfo:
    """The description of a request calling ``func(*args)``."""
    try:
        type_of = _types.get(func)
    except TypeError:  # an unhashable callable
        type_of = None
    target = func
    if type_of is None:
        name = "SCRIPT_CALL" if is_script(func) else "PYTHON_CALL"
    elif isinstance(type_of, str):
        name = type_of
    else:
        name, target = type_of(args)
    return MessageInfo(
        name, function_name(target), True, "FORWARD_AUTOGRAD_REQ" if wrapped else None
    )


def describe_response(request: MessageInfo, *, error: bool) -> MessageInfo:
    """The description of the response (or error reply) to ``request``."""
    name = "EXCEPTION" if error else _RESPONSES.get(request.type, "PYTHON_RET")
    wrapper = "FORWARD_AUTOGRAD_RESP" if request.wrapper is not None and not error else None
    return MessageInfo(name, request.function, False, wrapper)
