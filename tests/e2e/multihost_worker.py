"""One worker of test_multihost.py, run inside a network-namespace "host":
``multihost_worker.py RANK WORLD_SIZE MASTER_ADDR:PORT [CERT KEY]``. Rank 0 drives a
distributed autograd chain through every other worker (a stage per host) and an RRef, checks the
gradients against one-process autograd and prints ``RESULT <json>``; every worker prints the
address it listens on."""

from __future__ import annotations

import json
import ssl
import sys

import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc


def stage(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ weight)


def listen_address() -> str:
    address = rpc._get_current_rpc_agent().address
    assert address is not None
    return address.host


def chain(world_size: int, weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for rank in range(1, world_size):
        x = rpc.rpc_sync(f"worker{rank}", stage, (weights[rank - 1], x))
    return x


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    options: dict[str, object] = {"init_method": f"tcp://{sys.argv[3]}"}
    if len(sys.argv) > 4:  # mutual TLS: each side proves itself with the shared test cert
        cert, key = sys.argv[4], sys.argv[5]
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(cert, key)
        server.verify_mode = ssl.CERT_REQUIRED
        server.load_verify_locations(cert)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.load_cert_chain(cert, key)
        client.load_verify_locations(cert)
        options.update(server_ssl_context=server, client_ssl_context=client)
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(**options),  # type: ignore[arg-type]
    )
    print(f"LISTEN {rank} {listen_address()}", flush=True)
    if rank == 0:
        torch.manual_seed(0)
        weights = [torch.randn(8, 8, requires_grad=True) for _ in range(world_size - 1)]
        x = torch.randn(4, 8, requires_grad=True)
        differences = []
        for _ in range(3):
            with dist_autograd.context() as context_id:
                loss = chain(world_size, weights, x).sum()
                dist_autograd.backward(context_id, [loss])
                grads = dist_autograd.get_gradients(context_id)
                local = [t.detach().clone().requires_grad_() for t in [x, *weights]]
                h = local[0]
                for w in local[1:]:
                    h = torch.tanh(h @ w)
                expected = torch.autograd.grad(h.sum(), local)
                differences.append(
                    max(
                        (grads[t] - e).abs().max().item()
                        for t, e in zip([x, *weights], expected, strict=True)
                    )
                )
        rref = rpc.remote(f"worker{world_size - 1}", torch.add, (torch.ones(2), 1))
        addresses = [rpc.rpc_sync(f"worker{r}", listen_address) for r in range(world_size)]
        result = {
            "max_difference": max(differences),
            "rref": rref.to_here().tolist(),
            "addresses": addresses,
        }
        print("RESULT " + json.dumps(result), flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
