"""The membership token as a lease on the group's state in a torch store
(``_rpc/_group/_lease.py``): renewed while held, taken over from a holder that stops renewing
or is proved dead, and a holder that lost it cannot change the state any more."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from torch.distributed import HashStore, TCPStore

from distgrad._rpc._group._lease import LeaseLostError, MembershipLease

BOUND, RENEW = 0.6, 0.1


def record(name: str, incarnation: int, port: int = 0) -> dict[str, Any]:
    return {"name": name, "incarnation": incarnation, "host": "127.0.0.1", "port": port}


def lease(store: Any, name: str, rank: int, incarnation: int = 1, port: int = 0) -> MembershipLease:
    return MembershipLease(store, record(name, incarnation, port), rank, BOUND, RENEW)


def refusing_port() -> int:
    """A local port nothing listens on (bound and closed: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def freeze(held: MembershipLease) -> None:
    """The holder stops renewing (a stopped process), without giving the token back."""
    held._stop.set()  # the test plays a frozen process
    assert held._renewer is not None
    held._renewer.join(2)


def test_a_free_token_is_taken_and_given_back() -> None:
    """Acquire returns the committed members; after release another worker takes it at once."""
    store = HashStore()
    a = lease(store, "a", 1)
    state = a.acquire(5)
    assert state.members == {} and state.intent is None and state.taken_over is None
    a.commit({1: record("a", 1)}, None)
    a.release()
    b = lease(store, "b", 2)
    started = time.monotonic()
    state = b.acquire(5)
    assert time.monotonic() - started < 0.2
    assert state.members == {1: record("a", 1)} and state.taken_over is None
    b.release()


def test_a_renewing_holder_keeps_the_token() -> None:
    """While its holder renews, nobody takes the token over, however long it is held: the
    waiter times out naming the holder."""
    store = HashStore()
    a = lease(store, "a", 1)
    a.acquire(5)
    try:
        b = lease(store, "b", 2)
        with pytest.raises(RuntimeError, match=r"held by a .*keeps renewing"):
            b.acquire(3 * BOUND)
        a.commit({1: record("a", 1)}, None)  # still the holder
    finally:
        a.release()


def test_a_holder_that_stops_renewing_loses_the_token_and_cannot_write() -> None:
    """A frozen holder's token is taken over after the bound, with its intent still there for
    the next holder; when it wakes, its writes fail (LeaseLostError) and change nothing."""
    store = HashStore()
    a = lease(store, "a", 1)
    a.acquire(5)
    intent = {"kind": "join", "rank": 1, "record": record("a", 1)}
    a.commit({}, intent)
    freeze(a)
    b = lease(store, "b", 2)
    started = time.monotonic()
    state = b.acquire(10)
    took = time.monotonic() - started
    assert BOUND <= took < BOUND + 1.0
    assert state.intent == intent
    assert state.taken_over is not None and "did not renew it" in state.taken_over
    with pytest.raises(LeaseLostError, match="lost the group membership token to b"):
        a.commit({1: record("a", 1)}, None)
    b.commit({2: record("b", 1)}, None)
    a.release()  # does nothing: it is not a's any more
    b.release()
    c = lease(store, "c", 3)
    assert c.acquire(5).members == {2: record("b", 1)}
    c.release()


def test_a_holder_whose_address_refuses_connections_is_proved_dead() -> None:
    """A holder whose address refuses connections (its process is gone) loses the token well
    before the bound."""
    store = HashStore()
    dead = MembershipLease(store, record("a", 1, refusing_port()), 1, 30.0, RENEW)
    dead.acquire(5)
    freeze(dead)
    b = MembershipLease(store, record("b", 1), 2, 30.0, RENEW)
    started = time.monotonic()
    state = b.acquire(20)
    assert time.monotonic() - started < 5.0
    assert state.taken_over is not None and "refuses connections" in state.taken_over
    b.release()


def test_a_relaunched_holder_takes_its_own_token_back_at_once() -> None:
    """A worker relaunched under its name and rank takes over the token its earlier
    incarnation held (that one is dead: a new start replaced it)."""
    store = HashStore()
    old = MembershipLease(store, record("a", 1), 1, 30.0, RENEW)
    old.acquire(5)
    freeze(old)
    new = MembershipLease(store, record("a", 2), 1, 30.0, RENEW)
    started = time.monotonic()
    state = new.acquire(5)
    assert time.monotonic() - started < 1.0
    assert state.taken_over is not None and "relaunched" in state.taken_over
    new.release()


def test_the_lease_works_on_a_tcp_store_with_two_clients() -> None:
    """On torch's TCPStore (a server and a client, as a group's members use it), a stalled
    holder is taken over by another client."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False)
    a = lease(server, "a", 0)
    a.acquire(5)
    freeze(a)
    b = lease(client, "b", 1)
    assert b.acquire(10).taken_over is not None
    with pytest.raises(LeaseLostError):
        a.commit({}, None)
    b.release()


def test_a_bound_that_renewals_cannot_keep_is_refused() -> None:
    """A bound at most twice the renewal interval is a clear error."""
    with pytest.raises(ValueError, match="needs renewals under"):
        MembershipLease(HashStore(), record("a", 1), 1, 0.2, 0.1)
