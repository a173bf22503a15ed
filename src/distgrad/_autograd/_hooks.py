"""Hooks on leaves' ``AccumulateGrad`` nodes, run as torch's distributed engine runs them.

torch's distributed engine never executes a leaf's ``AccumulateGrad`` node (the gradient goes to
the context, not to ``.grad``), but it calls that node's *pre-hooks* and *post-hooks* around
accumulating into the context (``DistAccumulateGradCaptureHook``), once per pass and worker, with
the leaf's whole gradient (one graph task per worker waits for every contribution), after the
tensor's own hooks. DistributedDataParallel's reducer is such a post-hook (C++): it reads the
gradient, allreduces it and writes the average back -- through ``.grad`` when, as under
distgrad, torch's own C++ context is not set. Horovod, FSDP and user code register Python hooks
on these nodes too. Skipping them trains silently wrong.

distgrad's engine captures leaves' gradients (leaves as ``inputs``), where torch's engine calls
a leaf's tensor hooks but never its node's hooks. So a *hooked* leaf (:func:`is_hooked`: hooks
of its own or on its node) is handled apart:

1. in each run, its partial gradient is captured with its tensor hooks set aside
   (:func:`hooks_set_aside`) and summed in the pass (:class:`HookedLeaf`);
2. once no unresolved source of the pass can reach it, its ``AccumulateGrad`` node is
   *executed* from the sum (:func:`run_accumulators`), with ``.grad`` pointing at a copy of the
   context's gradient for the duration (:func:`borrowed_grads`): tensor hooks, node pre-hooks,
   accumulation, node post-hooks (DDP's reducer; its end-of-backward callback runs at the end of
   that engine call), torch's order; then ``.grad`` is read back into the context and restored.
   Post-accumulate-grad hooks stay set aside: torch's distributed engine does not call them.

Python cannot list a node's C++ hooks, so :func:`has_node_hooks` reads the sizes of the node's
``pre_hooks_`` / ``post_hooks_`` vectors. Their offsets are not guessed: :func:`_calibrate`
finds them once on a probe node by registering hooks and watching which words change, and
checks the result on a second probe. Where that fails (another interpreter layout, another
torch), every leaf is treated as hooked: correct, only slower.

``.grad`` is swapped under one process-wide lock (:data:`GRAD_LOCK`), the one
``DistributedOptimizer``'s local optimizers hold while they set ``.grad``: the two never
interleave. A local backward on the same parameters in another thread at that moment would see
the swapped ``.grad``; torch's users do not mix the two on one parameter concurrently.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from ._functions import edge_roots

__all__ = [
    "GRAD_LOCK",
    "HookedLeaf",
    "borrowed_grads",
    "has_node_hooks",
    "has_tensor_hooks",
    "hooks_set_aside",
    "is_hooked",
    "run_accumulators",
]

_log = logging.getLogger("distgrad.autograd")

#: Held while ``.grad`` of parameters is borrowed (here) or set (local optimizers).
GRAD_LOCK = threading.RLock()

_ENGINE: Any = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
_WORD = struct.Struct("Q")
_VECTOR = struct.Struct("QQQ")  # std::vector: begin, end, capacity
_SPAN = 512  # bytes of a node searched for the hook vectors


def _node_address(node: Any) -> int:
    """The C++ ``Node*`` a Python wrapper of a C++ autograd node holds (right after the
    object header)."""
    return int(_WORD.unpack(ctypes.string_at(id(node) + object.__basicsize__, 8))[0])


def _vector_len(address: int, offset: int) -> int:
    begin: int
    end: int
    begin, end, _ = _VECTOR.unpack(ctypes.string_at(address + offset, _VECTOR.size))
    return (end - begin) // 8


def _probe_node() -> Any:
    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.zeros(1, requires_grad=True)
        node = leaf.view_as(leaf).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    return leaf, node


def _find_vector(before: bytes, after: bytes) -> int | None:
    """The offset of the one vector that grew from 0 to 1 element between two snapshots."""
    found = None
    for offset in range(0, len(before) - _VECTOR.size + 1, 8):
        b0, e0, _ = _VECTOR.unpack_from(before, offset)
        b1, e1, _ = _VECTOR.unpack_from(after, offset)
        if e0 - b0 == 0 and e1 - b1 == 8:
            if found is not None:
                return None  # ambiguous
            found = offset
    return found


def _calibrate() -> tuple[int, int] | None:
    """``(pre_hooks offset, post_hooks offset)`` in a C++ node, or None if not found."""
    if hasattr(sys, "gettotalrefcount") or getattr(sys, "_is_gil_enabled", lambda: True)() is False:
        return None  # a debug or free-threaded interpreter: another object header
    accumulate_grad: Any = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
    if accumulate_grad.__basicsize__ < object.__basicsize__ + 8:
        return None
    try:
        keep, node = _probe_node()
        if type(node) is not accumulate_grad:
            return None
        address = _node_address(node)
        first = ctypes.string_at(address, _SPAN)
        post_handle = node.register_hook(lambda grad_inputs, grad_outputs: None)
        second = ctypes.string_at(address, _SPAN)
        pre_handle = node.register_prehook(lambda grad_outputs: None)
        third = ctypes.string_at(address, _SPAN)
        post = _find_vector(first, second)
        pre = _find_vector(second, third)
        post_handle.remove()
        pre_handle.remove()
        if post is None or pre is None or post == pre:
            return None
        # check on a fresh node: nothing, then a pre-hook only
        keep, node = _probe_node()
        address = _node_address(node)
        if _vector_len(address, pre) != 0 or _vector_len(address, post) != 0:
            return None
        handle = node.register_prehook(lambda grad_outputs: None)
        ok = _vector_len(address, pre) == 1 and _vector_len(address, post) == 0
        handle.remove()
        del keep
        return (pre, post) if ok else None
    except Exception:  # (any surprise means: do not trust the layout)
        return None


_OFFSETS: tuple[int, int] | None = None
_WINDOW: tuple[int, int, int, int] | None = None  # start, length, pre and post within it
_CALIBRATED = False
_CALIBRATION_LOCK = threading.Lock()


def _offsets() -> tuple[int, int] | None:
    global _OFFSETS, _WINDOW, _CALIBRATED
    if not _CALIBRATED:
        with _CALIBRATION_LOCK:
            if not _CALIBRATED:
                _OFFSETS = _calibrate()
                if _OFFSETS is None:
                    _log.info(
                        "cannot read autograd node hooks on this interpreter: every leaf's "
                        "AccumulateGrad node is run in distributed backward (correct, slower)"
                    )
                else:
                    pre, post = _OFFSETS
                    start = min(pre, post)
                    _WINDOW = (start, max(pre, post) + 16 - start, pre - start, post - start)
                _CALIBRATED = True
    return _OFFSETS


def has_node_hooks(node: Any) -> bool:
    """True if the ``AccumulateGrad`` node ``node`` has pre- or post-hooks (Python or C++;
    an emptied Python hook dict still counts: a false positive only costs time). About 1.5 µs:
    one read of the node's address, one of both vectors (a vector is empty when its begin and
    end pointers are equal)."""
    window = _WINDOW
    if window is None:
        if _offsets() is None:
            return True
        window = _WINDOW
        assert window is not None
    start, length, pre, post = window
    words = ctypes.string_at(_node_address(node) + start, length)
    return words[pre : pre + 8] != words[pre + 8 : pre + 16] or (
        words[post : post + 8] != words[post + 8 : post + 16]
    )


def _calibrate_tensor_hooks() -> int | None:
    """The offset of ``tensor_pre_hooks_`` (the hooks that ``register_hook`` on a non-leaf
    tensor adds to its ``grad_fn``) in a C++ node, found as :func:`_calibrate` finds the node
    hooks' and checked on a second probe; None if not found."""
    if _offsets() is None:  # (the same interpreter checks: their failure means "unknown")
        return None
    try:
        with torch.inference_mode(False), torch.enable_grad():
            leaf = torch.zeros(1, requires_grad=True)
            out = leaf * 1
            node = out.grad_fn
            address = _node_address(node)
            before = ctypes.string_at(address, _SPAN)
            out.register_hook(lambda grad: None)  # type: ignore[no-untyped-call]
            offset = _find_vector(before, ctypes.string_at(address, _SPAN))
            if offset is None:
                return None
            # check on a fresh node: nothing, a node pre-hook (not this vector), a tensor hook
            fresh = leaf * 1
            address = _node_address(fresh.grad_fn)
            if _vector_len(address, offset) != 0:
                return None
            handle = fresh.grad_fn.register_prehook(lambda grads: None)  # type: ignore[union-attr]
            unchanged = _vector_len(address, offset) == 0
            handle.remove()
            fresh.register_hook(lambda grad: None)  # type: ignore[no-untyped-call]
            ok = unchanged and _vector_len(address, offset) == 1
            return offset if ok else None
    except Exception:  # (any surprise means: do not trust the layout)
        return None


