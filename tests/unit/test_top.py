"""``distgrad top``'s reading of members (issue 30, bad input and failure): each way a member
can fail to answer gets its own clear line within the client's bound -- nothing listening
(gone), a frozen one (accepts, never answers), a wrong secret; a peer vanishing while it is
scraped; and the view made of samples (rates, quantiles)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch

import distgrad.rpc as rpc
from distgrad._cli import main
from distgrad._observe import _top as top
from distgrad._observe._endpoint import MetricsEndpoint, endpoint_of
from distgrad._testing._world import open_world, world_options


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_member_gone_or_frozen_is_named_so_within_the_bound() -> None:
    client = top._Client(None, 0.5, False, None)
    gone = f"127.0.0.1:{_free_port()}"
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(4)  # accepts (the kernel does), never answers: a SIGSTOPped member
    try:
        address = f"127.0.0.1:{frozen.getsockname()[1]}"
        started = time.monotonic()
        got = top.fetch(client, {"gone": gone, "frozen": address})
        took = time.monotonic() - started
    finally:
        frozen.close()
    assert "nothing listens" in got["gone"]["error"]
    assert "no answer within 0.5 s" in got["frozen"]["error"]
    print(f"both answered in {took:.2f} s")
    view = top.summarize(got, None)
    assert not view["members"]["frozen"]["ok"]
    assert "no answer" in top.render(view)


def test_wrong_secret_is_told() -> None:
    with open_world(1) as world:
        endpoint = MetricsEndpoint(world.agents[0], "0.0.0.0:0")
        try:
            port = endpoint.address.rsplit(":", 1)[1]
            got = top.fetch(
                top._Client(b"not the secret", 2.0, False, None), {"w": f"127.0.0.1:{port}"}
            )
            assert got["w"]["error"] == "refused: wrong or missing secret (401)"
            secret = world.agents[0].secret
            assert secret is not None
            right = top.fetch(top._Client(secret, 2.0, False, None), {"w": f"127.0.0.1:{port}"})
            assert right["w"]["worker"] == "worker0"
        finally:
            endpoint.close()


def test_a_peer_vanishing_while_scraped() -> None:
    """worker2 dies while worker0's endpoint is scraped in a loop: every scrape is answered,
    and the last ones show worker2 dead."""
    options = world_options()
    options.metrics_addr = "127.0.0.1:0"
    with open_world(3, options=options) as world:
        endpoint = endpoint_of(world.agents[0])
        assert endpoint is not None
        client = top._Client(None, 5.0, False, None)
        errors: list[str] = []
        samples: list[dict] = []
        stop = threading.Event()

        def scrape() -> None:
            while not stop.is_set():
                got = top.fetch(client, {"worker0": endpoint.address})["worker0"]
                (errors.append(got["error"]) if "error" in got else samples.append(got))

        scraper = threading.Thread(target=scrape)
        scraper.start()
        try:
            world.run_on(0, rpc.rpc_sync, "worker2", double, (torch.ones(1),))
            world.kill(2)
            with pytest.raises(Exception):  # noqa: B017 (a peer failure, whatever its class)
                world.run_on(0, rpc.rpc_sync, "worker2", double, (torch.ones(1),))
            deadline = time.monotonic() + 20
            while not (samples and "worker2" in samples[-1]["dead"] + samples[-1]["suspected"]):
                assert time.monotonic() < deadline, samples[-1] if samples else errors
                time.sleep(0.1)
        finally:
            stop.set()
            scraper.join(30)
    assert not errors and samples


def test_once_json_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    options = world_options()
    options.metrics_addr = "127.0.0.1:0"
    with open_world(2, options=options) as world:
        for _ in range(5):
            world.run_on(0, rpc.rpc_sync, "worker1", double, (torch.ones(1),))
        endpoint = endpoint_of(world.agents[0])
        assert endpoint is not None
        assert main(["top", endpoint.address, "--once", "--json"]) == 0
        view = json.loads(capsys.readouterr().out)
        assert main(["top", endpoint.address, "--once"]) == 0
        screen = capsys.readouterr().out
    members = view["members"]
    assert sorted(members) == ["worker0", "worker1"]
    to1 = members["worker0"]["peers"]["worker1"]
    assert to1["calls"] >= 5 and to1["p50_s"] is not None and to1["p99_s"] >= to1["p50_s"]
    assert members["worker0"]["state"] == "running" and members["worker0"]["calls_per_s"] > 0
    assert "worker0 -> worker1" in screen


def test_rates_come_from_two_samples() -> None:
    def snap(t: float, calls: int) -> dict:
        buckets = [0] * 21
        buckets[4] = calls
        function = {"outcomes": {"ok": calls}, "buckets": buckets, "seconds": 0.0}
        return {
            "address": "a", "time": t, "uptime": t, "state": "running", "calls_in_flight": 0,
            "requests_in_flight": 0, "suspected": [], "dead": [],
            "process": {"resident_bytes": 1}, "layers": {},
            "latency_bounds": [25e-6 * 2**i for i in range(20)],
            "peers": {"p": {"functions": {"f": function}, "calls_in_flight": 0,
                            "requests_served": 0, "bytes_sent": 0, "bytes_received": 0}},
        }  # fmt: skip

    view = top.summarize({"m": snap(12.0, 30)}, {"m": snap(10.0, 10)})
    member = view["members"]["m"]
    assert member["calls_per_s"] == pytest.approx(10.0)
    assert member["peers"]["p"]["p50_s"] == pytest.approx(25e-6 * 16)
