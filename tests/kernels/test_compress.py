"""`kernels.compress.split_nonzero_ranks`: the nonzero keys packed with their indices, and consecutive table
entries in the zero keys' places, against numpy's flatnonzero."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from mergepipe_db.kernels.compress import SLACK, split_nonzero_ranks


@numba.njit
def _split_ranks(src, keys, idx, table, out):  # noqa: ANN001, ANN202
    return split_nonzero_ranks(src, src.shape[0], keys, idx, table, out)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 33, 1000, 4096])
@pytest.mark.parametrize("nonzero", [0.0, 0.2, 0.9, 1.0])
def test_split_equals_flatnonzero(n, nonzero) -> None:
    rng = np.random.default_rng(n)
    src = np.where(rng.random(n) < nonzero, rng.integers(1, 1 << 32, n, dtype=np.uint64), 0).astype(np.uint32)
    nz, z = np.flatnonzero(src), np.flatnonzero(src == 0)
    keys, idx = np.full(n + SLACK, 7, np.uint32), np.full(n + SLACK, 7, np.uint32)
    table = rng.random(n).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    m, zeros = _split_ranks(src, keys, idx, table, out)
    assert (m, zeros) == (len(nz), len(z))
    assert np.array_equal(keys[:m], src[nz]) and np.array_equal(idx[:m], nz)
    assert np.array_equal(out[z], table[: len(z)])
