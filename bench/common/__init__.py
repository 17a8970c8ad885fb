"""Helpers every benchmark room shares: reports, measuring, workloads, replica processes, the null engine."""
