"""Layer 2: authenticated connections between workers, on one asyncio I/O thread per process."""
