"""Profiling across workers (layer 5); the public face is :mod:`distgrad.profiler`."""
