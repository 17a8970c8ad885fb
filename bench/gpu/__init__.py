"""GPU acceptance checks: the Triton backend end to end, CUDA graphs for decode."""
