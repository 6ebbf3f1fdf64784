"""`kernels.compress`: splitting keys into the nonzero ones (packed, with their indices) and the zero ones (their
indices, or consecutive table entries in their places), against numpy's flatnonzero."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from mergepipe_db.kernels.compress import SLACK, split_nonzero, split_nonzero_ranks


@numba.njit
def _split(src, keys, idx, zidx):  # noqa: ANN001, ANN202
    return split_nonzero(src, src.shape[0], keys, idx, zidx)


@numba.njit
def _split_ranks(src, keys, idx, table, out):  # noqa: ANN001, ANN202
    return split_nonzero_ranks(src, src.shape[0], keys, idx, table, out)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 33, 1000, 4096])
@pytest.mark.parametrize("nonzero", [0.0, 0.2, 0.9, 1.0])
def test_split_equals_flatnonzero(n, nonzero) -> None:
    rng = np.random.default_rng(n)
    src = np.where(rng.random(n) < nonzero, rng.integers(1, 1 << 32, n, dtype=np.uint64), 0).astype(np.uint32)
    nz, z = np.flatnonzero(src), np.flatnonzero(src == 0)
    keys, idx, zidx = (np.full(n + SLACK, 7, np.uint32) for _ in range(3))
    m, zeros = _split(src, keys, idx, zidx)
    assert (m, zeros) == (len(nz), len(z))
    assert np.array_equal(keys[:m], src[nz]) and np.array_equal(idx[:m], nz) and np.array_equal(zidx[:zeros], z)
    table = rng.random(n + SLACK).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    keys2, idx2 = np.zeros(n + SLACK, np.uint32), np.zeros(n + SLACK, np.uint32)
    m2, zeros2 = _split_ranks(src, keys2, idx2, table, out)
    assert (m2, zeros2) == (m, zeros)
    assert np.array_equal(keys2[:m], keys[:m]) and np.array_equal(idx2[:m], idx[:m])
    assert np.array_equal(out[z], table[: len(z)])
