"""The fused ingest kernel agrees with the plain torch/sketch computation, edge values included."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from mergepipe_db.core import sketch
from mergepipe_db.kernels import block_stats as kernels


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BF16"), (torch.float32, "F32"), (torch.float16, "F16")])
def test_delta_stats_match_torch_and_sketch(dtype: torch.dtype, name: str) -> None:
    g = torch.Generator().manual_seed(5)
    n = 1 << 15
    b = torch.randn(n, generator=g).to(dtype)
    e = (b.float() + torch.randn(n, generator=g) * torch.logspace(-30, 4, n)).to(dtype)
    e[:500] = b[:500]  # exact zeros
    e[600], b[600] = float("nan"), float("nan")  # NaN - NaN
    e[601], b[601] = float("inf"), float("inf")  # inf - inf = NaN
    b[602] = float("-inf")
    e[603], b[603] = -0.0, 0.0
    l2, l1, mx, pos, hist = kernels.delta_stats(e.view(torch.uint8).numpy().tobytes(),
                                                b.view(torch.uint8).numpy().tobytes(), name)
    d = e.float() - b.float()
    assert np.array_equal(hist, sketch.histogram(d.abs()))
    finite = torch.isfinite(d)
    assert pos == pytest.approx(float((d > 0).double().mean()), abs=0)
    assert np.isnan(l2) and np.isnan(mx)  # NaN propagates, as torch's norm and max do
    d_f = d[finite]
    l2f, l1f, mxf, _pos, _h = kernels.delta_stats(e[finite].view(torch.uint8).numpy().tobytes(),
                                                  b[finite].view(torch.uint8).numpy().tobytes(), name)
    assert l2f == pytest.approx(float(torch.linalg.vector_norm(d_f, dtype=torch.float64)), rel=1e-12)
    assert l1f == pytest.approx(float(d_f.abs().double().sum()), rel=1e-12)
    assert mxf == float(d_f.abs().max())


def test_delta_stats_bins_every_edge_exactly() -> None:
    """Each bin's smallest float32 (sketch.bin_edges) lands in that bin, the float32 just below it in the
    bin before: the kernel's bins are the sketch's at every boundary, subnormals and the clamps included."""
    edges = sketch.bin_edges()
    at = np.float32(edges[1:])
    below = np.nextafter(at, np.float32(0))
    values = np.concatenate([at, below, np.float32([0.0, np.inf, 3.0e38, 1e-45])])
    expected = np.concatenate([np.arange(1, sketch.NBINS), np.arange(0, sketch.NBINS - 1),
                               [0, sketch.LAST_BIN, sketch.LAST_BIN, 1]])
    _l2, _l1, mx, pos, hist = kernels.delta_stats(values.tobytes(), bytes(values.nbytes), "F32")
    assert np.array_equal(hist, np.bincount(expected, minlength=sketch.NBINS))
    assert mx == np.inf and pos == (values > 0).mean()


@pytest.mark.parametrize("n", [1, 7, 2048, 2049, 3 * 2048 + 13])
def test_delta_stats_any_length(n: int) -> None:
    """Lengths that are not a multiple of the kernel's tile or unroll give the same statistics as torch."""
    g = torch.Generator().manual_seed(n)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    e = (b.float() + torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16)
    l2, l1, mx, pos, hist = kernels.delta_stats(e.view(torch.uint8).numpy().tobytes(),
                                                b.view(torch.uint8).numpy().tobytes(), "BF16")
    d = e.float() - b.float()
    assert np.array_equal(hist, sketch.histogram(d.abs()))
    assert l2 == pytest.approx(float(torch.linalg.vector_norm(d, dtype=torch.float64)), rel=1e-12)
    assert l1 == pytest.approx(float(d.abs().double().sum()), rel=1e-12)
    assert mx == float(d.abs().max()) and pos == float((d > 0).double().mean())


