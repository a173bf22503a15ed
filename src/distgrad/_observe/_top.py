"""``distgrad top``: a live view of a running group, from any host that has its secret
(issue 30). It reads the members' metrics endpoints (``_endpoint``): the addresses given, and
every member they know of (``/members``); each second it asks each member for its figures
(``/json``, all at once, each bounded by ``--timeout``) and shows one row per member -- state,
calls/s, in flight, errors, suspected peers, memory, backward passes -- and one per peer it
called (calls/s, p50/p99 latency, in flight, errors by kind). ``--once --json`` prints one
sample as JSON for scripts. A member that does not answer is shown so (frozen, gone, wrong
secret), the others go on."""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from .._config import ENV_SECRET
from ._endpoint import ASK_TIMEOUT, token

__all__ = ["Sample", "add_parser", "fetch", "render", "run", "summarize"]

#: what the rows of a member that answered are made of (see :func:`summarize`)
Sample = dict[str, Any]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "top",
        help="live view of a running group's members (reads their metrics endpoints)",
        description="Attach to a running group through its members' metrics endpoints "
        "(metrics_addr= / DISTGRAD_METRICS_ADDR) and show every member, refreshed each second; "
        "q or Ctrl-C quits.",
    )
    parser.add_argument(
        "addresses",
        nargs="+",
        help="host:port of one or more members' endpoints (the others are found through them)",
    )
    parser.add_argument(
        "--secret",
        help=f"the group's cluster secret (default: ${ENV_SECRET}); needed off loopback",
    )
    parser.add_argument("--once", action="store_true", help="one sample, then exit")
    parser.add_argument("--json", action="store_true", help="with --once: print JSON")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument(
        "--timeout", type=float, default=2.0, help="seconds to wait for each member's answer"
    )
    parser.add_argument("--tls", action="store_true", help="the endpoints are served over TLS")
    parser.add_argument("--cafile", help="with --tls: the CA that signed the endpoints' certs")
    return parser


