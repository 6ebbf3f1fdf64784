"""Compiled (numba) kernels, named for what they compute: block statistics, merge arithmetic, float bit casts,
torch's random stream, and their warm-up.

The kernels that run on numba's threads use its OpenMP pool. GNU OpenMP keeps an idle worker spinning for
300,000 turns after each parallel loop; on a 2-core machine that spin takes the core the reader and the output
thread need between a merge's kernel calls, so it is cut to 1,000 here, before the pool is loaded (a value the
user set is kept)."""

import os

os.environ.setdefault("GOMP_SPINCOUNT", "1000")