@pytest.mark.parametrize("name", ["BF16", "F32"])
def test_delta_stats_sparse_and_dense_tiles_count_the_same(name: str) -> None:
    """A tile with at most a quarter of its |Δ| nonzero bins and counts only those, packed (the common case of a
    merge output at a low budget); the others bin every element. Tiles on both sides of that threshold, whose
    nonzero Δ span the bins (subnormal, huge, inf, NaN, −0 against +0), give the plain computation's statistics."""
    tile = 2048
    rng = np.random.default_rng(17)
    dtype = torch.bfloat16 if name == "BF16" else torch.float32
    nonzero = [0, 1, 200, tile // 4, tile // 4 + 1, tile // 2, tile, 37]  # per tile; the last one partial
    n = tile * (len(nonzero) - 1) + 100
    b = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype)
    e = b.clone()
    specials = torch.tensor([1e-40, -3e38, float("inf"), float("nan"), 1e-3, -7.0], dtype=torch.float32)
    for t, k in enumerate(nonzero):
        lo, hi = t * tile, min((t + 1) * tile, n)
        idx = torch.from_numpy(rng.choice(hi - lo, size=min(k, hi - lo), replace=False) + lo)
        if len(idx):
            scale = torch.from_numpy(np.exp(rng.uniform(-30, 5, len(idx))).astype(np.float32))
            e[idx] = (b[idx].float() + scale * torch.sign(torch.randn(len(idx)))).to(dtype)
            e[idx[: len(specials)]] = specials[: len(idx)].to(dtype)
    e[3], b[3] = -0.0, 0.0
    for x, y, what in ((e, b, "with inf/NaN"), (torch.where(e.isfinite(), e, b), b, "finite")):
        l2, l1, mx, pos, hist = kernels.delta_stats(x.view(torch.uint8).numpy().tobytes(),
                                                    y.view(torch.uint8).numpy().tobytes(), name)
        d = x.float() - y.float()
        assert np.array_equal(hist, sketch.histogram(d.abs())), what
        assert pos == float((d > 0).double().mean()), what
        if what == "finite":
            assert l2 == pytest.approx(float(torch.linalg.vector_norm(d, dtype=torch.float64)), rel=1e-12)
            assert l1 == pytest.approx(float(d.abs().double().sum()), rel=1e-12)
            assert mx == float(d.abs().max())
        else:
            assert np.isnan(l2) and np.isnan(mx)


def test_same_bytes_agrees_with_bytes_equality() -> None:
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, (1 << 16) + 5, dtype=np.uint8)
    for n in (0, 1, 17, 1 << 14, (1 << 14) + 1, a.shape[0]):
        b = a[:n].copy()
        assert kernels.same_bytes(memoryview(a[:n]), memoryview(b))
        if n:
            b[rng.integers(0, n)] ^= 0x40
            assert not kernels.same_bytes(memoryview(a[:n]), memoryview(b))
    assert not kernels.same_bytes(b"abc", b"ab")


def test_widen_into_is_torch_bf16_to_float32_for_every_bit_pattern() -> None:
    from mergepipe_db.kernels import merge as merge_kernels

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every BF16 value, NaNs and subnormals too
    out = np.empty(bits.size, np.float32)
    merge_kernels.widen_into(out, bits)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
    assert np.array_equal(out.view(np.uint32), want.numpy().view(np.uint32))


