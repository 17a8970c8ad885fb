"""Benchmarks of several replicas as real processes: warm-up, KV offload tiers, routing."""
