"""`kernels.row_ranks.della_probabilities` against numpy: ranks from ``np.argsort(kind="stable")`` along dim 1 (ties
in index order, NaN last), then DELLA's float32 formula, written plainly here; bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from mergepipe_db.kernels.row_ranks import della_probabilities


def numpy_probabilities(delta, shape, rows, d, eps):
    blk = delta.reshape(1, -1) if len(shape) <= 1 else delta.reshape((rows, *shape[1:]))
    a = np.abs(blk)
    order = np.argsort(a, axis=1, kind="stable")
    ranks = np.empty(a.shape, np.float32)
    positions = np.arange(a.shape[1], dtype=np.float32).reshape((1, -1) + (1,) * (a.ndim - 2))
    np.put_along_axis(ranks, order, np.broadcast_to(positions, a.shape), axis=1)
    n = a.shape[1]
    rn = ranks / np.float32(n - 1) if n > 1 else np.zeros_like(ranks)
    rn = np.clip(rn, 0, 1)
    return ((rn * np.float32(2)) * np.float32(eps) + np.float32(d - eps)).reshape(-1)


@pytest.mark.parametrize("shape,rows", [((7,), 7), ((1,), 1), ((), 1), ((12, 300), 5), ((6, 1), 6), ((4, 9, 3), 3),
                                        ((3, 700, 2), 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_numpy_stable_argsort(shape, rows, seed) -> None:
    rng = np.random.default_rng(seed)
    block = (rows, *shape[1:]) if len(shape) > 1 else shape
    delta = (rng.standard_normal(block) * np.exp(3 * rng.standard_normal(block))).astype(np.float32)
    flat = delta.reshape(-1)
    m = flat.size
    flat[rng.random(m) < 0.2] = 0.0
    flat[rng.random(m) < 0.1] = -0.0
    tied = rng.random(m) < 0.3  # equal magnitudes of both signs
    flat[tied] = np.float32(0.25) * np.sign(rng.standard_normal(int(tied.sum())))
    if m > 6:
        flat[[1, 4]] = np.nan
        flat[5] = -np.nan
        flat[2], flat[3] = np.inf, -np.inf
        flat[6] = np.float32(1e-45)
    flat[rng.random(m) < 0.05] = np.float32(-3e38)
    for d, eps in ((0.5, 0.15), (0.3, 0.1), (0.8, 0.05)):
        got = della_probabilities(np.zeros_like(flat), flat, shape, rows, d, eps)
        want = numpy_probabilities(flat, shape, rows, d, eps)
        assert np.array_equal(got.view(np.int32), want.view(np.int32))


def test_many_values_in_a_row() -> None:
    rng = np.random.default_rng(9)
    delta = (rng.standard_normal((3, 70_001)) * 0.01).astype(np.float32)
    delta[:, ::7] = np.float32(0.004)
    got = della_probabilities(np.zeros(delta.size, np.float32), delta.reshape(-1), (3, 70_001), 3, 0.4, 0.2)
    assert np.array_equal(got.view(np.int32), numpy_probabilities(delta.reshape(-1), (3, 70_001), 3, 0.4, 0.2)
                          .view(np.int32))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_rows_give_the_same_bits_for_any_thread_count(threads) -> None:
    """The rows are ranked in parallel chunks: the result equals the plain numpy ranks whatever numba's thread
    count (more chunks than rows, fewer, and one thread)."""
    import numba

    rng = np.random.default_rng(threads)
    for rows, n in ((200, 37), (3, 500), (70, 1)):
        delta = (rng.standard_normal((rows, n)) * 0.01).astype(np.float32).reshape(-1)
        want = numpy_probabilities(delta, (rows, n), rows, 0.5, 0.1)
        before = numba.get_num_threads()
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            got = della_probabilities(np.zeros_like(delta), delta, (rows, n), rows, 0.5, 0.1)
        finally:
            numba.set_num_threads(before)
        assert np.array_equal(got.view(np.int32), want.view(np.int32))


def test_rows_of_mostly_zeros() -> None:
    """Zero Δ (±0) rank first in index order without being sorted: rows all zero, none zero, mostly zero, and
    zeros only at either end, each against the plain stable argsort."""
    rng = np.random.default_rng(3)
    n = 600
    delta = (rng.standard_normal((6, n)) * 0.01).astype(np.float32)
    delta[0] = 0.0
    delta[1, ::2] = -0.0
    delta[2, rng.random(n) < 0.9] = 0.0
    delta[3, : n // 2] = 0.0
    delta[4, n // 2:] = -0.0
    delta[5, rng.random(n) < 0.9] = np.float32(0.004)  # ties, none zero
    flat = delta.reshape(-1)
    got = della_probabilities(np.zeros_like(flat), flat, (6, n), 6, 0.5, 0.1)
    assert np.array_equal(got.view(np.int32), numpy_probabilities(flat, (6, n), 6, 0.5, 0.1).view(np.int32))


@pytest.mark.parametrize("shape,rows", [((40, 300), 40), ((5, 64, 3), 5), ((1000,), 1)])
def test_from_stored_values(shape, rows) -> None:
    """Δ formed in the pass from θ₀ (float32) and the expert's stored BF16 bits, as widen(x) − θ₀: the same
    probabilities as from that Δ written out (unchanged elements, ties and a NaN among them)."""
    rng = np.random.default_rng(11)
    m = int(np.prod(shape))
    base_bits = (rng.standard_normal(m).astype(np.float32) * 0.02).view(np.uint32) >> 16
    raw = base_bits.astype(np.uint16)
    moved = rng.random(m) < 0.3
    raw[moved] = (raw[moved].astype(np.int64) + rng.integers(-3, 4, int(moved.sum()))).astype(np.uint16)
    raw[7] = 0x7FC0
    base = (base_bits.astype(np.uint32) << 16).view(np.float32)
    delta = (raw.astype(np.uint32) << 16).view(np.float32) - base
    got = della_probabilities(base, raw, shape, rows, 0.6, 0.2)
    want = numpy_probabilities(delta, shape, rows, 0.6, 0.2)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("values", [1, 5, 40, 300])
@pytest.mark.parametrize("shape,rows", [((64, 2048), 64), ((8, 512, 3), 8), ((3, 1000), 3)])
def test_rows_of_few_or_many_values(values, shape, rows) -> None:
    """A row's nonzero |Δ| taking few values (a BF16 fine-tune's: ranked by value, through a hash table) or
    many (sorted), both signs, in contiguous rows (zero ranks dealt as the keys are split) and strided ones;
    against the plain stable argsort."""
    rng = np.random.default_rng(values)
    m = int(np.prod((rows, *shape[1:])))
    levels = (rng.standard_normal(values) * 0.01).astype(np.float32)
    flat = levels[rng.integers(0, values, m)] * np.sign(rng.standard_normal(m)).astype(np.float32)
    flat[rng.random(m) < 0.75] = 0.0
    got = della_probabilities(np.zeros_like(flat), flat, shape, rows, 0.5, 0.15)
    want = numpy_probabilities(flat, shape, rows, 0.5, 0.15)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("width,rows_per_block,n_rows", [(1000, 3, 7), (7, 50, 200), (624, 2, 5), (64, 40, 90),
                                                         (13, 5, 23)])
@pytest.mark.parametrize("l1", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_della_keep_blocks_is_the_block_by_block_mask_and_sums(width, rows_per_block, n_rows, l1, packed) -> None:
    """`della_keep_blocks` (a row at a time: probabilities, uniforms handed out from whole twists, mask, sums) is
    the plain path: numpy's probabilities of each block, ``torch.rand`` of the block's generator, u < p, and
    the kept and dropped |Δ| summed in float64 (exact here: few values, all multiples of 2^-24). Rows longer and
    shorter than a twist (624 uniforms), a row that is exactly one, blocks of a selection with gaps; the mask
    as bools or packed eight to a byte (rows and blocks that end inside a byte), unpacked by
    `merge.unpack_mask`."""
    import torch

    from mergepipe_db.kernels import merge
    from mergepipe_db.kernels.exact_sum import ExactSum
    from mergepipe_db.kernels.row_ranks import della_keep_blocks

    rng = np.random.default_rng(width)
    shape = (n_rows, width)
    base = (rng.integers(-64, 64, shape) / 64.0).astype(np.float32).reshape(-1)
    delta = (rng.integers(-8, 9, shape) / 4096.0).astype(np.float32).reshape(-1)
    x = base + delta  # float32 stored values, exactly base + Δ
    blocks = [(s, min(s + rows_per_block, n_rows)) for s in range(0, n_rows, rows_per_block)]
    chosen = blocks[::2] + blocks[-1:] if len(blocks) > 2 else blocks  # a selection with gaps, in order
    chosen = sorted(set(chosen))
    spans = np.array([(s * width, e * width) for s, e in chosen], np.int64)
    seeds = np.array([1000 + 7 * i for i in range(len(chosen))], np.int64)
    d, eps = 0.6, 0.2
    keep = np.zeros(base.size, np.bool_)
    sums = (ExactSum(), ExactSum())
    bounds = np.array([s * width for s, _e in blocks] + [n_rows * width], np.int64)
    chosen_ids = np.array([blocks.index(blk) for blk in chosen], np.int64)
    offsets = np.array([bounds[b] // 8 + b for b in chosen_ids], np.int64)
    bits = np.full(merge.mask_bytes(base.size, len(blocks)), 0xAA, np.uint8) if packed else np.empty(0, np.uint8)
    della_keep_blocks(np.empty(0, np.bool_) if packed else keep, bits, offsets, base, x, spans, seeds, width,
                      np.float32(eps), np.float32(d - eps), l1, sums[0].reserve(base.size), sums[1].reserve(base.size))
    if packed:
        merge.unpack_mask(keep, bits, bounds, chosen_ids)
    want = np.zeros(base.size, np.bool_)
    for (s0, e0), seed in zip(spans, seeds):
        p = numpy_probabilities(x[s0:e0] - base[s0:e0], shape, (e0 - s0) // width, d, eps)
        g = torch.Generator().manual_seed(int(seed))
        u = torch.rand(int(e0 - s0), generator=g).numpy()
        want[s0:e0] = u < p
    assert np.array_equal(keep, want)
    a = np.abs(delta.astype(np.float64))
    read = np.zeros(base.size, np.bool_)
    for s0, e0 in spans:
        read[s0:e0] = True
    if l1:
        assert sums[0].value() == a[read & want].sum()
        assert sums[1].value() == a[read & ~want].sum()
    else:
        assert sums[0].value() == 0.0 and sums[1].value() == 0.0
