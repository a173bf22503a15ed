"""Who reads a plain socket connection: the I/O thread, or a caller waiting alone for its answer.

The I/O thread does not watch each connection's socket itself: the sockets of plain (not TLS)
connections are registered, one-shot, in an ``epoll`` set of their own, and the I/O loop watches
that set's one descriptor. When a socket has data, the loop takes the connection's read role
(:attr:`Connection.reading`, a lock), reads what is there, hands the frames on, gives the role
back and re-arms the socket. A thread that waits for the answer to its own call can take the
read role instead (``Connection.read_until``): it disarms the socket in the set -- a system call
from its own thread, which wakes nobody -- and reads the connection itself until its answer is
there, so the answer costs it one wake-up and the I/O thread none. Exactly one thread holds the
role at a time; whoever gives it back re-arms the socket, so data that came meanwhile wakes the
loop at once (the set is level-triggered).

Only Linux has ``epoll``; elsewhere (and for TLS connections, whose SSL object must be used by
one thread only) the loop watches the socket as before and callers wait for the loop.
"""

from __future__ import annotations

import select
import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ._io import IoThread

__all__ = ["ReadPoller", "available"]

_EVENTS = getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLONESHOT", 0)
_BATCH = 64  # sockets handled per wake-up of the loop at most


class Readable(Protocol):
    """What the poller calls when a registered socket has data (on the I/O thread)."""

    def on_poll(self) -> None: ...


def available() -> bool:
    """Whether this platform has one-shot ``epoll`` (Linux)."""
    return hasattr(select, "epoll") and hasattr(select, "EPOLLONESHOT")


class ReadPoller:
    """The one-shot ``epoll`` set of a transport's plain connections, watched by its I/O loop."""

    def __init__(self, io: IoThread) -> None:
        self._io = io
        self._epoll = select.epoll()
        #: the set's ``modify`` (a connection re-arms or disarms its socket with it directly)
        self.modify = self._epoll.modify
        self.events = _EVENTS
        self._by_fd: dict[int, Readable] = {}
        self._lock = threading.Lock()  # (register/unregister may run on a dialing thread)
        self._watched = False
        self._closed = False

    def start(self) -> None:
        """Let the loop watch the set (on the I/O thread)."""
        if not self._watched and not self._closed:
            self._io.loop.add_reader(self._epoll.fileno(), self._ready)
            self._watched = True

    def close(self) -> None:
        """Stop watching and close the set (on the I/O thread)."""
        if self._closed:
            return
        self._closed = True
        if self._watched:
            try:
                self._io.loop.remove_reader(self._epoll.fileno())
            except (ValueError, OSError):
                pass
        self._epoll.close()

    def register(self, fd: int, reader: Readable) -> None:
        """Watch ``fd`` (armed); ``reader.on_poll`` runs on the I/O thread when it has data."""
        with self._lock:
            self._by_fd[fd] = reader
            self._epoll.register(fd, _EVENTS)

    def unregister(self, fd: int, reader: Readable) -> None:
        """Stop watching ``fd`` (before it is closed)."""
        with self._lock:
            if self._by_fd.get(fd) is reader:
                del self._by_fd[fd]
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):  # not registered, or the set is closed
                pass

    def arm(self, fd: int) -> None:
        """Watch ``fd`` again (any thread; after its read role was given back)."""
        try:
            self._epoll.modify(fd, _EVENTS)
        except (OSError, ValueError):  # unregistered meanwhile (closed), or the set is closed
            pass

    def disarm(self, fd: int) -> None:
        """Stop reporting ``fd`` until :meth:`arm` (any thread; a caller took its read role)."""
        try:
            self._epoll.modify(fd, 0)
        except (OSError, ValueError):
            pass

    def _ready(self) -> None:
        try:
            events = self._epoll.poll(0, _BATCH)
        except (OSError, ValueError):  # closed
            return
        by_fd = self._by_fd
        for fd, _mask in events:
            reader = by_fd.get(fd)
            if reader is not None:
                reader.on_poll()