class _Client:
    def __init__(self, secret: bytes | None, timeout: float, tls: bool, cafile: str | None):
        self.timeout = timeout
        self.scheme = "https" if tls else "http"
        self.headers = {"Authorization": f"Bearer {token(secret)}"} if secret else {}
        self.context = ssl.create_default_context(cafile=cafile) if tls else None

    def get(self, address: str, path: str) -> Any:
        """The JSON at ``path`` of ``address``; raises ``OSError`` naming what went wrong."""
        request = urllib.request.Request(f"{self.scheme}://{address}{path}", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as a:
                return json.loads(a.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                raise OSError("refused: wrong or missing secret (401)") from None
            body = exc.read()[:200].decode(errors="replace")
            raise OSError(f"answered {exc.code}: {body}") from None
        except TimeoutError:
            raise OSError(f"no answer within {self.timeout:g} s (frozen?)") from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise OSError(f"no answer within {self.timeout:g} s (frozen?)") from None
            if isinstance(reason, ConnectionRefusedError):
                raise OSError("nothing listens there (gone?)") from None
            raise OSError(f"unreachable: {reason}") from None
        except (ConnectionError, ValueError) as exc:
            raise OSError(f"broken answer: {exc!r}") from None


def discover(client: _Client, addresses: Sequence[str]) -> dict[str, str]:
    """member name -> endpoint address: those the given endpoints know of, or the addresses
    themselves (named by their address) if none answers."""
    found: dict[str, str] = {}
    patient = _Client.__new__(_Client)  # (a member asks its peers first: a longer bound)
    patient.__dict__.update(client.__dict__, timeout=client.timeout + ASK_TIMEOUT + 0.5)
    for address in addresses:
        try:
            members = patient.get(address, "/members")
        except OSError:
            continue
        for name, member_address in members.items():
            if member_address:
                found.setdefault(name, member_address)
            elif name not in found:
                found[name] = ""  # a member that did not say where: shown, not asked
    for address in addresses:
        if address not in found.values():
            found[address] = address
    return found


def fetch(client: _Client, members: dict[str, str]) -> dict[str, Sample]:
    """Every member's ``/json``, asked of all at once; a failure is ``{"error": ...}``."""
    results: dict[str, Sample] = {}

    def one(name: str, address: str) -> None:
        if not address:
            results[name] = {"error": "no answer: its endpoint address is not known yet"}
            results[name]["address"] = "?"
            return
        try:
            results[name] = client.get(address, "/json")
        except OSError as exc:
            results[name] = {"error": str(exc)}
        results[name]["address"] = address

    threads = [
        threading.Thread(target=one, args=item, daemon=True) for item in sorted(members.items())
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(client.timeout + 5)
    for name, address in members.items():  # (a thread still stuck: its own bound failed)
        results.setdefault(name, {"error": "no answer", "address": address})
    return results


def _quantile(buckets: list[int], bounds: list[float], q: float) -> float | None:
    total = sum(buckets)
    if not total:
        return None
    seen = 0
    for i, count in enumerate(buckets):
        seen += count
        if count and seen >= q * total:
            return bounds[min(i, len(bounds) - 1)]
    return bounds[-1]


def _calls(peer: dict[str, Any]) -> int:
    return sum(sum(f["outcomes"].values()) for f in peer["functions"].values())


def summarize(now: dict[str, Sample], before: dict[str, Sample] | None) -> dict[str, Any]:
    """Rows of the view: per member, and per member and peer; rates from ``before`` (or, the
    first time, averages since each member started)."""
    members: dict[str, Any] = {}
    for name, snap in sorted(now.items()):
        if "error" in snap:
            members[name] = {"address": snap["address"], "ok": False, "error": snap["error"]}
            continue
        prev = (before or {}).get(name)
        if prev is not None and "error" in prev:
            prev = None
        span = snap["time"] - prev["time"] if prev is not None else snap["uptime"]
        peers: dict[str, Any] = {}
        calls_total = errors_total = 0
        calls_before = 0
        for peer, p in sorted(snap["peers"].items()):
            buckets = [0] * (len(snap["latency_bounds"]) + 1)
            outcomes = {"timeout": 0, "remote": 0, "peer_failure": 0, "other": 0}
            for f in p["functions"].values():
                for i, count in enumerate(f["buckets"]):
                    buckets[i] += count
                for kind in outcomes:
                    outcomes[kind] += f["outcomes"].get(kind, 0)
            calls = _calls(p)
            old = _calls(prev["peers"][peer]) if prev is not None and peer in prev["peers"] else 0
            errors = sum(outcomes.values())
            calls_total += calls
            calls_before += old
            errors_total += errors
            bounds = snap["latency_bounds"]
            peers[peer] = {
                "calls": calls,
                "calls_per_s": (calls - old) / span if span > 0 else 0.0,
                "p50_s": _quantile(buckets, bounds, 0.5),
                "p99_s": _quantile(buckets, bounds, 0.99),
                "in_flight": p["calls_in_flight"],
                "errors": outcomes,
                "requests_served": p["requests_served"],
                "bytes_sent": p["bytes_sent"],
                "bytes_received": p["bytes_received"],
            }
        layers = snap["layers"]
        members[name] = {
            "address": snap["address"],
            "ok": True,
            "state": snap["state"],
            "uptime_s": snap["uptime"],
            "calls": calls_total,
            "calls_per_s": (calls_total - calls_before) / span if span > 0 else 0.0,
            "in_flight": snap["calls_in_flight"],
            "serving": snap["requests_in_flight"],
            "errors": errors_total,
            "suspected": snap["suspected"],
            "dead": snap["dead"],
            "resident_bytes": snap["process"]["resident_bytes"],
            "backward_passes": layers.get("backward_passes_total", 0),
            "backward_seconds": layers.get("backward_seconds_total", 0.0),
            "peers": peers,
        }
    return {"time": time.time(), "members": members}


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.2f}" if seconds < 1 else f"{seconds * 1e3:.0f}"


def _bytes(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024:
            return f"{n:.0f}{unit}"
        n /= 1024
    return f"{n:.0f}T"


def _age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


def render(view: dict[str, Any]) -> str:
    """The view as the screen shows it."""
    members = view["members"]
    lines = [
        f"distgrad top - {len(members)} members - "
        f"{time.strftime('%H:%M:%S', time.localtime(view['time']))}   (q quits)",
        "",
        f"{'MEMBER':<12} {'STATE':<9} {'UP':>7} {'CALLS/S':>9} {'INFL':>5} {'SERV':>5} "
        f"{'ERRORS':>6} {'RSS':>6} {'BWD':>6} {'BWD-S':>7}  SUSPECTED",
    ]
    for name, m in members.items():
        if not m["ok"]:
            lines.append(f"{name:<12} {'-':<9} {m['error']}  [{m['address']}]")
            continue
        suspected = ",".join(m["suspected"] + [f"{d}(dead)" for d in m["dead"]]) or "-"
        lines.append(
            f"{name:<12} {m['state']:<9} {_age(m['uptime_s']):>7} {m['calls_per_s']:>9.1f} "
            f"{m['in_flight']:>5} {m['serving']:>5} {m['errors']:>6} "
            f"{_bytes(m['resident_bytes']):>6} {m['backward_passes']:>6.0f} "
            f"{m['backward_seconds']:>7.2f}  {suspected}"
        )
    lines += [
        "",
        f"{'FROM -> TO':<24} {'CALLS/S':>9} {'P50 ms':>8} {'P99 ms':>8} {'INFL':>5} "
        f"{'TIMEOUT':>7} {'REMOTE':>6} {'PEER':>5} {'SENT':>7} {'RECV':>7}",
    ]
    for name, m in members.items():
        if not m["ok"]:
            continue
        for peer, p in m["peers"].items():
            if not p["calls"]:
                continue
            e = p["errors"]
            lines.append(
                f"{name + ' -> ' + peer:<24} {p['calls_per_s']:>9.1f} {_ms(p['p50_s']):>8} "
                f"{_ms(p['p99_s']):>8} {p['in_flight']:>5} {e['timeout']:>7} {e['remote']:>6} "
                f"{e['peer_failure']:>5} {_bytes(p['bytes_sent']):>7} "
                f"{_bytes(p['bytes_received']):>7}"
            )
    return "\n".join(lines)


def _quit_pressed(timeout: float) -> bool:
    """Wait up to ``timeout`` for a key on a terminal's stdin; True for q."""
    if not sys.stdin.isatty():
        time.sleep(timeout)
        return False
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return bool(ready) and sys.stdin.read(1) in ("q", "Q")


def run(args: argparse.Namespace) -> int:
    secret_text = args.secret or os.environ.get(ENV_SECRET)
    secret = secret_text.encode() if secret_text else None
    client = _Client(secret, args.timeout, args.tls, args.cafile)
    members = discover(client, args.addresses)
    if args.once:
        view = summarize(fetch(client, members), None)
        print(json.dumps(view, indent=2) if args.json else render(view))
        return 0 if any(m["ok"] for m in view["members"].values()) else 1
    interactive = sys.stdin.isatty()
    saved = None
    if interactive:
        import termios
        import tty

        saved = termios.tcgetattr(sys.stdin)
        tty.setcbreak(sys.stdin.fileno())
    before: dict[str, Sample] | None = None
    try:
        while True:
            now = fetch(client, members)
            view = summarize(now, before)
            before = now
            sys.stdout.write("\x1b[H\x1b[2J" + render(view) + "\n")
            sys.stdout.flush()
            if _quit_pressed(args.interval):
                return 0
            if len(members) < 2 or any("error" in s for s in now.values()):
                members = {**members, **discover(client, list(members.values()))}
    except KeyboardInterrupt:
        return 0
    finally:
        if saved is not None:
            import termios

            termios.tcsetattr(sys.stdin, termios.TCSADRAIN, saved)
