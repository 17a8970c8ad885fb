"""Offline benchmarks, the engine in-process: throughput, prefix caching, scheduler, outputs, schemas."""
