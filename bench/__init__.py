"""The benchmarks, in rooms: common/ (shared helpers), offline/, serving/, fleet/, kernels/, gpu/."""
