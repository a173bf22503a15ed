"""The I/O thread never waits for a handshake (issue 22 item 3): a message sent from it to a
peer with no open connection is dialed and sent by a dialing thread. Before, two workers whose
I/O threads each dialed the other while handling a frame waited for each other (a handshake is
answered by the acceptor's I/O thread) until the handshake timed out -- seen as a shutdown
stuck in every worker. On in-memory worlds, whose handshakes are answered as over sockets."""

from __future__ import annotations

import threading
import time

from distgrad._rpc._core._agent import current_agent
from distgrad._rpc._core._functions import on_io_thread
from distgrad.testing import open_world, world_options

_both_dialing = threading.Barrier(2)
_lock = threading.Lock()
_took: dict[int, float] = {}
_errors: dict[int, BaseException] = {}
_pongs: dict[int, int] = {}
_io_threads: dict[int, str] = {}


@on_io_thread
def _ping(other: int) -> None:
    """On worker ``1 - other``'s I/O thread: once both are here, notify ``other`` (a peer this
    worker has no connection to)."""
    agent = current_agent()
    assert agent is not None
    me = agent.worker_info.id
    _io_threads[me] = threading.current_thread().name
    _both_dialing.wait(5)
    started = time.monotonic()
    try:
        agent.notify(other, _pong, (me,))
    except BaseException as exc:
        with _lock:
            _errors[me] = exc
    with _lock:
        _took[me] = time.monotonic() - started


@on_io_thread
def _pong(src: int) -> None:
    agent = current_agent()
    assert agent is not None
    with _lock:
        _pongs[agent.worker_info.id] = src


def test_two_io_threads_that_dial_each_other_do_not_wait_for_each_other() -> None:
    """worker2 pings worker0 and worker1; each one's I/O thread, handling the ping, notifies
    the other at the same moment. Both notices arrive at once, and neither I/O thread waited
    (before: each waited a handshake timeout for the other's I/O thread, and both failed)."""
    _took.clear()
    _errors.clear()
    _pongs.clear()
    _both_dialing.reset()
    options = world_options(heartbeat_interval=0.1, peer_timeout=1.0)
    with open_world(3, options=options) as world:
        agent2 = world.agents[2]
        world.run_on(2, agent2.notify, 0, _ping, (1,))
        world.run_on(2, agent2.notify, 1, _ping, (0,))
        deadline = time.monotonic() + 5.0
        while len(_pongs) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _errors == {}
        assert _pongs == {0: 1, 1: 0}
        assert set(_took) == {0, 1}
        assert max(_took.values()) < 0.2, _took  # handed to a dialing thread, not waited for
        assert all(name.startswith("distgrad-io") for name in _io_threads.values())
        for rank in (0, 1):
            assert world.agents[rank]._dialer.dials >= 1
