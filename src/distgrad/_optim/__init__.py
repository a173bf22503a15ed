"""DistributedOptimizer (layer 5): built on the public RPC and autograd APIs."""
