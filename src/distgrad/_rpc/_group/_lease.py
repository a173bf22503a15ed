"""The membership token of a dynamic group, as a *lease* on the group's state in the store.

The whole membership state is one store key holding plain JSON: the members' records (name,
address, incarnation), the *lease* (who holds the token: name, rank, incarnation, address, and
a counter its holder bumps every ``renew_every`` seconds) and the *intent* of the join or leave
in progress (kind, rank and record of the worker joining or leaving). Every change is one
``compare_set`` on that key, so a change is applied only by the worker that still holds the
lease and sees the state it last wrote (a holder that lost the lease finds out at its next
write, and its change is not applied).

A worker waiting for the token watches the key. The token is free when the lease is empty; it
is taken over (``compare_set`` against the very value watched, so one waiter wins) when

* the value has not changed for ``bound`` seconds of the waiter's own monotonic clock: the
  holder stopped renewing (dead, frozen or cut off past the bound; no clocks are compared
  between hosts), or
* the holder's death is proved: its address refuses connections, or the holder is an earlier
  incarnation of the waiter itself (the same name and rank, relaunched).

The holder writes its intent before it tells any member, and clears it when the change is
complete; a worker that takes the token over finds the intent of the one that lost it and
completes the change (``_dynamic``): a leave is rolled forward, a join rolled back, so every
member's view of the group ends the same.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["GroupState", "LeaseLostError", "MembershipLease", "write_state"]

_log = logging.getLogger("distgrad.rpc")
_KEY = "distgrad/membership"
_POLL_S = 0.02
_PROBE_EVERY_S = 1.0


class LeaseLostError(RuntimeError):
    """The membership token was taken over (this worker stalled past the lease's bound): the
    change it was making is completed or undone by the worker that took it over."""


@dataclass
class GroupState:
    """The group's membership as the store holds it: members' records by rank, and the
    intent of a change that its worker did not finish (``None`` when none)."""

    members: dict[int, dict[str, Any]]
    intent: dict[str, Any] | None
    #: why the token was taken over from its previous holder (``None``: it was free)
    taken_over: str | None = None


def _decode(raw: bytes) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(raw)
    return value


def _encode(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


_EMPTY = _encode({"intent": None, "lease": None, "members": {}})


def _members(value: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(rank): rec for rank, rec in value["members"].items()}


def write_state(store: Any, members: dict[int, dict[str, Any]]) -> None:
    """Start the state of a group whose members met without the store (in-memory worlds)."""
    store.set(_KEY, _encode({"intent": None, "lease": None, "members": _str_keys(members)}))


def _str_keys(members: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(rank): rec for rank, rec in sorted(members.items())}


def _refuses(host: object, port: object) -> bool:
    """True if ``host:port`` (a literal IP address) refuses a TCP connection: nothing listens
    there, so the process that did is gone."""
    if not isinstance(host, str) or not isinstance(port, int) or port <= 0:
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # unreachable, timed out: no proof of anything
        return False


class MembershipLease:
    """This worker's hold on the membership token (one join or leave at a time).

    ``me`` is this worker's record (``_rendezvous.address_record``) and ``rank`` its rank; a
    holder silent for ``bound`` seconds loses the token. Acquire with
    :meth:`acquire`; change the state with :meth:`commit`; :meth:`release` gives the token
    back (always call it: it also stops the renewing thread)."""

    def __init__(
        self, store: Any, me: dict[str, Any], rank: int, bound: float, renew_every: float
    ) -> None:
        if bound <= 2 * renew_every:
            raise ValueError(f"a lease bound of {bound:g}s needs renewals under {bound / 2:g}s")
        self._store = store
        self._me = {
            "holder": str(me["name"]),
            "rank": rank,
            "incarnation": int(me.get("incarnation") or 0),
            "host": me.get("host"),
            "port": me.get("port"),
        }
        self.bound = bound
        self._renew_every = renew_every
        self._lock = threading.Lock()
        self._raw: bytes | None = None  # the value this worker last wrote while holding
        self._value: dict[str, Any] = {}
        self._lost: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __repr__(self) -> str:
        state = "lost" if self._lost else "held" if self._raw is not None else "not held"
        return f"<MembershipLease of {self._me['holder']} ({state})>"

    @property
    def held(self) -> bool:
        return self._raw is not None and self._lost is None

    # -- taking the token ------------------------------------------------------------------------
    def _read(self) -> bytes:
        return bytes(self._store.compare_set(_KEY, "", _EMPTY))  # creates it when missing

    def _takeover_reason(
        self, lease: dict[str, Any], unchanged_s: float, probe: bool
    ) -> str | None:
        holder = f"{lease['holder']} (rank {lease['rank']})"
        if (
            lease["holder"] == self._me["holder"]
            and lease["rank"] == self._me["rank"]
            and lease["incarnation"] != self._me["incarnation"]
        ):
            return f"its holder {holder} was relaunched (an earlier incarnation of this worker)"
        if unchanged_s > self.bound:
            return (
                f"its holder {holder} did not renew it for {unchanged_s:.1f}s (bound "
                f"{self.bound:g}s): it died, stalled or was cut off"
            )
        if probe and _refuses(lease.get("host"), lease.get("port")):
            return f"its holder {holder} is dead (its address refuses connections)"
        return None

    def acquire(self, timeout: float) -> GroupState:
        """Take the token (waiting for it, or taking it over from a holder proved or
        suspected dead); return the group's state. Raises ``RuntimeError`` after ``timeout``
        seconds (``<= 0``: no limit) of a holder that keeps renewing it."""
        deadline = time.monotonic() + (timeout if timeout > 0 else 3600.0 * 24 * 365)
        seen: bytes | None = None
        seen_at = probed_at = time.monotonic()
        while True:
            raw = self._read()
            value = _decode(raw)
            lease = value["lease"]
            now = time.monotonic()
            reason: str | None = None
            if lease is not None:
                if raw != seen:
                    seen, seen_at = raw, now
                unchanged = now - seen_at
                probe = unchanged > 2 * self._renew_every and now - probed_at > _PROBE_EVERY_S
                if probe:
                    probed_at = now
                reason = self._takeover_reason(lease, unchanged, probe)
                if reason is None:
                    if now > deadline:
                        raise RuntimeError(
                            f"timed out after {timeout:g}s waiting for the group membership "
                            f"token, held by {lease['holder']} (it keeps renewing it: a join "
                            "or leave in progress)"
                        )
                    time.sleep(_POLL_S)
                    continue
            mine = dict(value, lease=dict(self._me, seq=0))
            desired = _encode(mine)
            if bytes(self._store.compare_set(_KEY, raw, desired)) != desired:
                continue  # someone else took it, or its holder renewed it: look again
            if reason is not None:
                _log.warning("took over the group membership token: %s", reason)
            _log.debug("%s holds the group membership token", self._me["holder"])
            self._raw, self._value = desired, mine
            self._renewer = threading.Thread(target=self._renew, name="distgrad-lease", daemon=True)
            self._renewer.start()
            return GroupState(_members(value), value["intent"], reason)

    # -- holding it ------------------------------------------------------------------------------
    def _swap(self, value: dict[str, Any]) -> None:
        """Write ``value`` if the store still holds what this worker last wrote (under the
        lock); else the lease is lost."""
        assert self._raw is not None
        if self._lost is not None:
            raise LeaseLostError(self._lost)
        lease = value.get("lease")
        if lease is not None:
            value = dict(value, lease=dict(lease, seq=int(lease["seq"]) + 1))
        desired = _encode(value)
        found = bytes(self._store.compare_set(_KEY, self._raw, desired))
        if found != desired:
            now = _decode(found).get("lease") or {}
            self._lost = (
                f"{self._me['holder']} lost the group membership token to "
                f"{now.get('holder', 'nobody')}: it did not renew it within {self.bound:g}s "
                "(stalled or cut off from the store); the change it was making is completed "
                "or undone by the next holder"
            )
            raise LeaseLostError(self._lost)
        self._raw, self._value = desired, value

    def _renew(self) -> None:
        while not self._stop.wait(self._renew_every):
            with self._lock:
                if self._raw is None or self._lost is not None:
                    return
                try:
                    self._swap(self._value)
                except LeaseLostError:
                    return
                except Exception as exc:  # the store is unreachable: keep trying
                    _log.warning("could not renew the group membership token: %s", exc)

    def check(self) -> None:
        """Raise :class:`LeaseLostError` if the token was taken over."""
        if self._lost is not None:
            raise LeaseLostError(self._lost)

    def commit(self, members: dict[int, dict[str, Any]], intent: dict[str, Any] | None) -> None:
        """Make ``members`` and ``intent`` the group's state (raises :class:`LeaseLostError`
        if the token was taken over)."""
        with self._lock:
            self._swap(dict(self._value, members=_str_keys(members), intent=intent))

    def release(self) -> None:
        """Give the token back, leaving the state as last committed (an intent still there is
        completed by the next holder). Never raises (the store may be gone)."""
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(5.0)
        with self._lock:
            if self._raw is None or self._lost is not None:
                return
            try:
                self._swap(dict(self._value, lease=None))
            except Exception as exc:  # lost, or the store is gone (the leader died)
                _log.warning("could not release the group membership token: %s", exc)
            self._raw = None
