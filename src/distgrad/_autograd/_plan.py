"""Which part of a worker's graph one engine run of a pass may execute (pure graph logic).

A node of a worker's graph runs at most once per pass, with the sum of every gradient that
reaches it (torch's rule). distgrad still starts torch's engine as soon as gradients arrive, so
each run executes only the nodes that no *pending* source can reach any more (a source is
pending until its gradients are all in; the nodes a pending source reaches are *blocked*).
Where the run's gradients flow into a node that does not run, they are *captured* there (the
edge, a ``GradientEdge``, is one of the run's ``inputs``) and wait in the pass
(:class:`Waiting`); a later run that finds the node unblocked starts from it, with the sum.

:func:`plan` walks down from a run's start nodes through unblocked nodes. A node is *live* if
it leads to an input of the run -- a leaf's ``AccumulateGrad`` node or a recv function of the
context, unblocked -- and torch's engine executes exactly the live nodes (it executes what
leads to the ``inputs`` it is given). An unblocked node that leads only into blocked nodes is
not live yet: it waits, as a blocked one does, until what it leads to runs.

Why each node runs once: a node runs in the first run in which it is unblocked and live; every
gradient for it comes from a source that reaches it (resolved by then: it is unblocked) or from
a node above it that waits (that node is live in the same run, since it leads to this one), so
all of them are in that run. The exception is a captured node below another captured one: torch
executes every node above a captured one, so the upper one runs early (:func:`_widen`). Why
nothing deadlocks: a pending source's gradient can only depend on work that comes later in the
forward than its message, and a node it reaches came earlier -- what waits never holds up what
it waits for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ._functions import RecvRpc
from ._hooks import has_tensor_hooks

__all__ = ["Plan", "Waiting", "plan"]

_ACCUMULATE_GRAD: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
_RECV: type = RecvRpc._backward_cls  # type: ignore[attr-defined]
_PYTHON_NODE: type = torch._C._FunctionBase


def add_grads(old: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    """``old + grad``, with a sparse operand first (a dense tensor cannot add a sparse one)."""
    if old is None:
        return grad
    return grad + old if old.is_sparse else old + grad


@dataclass(eq=False, slots=True)
class Waiting:
    """Gradients summed for one input (``nr``) of a node that could not run yet."""

    node: Any
    nr: int
    grad: torch.Tensor | None = None


@dataclass(eq=False, slots=True)
class Plan:
    """What one engine run executes: its live start nodes, the inputs it captures -- leaves
    (by the variable's id, with their ``AccumulateGrad`` nodes), recv nodes (by id) and the
    edges into nodes that do not run now (``captures``: their gradients wait)."""

    live: set[int] = field(default_factory=set)
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)
    accumulators: dict[int, Any] = field(default_factory=dict)
    recv_nodes: list[int] = field(default_factory=list)
    captures: list[tuple[Any, int]] = field(default_factory=list)
    #: nodes that do not run now but may later (blocked, or leading into blocked nodes);
    #: a node in neither set leads to no input at all, and torch would not run it either
    later: set[int] = field(default_factory=set)
    #: some nodes that wait run early with part of their gradient (see :func:`plan`)
    partial: bool = False


def plan(starts: Iterable[Any], blockers: Mapping[int, int], recvs: Mapping[int, Any]) -> Plan:
    """The plan of a run from the nodes ``starts``; ``blockers``: node id -> the number of
    pending sources that reach it (absent or 0: none); ``recvs``: the context's recv nodes by
    id (a recv node of another context is an end, not an input)."""
    result = Plan()
    order = _walk(starts, blockers, result.later)
    live = result.live
    later = result.later
    for node in order:
        key = id(node)
        kind = type(node)
        if kind is _ACCUMULATE_GRAD:
            variable = node.variable
            live.add(key)
            result.leaves[id(variable)] = variable
            result.accumulators[id(variable)] = node
            continue
        if kind is _RECV:
            if key in recvs:
                live.add(key)
                result.recv_nodes.append(key)
            continue
        children = [child for child, _ in node.next_functions]
        if any(child is not None and id(child) in live for child in children):
            live.add(key)
        elif any(child is not None and id(child) in later for child in children):
            later.add(key)
    targets: dict[tuple[int, int], tuple[Any, int]] = {}
    for node in order:
        key = id(node)
        if key not in live or type(node) is _ACCUMULATE_GRAD or type(node) is _RECV:
            continue
        for child, nr in node.next_functions:
            if child is not None and id(child) in later:
                targets[(id(child), nr)] = (child, nr)
    hooked = any(_hooked(node) for node, _ in targets.values())
    if hooked or (len({key for key, _ in targets}) > 1 and _nested(targets)):
        result.partial = True
        _widen(targets, live)
    result.captures = list(targets.values())
    return result


def _hooked(node: Any) -> bool:
    """A node not to capture at: torch calls the hooks of a captured node's tensors
    (``register_hook`` on an intermediate) on the captured part, and again when the node runs
    on the whole, hooked part included -- a hook that scales would scale that part twice. Such
    a node runs now instead, on its part (``_widen``). A leaf's hooks are set aside while it is
    captured (``_run``); a custom Function's node cannot be read (``has_tensor_hooks``)."""
    kind = type(node)
    if kind is _ACCUMULATE_GRAD or isinstance(node, _PYTHON_NODE):
        return False
    return has_tensor_hooks(node)


def _walk(starts: Iterable[Any], blockers: Mapping[int, int], later: set[int]) -> list[Any]:
    """The unblocked nodes below ``starts``, children before parents; blocked ones go to
    ``later``."""
    order: list[Any] = []
    seen: set[int] = set()
    for start in starts:
        if blockers.get(id(start), 0) > 0:
            later.add(id(start))
            continue
        stack: list[tuple[Any, bool]] = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            key = id(node)
            if key in seen:
                continue
            seen.add(key)
            stack.append((node, True))
            kind = type(node)
            if kind is _ACCUMULATE_GRAD or kind is _RECV:
                continue
            for child, _ in node.next_functions:
                if child is None:
                    continue
                child_key = id(child)
                if blockers.get(child_key, 0) > 0:
                    later.add(child_key)
                elif child_key not in seen:
                    stack.append((child, False))
    return order


def _below(node: Any) -> list[Any]:
    if type(node) is _ACCUMULATE_GRAD or type(node) is _RECV:
        return []
    return [child for child, _ in node.next_functions if child is not None]


def _nested(targets: Mapping[tuple[int, int], tuple[Any, int]]) -> bool:
    """True if a captured node lies below another one (torch would run the upper one)."""
    nodes = {key: node for key, (node, _) in targets.items()}
    ids = {key for key, _ in nodes}
    seen: set[int] = set()
    for node, _ in targets.values():
        stack = _below(node)
        while stack:
            child = stack.pop()
            if id(child) in ids:
                return True
            if id(child) not in seen:
                seen.add(id(child))
                stack.extend(_below(child))
    return False


def _widen(targets: dict[tuple[int, int], tuple[Any, int]], live: set[int]) -> None:
    """Captured nodes below other captured ones, or with hooks on their tensors
    (:func:`_hooked`): torch runs every node above a captured one, so those run now, with the
    part of their gradient this run has (the rest comes later: correct by linearity, but such
    a node runs more than once in the pass, its hooks once per part). A node that runs is not
    captured; what it leads to is, until nothing that runs feeds a node that does not."""
    runs: dict[int, Any] = {}
    while True:
        runs.update(_above(targets))
        runs.update((key, node) for (key, _), (node, _) in targets.items() if _hooked(node))
        changed = False
        for key in [key for key in targets if key[0] in runs]:
            del targets[key]
            changed = True
        for node in runs.values():
            for child, nr in node.next_functions:
                if child is None or id(child) in live or id(child) in runs:
                    continue
                if (id(child), nr) not in targets:
                    targets[(id(child), nr)] = (child, nr)
                    changed = True
        if not changed:
            return


def _above(targets: Mapping[tuple[int, int], tuple[Any, int]]) -> dict[int, Any]:
    """The nodes at or below the captured ones that lead to a captured node (torch runs
    them), by id."""
    captured = {key for key, _ in targets}
    hits: dict[int, bool] = {}
    runs: dict[int, Any] = {}
    for start, _ in targets.values():
        stack: list[tuple[Any, bool]] = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            key = id(node)
            if expanded:
                hit = any(id(c) in captured or hits.get(id(c), False) for c in _below(node))
                hits[key] = hit
                if hit:
                    runs[key] = node
                continue
            if key in hits:
                continue
            hits[key] = False
            stack.append((node, True))
            stack.extend((child, False) for child in _below(node) if id(child) not in hits)
    return runs