def test_narrow_bf16_rounds_as_torch() -> None:
    """Ties to even, carries into the exponent, overflow to inf, subnormals, ±0 and ±inf: every non-NaN
    float32 rounds to torch's BF16 bits; a NaN anywhere makes the kernel refuse (torch is asked then)."""
    from mergepipe_db.kernels import merge as merge_kernels

    rng = np.random.default_rng(3)
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)  # below, at and above the halfway point
    bits = (hi[:, None] | lows[None, :]).reshape(-1)
    bits = np.concatenate([bits, rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32)])
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    out = np.empty(x.size, np.uint16)
    assert merge_kernels.narrow_bf16(out, x)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(out, want)
    x[17] = np.nan
    assert not merge_kernels.narrow_bf16(out, x)


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16"])
@pytest.mark.parametrize("nan", [False, True])
def test_output_cast_is_torchs(dtype: str, nan: bool) -> None:
    from mergepipe_db.core.dtypes import torch_dtype
    from mergepipe_db.pipeline.execute import cast_into

    g = torch.Generator().manual_seed(9)
    merged = (torch.randn(4098, generator=g) * torch.logspace(-42, 38, 4098)).reshape(3, -1)
    if nan:
        merged[1, 5] = float("nan")
        merged[2, -1] = -float("nan")
    out = np.empty(merged.numel() * torch.empty(0, dtype=torch_dtype(dtype)).element_size(), np.uint8)
    cast_into(out, dtype, merged.numpy())
    want = merged.to(torch_dtype(dtype)).reshape(-1).view(torch.uint8).numpy()
    assert np.array_equal(out, want)


@pytest.mark.parametrize(("method", "weights", "normalize", "identity_like"), [
    ("linear", [0.125] * 8, True, True), ("linear", [0.5, 0.5], False, True),
    ("task_arithmetic", [0.3, 0.9], False, True), ("ties", [1.0, 1.0], True, True),
    ("linear", [0.3, 0.3], False, False),  # 0.6·θ₀
    ("linear", [0.7, 0.1, 0.3], True, False)])  # (0.7·θ₀ + 0.1·θ₀ + 0.3·θ₀) / 1.1 rounds
