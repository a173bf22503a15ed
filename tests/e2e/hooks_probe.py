"""Run by test_hooks.py under torch's RPC and under distgrad's (argv[1]: "torch" or "distgrad",
argv[2]: a free port): hooks on a leaf that gets gradients from a local path and through an RPC,
in two contexts; prints what the hooks saw, in order, and the context gradients."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

if sys.argv[1] == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
else:
    import distgrad.autograd as dist_autograd  # type: ignore[no-redef]
    import distgrad.rpc as rpc  # type: ignore[no-redef]


def main() -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[2]
    rpc.init_rpc("w0", rank=0, world_size=1)
    log: list[Any] = []

    def fmt(grads: Any) -> list[Any]:
        return [None if g is None else g.tolist() for g in grads]

    w = torch.ones(3, requires_grad=True)
    node = w.view_as(w).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    node.register_prehook(lambda go: (log.append(("pre", fmt(go))), (go[0] * 10,))[1])
    node.register_hook(lambda gi, go: log.append(("post", fmt(gi), fmt(go))))
    # a non-linear tensor hook: applied to the whole gradient, not to each part of it
    w.register_hook(lambda g: (log.append(("tensor", g.tolist())), g.clamp(max=4.0))[1])
    w.register_post_accumulate_grad_hook(lambda t: log.append(("post_accumulate",)))
    for _ in range(2):
        with dist_autograd.context() as context_id:
            x = rpc.rpc_sync("w0", torch.mul, args=(w, 3))
            loss = (x * torch.arange(3.0)).sum() + (w * w).sum()
            dist_autograd.backward(context_id, [loss])
            log.append(("context", dist_autograd.get_gradients(context_id)[w].tolist()))
    log.append(("grad", w.grad))
    print(repr(log))
    rpc.shutdown()


if __name__ == "__main__":
    main()
