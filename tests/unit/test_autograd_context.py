"""Unit tests of distributed autograd contexts and their container (SPEC 2.1, 2.2)."""

from __future__ import annotations

import threading

import pytest
import torch

from distgrad._autograd import _context, _context_state
from distgrad._autograd._context import ContextContainer, DistAutogradContext, context

#: whether this torch tells a tensor's owners (``Tensor._use_count``, not in torch 2.3): only
#: then is a first gradient nothing else refers to taken over; else it is copied
TAKES_OVER = _context_state._counts

NOT_FOUND = "Could not find autograd context with id: {}"
NO_CURRENT = (
    "Current thread doesn't have a valid autograd context. Please wrap your code using: "
    "`with torch.distributed.autograd.context() as context_id` to generate a valid context"
)


def make(worker_id: int = 0) -> ContextContainer:
    container = ContextContainer()
    container.init(worker_id)
    return container


def sparse(index: list[int], values: list[float], size: int = 4) -> torch.Tensor:
    return torch.sparse_coo_tensor(
        torch.tensor([index]), torch.tensor(values), (size,), check_invariants=True
    )


# -- ids -----------------------------------------------------------------------------------------


def test_first_context_on_worker_0_has_id_0() -> None:
    """Worker 0's contexts are numbered 0, 1, 2, ..."""
    container = make(0)
    ids = []
    for _ in range(3):
        ids.append(container.new_context().context_id)
        container.clear_current_context()
    assert ids == [0, 1, 2]


def test_ids_carry_the_worker_id_in_the_top_bits() -> None:
    """Worker 3's context and message ids are (3 << 48) | counter."""
    container = make(3)
    ctx = container.new_context()
    assert ctx.context_id == 3 << 48
    assert ctx._context_id() == ctx.context_id
    assert container.new_autograd_message_id() == 3 << 48
    assert container.new_autograd_message_id() == (3 << 48) | 1


def test_context_and_message_counters_are_separate() -> None:
    """Allocating message ids does not advance the context counter, nor the other way round."""
    container = make(1)
    base = 1 << 48
    assert [container.new_autograd_message_id() for _ in range(3)] == [base, base + 1, base + 2]
    assert container.new_context().context_id == base
    container.clear_current_context()
    assert container.new_context().context_id == base + 1
    assert container.new_autograd_message_id() == base + 3


def test_max_id() -> None:
    """_get_max_id() is 281474976710655 + (worker_id << 48)."""
    assert make(1).max_id() == 281474976710655 + (1 << 48)
    assert make(0).max_id() == 2**48 - 1


def test_ids_do_not_repeat_across_reinit_with_the_same_id() -> None:
    """A repeated init with the same worker id keeps the counters running."""
    container = make(2)
    first = container.new_context().context_id
    container.release_context(first)
    container.init(2)
    assert container.new_context().context_id == first + 1


