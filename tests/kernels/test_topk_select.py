"""torch.topk's choice of the k largest, reproduced (`kernels.topk_select`): the same index set as torch's own
topk on values with many ties at the cut (where the choice is the algorithm's, not the values'), NaNs and
zeros; and every case it does not reproduce declined before `keep` is written."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from mergepipe_db.kernels import topk_select as T


def _torch_mask(v: np.ndarray, k: int) -> np.ndarray:
    keep = np.zeros(v.size, np.uint8)
    keep[torch.topk(torch.from_numpy(v), k).indices.numpy()] = 1
    return keep


def _ours(v: np.ndarray, k: int, depth: int | None = None) -> tuple[bool, np.ndarray]:
    keep = np.full(v.size, 7, np.uint8)
    ok = T.torch_topk_mask(v, k, keep, np.empty(v.size + 3, np.uint64), depth)
    return ok, keep


def _values(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    if kind == "distinct":
        return rng.random(n, dtype=np.float32)
    if kind == "few":  # a handful of values: nearly every cut splits a tie
        return rng.integers(0, 4, n).astype(np.float32)
    # sce's |var| of 8 BF16 experts whose Δ are mostly 0, as torch computes it
    d = rng.standard_normal((8, n)).astype(np.float32) * 1e-3
    d[rng.random((8, n)) < 0.85] = 0
    d = torch.from_numpy(d).to(torch.bfloat16).float()
    return torch.var(d, dim=0, unbiased=False).abs().numpy()


@pytest.mark.parametrize("kind", ["distinct", "few", "sce"])
def test_same_set_as_torch_topk(kind: str) -> None:
    """Random sizes (down to 1) and every k torch sends to nth_element, some arrays with NaNs and inf."""
    rng = np.random.default_rng({"distinct": 1, "few": 2, "sce": 3}[kind])
    checked = 0
    for trial in range(150):
        n = int(rng.integers(1, 3000))
        v = _values(rng, n, kind)
        if trial % 5 == 0:
            v[rng.integers(0, n, 1 + n // 100)] = np.nan
        if trial % 7 == 0:
            v[rng.integers(0, n, 2)] = np.inf
        k = int(rng.integers(n // 64 + 1, n + 1)) if trial % 10 else n
        if k * 64 <= n:
            continue
        ok, keep = _ours(v, k)
        assert ok, (trial, n, k)
        np.testing.assert_array_equal(keep, _torch_mask(v, k), err_msg=f"trial {trial}: n={n} k={k}")
        checked += 1
    assert checked > 100


def test_large_tensor_ties_at_the_cut() -> None:
    """A 300,000-element |var| with half the nonzero variances kept, as sce's select_topk 0.5: ties at the cut
    are split, and the split is torch's."""
    v = _values(np.random.default_rng(5), 300_000, "sce")
    k = int(np.count_nonzero(v) * 0.5)
    cut = np.sort(v)[::-1][k - 1]
    assert (v > cut).sum() < k < (v >= cut).sum()  # a split tie: the values alone do not decide
    ok, keep = _ours(v, k)
    assert ok
    np.testing.assert_array_equal(keep, _torch_mask(v, k))


def test_negative_nan_is_a_nan() -> None:
    """A NaN with its sign bit set ties with the others, above +inf."""
    v = np.array([1.0, np.inf, 2.0, 0.0, 3.0], np.float32)
    v = np.concatenate([v, -np.float32(np.nan) * np.ones(3, np.float32), np.float32(np.nan) * np.ones(2, np.float32)])
    assert np.signbit(v[5])
    for k in range(1, v.size + 1):
        ok, keep = _ours(v, k)
        assert ok
        np.testing.assert_array_equal(keep, _torch_mask(v, k))


@pytest.mark.parametrize("case", ["heap", "negative", "minus_zero", "k0", "depth"])
def test_declined_before_anything_is_written(case: str) -> None:
    """What torch does another way (a heap when k * 64 <= numel; libstdc++'s heap select past the depth limit)
    or what is no magnitude: False, and `keep` as it was."""
    v = _values(np.random.default_rng(6), 4096, "few")
    k = 2000
    depth = None
    if case == "heap":
        k = 64
    elif case == "negative":
        v[100] = -1.0
    elif case == "minus_zero":
        v[100] = -0.0
    elif case == "k0":
        k = 0
    else:
        depth = 0
    ok, keep = _ours(v, k, depth)
    assert not ok
    assert (keep == 7).all()


def test_depth_limit_is_libstdcxx() -> None:
    assert [T.depth_limit(n) for n in (1, 2, 3, 4, 7, 8, 1 << 20, (1 << 20) + 1)] == [0, 2, 2, 4, 4, 6, 40, 40]


@numba.njit(cache=True)
def _move_median_to_first(keys: np.ndarray, result: int, a: int, b: int, c: int) -> None:
    """libstdc++'s ``__move_median_to_first`` as it is written, its comparison "greater by top half"."""
    def greater(x: int, y: int) -> bool:
        return keys[x] >> 32 > keys[y] >> 32

    ab, ac, bc = greater(a, b), greater(a, c), greater(b, c)  # no side effects: all three asked at once
    if ab:
        pick = b if bc else c if ac else a
    else:
        pick = a if ac else c if bc else b
    keys[result], keys[pick] = keys[pick], keys[result]


@numba.njit(cache=True)
def _plain_select(keys: np.ndarray, nth: int, depth: int) -> bool:
    """libstdc++'s introselect as written (median of three, unguarded partition, insertion sort), its partition
    a scan at a time: the reference for the block partition of `select_k_largest`."""
    first, last = 0, keys.shape[0]
    while last - first > 3:
        if depth == 0:
            return False
        depth -= 1
        _move_median_to_first(keys, first, first + 1, first + (last - first) // 2, last - 1)
        top = keys[first] >> 32
        i, j = first + 1, last
        while True:
            while keys[i] >> 32 > top:
                i += 1
            j -= 1
            while keys[j] >> 32 < top:
                j -= 1
            if i >= j:
                break
            keys[i], keys[j] = keys[j], keys[i]
            i += 1
        if i <= nth:
            first = i
        else:
            last = i
    for i in range(first + 1, last):
        v = keys[i]
        j = i
        while j > first and v >> 32 > keys[j - 1] >> 32:
            keys[j] = keys[j - 1]
            j -= 1
        keys[j] = v
    return True


@pytest.mark.parametrize("kind", ["distinct", "few", "sce"])
def test_block_partition_moves_every_key_as_the_plain_loop(kind: str) -> None:
    """Arrays long enough for the block partition (many blocks, and ranges that end mid-block): after the
    select, every key is where the plain introselect puts it, not only the same set in front."""
    rng = np.random.default_rng({"distinct": 11, "few": 12, "sce": 13}[kind])
    for trial in range(12):
        n = int(rng.integers(600, 60_000))
        v = _values(rng, n, kind)
        keys = np.empty(n, np.uint64)
        assert T._make_keys(v.view(np.uint32), keys)
        nth = int(rng.integers(0, n))
        ours, ref = keys.copy(), keys.copy()
        assert T.select_k_largest(ours, nth, T.depth_limit(n)) == _plain_select(ref, nth, T.depth_limit(n))
        np.testing.assert_array_equal(ours, ref, err_msg=f"trial {trial}: n={n} nth={nth}")
