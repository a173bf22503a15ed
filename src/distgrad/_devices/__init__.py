"""Devices as part of the message: device maps (``_maps``), and the one interface behind which
tensors on devices are moved and ordered (``_backend``: the CPU no-op; ``_cuda``: CUDA streams
and staging). Layer 1 beside the wire: it imports nothing of distgrad's but ``_errors``."""
