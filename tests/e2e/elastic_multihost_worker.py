"""A process of ``test_elastic_multihost.py``; run as a script inside a network namespace.

``python elastic_multihost_worker.py RANK MASTER_HOST:PORT [CERT KEY]``: rank 0 leads the
dynamic group and drives: it waits for 2 members, runs an autograd step through every member,
says ``GROW``, waits for 5, steps, tells ranks 2-4 to leave, waits for 2, steps, tells rank 1 to
leave, and prints ``RESULT {json}``. Other ranks join and serve until told to leave.
"""

from __future__ import annotations

import json
import ssl
import sys
import threading
import time

import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc

_leave = threading.Event()


def leave_now() -> None:
    _leave.set()


def my_address() -> str:
    agent = rpc.api._get_current_rpc_agent()
    return str(agent.address.host)


def options(master: str, tls: list[str]) -> rpc.TensorPipeRpcBackendOptions:
    extra: dict[str, object] = {}
    if tls:  # mutual TLS: each side proves itself with the shared test cert
        cert, key = tls
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(cert, key)
        server.verify_mode = ssl.CERT_REQUIRED
        server.load_verify_locations(cert)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.load_cert_chain(cert, key)
        client.load_verify_locations(cert)
        extra.update(server_ssl_context=server, client_ssl_context=client)
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{master}", rpc_timeout=60, **extra)


def step() -> float:
    """An autograd chain through every other member; max |distributed - local| gradient."""
    others = [w.name for w in rpc.members() if w.id != 0]
    w = torch.randn(4, requires_grad=True)
    with dist_autograd.context() as context_id:
        x = w
        for i, name in enumerate(others):
            x = rpc.rpc_sync(name, torch.mul, args=(x, float(i + 2)))
        dist_autograd.backward(context_id, [(x * x).sum()])
        grad = dist_autograd.get_gradients(context_id)[w]
    local = w.detach().clone().requires_grad_()
    y = local
    for i in range(len(others)):
        y = y * float(i + 2)
    (y * y).sum().backward()
    assert local.grad is not None
    return float((grad - local.grad).abs().max())


def wait_size(n: int) -> None:
    deadline = time.monotonic() + 90
    while len(rpc.members()) != n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"group of {len(rpc.members())}, expected {n}")
        time.sleep(0.05)


def main() -> None:
    rank, master, tls = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=None, rpc_backend_options=options(master, tls))
    if rank != 0:
        _leave.wait(150)
        rpc.shutdown()
        return
    result: dict[str, object] = {}
    try:
        wait_size(2)
        result["diff_2"] = step()
        print("GROW", flush=True)
        wait_size(5)
        result["diff_5"] = step()
        result["addresses"] = {w.name: rpc.rpc_sync(w, my_address) for w in rpc.members()}
        for r in (2, 3, 4):
            rpc.rpc_sync(f"w{r}", leave_now)
        wait_size(2)
        result["diff_back_to_2"] = step()
        result["members"] = [w.name for w in rpc.members()]
        rpc.rpc_sync("w1", leave_now)
        wait_size(1)
    finally:
        rpc.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
