"""Compiled CPU ops: C++ sources in ``csrc/``, built and loaded by ``ops.py``."""
