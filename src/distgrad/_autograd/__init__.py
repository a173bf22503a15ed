"""Layer 4: distributed autograd -- contexts, send/recv functions, the backward engine."""
