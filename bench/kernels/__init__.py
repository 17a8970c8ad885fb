"""The kernel micro-benchmark: attention, store_kvcache, linear, feature rows, the weight-read floor."""
