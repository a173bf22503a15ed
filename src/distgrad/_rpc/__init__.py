"""Layer 3: the RPC agent -- rendezvous, calls, futures, timeouts, remote errors, shutdown."""
