"""A member's metrics endpoint (issue 30): an HTTP server on its own thread, opt-in
(``TensorPipeRpcBackendOptions(metrics_addr="host:port")`` or ``$DISTGRAD_METRICS_ADDR``; port
0 picks one), answering

* ``/metrics``: Prometheus' text format (``_exposition.prometheus_text``);
* ``/json``: the same figures as JSON (what ``distgrad top`` reads);
* ``/members``: every member's endpoint address, asked of each over RPC (once, then kept);
* ``/traces``: its finished spans (when calls are traced: ``DISTGRAD_TRACE=1``).

Where the address is not loopback, every request must carry the bearer token derived from the
cluster secret (:func:`token`: ``Authorization: Bearer <token>``), and with the options' TLS
contexts it is served over TLS. One request at a time, each bounded (``REQUEST_TIMEOUT``), the
figures rendered at most every ``FRESH`` seconds: a flood of requests costs the member what a
few scrapes a second do, and its RPC traffic goes on (the server never takes the agent's
locks for longer than a snapshot)."""

from __future__ import annotations

import hashlib
import hmac
import http.server
import ipaddress
import json
import logging
import socket
import ssl
import threading
import time
from typing import Any

from .._config import ENV_METRICS_ADDR, env_str
from .._rpc._core import (
    RpcAgent,
    RpcLayer,
    bind_thread,
    current_agent,
    register_layer,
    tracing,
)
from . import _exposition

__all__ = [
    "ASK_TIMEOUT",
    "ENV_METRICS_ADDR",
    "FRESH",
    "REQUEST_TIMEOUT",
    "MetricsEndpoint",
    "ObserveLayer",
    "endpoint_of",
    "metrics_address",
    "register",
    "token",
]

_log = logging.getLogger("distgrad.observe")

#: seconds a request may take to arrive and be answered (a slow or stuck client is cut off)
REQUEST_TIMEOUT = 2.0
#: seconds a rendered snapshot is served again to the next requests
FRESH = 0.25
#: seconds to wait for a peer's answer to the endpoint-address question
ASK_TIMEOUT = 1.0


def token(secret: bytes) -> str:
    """The bearer token of a group's metrics endpoints, derived from its cluster secret."""
    return hmac.new(secret, b"distgrad metrics endpoint v1", hashlib.sha256).hexdigest()


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"metrics address {address!r}: expected host:port (port 0: any)")
    return host.strip("[]"), int(port)