def test_skipped_blocks_copied_with_exceptions_equal_the_table_lookup(method, weights, normalize,
                                                                      identity_like) -> None:
    """Where the base-only table is the identity but for a few patterns (−0 → +0 for sums of θ₀·w), skipped
    blocks are copied with those replaced: the same bits, and the same NaN verdict, as looking every element
    up in the table — over every BF16 pattern, in blocks with and without NaN."""
    from mergepipe_db.kernels import merge as merge_kernels
    from mergepipe_db.operators import ExpertParams, make_operator

    op = make_operator(method, [ExpertParams(key=f"{i:032x}", weight=w, density=0.5) for i, w in enumerate(weights)],
                       normalize=normalize)
    table = op.base_only_table()
    lut = np.empty(1 << 16, np.uint16)
    merge_kernels.narrow_bf16(lut, table)
    exceptions = merge_kernels.near_identity(table, lut)
    assert (exceptions.shape[0] > 0) == identity_like
    if not identity_like:
        return
    assert [0x8000, 0x0000] in exceptions.tolist()
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = bits[(bits & 0x7FFF) <= 0x7F80]
    rng = np.random.default_rng(0)
    base = np.concatenate([finite, rng.permutation(bits)])  # block 0 has no NaN, block 1 every pattern
    bounds = np.array([0, finite.size, base.size], np.int64)
    x = rng.standard_normal(base.size).astype(np.float32)
    for skip in ([True, False], [True, True], [False, True]):
        skip = np.array(skip)
        got, want = np.empty(base.size, np.uint16), np.empty(base.size, np.uint16)
        same, same_want = np.ones(2, np.bool_), np.ones(2, np.bool_)
        ok_got = merge_kernels.narrow_bf16_with_table(got, x, base, bounds, skip, table, lut, exceptions, same)
        ok_want = merge_kernels.narrow_bf16_with_table(want, x, base, bounds, skip, table, lut,
                                                       np.empty((0, 2), np.uint16), same_want)
        assert ok_got == ok_want == (not skip[1])
        assert not same_want.any()  # without exceptions, no block is said to be unchanged
        # a skipped block holding −0 (every pattern is in both blocks) is changed by the copy: never unchanged
        assert not same.any()
        if ok_want:
            np.testing.assert_array_equal(got, want)
    # without the patterns the table moves, a skipped block is θ₀'s bytes: it says so and is left unwritten
    plain = finite[~np.isin(finite, exceptions[:, 0])]
    for skip in ([True], [False]):
        out, same = np.full(plain.size, 0x7FC1, np.uint16), np.zeros(1, np.bool_)
        assert merge_kernels.narrow_bf16_with_table(out, x[:plain.size], plain, np.array([0, plain.size]),
                                                    np.array(skip), table, lut, exceptions, same)
        assert bool(same[0]) == skip[0]
        if skip[0]:
            assert (out == 0x7FC1).all()
            np.testing.assert_array_equal(lut[plain], plain)  # what the table would have written
        else:  # a NaN: the caller converts the whole tensor with torch; the numbers still agree
            num = (want & 0x7FFF) <= 0x7F80
            np.testing.assert_array_equal(got[num], want[num])


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BF16"), (torch.float32, "F32"), (torch.float16, "F16")])
def test_delta_stats_skip_zero_tiles_without_changing_a_statistic(dtype: torch.dtype, name: str) -> None:
    """Tiles whose Δ is ±0 throughout (a merge output that rounds back to θ₀ almost everywhere) are counted into
    bin 0 without the other passes; a tile of equal bits that holds NaN or inf (NaN − NaN, inf − inf = NaN) or
    −0 against +0 is not skipped wrongly: every statistic equals the plain computation."""
    g = torch.Generator().manual_seed(11)
    tile = 2048
    b = torch.randn(9 * tile + 100, generator=g).to(dtype)
    e = b.clone()
    e[3 * tile + 7] = (b[3 * tile + 7].float() + 0.5).to(dtype)  # one change in tile 3
    e[5 * tile + 1], b[5 * tile + 1] = -0.0, 0.0  # ±0 only: Δ = 0, still bin 0
    cases = {"few changes": (e.clone(), b.clone())}
    nan_e, nan_b = e.clone(), b.clone()
    nan_e[7 * tile + 5] = nan_b[7 * tile + 5] = float("nan")  # equal bits, Δ = NaN
    cases["NaN - NaN"] = (nan_e, nan_b)
    inf_e, inf_b = e.clone(), b.clone()
    inf_e[8 * tile] = inf_b[8 * tile] = float("inf")  # equal bits, Δ = NaN
    cases["inf - inf"] = (inf_e, inf_b)
    cases["all zero"] = (b.clone(), b.clone())
    for what, (x, y) in cases.items():
        l2, l1, mx, pos, hist = kernels.delta_stats(x.view(torch.uint8).numpy().tobytes(),
                                                    y.view(torch.uint8).numpy().tobytes(), name)
        d = x.float() - y.float()
        assert np.array_equal(hist, sketch.histogram(d.abs())), what
        assert pos == float((d > 0).double().mean()), what
        if torch.isnan(d).any():
            assert np.isnan(l2) and np.isnan(mx), what
            continue
        assert l2 == pytest.approx(float(torch.linalg.vector_norm(d, dtype=torch.float64)), rel=1e-12), what
        assert l1 == pytest.approx(float(d.abs().double().sum()), rel=1e-12), what
        assert mx == float(d.abs().max()), what


_NUMBA_WITHOUT_SCIPY = """
import sys
import numpy as np
from mergepipe_db.kernels import warmup
if sys.argv[1] == "scipy-first":
    import scipy.linalg
print(warmup.import_numba_without_scipy())
print("scipy.linalg" in sys.modules)
from numba.np import arraymath
print(arraymath._HAVE_BLAS)
from mergepipe_db.kernels import merge as merge_kernels
out = np.empty(3, np.uint16)
merge_kernels.narrow_bf16(out, np.array([1.0, -2.5, 3.0], np.float32))
print(out.tolist())
import scipy.linalg
print(float(scipy.linalg.norm(np.array([3.0, 4.0]))))
"""


