"""Benchmarks of a running server over HTTP: the load generator, its datasets, hostile requests."""