def test_ids_are_unique_across_threads() -> None:
    """Concurrent allocation never hands out an id twice."""
    container = make(5)
    results: list[list[int]] = []

    def allocate() -> None:
        ids = []
        for _ in range(500):
            ids.append(container.new_autograd_message_id())
            ids.append(container.new_context().context_id)
            container.clear_current_context()
        results.append(ids)

    threads = [threading.Thread(target=allocate) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [i for ids in results for i in ids]
    assert len(every) == 8 * 1000
    message_ids = every[0::2]
    assert len(set(message_ids)) == len(message_ids)
    assert container.num_contexts() == 8 * 500


# -- init ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("worker_id", [-1, 65536])
def test_init_rejects_worker_ids_out_of_range(worker_id: int) -> None:
    """init() accepts only worker ids in [0, 65535]."""
    with pytest.raises(RuntimeError, match=r"^worker_id needs to be in the range \[0, 65535\]$"):
        ContextContainer().init(worker_id)


def test_init_accepts_the_range_bounds() -> None:
    """0 and 65535 are valid worker ids."""
    assert make(0).worker_id == 0
    assert make(65535).max_id() == (65535 << 48) | (2**48 - 1)


def test_reinit_with_another_id_fails_and_with_the_same_id_is_a_noop() -> None:
    """init() is idempotent for one worker id and refuses a different one."""
    container = make(4)
    container.init(4)
    assert container.worker_id == 4
    with pytest.raises(RuntimeError) as info:
        container.init(7)
    assert str(info.value) == (
        "Container is already initialized with worker_id: 4, "
        "cannot initialize with different worker_id: 7"
    )
    assert container.worker_id == 4


def test_use_before_init_fails() -> None:
    """Creating a context or reading the worker id before init() tells the user what to call."""
    container = ContextContainer()
    message = "Need to initialize distributed autograd using torch.distributed.autograd.init()"
    assert not container.initialized
    with pytest.raises(RuntimeError) as info:
        container.new_context()
    assert str(info.value) == message
    with pytest.raises(RuntimeError, match="Need to initialize"):
        _ = container.worker_id
    assert container.current_context_id() == -1


def test_reset_for_tests_starts_over() -> None:
    """reset_for_tests() forgets contexts, the worker id, the counters and the current context."""
    container = make(1)
    container.new_context()
    container.new_autograd_message_id()
    container.reset_for_tests()
    assert not container.initialized
    assert container.num_contexts() == 0
    assert container.current_context_id() == -1
    container.init(0)
    assert container.new_context().context_id == 0
    assert container.new_autograd_message_id() == 0


# -- the current context -------------------------------------------------------------------------


def test_new_context_sets_current_and_nested_new_context_fails() -> None:
    """A thread has at most one current context: a second new_context() raises."""
    container = make(0)
    assert container.current_context_id() == -1
    assert not container.has_current_context()
    ctx = container.new_context()
    assert container.current_context() is ctx
    assert container.current_context_id() == ctx.context_id
    assert container.has_current_context()
    with pytest.raises(RuntimeError) as info:
        container.new_context()
    assert str(info.value) == "Already have an autograd context id for this thread."
    assert container.num_contexts() == 1


def test_current_context_without_one_fails() -> None:
    """current_context() without a current context raises the reference's message."""
    container = make(0)
    with pytest.raises(RuntimeError) as info:
        container.current_context()
    assert str(info.value) == NO_CURRENT


def test_current_context_is_thread_local() -> None:
    """Two threads each see their own current context."""
    container = make(0)
    barrier = threading.Barrier(2)
    seen: dict[str, tuple[int, int]] = {}

    def run(name: str) -> None:
        ctx = container.new_context()
        barrier.wait()  # both contexts exist before either thread looks
        seen[name] = (ctx.context_id, container.current_context()._context_id())
        barrier.wait()

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen["a"][0] == seen["a"][1]
    assert seen["b"][0] == seen["b"][1]
    assert seen["a"][0] != seen["b"][0]
    assert container.current_context_id() == -1  # the main thread has none


def test_forced_current_sets_and_restores() -> None:
    """forced_current() overrides the current id for the block (nesting works) and restores it."""
    container = make(0)
    own = container.new_context().context_id
    with container.forced_current(42):
        assert container.current_context_id() == 42
        with container.forced_current(43):
            assert container.current_context_id() == 43
        assert container.current_context_id() == 42
    assert container.current_context_id() == own


def test_forced_current_restores_on_exception_and_without_a_previous_context() -> None:
    """forced_current() restores -1 even when the block raises."""
    container = make(0)
    remote = container.get_or_create_context(7 << 48)
    with pytest.raises(ValueError), container.forced_current(remote.context_id):
        assert container.current_context() is remote
        with pytest.raises(RuntimeError, match="Already have an autograd context id"):
            container.new_context()
        raise ValueError("boom")
    assert container.current_context_id() == -1


def test_set_and_clear_current_context_id() -> None:
    """set_current_context_id() and clear_current_context() write the thread-local id."""
    container = make(0)
    container.set_current_context_id(12)
    assert container.current_context_id() == 12
    container.clear_current_context()
    assert container.current_context_id() == -1


def test_a_thread_counts_the_containers_where_it_has_a_current_context() -> None:
    """``recording.reasons`` -- what lets a call skip asking distributed autograd whether to
    record it -- counts, per thread, the containers where the thread has a current context:
    every way a current context is set, changed, cleared or released keeps it exact."""
    from distgrad._rpc._core import recording

    base = recording.reasons  # (what earlier tests left on this thread)
    a, b = make(0), make(1)
    ctx = a.new_context()
    assert recording.reasons == base + 1
    with b.forced_current(5):
        assert recording.reasons == base + 2
        with b.forced_current(6):  # (one context for another: no change)
            assert recording.reasons == base + 2
        with b.forced_current(-1):
            assert recording.reasons == base + 1
    assert recording.reasons == base + 1
    a.set_current_context_id(9)
    assert recording.reasons == base + 1
    a.clear_current_context()
    a.clear_current_context()  # (twice: counted once)
    assert recording.reasons == base
    a.set_current_context_id(ctx.context_id)
    assert recording.reasons == base + 1
    a.release_context(ctx.context_id)  # releasing the current context clears it
    assert recording.reasons == base
    other = a.new_context()
    a.release_context_if_present(other.context_id)
    assert recording.reasons == base
    seen: list[int] = []

    def elsewhere() -> None:
        seen.append(recording.reasons)
        a.new_context()
        seen.append(recording.reasons)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [0, 1] and recording.reasons == base  # (per thread)


# -- lookup and release --------------------------------------------------------------------------


def test_get_or_create_does_not_set_current() -> None:
    """The receiver-side get_or_create_context() creates once and leaves the current id alone."""
    container = make(1)
    ctx = container.get_or_create_context(0)
    assert container.get_or_create_context(0) is ctx
    assert container.current_context_id() == -1
    assert container.retrieve_context(0) is ctx
    assert container.get_context(0) is ctx
    assert container.has_context(0)
    assert container.num_contexts() == 1


def test_release_resets_current_and_returns_the_context() -> None:
    """Releasing this thread's current context removes it and resets the current id to -1."""
    container = make(0)
    ctx = container.new_context()
    assert container.release_context(ctx.context_id) is ctx
    assert container.current_context_id() == -1
    assert not container.has_context(ctx.context_id)
    assert container.get_context(ctx.context_id) is None
    assert container.num_contexts() == 0


def test_release_of_another_context_keeps_current() -> None:
    """Releasing a context that is not current leaves the current id in place."""
    container = make(0)
    other = container.get_or_create_context(9 << 48)
    ctx = container.new_context()
    container.release_context(other.context_id)
    assert container.current_context_id() == ctx.context_id


def test_unknown_ids_fail_with_the_reference_message() -> None:
    """retrieve_context() and release_context() of an unknown id raise 'Could not find ...'."""
    container = make(0)
    with pytest.raises(RuntimeError) as info:
        container.retrieve_context(123)
    assert str(info.value) == NOT_FOUND.format(123)
    with pytest.raises(RuntimeError) as info:
        container.release_context(456)
    assert str(info.value) == NOT_FOUND.format(456)


def test_release_if_present() -> None:
    """release_context_if_present() returns None for an unknown id and the context otherwise."""
    container = make(0)
    assert container.release_context_if_present(5) is None
    ctx = container.new_context()
    assert container.release_context_if_present(ctx.context_id) is ctx
    assert container.release_context_if_present(ctx.context_id) is None
    assert container.current_context_id() == -1


def test_debug_info_has_exactly_the_reference_keys() -> None:
    """debug_info() reports contexts and contexts with a backward pass in progress."""
    container = make(0)
    assert container.debug_info() == {"num_current_backward_passes": 0, "num_autograd_contexts": 0}
    ctx = container.new_context()
    container.get_or_create_context(1 << 48)
    ctx.pass_state = object()
    assert container.debug_info() == {"num_current_backward_passes": 1, "num_autograd_contexts": 2}


# -- the context object --------------------------------------------------------------------------


def test_send_and_recv_functions_are_ordered_by_message_id() -> None:
    """_send_functions() and _recv_functions() sort by message id whatever the insertion order."""
    ctx = DistAutogradContext(0)
    for msg_id in (1 << 48, 5, 0, 3):
        ctx.add_send_function(msg_id, f"send{msg_id}")
        ctx.add_recv_function(msg_id, f"recv{msg_id}")
    assert list(ctx._send_functions()) == [0, 3, 5, 1 << 48]
    assert list(ctx._recv_functions().values()) == ["recv0", "recv3", "recv5", f"recv{1 << 48}"]
    assert list(ctx._send_functions().values())[1] == "send3"


def test_known_workers() -> None:
    """add_known_worker() collects worker ids; _known_worker_ids() returns a copy."""
    ctx = DistAutogradContext(0)
    for worker in (2, 1, 2):
        ctx.add_known_worker(worker)
    known = ctx._known_worker_ids()
    assert known == {1, 2}
    known.add(9)
    assert ctx._known_worker_ids() == {1, 2}


def test_repr_shows_id_and_counts() -> None:
    """repr() shows the id, the known workers and the counts."""
    ctx = DistAutogradContext(7)
    ctx.add_known_worker(1)
    ctx.add_send_function(0, None)
    text = repr(ctx)
    assert "id=7" in text
    assert "workers=[1]" in text
    assert "sends=1" in text
    assert "recvs=0" in text


def test_accumulate_dense_gradients() -> None:
    """Dense gradients add up out of place; a first gradient the caller still holds is copied,
    one that only its pair refers to is taken over."""
    ctx = DistAutogradContext(0)
    leaf = torch.zeros(3, requires_grad=True)
    first = torch.ones(3)
    ctx.accumulate_grad(leaf, first)
    assert ctx.gradients()[leaf] is not first
    snapshot = ctx.gradients()
    ctx.accumulate_grad(leaf, torch.full((3,), 2.0))
    assert torch.equal(ctx.gradients()[leaf], torch.full((3,), 3.0))
    assert torch.equal(snapshot[leaf], torch.ones(3))  # an earlier snapshot is unchanged
    assert torch.equal(first, torch.ones(3))
    assert leaf.grad is None
    other = torch.zeros(3, requires_grad=True)
    pairs = [(other, torch.ones(3))]
    address = pairs[0][1].data_ptr()
    ctx.accumulate_grads(pairs)
    assert (ctx.gradients()[other].data_ptr() == address) is TAKES_OVER
    assert torch.equal(ctx.gradients()[other], torch.ones(3))


def test_accumulate_clones_views_and_non_contiguous_gradients() -> None:
    """A first gradient that is not laid out as its variable, or a slice of a larger storage,
    is copied before it is stored."""
    ctx = DistAutogradContext(0)
    base = torch.arange(6.0).reshape(2, 3)
    a = torch.zeros(3, 2, requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    ctx.accumulate_grads([(a, base.t()), (b, base[0])])
    grads = ctx.gradients()
    assert torch.equal(grads[a], base.t())
    assert torch.equal(grads[b], base[0])
    assert grads[a].is_contiguous()
    assert not grads[b]._is_view()
    base.zero_()
    assert grads[b].sum().item() == 3.0


def _engine_grads(lin: torch.nn.Linear) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gw, gb = torch.autograd.grad(lin(torch.randn(2, 4)).sum(), [lin.weight, lin.bias])
    return [(lin.weight, gw), (lin.bias, gb)]


def test_accumulate_takes_over_what_nothing_else_refers_to() -> None:
    """The engine's gradients (a linear layer's weight gradient is a contiguous view over a
    whole storage) are stored as they are when only their pairs refer to them; the same
    gradients still held by the caller, or a view whose base the caller holds, are copied."""
    lin = torch.nn.Linear(4, 3)
    ctx = DistAutogradContext(0)
    pairs = _engine_grads(lin)
    addresses = [grad.data_ptr() for _, grad in pairs]
    assert pairs[0][1]._is_view() and pairs[0][1].is_contiguous()
    ctx.accumulate_grads(pairs)
    del pairs
    grads = ctx.gradients()
    assert ([grads[lin.weight].data_ptr(), grads[lin.bias].data_ptr()] == addresses) is TAKES_OVER
    held = _engine_grads(lin)
    ctx = DistAutogradContext(1)
    ctx.accumulate_grads(list(held))  # (two lists refer to each gradient)
    grads = ctx.gradients()
    assert {grads[v].data_ptr() for v, _ in held}.isdisjoint(g.data_ptr() for _, g in held)
    base = torch.ones(3, 2)
    a = torch.zeros(2, 3, requires_grad=True)
    ctx = DistAutogradContext(2)
    ctx.accumulate_grads([(a, base.t())])
    base.add_(1)
    assert torch.equal(ctx.gradients()[a], torch.ones(2, 3))


def test_accumulate_never_aliases_one_tensor_for_two_variables() -> None:
    """One tensor given for two variables (a custom Function's backward returning it twice)
    is stored as two copies: changing one stored gradient (or the tensor) changes nothing
    else."""
    ctx = DistAutogradContext(0)
    a = torch.zeros(3, requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    shared = torch.ones(3)
    pairs = [(a, shared), (b, shared)]
    del shared
    ctx.accumulate_grads(pairs)
    grads = ctx.gradients()
    assert grads[a].data_ptr() != grads[b].data_ptr()
    assert pairs[0][1].data_ptr() not in (grads[a].data_ptr(), grads[b].data_ptr())
    grads[a].mul_(5)
    pairs[0][1].mul_(7)
    assert torch.equal(grads[b], torch.ones(3))


def test_accumulate_sparse_takes_over_only_what_is_not_shared() -> None:
    """A sparse first gradient that only its pair refers to keeps its values (no copy), but
    its indices are copied when the caller still holds them (an embedding's gradient shares
    the lookup's index tensor); a sparse gradient the caller holds is copied whole."""
    ctx = DistAutogradContext(0)
    leaf = torch.zeros(4, 2, requires_grad=True)
    indices = torch.tensor([[0, 2]])
    pairs = [(leaf, torch.sparse_coo_tensor(indices, torch.ones(2, 2), (4, 2)))]
    values_at = pairs[0][1]._values().data_ptr()
    ctx.accumulate_grads(pairs)
    del pairs
    grad = ctx.gradients()[leaf]
    assert (grad._values().data_ptr() == values_at) is TAKES_OVER
    assert grad._indices().data_ptr() != indices.data_ptr()
    indices.zero_()
    assert grad._indices().tolist() == [[0, 2]]
    held = sparse([1], [3.0])
    other = torch.zeros(4, requires_grad=True)
    ctx.accumulate_grad(other, held)
    assert ctx.gradients()[other]._values().data_ptr() != held._values().data_ptr()
    assert torch.equal(ctx.gradients()[other].to_dense(), held.to_dense())


def test_accumulate_detaches_gradients_that_require_grad() -> None:
    """A stored gradient never carries autograd history."""
    ctx = DistAutogradContext(0)
    leaf = torch.zeros(2, requires_grad=True)
    ctx.accumulate_grad(leaf, torch.ones(2, requires_grad=True) * 2)
    ctx.accumulate_grad(leaf, torch.ones(2, requires_grad=True))
    grad = ctx.gradients()[leaf]
    assert not grad.requires_grad
    assert grad.grad_fn is None
    assert torch.equal(grad, torch.full((2,), 3.0))


def test_accumulate_sparse_gradients() -> None:
    """Sparse plus sparse stays sparse and sums correctly."""
    ctx = DistAutogradContext(0)
    leaf = torch.zeros(4, requires_grad=True)
    ctx.accumulate_grad(leaf, sparse([0, 2], [1.0, 2.0]))
    ctx.accumulate_grad(leaf, sparse([2, 3], [3.0, 4.0]))
    grad = ctx.gradients()[leaf]
    assert grad.is_sparse
    assert torch.equal(grad.to_dense(), torch.tensor([1.0, 0.0, 5.0, 4.0]))


@pytest.mark.parametrize("sparse_first", [True, False])
def test_accumulate_mixed_dense_and_sparse(sparse_first: bool) -> None:
    """Dense plus sparse (in either order) gives the dense sum."""
    ctx = DistAutogradContext(0)
    leaf = torch.zeros(4, requires_grad=True)
    dense = torch.ones(4)
    grads = [sparse([1], [5.0]), dense] if sparse_first else [dense, sparse([1], [5.0])]
    for grad in grads:
        ctx.accumulate_grad(leaf, grad)
    total = ctx.gradients()[leaf]
    assert not total.is_sparse
    assert torch.equal(total, torch.tensor([1.0, 6.0, 1.0, 1.0]))
    assert torch.equal(dense, torch.ones(4))


def test_gradients_are_keyed_by_tensor_identity() -> None:
    """Two equal-valued tensors are distinct keys, and lookups by the original object work."""
    ctx = DistAutogradContext(0)
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(2, requires_grad=True)
    ctx.accumulate_grad(a, torch.full((2,), 1.0))
    ctx.accumulate_grad(b, torch.full((2,), 10.0))
    ctx.accumulate_grad(a, torch.full((2,), 1.0))
    grads = ctx.gradients()
    assert len(grads) == 2
    assert torch.equal(grads[a], torch.full((2,), 2.0))
    assert torch.equal(grads[b], torch.full((2,), 10.0))
    assert [key is a or key is b for key in grads] == [True, True]
    assert ctx.accumulated_grads.keys() == grads.keys()
    assert DistAutogradContext(1).gradients() == {}


# -- the `context` manager -----------------------------------------------------------------------


@pytest.fixture
def global_container(monkeypatch: pytest.MonkeyPatch) -> ContextContainer:
    """A fresh container standing in for the process-wide one, with no release hook."""
    container = make(0)
    monkeypatch.setattr(_context, "CONTAINER", container)
    monkeypatch.setattr(_context, "on_release", None)
    return container


def test_context_manager_yields_an_int_id_and_releases(
    global_container: ContextContainer,
) -> None:
    """`with context()` returns the int id of the new current context and releases it on exit."""
    released: list[DistAutogradContext] = []
    _context.on_release = released.append
    with context() as context_id:
        assert isinstance(context_id, int)
        assert global_container.current_context_id() == context_id
        assert global_container.has_context(context_id)
    assert not global_container.has_context(context_id)
    assert global_container.current_context_id() == -1
    assert [ctx.context_id for ctx in released] == [context_id]


def test_context_manager_releases_on_exception_and_calls_the_hook_after_removal(
    global_container: ContextContainer,
) -> None:
    """An exception in the block propagates; the context is released before on_release runs."""
    seen: list[tuple[int, bool]] = []

    def hook(ctx: DistAutogradContext) -> None:
        seen.append((ctx.context_id, global_container.has_context(ctx.context_id)))

    _context.on_release = hook
    with pytest.raises(KeyError, match="inside"), context() as context_id:
        raise KeyError("inside")
    assert seen == [(context_id, False)]
    assert global_container.num_contexts() == 0
    assert global_container.current_context_id() == -1


def test_context_manager_without_hook_and_nested(global_container: ContextContainer) -> None:
    """Without a hook the release still happens; a nested `with context()` raises."""
    with context() as context_id:
        with pytest.raises(RuntimeError, match="Already have an autograd context id"), context():
            pass
        assert global_container.current_context_id() == context_id
    assert global_container.num_contexts() == 0