@pytest.mark.parametrize("first", ["numba", "scipy-first"])
def test_numba_loads_without_scipys_blas_and_scipy_stays_importable(first: str) -> None:
    """`warmup.import_numba_without_scipy` (what the commands do): numba is loaded without SciPy's BLAS,
    the kernels still run, and SciPy imports normally afterwards; when SciPy is already imported, numba's
    usual set-up is left alone."""
    pytest.importorskip("scipy.linalg")
    done = subprocess.run([sys.executable, "-c", _NUMBA_WITHOUT_SCIPY, first], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    imported, blas_before, have_blas, bf16, norm = done.stdout.split("\n")[:5]
    if first == "numba":
        assert (imported, blas_before, have_blas) == ("True", "False", "False")
    else:
        assert (imported, blas_before, have_blas) == ("False", "True", "True")
    assert bf16 == "[16256, 49184, 16448]"  # 1.0, -2.5, 3.0 as BF16 bits
    assert norm == "5.0"


def _legacy_lora_stats(d: torch.Tensor) -> dict:
    """The LoRA block statistics as `sources/adapters.py` (`_stats_f32`) computed them before they moved to
    `block_stats.float32_delta_block_stats`: the catalogue of an adapter must not change (plans rank by it)."""
    d = d.reshape(-1)
    if d.numel() == 0:
        return {"delta_l2": 0.0, "delta_l1": 0.0, "delta_max": 0.0, "pos_frac": 0.0,
                "sketch": sketch.encode(sketch.histogram(torch.zeros(0)))}
    a = d.abs()
    return {"delta_l2": float(torch.linalg.vector_norm(d, dtype=torch.float64)),
            "delta_l1": float(a.sum(dtype=torch.float64)), "delta_max": float(a.max()),
            "pos_frac": float((d > 0).sum()) / d.numel(), "sketch": sketch.encode(sketch.histogram(a))}


def _special_float32_blocks() -> list[np.ndarray]:
    rng = np.random.default_rng(33)
    blocks = [np.zeros(0, np.float32), np.zeros(7, np.float32), np.array([-0.0] * 5, np.float32),
              np.array([np.inf, -np.inf, 1.0, -0.0], np.float32)]
    tiny = np.finfo(np.float32).tiny
    for n in (1, 3, 2048, 2049, 5000, 70_000):  # 70 000: past sketch.histogram's chunk
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 4)).astype(np.float32)
        kinds = rng.integers(0, 6, n)
        x[kinds == 0] = 0.0
        x[kinds == 1] = -0.0
        x[kinds == 2] = (rng.random(int((kinds == 2).sum())) * tiny).astype(np.float32)  # denormals
        x[kinds == 3] *= np.float32(2.0 ** -40)
        if n > 3:
            x[rng.integers(0, n, 2)] = [np.inf, -np.inf]
        blocks.append(x)
        blocks.append(np.abs(x[: n // 2]) * np.float32(-1))  # no positive Δ
    return blocks


def _same(a: dict, b: dict) -> bool:
    """Equal statistics, NaN (max/L2 of ±inf) equal to NaN."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)


def test_float32_delta_block_stats_is_the_lora_scan_s_computation_bit_for_bit() -> None:
    """`float32_delta_block_stats` (the LoRA entry point of the one statistics implementation) gives exactly
    what the LoRA scan stored before: on numpy arrays and torch tensors, with zeros of both signs, denormals
    and infinities. The fused kernel (`delta_block_stats`) sums in another order, so it is not used here."""
    for x in _special_float32_blocks():
        t = torch.from_numpy(x.copy())
        want = _legacy_lora_stats(t)
        for arg in (x, t, t.reshape(1, -1), x.reshape(-1, 1)):
            got = kernels.float32_delta_block_stats(arg)
            assert _same(got, want), (x.shape, got, want)


def test_zero_block_stats_are_the_statistics_of_equal_bytes() -> None:
    for dtype, np_dtype in (("F32", np.float32), ("BF16", np.uint16), ("F16", np.float16)):
        base = np.arange(300, dtype=np.float32).astype(np_dtype).tobytes()
        assert kernels.zero_block_stats(len(base), dtype) == kernels.delta_block_stats(
            bytearray(base), memoryview(base), dtype)


def _import_or_none(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None
