"""Layer 1: message framing, the tensor-aware pickler, and validation of what a socket sends."""
