"""Testing tools that run whole worlds in one process (the in-memory world)."""