class _Server(http.server.HTTPServer):
    request_queue_size = 64
    endpoint: MetricsEndpoint

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.debug("metrics endpoint: a request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("metrics endpoint: " + format, *args)

    def do_GET(self) -> None:
        endpoint = self.server.endpoint
        refusal = endpoint.refusal(self.headers.get("Authorization"))
        if refusal is not None:
            self._answer(refusal[0], refusal[1], "text/plain; charset=utf-8")
            return
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                body = _exposition.prometheus_text(endpoint.snapshot())
                self._answer(200, body, _exposition.CONTENT_TYPE)
            elif path == "/json":
                self._answer(200, json.dumps(endpoint.snapshot()), "application/json")
            elif path == "/members":
                self._answer(200, json.dumps(endpoint.members()), "application/json")
            elif path == "/traces":
                self._answer(200, json.dumps(endpoint.traces()), "application/json")
            else:
                self._answer(
                    404, "not found: try /metrics, /json, /members or /traces\n", "text/plain"
                )
        except Exception as exc:  # (the agent stopping under us, say): say so, keep serving
            self._answer(503, f"the member cannot answer now: {exc!r}\n", "text/plain")

    def _answer(self, status: int, body: str, content_type: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class MetricsEndpoint:
    """One agent's endpoint: its server thread, what it answers and who may ask."""

    def __init__(
        self,
        agent: RpcAgent,
        address: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        host, port = parse_address(address)
        self._agent = agent
        #: a token is asked for unless the address is loopback
        self.guarded = not is_loopback(host)
        server = _Server6 if ":" in host else _Server
        self._server = server((host, port), _Handler)
        self._server.endpoint = self
        self._server.timeout = REQUEST_TIMEOUT
        self.tls = ssl_context is not None
        if ssl_context is not None:
            self._server.socket = ssl_context.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
        bound = self._server.server_address
        self.address = f"{host if ':' not in host else f'[{host}]'}:{bound[1]}"
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._members: dict[str, str] = {}
        self._thread = threading.Thread(
            target=self._serve, name=f"distgrad-metrics-{agent.worker_info.name}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"<MetricsEndpoint {self.address} guarded={self.guarded} tls={self.tls}>"

    def _serve(self) -> None:
        previous = bind_thread(self._agent)
        try:
            self._server.serve_forever(poll_interval=0.2)
        finally:
            bind_thread(previous)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def refusal(self, authorization: str | None) -> tuple[int, str] | None:
        """Why a request with this ``Authorization`` header is refused (status, body), or None."""
        if not self.guarded:
            return None
        secret = self._agent.secret
        if secret is None:
            return 503, "the member has no cluster secret yet\n"
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token(secret)):
            return 401, (
                "wrong or missing token: send 'Authorization: Bearer <token>', the token derived "
                "from the group's cluster secret (distgrad top --secret / $DISTGRAD_SECRET)\n"
            )
        return None

    def snapshot(self) -> dict[str, Any]:
        """The member's figures, rendered at most every ``FRESH`` seconds."""
        now = time.monotonic()
        with self._lock:
            cached = self._cached
            if cached is not None and now - cached[0] < FRESH:
                return cached[1]
            snap = _exposition.snapshot(self._agent)
            snap["metrics_address"] = self.address
            self._cached = (now, snap)
            return snap

    def traces(self) -> list[dict[str, Any]]:
        """This member's finished spans kept (``_rpc._core.tracing``; empty unless traced)."""
        name = self._agent.worker_info.name
        return [span.as_dict() for span in tracing.finished(name)]

    def members(self) -> dict[str, str | None]:
        """Every member's endpoint address (None: it has none, or did not answer), asked of
        each over RPC the first time and kept."""
        agent = self._agent
        found: dict[str, str | None] = {agent.worker_info.name: self.address}
        asking = []
        for info in agent.get_worker_infos():
            if info.name in found:
                continue
            known = self._members.get(info.name)
            if known is not None:
                found[info.name] = known
                continue
            try:
                future = agent.call_async(
                    info, metrics_address, (), {}, ASK_TIMEOUT, force=False, internal=True
                )
            except Exception:
                found[info.name] = None
                continue
            asking.append((info.name, future))
        for name, future in asking:
            try:
                address = future.wait()
            except Exception:
                address = None
            if isinstance(address, str):
                self._members[name] = address
            found[name] = address
        return found


def endpoint_of(agent: RpcAgent) -> MetricsEndpoint | None:
    endpoint = agent.layer_state.get(MetricsEndpoint)
    return endpoint if isinstance(endpoint, MetricsEndpoint) else None


def metrics_address() -> str | None:
    """(Run by a peer over RPC.) This member's endpoint address, if it has one."""
    agent = current_agent()
    endpoint = endpoint_of(agent) if agent is not None else None
    return endpoint.address if endpoint is not None else None


class ObserveLayer(RpcLayer):
    """Starts an agent's metrics endpoint when it starts (if asked for), closes it when it
    stops."""

    name = "observe"

    def on_agent_start(self, agent: Any) -> None:
        assert isinstance(agent, RpcAgent)
        address = getattr(agent.options, "metrics_addr", None) or env_str(ENV_METRICS_ADDR)
        if not address:
            return
        ssl_context = getattr(agent.options, "server_ssl_context", None)
        endpoint = MetricsEndpoint(agent, address, ssl_context=ssl_context)
        agent.layer_state[MetricsEndpoint] = endpoint
        _log.info("%s: metrics endpoint at %s", agent.worker_info.name, endpoint.address)

    def on_agent_stop(self, agent: Any) -> None:
        endpoint = agent.layer_state.pop(MetricsEndpoint, None)
        if isinstance(endpoint, MetricsEndpoint):
            endpoint.close()


def register() -> None:
    """Register the layer (``distgrad.rpc`` does, when imported); again: nothing."""
    register_layer(_LAYER)


_LAYER = ObserveLayer()
