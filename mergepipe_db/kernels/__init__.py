"""Compiled (numba) kernels, named for what they compute: block statistics, merge arithmetic, float bit casts,
torch's random stream, and their warm-up."""