_TENSOR_HOOKS: list[int | None] = []


def has_tensor_hooks(node: Any) -> bool:
    """True if a tensor whose ``grad_fn`` is the C++ node ``node`` may have hooks
    (``register_hook`` on a non-leaf tensor, even one whose hooks were removed since): the
    size of the node's tensor pre-hook vector, found by calibration; True where that cannot be
    read. False for a node of a custom ``autograd.Function`` (a Python node: its C++ node is not
    reachable from Python), which the caller must know."""
    if not _TENSOR_HOOKS:
        _offsets()  # (first: it takes the calibration lock itself)
        with _CALIBRATION_LOCK:
            if not _TENSOR_HOOKS:
                _TENSOR_HOOKS.append(_calibrate_tensor_hooks())
    offset = _TENSOR_HOOKS[0]
    if offset is None:
        return True
    return _vector_len(_node_address(node), offset) != 0


def is_hooked(variable: torch.Tensor, node: Any) -> bool:
    """True if a leaf's gradient meets hooks: its own (``register_hook``) or its node's."""
    return bool(variable._backward_hooks) or has_node_hooks(node)


class HookedLeaf:
    """A hooked leaf of a pass, its ``AccumulateGrad`` node and the gradient captured for it so
    far (the sum of the pass's runs; hooks see the total once, as in torch)."""

    __slots__ = ("grad", "node", "variable")

    def __init__(self, variable: torch.Tensor, node: Any) -> None:
        self.variable = variable
        self.node = node
        self.grad: torch.Tensor | None = None

    def add(self, grad: torch.Tensor) -> None:
        grad = grad.detach()
        old = self.grad
        self.grad = grad if old is None else (grad + old if old.is_sparse else old + grad)


