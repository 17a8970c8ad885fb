"""The `pagedserve` command: one dispatcher above the layers.

It may import every package (service, engine, bench); none of them imports
it, so the engine stays free of HTTP and of the benchmarks.
"""
