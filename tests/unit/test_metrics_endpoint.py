"""The metrics endpoint (issue 30 item 2, and its bad input): Prometheus text read back by
``prometheus_client``'s own parser, the figures matching what the job did; JSON; members'
addresses; the token guard; a flood; a frozen member's endpoint as seen by a scraper."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import parser as prometheus_parser  # (the test extra has it)

import distgrad.rpc as rpc
from distgrad._observe import _endpoint, _top
from distgrad._observe._endpoint import MetricsEndpoint, endpoint_of, token
from distgrad._testing._world import open_world, world_options
from tests._needs import command, needs


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def fail() -> None:
    raise ValueError("no")


def _get(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    found = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_prometheus_text_parses_and_matches_the_calls() -> None:
    options = world_options()
    options.metrics_addr = "127.0.0.1:0"
    tensor = torch.ones(100)
    with open_world(2, options=options) as world:
        for _ in range(4):
            world.run_on(0, rpc.rpc_sync, "worker1", double, (tensor,))
        with pytest.raises(ValueError):
            world.run_on(0, rpc.rpc_sync, "worker1", fail)
        endpoint = endpoint_of(world.agents[0])
        assert endpoint is not None and not endpoint.guarded
        status, text = _get(f"http://{endpoint.address}/metrics")
        stats = world.agents[0].agent_statistics().peers["worker1"]
        status_json, body = _get(f"http://{endpoint.address}/json")
        status_members, members = _get(f"http://{endpoint.address}/members")
        status_missing, _ = _get(f"http://{endpoint.address}/nothing")
        other = endpoint_of(world.agents[1])
        assert other is not None
    assert (status, status_json, status_members, status_missing) == (200, 200, 200, 404)
    samples = _samples(text)
    function = f"{__name__}.double"
    me = {"worker": "worker0", "peer": "worker1"}
    assert _value(samples, "distgrad_calls_total", **me, function=function, outcome="ok") == 4
    assert (
        _value(samples, "distgrad_calls_total", **me, function=f"{__name__}.fail", outcome="remote")
        == 1
    )
    assert _value(samples, "distgrad_call_latency_seconds_count", **me, function=function) == 4
    assert (
        _value(samples, "distgrad_call_latency_seconds_bucket", **me, function=function, le="+Inf")
        == 4
    )
    assert _value(samples, "distgrad_sent_bytes_total", **me) == stats.bytes_sent
    assert _value(samples, "distgrad_received_bytes_total", **me) == stats.bytes_received
    assert _value(samples, "distgrad_peer_suspected", **me) == 0
    assert _value(samples, "distgrad_up", worker="worker0") == 1
    snap = json.loads(body)
    assert snap["worker"] == "worker0" and snap["peers"]["worker1"]["calls_sent"] == 5
    assert json.loads(members) == {"worker0": endpoint.address, "worker1": other.address}


def test_guarded_endpoint_wants_the_token() -> None:
    """An endpoint on a non-loopback address answers only with the token derived from the
    secret: none or a wrong one gets 401 and says how to get it."""
    with open_world(1) as world:
        agent = world.agents[0]
        endpoint = MetricsEndpoint(agent, "0.0.0.0:0")
        try:
            assert endpoint.guarded
            port = endpoint.address.rsplit(":", 1)[1]
            url = f"http://127.0.0.1:{port}/metrics"
            status, body = _get(url)
            assert status == 401 and "token" in body and "secret" in body
            status, _ = _get(url, {"Authorization": "Bearer " + token(b"wrong secret")})
            assert status == 401
            assert agent.secret is not None
            status, text = _get(url, {"Authorization": "Bearer " + token(agent.secret)})
            assert status == 200 and "distgrad_up" in text
        finally:
            endpoint.close()


def test_flood_and_stuck_clients_get_answers_and_calls_go_on() -> None:
    """Clients that connect and say nothing, and a flood of scrapes: each scrape is answered
    (a stuck client is cut off after REQUEST_TIMEOUT), and calls keep working meanwhile. The
    no-op latency beside the scraping loop is printed (an observation, not an assertion)."""
    options = world_options()
    options.metrics_addr = "127.0.0.1:0"
    with open_world(2, options=options) as world:
        endpoint = endpoint_of(world.agents[1])
        assert endpoint is not None
        host, port = endpoint.address.rsplit(":", 1)
        stuck = [socket.create_connection((host, int(port))) for _ in range(3)]
        stop = threading.Event()
        answers: list[int] = []

        def scrape() -> None:
            while not stop.is_set():
                answers.append(_get(f"http://{endpoint.address}/metrics", timeout=30)[0])

        scrapers = [threading.Thread(target=scrape) for _ in range(4)]

        def latency(n: int) -> float:
            start = time.perf_counter()
            for _ in range(n):
                world.run_on(0, rpc.rpc_sync, "worker1", double, (torch.ones(1),))
            return (time.perf_counter() - start) / n * 1e6

        quiet = latency(200)
        for t in scrapers:
            t.start()
        try:
            busy = latency(200)
        finally:
            stop.set()
            for t in scrapers:
                t.join(30)
            for s in stuck:
                s.close()
    print(
        f"rpc_sync no-op over the in-memory transport: {quiet:.0f} us quiet, {busy:.0f} us "
        f"beside 4 scraping loops ({len(answers)} scrapes)"
    )
    assert answers and set(answers) == {200}


def test_scraping_a_frozen_member_times_out_cleanly() -> None:
    """A member whose endpoint accepts but never answers (a frozen process: its listening
    socket's backlog takes the connection, nothing reads it): the scraper's own bound gives a
    clear error, not a hang."""
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(4)
    try:
        port = frozen.getsockname()[1]
        start = time.monotonic()
        with pytest.raises((TimeoutError, urllib.error.URLError, socket.timeout)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=0.5).read()
        assert time.monotonic() - start < 30  # (a bound of the test, not a timing)
    finally:
        frozen.close()


def test_register_is_idempotent() -> None:
    _endpoint.register()
    _endpoint.register()


@needs(command("openssl"))
def test_tls_endpoint_with_the_token(tmp_path: Path) -> None:
    """With a server TLS context the endpoint speaks TLS only; distgrad top reads it with
    --tls and the CA (and the token: the address is not loopback)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(cert), str(key))
    with open_world(1) as world:
        agent = world.agents[0]
        endpoint = MetricsEndpoint(agent, "0.0.0.0:0", ssl_context=server)
        try:
            address = "127.0.0.1:" + endpoint.address.rsplit(":", 1)[1]
            with pytest.raises(OSError):  # plaintext: no answer (the port speaks TLS only)
                _get(f"http://{address}/json", timeout=5)
            assert agent.secret is not None
            client = _top._Client(agent.secret, 5.0, True, str(cert))
            got = _top.fetch(client, {"worker0": address})["worker0"]
            assert got.get("worker") == "worker0", got
            wrong = _top._Client(b"wrong", 5.0, True, str(cert))
            assert "401" in _top.fetch(wrong, {"worker0": address})["worker0"]["error"]
        finally:
            endpoint.close()