_warned_post_accumulate: set[int] = set()


def _warn_post_accumulate(variable: torch.Tensor) -> None:
    if id(variable) not in _warned_post_accumulate:
        _warned_post_accumulate.add(id(variable))
        _log.warning(
            "a post-accumulate-grad hook on a leaf does not run in distributed backward (as in "
            "torch: the gradient goes to the context, not to .grad)"
        )


@contextmanager
def hooks_set_aside(variables: Sequence[torch.Tensor], name: str) -> Iterator[None]:
    """Empty the leaves' own hook dicts ``name`` (``_backward_hooks`` or
    ``_post_accumulate_grad_hooks``) for a moment: the C++ side holds the dict objects, so
    emptied dicts run nothing. Every hook goes back, in order, afterwards."""
    saved: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
    for variable in variables:
        hooks = getattr(variable, name, None)
        if hooks:
            if name == "_post_accumulate_grad_hooks":
                _warn_post_accumulate(variable)
            saved.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.update(items)


def run_accumulators(leaves: Sequence[HookedLeaf]) -> None:
    """Execute the ``AccumulateGrad`` nodes of ``leaves`` from their gradients, in one engine
    call: tensor hooks, node pre-hooks, accumulation into ``.grad`` (lent by the caller with
    :func:`borrowed_grads`, under :data:`GRAD_LOCK`), node post-hooks -- torch's order."""
    runnable = [leaf for leaf in leaves if leaf.grad is not None]
    if not runnable:
        return
    # The node itself where torch's engine starts from GradientEdge roots (torch 2.4 and
    # later); before, the leaf tensor: its gradient edge is the same AccumulateGrad node.
    roots: tuple[Any, ...]
    if edge_roots():
        roots = tuple(GradientEdge(leaf.node, 0) for leaf in runnable)
    else:
        roots = tuple(leaf.variable for leaf in runnable)
    grads = tuple(leaf.grad for leaf in runnable)
    for leaf in runnable:
        leaf.grad = None  # (fewer references: AccumulateGrad may take the tensor over)
    with hooks_set_aside([leaf.variable for leaf in runnable], "_post_accumulate_grad_hooks"):
        _ENGINE.run_backward(roots, grads, True, False, (), True, True)


@contextmanager
def borrowed_grads(
    variables: Sequence[torch.Tensor], current: dict[int, torch.Tensor]
) -> Iterator[None]:
    """Point each variable's ``.grad`` at a copy of its context gradient (or None) for the
    duration; restore the user's ``.grad`` afterwards."""
    saved = [variable.grad for variable in variables]
    try:
        for variable in variables:
            grad = current.get(id(variable))
            variable.grad = None if grad is None else grad.clone()
        yield
    finally:
        for variable, grad in zip(variables, saved, strict=True):
            variable.grad = grad
