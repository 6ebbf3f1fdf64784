"""Merge operators: pure float32 array math (numpy, numba kernels), one tensor at a time, streaming over the experts.

An operator folds the experts of one tensor in spec order: ``begin(base, ctx)``, then ``add(x)`` for
k = 0..K-1 (every expert, also one with nothing selected), then ``finish()``. Memory is a few tensors of the
tensor's size, whatever K. At full selection the result is identical, bit for bit, to the plain formulas
of docs/SEMANTICS.md; under a partial selection omitted rows contribute Δ = 0 and are never touched.

Bit-exactness rests on doing, per element, the same float32 operations in the same order as the formulas:
``x * s`` / ``x / s`` with the same Python float, sums into +0.0 accumulators in spec order. Adding a zero
term is skipped: an accumulator that starts at +0.0 and only receives sums is never -0.0, so ``acc + (±0)``
leaves its bits unchanged. Work is done in cache-sized chunks with reused scratch buffers (fresh pages
cost more than arithmetic on these machines). No I/O, no catalog.

Arrays are numpy: a BF16 value is held as its uint16 bit pattern. torch's results are the definition of
DARE's masks (`torch.rand` keyed per block, drawn here by `mt19937`, which reproduces them bit for bit) and
slerp's float64 norms; torch is imported only for the latter. Callers may pass torch tensors; they are
converted on entry (torch's import costs ~2 s of a merge's start-up).
"""

from __future__ import annotations

import abc
import hashlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mergepipe_db.core import sketch as _sketch
from mergepipe_db.core.dtypes import as_float32
from mergepipe_db.errors import SpecError, UnsupportedDtypeError

__all__ = [
    "OPERATORS",
    "ExpertInput",
    "ExpertParams",
    "MergeOperator",
    "TensorContext",
    "as_float32",
    "dare_keep_mask",
    "make_operator",
]

_CHUNK = 1 << 16  # elements per arithmetic step: scratch stays in L2
_NO_F32 = np.empty(0, np.float32)


def empty_buffer(n: int, dtype: Any = np.float32) -> np.ndarray:
    """An uninitialised 1-D array for a long-lived scratch buffer: big ones page-aligned, in a mapping of their
    own (`storage.aligned_empty`)."""
    dt = np.dtype(dtype)
    if n * dt.itemsize < (2 << 20):
        return np.empty(n, dt)
    from mergepipe_db.io.local import aligned_empty

    return aligned_empty(n * dt.itemsize).view(dt)


def _is_torch(t: object) -> bool:
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is imported
    return torch is not None and isinstance(t, torch.Tensor)


def _as_raw(t: Any, what: str) -> np.ndarray:
    """Stored values for `ExpertInput.from_raw`: float32/float16/float64, or BF16 as uint16 bit patterns."""
    if _is_torch(t):
        import torch

        if not t.is_floating_point():
            raise UnsupportedDtypeError(f"{what} has dtype {t.dtype}, which merge arithmetic cannot use")
        t = t.detach().contiguous()
        return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
    a = np.asarray(t)
    if a.dtype.kind != "f" and a.dtype != np.uint16:
        raise UnsupportedDtypeError(f"{what} has dtype {a.dtype}, which merge arithmetic cannot use")
    return np.asarray(a, order="C")  # (not ascontiguousarray: it makes a 0-d tensor 1-d)


#: TIES keeps the experts' stored bytes of a tensor for one fused pass while they add up to at most this
#: (beyond it, it folds them one by one): memory stays bounded whatever K
_FUSE_BYTES = 1 << 30
#: linear and task arithmetic keep up to this many bytes of experts' stored values, then fold them in one
#: fused pass (`_Stash`) and start again: the accumulator is read and written once per group, not per expert.
#: 256 MiB (two experts' embeddings of a 1B-parameter model) keeps peak RSS flat in K: 2 GB models, full read,
#: 1.61-1.77 GiB for K = 2…16 (512 MiB: 1.61-2.09 GiB), at the same speed
_GROUP_BYTES = 256 << 20


class _Stash:
    """Experts' stored values (as `ExpertInput.fast_source` gives them) kept for one fused pass over a
    tensor, at most `_GROUP_BYTES` of them, all of one dtype."""

    def __init__(self) -> None:
        self.items: list[tuple[np.ndarray, ExpertInput]] = []
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self.items)

    def __iter__(self) -> Iterator[tuple[np.ndarray, ExpertInput]]:
        return iter(self.items)

    def full_for(self, src: np.ndarray) -> bool:
        """Whether `src` cannot join the kept inputs (their pass must run first)."""
        return bool(self.items) and (self.nbytes + src.nbytes > _GROUP_BYTES or self.items[0][0].dtype != src.dtype)

    def offer(self, src: np.ndarray, x: ExpertInput, fold: Callable[[], None]) -> bool:
        """Keep `src` for the next fused pass, running `fold` first when it cannot join the kept inputs;
        False (nothing kept) when `src` alone exceeds a group: the caller folds it by itself."""
        if self.full_for(src):
            fold()
        if src.nbytes > _GROUP_BYTES:
            return False
        self.items.append((src, x))
        self.nbytes += src.nbytes
        return True

    def take(self, n_blocks: int) -> tuple[list[tuple[np.ndarray, ExpertInput]], Any, np.ndarray]:
        """(items, their values as `merge_kernels.pack` gives them, selected[item, block]); the stash is empty
        afterwards."""
        items, self.items, self.nbytes = self.items, [], 0
        selected = np.zeros((len(items), n_blocks), np.bool_)
        for k, (_src, x) in enumerate(items):
            selected[k, list(x.selected_blocks)] = True
        return items, _mk().pack([src for src, _x in items]), selected


def live_ranges(bounds: np.ndarray, skip: np.ndarray | None) -> list[tuple[int, int]]:
    """Element ranges [start, stop) of the blocks without ``skip[b]`` (all of them for None), adjacent ones
    merged; `bounds` as `block_bounds` gives them."""
    if skip is None or not skip.any():
        return [(0, int(bounds[-1]))]
    out: list[tuple[int, int]] = []
    for b in np.flatnonzero(~skip).tolist():
        s, e = int(bounds[b]), int(bounds[b + 1])
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def block_bounds(ctx: TensorContext) -> np.ndarray:
    """Element offsets of the tensor's blocks: block b is [bounds[b], bounds[b+1]) of the flat tensor."""
    return np.array([ctx.block_rows(b)[0] * ctx.row_numel for b in range(ctx.n_blocks)] + [ctx.numel], np.int64)


def _mk():  # noqa: ANN202 - the fused kernels (numba), imported on first use
    from mergepipe_db.kernels import merge as merge_kernels

    return merge_kernels
_EDGES = _sketch.bin_edges()
_LAST = _sketch.LAST_BIN


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertParams:
    """One expert's merge parameters (docs/SEMANTICS.md)."""

    key: str  #: expert checkpoint id (hex string): the DARE mask key
    weight: float = 1.0
    density: float = 1.0
    gamma: float = 0.01  #: breadcrumbs: fraction of the largest |Δ| dropped


@dataclass(frozen=True)
class TensorContext:
    """The tensor being merged: name, shape, row-block layout and the merge seed."""

    name: str
    shape: tuple[int, ...]
    rows_per_block: int
    n_blocks: int
    seed: int

    @property
    def n_rows(self) -> int:
        """Rows along dim 0 (a 0-d tensor has one)."""
        return int(self.shape[0]) if len(self.shape) >= 1 else 1

    @property
    def row_numel(self) -> int:
        """Elements in one row (1 for 0-d and 1-d tensors)."""
        return math.prod(self.shape[1:]) if len(self.shape) >= 2 else 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def block_rows(self, block: int) -> tuple[int, int]:
        """Row range [start, stop) of a block; a 0-d or 1-d tensor is the single block 0."""
        n = self.n_rows
        if len(self.shape) <= 1 or n == 0:
            if block != 0:
                raise ValueError(f"tensor {self.name!r} has a single block, not block {block}")
            return 0, n
        start = block * self.rows_per_block
        if block < 0 or start >= n:
            raise ValueError(f"tensor {self.name!r}: block {block} out of range ({self.n_blocks} blocks)")
        return start, min(n, start + self.rows_per_block)


def _as_f32(t: Any, what: str) -> np.ndarray | None:
    """A float32 array of `t` (numpy, or a torch tensor: shared when already float32 and contiguous)."""
    if t is None:
        return None
    if _is_torch(t):
        import torch

        if not t.is_floating_point():
            raise UnsupportedDtypeError(f"{what} has dtype {t.dtype}, which merge arithmetic cannot use")
        return t.detach().to(torch.float32).contiguous().numpy()
    a = np.asarray(t)
    if a.dtype.kind != "f":
        raise UnsupportedDtypeError(f"{what} has dtype {a.dtype}, which merge arithmetic cannot use")
    return np.asarray(a, dtype=np.float32, order="C")


class ExpertInput:
    """One expert's view of one tensor. Rows of omitted blocks equal the base (Δ exactly 0).

    Give ``theta`` (θ_k, base rows where omitted) or ``delta`` (θ_k − θ₀, 0 on omitted rows), float32 in
    the tensor's shape (numpy arrays, or torch tensors converted on entry), plus ``base`` (the operator
    binds its own base and context in ``add`` when they are missing). The other one is computed lazily, on
    the selected rows only, when first asked for, and cached. Both are None when ``selected_blocks == ()``.

    ``full`` means every block whose Δ may be nonzero was selected (omitted blocks, if any, are known to
    equal the base), so tensor-global statistics computed from the rows read are exact. ``sketch`` is the
    tensor-level |Δ| histogram from the catalog (sum of the block histograms), used for thresholds when
    the selection is not full.
    """

    __slots__ = ("index", "params", "selected_blocks", "full", "sketch", "_base", "_theta", "_delta", "_raw",
                 "_ctx")

    def __init__(
        self,
        index: int,
        params: ExpertParams,
        selected_blocks: Sequence[int],
        full: bool,
        sketch: np.ndarray | None = None,
        *,
        base: Any = None,
        theta: Any = None,
        delta: Any = None,
        raw: Any = None,
        ctx: TensorContext | None = None,
    ) -> None:
        self.index = int(index)
        self.params = params
        self.selected_blocks: tuple[int, ...] = tuple(sorted({int(b) for b in selected_blocks}))
        self.full = bool(full)
        self.sketch = None if sketch is None else np.asarray(sketch, dtype=np.int64)
        self._base = _as_f32(base, "base")
        self._ctx = ctx
        self._raw = None
        if self.selected_blocks:
            if theta is None and delta is None and raw is None:
                raise ValueError(f"expert {self.index}: blocks selected but neither theta, delta nor raw given")
            self._theta = _as_f32(theta, f"expert {self.index} tensor")
            self._delta = _as_f32(delta, f"expert {self.index} delta")
            if raw is not None and theta is None and delta is None:
                self._raw = _as_raw(raw, f"expert {self.index} tensor")
        else:
            self._theta = self._delta = None

    @classmethod
    def from_raw(cls, index: int, params: ExpertParams, selected_blocks: Sequence[int], full: bool,
                 sketch: np.ndarray | None = None, *, base: Any = None, raw: Any,
                 ctx: TensorContext | None = None) -> ExpertInput:
        """An input holding θ_k as stored (the tensor's shape; BF16 as uint16 bit patterns, F16, F32), valid on
        the selected rows only: the rows of omitted blocks were never read and may hold anything. Operators
        read it in place."""
        return cls(index, params, selected_blocks, full, sketch, base=base, raw=raw, ctx=ctx)

    @classmethod
    def from_theta(cls, index: int, params: ExpertParams, selected_blocks: Sequence[int], full: bool,
                   sketch: np.ndarray | None = None, *, base: Any = None,
                   theta: Any, ctx: TensorContext | None = None) -> ExpertInput:
        """An input holding θ_k (Δ_k computed lazily)."""
        return cls(index, params, selected_blocks, full, sketch, base=base, theta=theta, ctx=ctx)

    @classmethod
    def from_delta(cls, index: int, params: ExpertParams, selected_blocks: Sequence[int], full: bool,
                   sketch: np.ndarray | None = None, *, base: Any = None,
                   delta: Any, ctx: TensorContext | None = None) -> ExpertInput:
        """An input holding Δ_k (θ_k = θ₀ + Δ_k computed lazily)."""
        return cls(index, params, selected_blocks, full, sketch, base=base, delta=delta, ctx=ctx)

    # -- lazy θ / Δ --------------------------------------------------------------------------------

    def _need_base(self) -> np.ndarray:
        if self._base is None:
            raise ValueError(f"expert {self.index}: base is needed to derive theta/delta")
        return self._base

    @property
    def theta(self) -> np.ndarray | None:
        """θ_k (float32): θ₀ + Δ_k on selected rows, θ₀ on omitted rows."""
        if not self.selected_blocks:
            return None
        if self._theta is None and self._raw is not None:
            self._theta = self._theta_from_raw()
        if self._theta is None:
            base, delta = self._need_base(), self._delta
            assert delta is not None
            if self._ctx is None:
                self._theta = base + delta
            else:
                theta = base.copy()
                tf, bf, df = theta.reshape(-1), base.reshape(-1), delta.reshape(-1)
                for s, e in self._element_ranges(self._ctx):
                    np.add(bf[s:e], df[s:e], out=tf[s:e])
                self._theta = theta
        return self._theta

    def _theta_from_raw(self) -> np.ndarray:
        """θ_k in float32: the stored values on the selected rows, θ₀ on the others."""
        raw = self._raw
        assert raw is not None
        if self._ctx is None:
            return as_float32(raw)
        theta = self._need_base().copy()
        tf, rf = theta.reshape(-1), raw.reshape(-1)
        for s, e in self._element_ranges(self._ctx):
            tf[s:e] = as_float32(rf[s:e])
        return theta

    def fast_source(self) -> np.ndarray | None:
        """θ_k for the fused kernels (mergepipe_db/merge_kernels.py), flat and valid on the selected rows: the
        stored BF16 bit patterns (uint16) or float32 values; None when θ_k is only known through Δ_k."""
        raw = self._raw
        if self._theta is None and raw is not None and raw.dtype in (np.uint16, np.float32):
            return raw.reshape(-1)
        if self._theta is None and raw is not None:
            self._theta = self._theta_from_raw()
        if self._theta is not None:
            return self._theta.reshape(-1)
        return None

    def element_ranges_array(self, ctx: TensorContext) -> np.ndarray:
        """Selected element ranges as an int64 array of [start, stop) rows (the kernels' ``ranges``)."""
        r = self._element_ranges(ctx)
        return np.array(r, dtype=np.int64).reshape(len(r), 2)

    @property
    def delta(self) -> np.ndarray | None:
        """Δ_k = θ_k − θ₀ (float32) on selected rows, exactly 0 on omitted rows."""
        if not self.selected_blocks:
            return None
        if self._delta is None and self._theta is None and self._raw is not None:
            self._theta = self._theta_from_raw()
        if self._delta is None:
            base, theta = self._need_base(), self._theta
            assert theta is not None
            if self._ctx is None:
                self._delta = theta - base
            else:
                delta = np.zeros_like(base)
                df, tf, bf = delta.reshape(-1), theta.reshape(-1), base.reshape(-1)
                for s, e in self._element_ranges(self._ctx):
                    np.subtract(tf[s:e], bf[s:e], out=df[s:e])
                self._delta = delta
        return self._delta

    # -- geometry ----------------------------------------------------------------------------------

    def selected_row_ranges(self, ctx: TensorContext) -> list[tuple[int, int]]:
        """Coalesced [start, stop) row ranges of the selected blocks, in order."""
        out: list[tuple[int, int]] = []
        for b in self.selected_blocks:
            s, e = ctx.block_rows(b)
            if s == e:
                continue
            if out and out[-1][1] == s:
                out[-1] = (out[-1][0], e)
            else:
                out.append((s, e))
        return out

    def _element_ranges(self, ctx: TensorContext) -> list[tuple[int, int]]:
        rn = ctx.row_numel
        return [(s * rn, e * rn) for s, e in self.selected_row_ranges(ctx) if rn]

    def _bind(self, base: np.ndarray, ctx: TensorContext) -> None:
        if self._base is None:
            self._base = base
        if self._ctx is None:
            self._ctx = ctx
        for t, what in ((self._theta, "theta"), (self._delta, "delta"), (self._raw, "raw")):
            if t is not None and tuple(t.shape) != tuple(ctx.shape):
                raise ValueError(f"expert {self.index}: {what} shape {tuple(t.shape)} != {tuple(ctx.shape)}")

    def _theta_flat(self) -> np.ndarray | None:
        if self._theta is None and self._raw is not None:
            self._theta = self._theta_from_raw()
        return None if self._theta is None else self._theta.reshape(-1)

    def _delta_flat(self) -> np.ndarray | None:
        return None if self._delta is None else self._delta.reshape(-1)


def _block_seed(seed: int, expert_key: str, tensor_name: str, block_index: int) -> int:
    """The generator seed of one block's DARE uniforms (docs/SEMANTICS.md)."""
    key = hashlib.sha256(f"{seed}\x1f{expert_key}\x1f{tensor_name}\x1f{block_index}".encode()).digest()
    return int.from_bytes(key[:8], "little") & (2**63 - 1)


def _block_generator(seed: int, expert_key: str, tensor_name: str, block_index: int) -> Any:
    """The torch.Generator of one block's DARE uniforms."""
    import torch

    g = torch.Generator(device="cpu")
    g.manual_seed(_block_seed(seed, expert_key, tensor_name, block_index))
    return g


def _dare_uniforms(seed: int, expert_key: str, tensor_name: str, block_index: int, out: np.ndarray) -> None:
    """One block's uniforms, ``torch.rand(out.size)`` of its keyed generator, into `out` (flat float32),
    drawn by `mt19937.torch_rand_into` (the same bits, ~10× faster than torch's element-by-element loop)."""
    from mergepipe_db.kernels.torch_rand import torch_rand_into

    torch_rand_into(_block_seed(seed, expert_key, tensor_name, block_index), out)


def dare_keep_mask(seed: int, expert_key: str, tensor_name: str, block_index: int,
                   block_shape: tuple[int, ...], density: float) -> Any:
    """The DARE keep mask (a bool torch tensor, ``block_shape``) of one block: ``rand(block_shape) < density``
    from a generator keyed by (seed, expert, tensor, block) — independent of which other blocks are read."""
    import torch

    g = _block_generator(seed, expert_key, tensor_name, block_index)
    u = torch.rand(tuple(block_shape), generator=g, dtype=torch.float32)
    return u < float(density)


def _weight_sum(weights: Sequence[float]) -> float:
    """W = Σ w_k as a Python float summed in order; 1 when |W| < 1e-8."""
    total = 0.0
    for w in weights:
        total = total + w
    return 1.0 if abs(total) < 1e-8 else total


# --------------------------------------------------------------------------------------------------
# Order statistics of |Δ| (TIES / breadcrumbs thresholds)
# --------------------------------------------------------------------------------------------------


_RADIX_SMALL = 4096  # below this many elements a sort is cheaper than two 64 Ki-bin bincounts
_RADIX_CHUNK = 1 << 20  # elements per bincount of the radix select


def _locate_from_top(counts: np.ndarray, k: int) -> tuple[int, int]:
    """(index, count above it) of the k-th largest item of a histogram over increasing keys."""
    from_top = np.cumsum(counts[::-1])
    i = int(np.searchsorted(from_top, k, side="left"))
    idx = counts.size - 1 - i
    return idx, int(from_top[i]) - int(counts[idx])


def _kth_largest_exact(a: np.ndarray, k: int, op: MergeOperator, cache: dict[str, np.ndarray] | None = None,
                       ) -> float:
    """The k-th largest (1 <= k <= numel) of a 1-D float32 array of magnitudes, NaN counted largest.

    Radix select on the bit patterns (non-negative float32 order = int32 order, NaN above inf): a
    bincount of the top 16 bits locates the k-th largest's prefix, a second one its low 16 bits. Equal
    to ``torch.sort(a, descending=True).values[k-1]`` without sorting, topk or selecting elements.
    ``cache`` keeps the first bincount for further queries on the same ``a``.
    """
    n = a.size
    if n <= _RADIX_SMALL:
        return float(np.sort(a)[n - k])  # ascending, NaN last: the k-th largest with NaN largest
    bits = a.view(np.int32)
    step = min(n, _RADIX_CHUNK)
    c = op._scratch("radix", step, np.int32)
    h1 = None if cache is None else cache.get("h1")
    if h1 is None:
        h1 = np.zeros(1 << 15, dtype=np.int64)
        for s in range(0, n, step):
            chunk = np.right_shift(bits[s : s + step], 16, out=c[: min(step, n - s)])
            h1 += np.bincount(chunk, minlength=1 << 15)
        if cache is not None:
            cache["h1"] = h1
    hi, above = _locate_from_top(h1, k)
    first = (hi << 16) - 1  # 0: below the prefix, 1..65536: inside, 65537: above
    top = min(first + (1 << 16) + 1, 2**31 - 1)  # int32 ends inside the last prefix: nothing lies above it
    h2 = np.zeros((1 << 16) + 2, dtype=np.int64)
    for s in range(0, n, step):
        chunk = np.clip(bits[s : s + step], first, top, out=c[: min(step, n - s)])
        chunk -= first
        h2 += np.bincount(chunk, minlength=(1 << 16) + 2)
    low, _ = _locate_from_top(h2[1 : (1 << 16) + 1], k - above)
    return float(np.array([(hi << 16) | low], dtype=np.int32).view(np.float32)[0])


class _Magnitudes:
    """|Δ| of the rows read for one expert and tensor, and order statistics of the whole tensor's |Δ|.

    Positions follow a descending sort with NaN first (torch's order): ``desc(k)`` is the k-th largest.
    Exact mode (``hist is None``: full selection, or no sketch): the tensor is the rows read plus zeros
    for the rest; `_kth_largest_exact` finds the value. Sketch mode (partial selection): the catalog
    histogram locates the bin; when every element of that bin was read the value is still exact (its rank
    among the rows read is known), otherwise it is interpolated inside the bin (`sketch.kth_largest`).
    """

    def __init__(self, a: np.ndarray, n_total: int, hist: np.ndarray | None, op: MergeOperator) -> None:
        self.a = a
        self.n = n_total
        self.hist = hist
        self._op = op
        self._nan_read: int | None = None
        self._cache: dict[str, np.ndarray] = {}

    def nan_read(self) -> int:
        if self._nan_read is None:
            a = self.a
            self._nan_read = 0
            if a.size and bool(np.isnan(a.max())):
                self._nan_read = int(np.isnan(a).sum())
        return self._nan_read

    def _count_ge(self, v: float) -> int:
        """Read elements with |Δ| >= v (NaN not counted)."""
        total = 0
        for s, e in _chunks([(0, self.a.size)]):
            total += int(np.count_nonzero(np.greater_equal(self.a[s:e], v, out=self._op._scratch("ge", e - s,
                                                                                                 np.bool_))))
        return total

    def _desc_sketch(self, k: int) -> float | None:
        """Exact k-th largest from the sketch's counts when every element of its bin was read, else None."""
        hist = self.hist
        assert hist is not None
        b, above = _sketch.locate_kth_largest(hist, k)
        if b == _sketch.ZERO_BIN:
            return 0.0
        r = k - above  # rank inside bin b (NaN first in the last bin)
        ge_lo = self._count_ge(float(_EDGES[b]))
        if b == _LAST:
            in_bin, read_above = ge_lo + self.nan_read(), 0
        else:
            read_above = self._count_ge(float(_EDGES[b + 1]))
            in_bin = ge_lo - read_above
            read_above += self.nan_read()
        if in_bin != int(hist[b]):
            return None
        return _kth_largest_exact(self.a, read_above + r, self._op, self._cache)

    def desc(self, k: int) -> float:
        """The k-th largest |Δ| of the whole tensor (1 <= k <= n), NaN counted largest."""
        if self.hist is None:
            return _kth_largest_exact(self.a, k, self._op, self._cache) if k <= self.a.size else 0.0
        exact = self._desc_sketch(k) if int(self.hist.sum()) == self.n else None
        if exact is not None:
            return exact
        return float(np.float32(_sketch.kth_largest(self.hist, k)))

    def nan_total(self) -> int | None:
        """NaN count of the whole tensor if known (0 or more), else None."""
        if self.hist is None or self.nan_read():
            return self.nan_read()
        if int(self.hist[_LAST]) == 0 or self._count_ge(float(_EDGES[_LAST])) == int(self.hist[_LAST]):
            return 0
        return None

    def topk_min(self, k: int) -> float:
        """``torch.topk(|Δ|.flatten(), k).values.min()`` (+inf for k == 0): NaN if any NaN. When a partial
        read cannot tell (NaN would sit in the sketch's last bin, not wholly read), NaN is left out."""
        if k <= 0:
            return math.inf
        if self.nan_total():
            return math.nan
        return self.desc(k)

    def bottomk_max(self, k: int) -> float:
        """``torch.topk(|Δ|.flatten(), k, largest=False).values.max()`` (-inf for k == 0)."""
        if k <= 0:
            return -math.inf
        return self.desc(self.n - k + 1)


# --------------------------------------------------------------------------------------------------
# Operators
# --------------------------------------------------------------------------------------------------


def _chunks(ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    for s, e in ranges:
        for c in range(s, e, _CHUNK):
            yield c, min(e, c + _CHUNK)


def _finite(value: object, what: str, method: str) -> float:
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SpecError(f"{method}: {what} must be a number, got {value!r}") from None
    if not math.isfinite(f):
        raise SpecError(f"{method}: {what} must be finite, got {value!r}")
    return f


class MergeOperator(abc.ABC):
    """Streaming fold of one tensor over the experts: ``begin``, ``add`` for k = 0..K-1, ``finish``.

    One operator serves every tensor of a merge; it keeps grow-only scratch buffers between tensors.
    ``finish`` returns a float32 array valid until the next ``begin``. Arithmetic on inf/NaN follows IEEE
    754 without numpy's floating-point warnings.
    """

    name: ClassVar[str]
    #: fixed-coefficient additive (linear, task_arithmetic): the omitted-update bound applies
    additive: ClassVar[bool] = False
    #: plan whole tensors (slerp)
    tensor_granular: ClassVar[bool] = False
    #: reads θ_k (linear, slerp); the others use Δ_k
    uses_theta: ClassVar[bool] = False
    #: needs tensor-global thresholds (ties, breadcrumbs): a partial read takes them from the sketch
    needs_full_tensor_stats: ClassVar[bool] = False
    #: plan block rows of all experts together (ties, dare_ties; sql/plan_rank_grouped.sql)
    joint_election: ClassVar[bool] = False
    normalize_default: ClassVar[bool] = False
    #: imports torch for its results (slerp's norms): the executor sets its thread count first
    uses_torch: ClassVar[bool] = False
    #: inputs kept for a fused pass over the tensor (a `_Stash`, or TIES's list); empty or None: none held
    _stash: Any = None

    def __init__(self, experts: Sequence[ExpertParams], *, normalize: bool | None = None, lam: float = 1.0,
                 t: float | None = None) -> None:
        experts = tuple(experts)
        if not experts:
            raise SpecError(f"{self.name} needs at least one expert model")
        self.weights: list[float] = []
        self.densities: list[float] = []
        self.gammas: list[float] = []
        for k, e in enumerate(experts):
            if not isinstance(e, ExpertParams):
                raise SpecError(f"{self.name}: expert {k} parameters must be ExpertParams, "
                                f"got {type(e).__name__}")
            self.weights.append(_finite(e.weight, f"expert {k} weight", self.name))
            d = _finite(e.density, f"expert {k} density", self.name)
            if not 0.0 < d <= 1.0:
                raise SpecError(f"{self.name}: expert {k} density {e.density!r} must be in (0, 1]")
            self.densities.append(d)
            g = _finite(e.gamma, f"expert {k} gamma", self.name)
            if not 0.0 <= g <= 1.0:
                raise SpecError(f"{self.name}: expert {k} gamma {e.gamma!r} must be in [0, 1]")
            self.gammas.append(g)
        self.experts: tuple[ExpertParams, ...] = experts
        self.normalize = self.normalize_default if normalize is None else bool(normalize)
        self.lam = _finite(lam, "lambda", self.name)
        self.t = None if t is None else _finite(t, "t", self.name)
        self.weight_sum = _weight_sum(self.weights)
        self._pool: dict[str, np.ndarray] = {}
        self._base: np.ndarray | None = None
        self._bflat: np.ndarray | None = None
        self._ctx: TensorContext | None = None
        self._next = 0
        self._skip: np.ndarray | None = None
        self._table: np.ndarray | None = None
        self._validate()

    def _validate(self) -> None:
        """Method-specific checks (SpecError)."""
        return None

    @property
    def n_experts(self) -> int:
        return len(self.experts)

    def coefficient(self, k: int) -> float:
        """c_k = |λ·w_k / W| (normalized) or |λ·w_k|: the bound's coefficient for additive operators, an
        importance weight (a fixed multiple of |w_k|) for the others."""
        c = self.lam * self.weights[k]
        if self.normalize:
            c = c / self.weight_sum
        return abs(c)

    # -- protocol ----------------------------------------------------------------------------------

    def begin(self, base: Any, ctx: TensorContext, skip: np.ndarray | None = None) -> None:
        """Start a tensor: ``base`` is θ₀ in float32 (other float dtypes are upcast). ``skip`` (bool per block):
        blocks no expert will select, which the caller writes itself from `base_only_table`; the result is
        undefined there, the operator spends no work on them and does not read ``base`` there (the caller
        need not fill it)."""
        b = _as_f32(base, f"base tensor {ctx.name!r}")
        assert b is not None
        if tuple(b.shape) != tuple(ctx.shape):
            raise ValueError(f"tensor {ctx.name!r}: base shape {tuple(b.shape)} != context shape {ctx.shape}")
        if skip is not None and (skip.shape != (ctx.n_blocks,) or self.base_only_table() is None):
            raise ValueError(f"tensor {ctx.name!r}: skip must be one flag per block, for an operator with a "
                             f"base-only table")
        self._base, self._bflat, self._ctx, self._next = b, b.reshape(-1), ctx, 0
        self._skip = np.zeros(ctx.n_blocks, np.bool_) if skip is None else np.asarray(skip, np.bool_)
        with np.errstate(all="ignore"):
            self._begin()

    def add(self, x: ExpertInput) -> None:
        """Fold expert ``x.index``; experts must come in spec order, every one of them."""
        if self._base is None or self._ctx is None:
            raise RuntimeError("add() before begin()")
        if x.index != self._next:
            raise ValueError(f"expert inputs must arrive in spec order: expected {self._next}, got {x.index}")
        if x.params is not None and x.params != self.experts[x.index]:
            raise ValueError(f"expert {x.index}: input parameters {x.params} differ from the operator's")
        x._bind(self._base, self._ctx)
        with np.errstate(all="ignore"):
            self._add(x)
        self._next += 1

    def finish(self) -> np.ndarray:
        """The merged tensor (float32, the base's shape). It may be one of the operator's reused buffers: valid
        until the next ``begin()``, which overwrites it (fresh pages per tensor cost more than the arithmetic)."""
        if self._base is None:
            raise RuntimeError("finish() before begin()")
        if self._next != self.n_experts:
            raise RuntimeError(f"finish() after {self._next} of {self.n_experts} experts")
        with np.errstate(all="ignore"):
            out = self._finish()
        self._base = self._bflat = None
        self._ctx = None
        self._end()
        return out

    def base_only_table(self) -> np.ndarray | None:
        """The result on a block no expert selected, as a function of θ₀ alone: float32 values indexed by θ₀'s
        BF16 bit pattern (65,536 entries), from the same float32 operations in the same order as the fold;
        None when the operator has no such form (slerp). The executor writes such blocks from it (``skip``)."""
        if self._table is None:
            b = as_float32(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16))
            with np.errstate(all="ignore"):
                self._table = self._base_only(b)
        return self._table

    def _base_only(self, b: np.ndarray) -> np.ndarray | None:
        """`base_only_table` for the θ₀ values `b` (float32)."""
        return None

    def _live_ranges(self) -> list[tuple[int, int]]:
        """Element ranges [start, stop) of the blocks not skipped, adjacent ones merged."""
        assert self._ctx is not None and self._skip is not None
        return live_ranges(block_bounds(self._ctx), self._skip)

    def held_inputs(self) -> frozenset[int]:
        """Indices of the inputs already added whose stored bytes the operator still holds (kept for a fused
        pass, until it runs or `finish`): the caller must not reuse their buffers before then. Operators
        keep inputs in `_stash`, as (values, input, ...) items."""
        return frozenset(item[1].index for item in self._stash or ())

    def release_buffers(self) -> None:
        """Drop the scratch buffers kept between tensors."""
        self._pool.clear()

    @abc.abstractmethod
    def _begin(self) -> None: ...

    @abc.abstractmethod
    def _add(self, x: ExpertInput) -> None: ...

    @abc.abstractmethod
    def _finish(self) -> np.ndarray: ...

    def _end(self) -> None:
        """Drop per-tensor references."""
        return None

    # -- helpers -----------------------------------------------------------------------------------

    def _scratch(self, name: str, n: int, dtype: Any = np.float32) -> np.ndarray:
        """A reused 1-D buffer of n elements (contents undefined)."""
        buf = self._pool.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            self._pool.pop(name, None)
            buf = empty_buffer(max(n, 1), dtype)
            self._pool[name] = buf
        return buf[:n]

    def _delta_chunk(self, x: ExpertInput, s: int, e: int) -> np.ndarray:
        """Δ_k[s:e] (flat): a view of the given Δ, or θ_k − θ₀ into scratch."""
        d = x._delta_flat()
        if d is not None:
            return d[s:e]
        theta = x._theta_flat()
        assert theta is not None and self._bflat is not None
        return np.subtract(theta[s:e], self._bflat[s:e], out=self._scratch("delta", e - s))

    def _theta_chunk(self, x: ExpertInput, s: int, e: int) -> np.ndarray:
        """θ_k[s:e] (flat) on selected rows: a view of the given θ, or θ₀ + Δ_k into scratch."""
        theta = x._theta_flat()
        if theta is not None:
            return theta[s:e]
        d = x._delta_flat()
        assert d is not None and self._bflat is not None
        return np.add(self._bflat[s:e], d[s:e], out=self._scratch("theta", e - s))


def _all_finite(t: np.ndarray) -> bool:
    """True when every element is finite (a sum that overflows answers False: callers then take the
    exact slow path, which is always correct)."""
    return bool(np.isfinite(t.sum()))


class _DeltaFold(MergeOperator):
    """Operators on task vectors: D_k = T_k · w_k folded over the selected rows only.

    Masks are applied as float 0/1 indicators (``D * 1 = D``, ``D * 0 = ±0``), which equals
    ``where(keep, ·, 0.0)`` whenever D is finite; a chunk holding inf/NaN takes the literal ``where``.
    The sign of a zero D never matters: it only meets +0.0-started accumulators.
    """

    #: How T_k is formed from Δ_k when density < 1: None (T_k = Δ_k), "magnitude" (TIES trim),
    #: "magnitude_outliers" (breadcrumbs) or "random" (DARE). At density 1, T_k = Δ_k for all of them.
    sparsification: ClassVar[str | None] = None

    def _add(self, x: ExpertInput) -> None:
        assert self._ctx is not None
        ranges = x._element_ranges(self._ctx)
        if not ranges:
            return
        if self.sparsification is None or self.densities[x.index] >= 1:
            self._fold(x, ranges)
        elif self.sparsification == "magnitude":
            self._fold_ties_trim(x, ranges)
        elif self.sparsification == "magnitude_outliers":
            self._fold_breadcrumbs_trim(x, ranges)
        else:
            self._fold_dare(x)

    def _validate(self) -> None:
        if self.sparsification == "random":
            _check_keys(self)

    def _fold(self, x: ExpertInput, ranges: list[tuple[int, int]]) -> None:
        """T_k = Δ_k."""
        w = self.weights[x.index]
        if self._fold_fast(x, None):
            return
        self._set_expert(w)
        for s, e in _chunks(ranges):
            d = self._delta_chunk(x, s, e)
            self._combine(s, e, np.multiply(d, w, out=self._scratch("D", e - s)), None)

    def _set_expert(self, w: float) -> None:
        """Per-expert constants for `_combine`."""
        self._w = w

    @abc.abstractmethod
    def _combine(self, s: int, e: int, D: np.ndarray, finite: bool | None) -> None:
        """Fold D_k[s:e] (may be modified); ``finite``: known all-finite (True) or unknown (None)."""

    def _fold_fast(self, x: ExpertInput, tau: float | None, zero_check: int = 0) -> bool:
        """Fold T_k (T_k = Δ_k, or where(|Δ_k| >= τ, Δ_k, 0.0) when ``tau`` is given) with a fused kernel, if
        this operator has one and θ_k is at hand; False: the caller takes the chunked numpy path.
        ``zero_check`` = k: τ = 0 came from the sketch unchecked (`_exact_tau_fast`)."""
        return False

    def _dare_block_fast(self, src: np.ndarray, b: int, s0: int, e0: int, u: np.ndarray, d: float,
                         w: float) -> bool:
        """Fold block b's DARE task vector (uniforms `u`) with a fused kernel, if this operator has one."""
        return False

    # -- trims ---------------------------------------------------------------------------------------

    def _magnitudes(self, x: ExpertInput, ranges: list[tuple[int, int]]) -> _Magnitudes:
        n_read = sum(e - s for s, e in ranges)
        a = self._scratch("abs", n_read)
        assert self._ctx is not None and self._bflat is not None
        src = x.fast_source()
        if src is not None:
            _mk().absdelta(a, self._bflat, src, x.element_ranges_array(self._ctx))
        else:
            off = 0
            for s, e in _chunks(ranges):
                np.abs(self._delta_chunk(x, s, e), out=a[off : off + e - s])
                off += e - s
        hist = None if (x.full or x.sketch is None) else x.sketch
        return _Magnitudes(a, self._ctx.numel, hist, self)

    def _fold_masked(self, x: ExpertInput, ranges: list[tuple[int, int]], mags: _Magnitudes,
                     lo: float | None, hi: float | None) -> None:
        """T_k = where(keep, Δ_k, 0.0): keep = |Δ| >= lo when ``hi`` is None (TIES), else
        lo < |Δ| < hi (breadcrumbs; ``lo`` None: no lower test)."""
        w = self.weights[x.index]
        self._set_expert(w)
        a = mags.a
        off = 0
        for s, e in _chunks(ranges):
            n = e - s
            ac = a[off : off + n]
            off += n
            d = self._delta_chunk(x, s, e)
            D = np.multiply(d, w, out=self._scratch("D", n))
            if _all_finite(D):
                ind = self._scratch("ind", n)
                if hi is None:
                    assert lo is not None
                    np.greater_equal(ac, lo, out=ind)
                else:
                    np.less(ac, hi, out=ind)
                    if lo is not None:
                        D *= np.greater(ac, lo, out=self._scratch("ind2", n))
                D *= ind
                self._combine(s, e, D, True)
            else:  # the literal formula
                if hi is None:
                    assert lo is not None
                    keep = ac >= lo
                else:
                    keep = ac < hi if lo is None else (ac > lo) & (ac < hi)
                T = np.where(keep, d, np.float32(0.0))
                T *= w
                self._combine(s, e, T, None)

    #: the operator has fused kernels for T_k = Δ_k and the TIES trim (`_fold_fast`)
    _fused: ClassVar[bool] = False

    def _fold_ties_trim(self, x: ExpertInput, ranges: list[tuple[int, int]]) -> None:
        """TIES step 1 (density < 1): keep |Δ| >= τ, τ the k-th largest |Δ| of the whole tensor."""
        assert self._ctx is not None
        k = int(self.densities[x.index] * self._ctx.numel)
        exact = x.full or x.sketch is None
        if exact and k > 0 and self._fused:
            tau_fast, zero_check = self._exact_tau_fast(x, ranges, k)
            if tau_fast is not None and self._fold_fast(x, tau_fast, zero_check):
                return
        if not exact and k > 0 and self._fused:
            tau_sketch, zero_check = self._sketch_tau_fast(x, k)
            if tau_sketch is not None and math.isnan(tau_sketch):
                return  # |Δ| >= NaN is false everywhere: T_k = 0
            if tau_sketch is not None and self._fold_fast(x, tau_sketch, zero_check):
                return
        mags = self._magnitudes(x, ranges)
        tau = mags.topk_min(k)
        if math.isnan(tau):
            return  # |Δ| >= NaN is false everywhere: T_k = 0
        if tau == math.inf and not bool(np.isinf(mags.a).any()):
            return
        if self._fold_fast(x, tau):
            return
        self._fold_masked(x, ranges, mags, tau, None)

    def _exact_tau_fast(self, x: ExpertInput, ranges: list[tuple[int, int]], k: int) -> tuple[float | None, int]:
        """(τ, zero_check): τ the k-th largest |Δ| of a fully selected tensor by the fused kernels, or None
        when they cannot tell (no θ_k bytes, inf/NaN, or a sketch the rows read contradict). With the
        catalog's tensor sketch the bin of τ is known, so one pass collects that bin only; otherwise a
        two-pass radix select. When the sketch puts τ at 0 (most of the tensor unchanged, common in BF16
        fine-tunes) the bytes must show fewer than k nonzero |Δ| and no inf/NaN: checked here, or, for an
        input kept for a fused pass, by that pass (zero_check = k, see `_TiesFold`)."""
        src = x.fast_source()
        if src is None or self._bflat is None or self._ctx is None:
            return None, 0
        base, ranges_arr = self._bflat, x.element_ranges_array(self._ctx)
        hist = x.sketch
        if hist is not None and int(hist.sum()) == self._ctx.numel:
            b, above = _sketch.locate_kth_largest(hist, k)
            if b == _sketch.ZERO_BIN:
                if self._defers_zero_check(src):
                    return 0.0, k
                if _mk().kth_largest_is_zero(base, src, ranges_arr, k):
                    return 0.0, 0
            if b not in (_sketch.ZERO_BIN, _LAST):
                tau = _mk().kth_largest_in_bin(base, src, ranges_arr, k, float(_EDGES[b]), float(_EDGES[b + 1]),
                                               int(hist[b]), above)
                if tau is not None:
                    return tau, 0
        n_read = sum(e - s for s, e in ranges)
        return _mk().kth_largest_abs_delta(base, src, ranges_arr, n_read, self._ctx.numel, k), 0

    def _sketch_tau_fast(self, x: ExpertInput, k: int) -> tuple[float | None, int]:
        """(τ, zero_check): τ of a partly read tensor as `_Magnitudes.topk_min` gives it, by a fused kernel in one
        pass, without the |Δ| of the rows read in memory; None (the caller takes that path) without θ_k's
        bytes, or when the sketch is incomplete or has values in its last bin (inf/NaN: their counts decide
        there). τ = 0 (the sketch's bin 0) holds unless a NaN is read: an input kept for the fused pass is
        checked by it (zero_check = numel + 1: no count of nonzero |Δ| reaches it, so only an inf or NaN
        read sends it back here, to the |Δ|-in-memory path; `_TiesFold._finish_fused`)."""
        src, hist = x.fast_source(), x.sketch
        if src is None or hist is None or self._bflat is None or self._ctx is None:
            return None, 0
        if int(hist[_LAST]) or int(hist.sum()) != self._ctx.numel:
            return None, 0
        b, _above = _sketch.locate_kth_largest(hist, k)
        ranges_arr = x.element_ranges_array(self._ctx)
        if b == _sketch.ZERO_BIN:
            if self._defers_zero_check(src):
                return 0.0, self._ctx.numel + 1
            _nonzero, special = _mk().absdelta_count(self._bflat, src, ranges_arr)
            return (None if special else 0.0), 0
        return _mk().sketch_tau(self._bflat, src, ranges_arr, hist, k, float(_EDGES[b]), float(_EDGES[b + 1])), 0

    def _defers_zero_check(self, src: np.ndarray) -> bool:
        """Whether a fused pass will check a τ = 0 taken from the sketch (`_exact_tau_fast`)."""
        return False

    def _fold_breadcrumbs_trim(self, x: ExpertInput, ranges: list[tuple[int, int]]) -> None:
        """Breadcrumbs (density < 1): keep lo < |Δ| < hi."""
        assert self._ctx is not None
        n = self._ctx.numel
        target = int(self.densities[x.index] * n)
        n_top = int(self.gammas[x.index] * n)
        n_bot = n - target - n_top
        if n_bot < 0:
            n_top += n_bot
            n_bot = 0
        mags = self._magnitudes(x, ranges)
        hi = math.inf if n_top == 0 else mags.topk_min(n_top)
        lo = -math.inf if n_bot == 0 else mags.bottomk_max(n_bot)
        if math.isnan(hi) or math.isnan(lo):
            return  # a comparison with NaN is false everywhere: T_k = 0
        self._fold_masked(x, ranges, mags, None if lo == -math.inf else lo, hi)

    def _fold_dare(self, x: ExpertInput) -> None:
        """DARE: T_k = where(rand < d, Δ_k / d, 0.0), masks drawn per selected block only."""
        ctx = self._ctx
        assert ctx is not None
        k = x.index
        w, d = self.weights[k], self.densities[k]
        key = self.experts[k].key
        self._set_expert(w)
        rn = ctx.row_numel
        src = x.fast_source()
        for b in x.selected_blocks:
            rs, re = ctx.block_rows(b)
            s0, e0 = rs * rn, re * rn
            if s0 == e0:
                continue
            u = self._scratch("u", e0 - s0)
            _dare_uniforms(ctx.seed, key, ctx.name, b, u)
            if src is not None and self._dare_block_fast(src, b, s0, e0, u, d, w):
                continue
            for s, e in _chunks([(s0, e0)]):
                n = e - s
                uc = u[s - s0 : e - s0]
                delta = self._delta_chunk(x, s, e)
                D = np.divide(delta, d, out=self._scratch("D", n))
                D *= w
                if _all_finite(D):
                    D *= np.less(uc, d, out=self._scratch("ind", n))
                    self._combine(s, e, D, True)
                else:  # the literal formula
                    T = np.where(uc < d, delta / d, np.float32(0.0))
                    T *= w
                    self._combine(s, e, T, None)


class _AdditiveFold(_DeltaFold):
    """task_arithmetic and the methods that follow it with T_k: mixed = Σ T_k·w_k; θ₀ + mixed·λ."""

    _mixed: np.ndarray | None = None

    def _begin(self) -> None:
        assert self._base is not None
        # written on the blocks not skipped (the caller writes the others) by the first fused pass, or zeroed
        # by `_settle` before a streamed fold
        self._mixed = self._scratch("out", self._base.size)
        self._started = False
        self._stash = _Stash()

    def _fold_stash(self, finish: bool = False) -> None:
        """Fold the kept inputs (in order) in one fused pass, which starts the sum if nothing has yet; with
        `finish`, it also ends each element as `_finish` does."""
        if not self._stash:
            return
        assert self._mixed is not None and self._ctx is not None and self._bflat is not None
        items, raws, selected = self._stash.take(self._ctx.n_blocks)
        w = np.array([self.weights[x.index] for _src, x in items], np.float32)
        _mk().delta_fused(self._mixed, self._bflat, raws, selected, block_bounds(self._ctx), w, self._skip,
                          not self._started, finish, self.normalize, np.float32(self.weight_sum),
                          np.float32(self.lam))
        self._started = True

    def _settle(self) -> None:
        """Fold the kept inputs, or start the sum at zero: `_mixed` then holds Σ T_k·w_k so far (experts are
        folded in order)."""
        if self._stash:
            self._fold_stash()
        elif not self._started:
            assert self._mixed is not None
            for s, e in self._live_ranges():
                self._mixed[s:e] = 0.0
            self._started = True

    def _combine(self, s: int, e: int, D: np.ndarray, finite: bool | None) -> None:
        assert self._mixed is not None
        self._settle()
        self._mixed[s:e] += D

    def _dare_block_fast(self, src: np.ndarray, b: int, s0: int, e0: int, u: np.ndarray, d: float,
                         w: float) -> bool:
        if self._mixed is None or self._bflat is None:
            return False
        self._settle()
        _mk().dare_delta_span(self._mixed[s0:e0], self._bflat[s0:e0], src[s0:e0], u,
                              np.float32(d), np.float32(w))
        return True

    def _fold_fast(self, x: ExpertInput, tau: float | None, zero_check: int = 0) -> bool:
        src = x.fast_source() if tau is None else None
        if src is None or self._mixed is None or self._ctx is None or self._bflat is None:
            return False
        if self._stash.offer(src, x, self._fold_stash):
            return True
        self._settle()
        w = np.float32(self.weights[x.index])
        _mk().delta_add(self._mixed, self._bflat, src, x.element_ranges_array(self._ctx), w)
        return True

    def _finish(self) -> np.ndarray:
        mixed, base = self._mixed, self._base
        assert mixed is not None and base is not None
        if self._stash:  # the last fused pass ends each element
            self._fold_stash(finish=True)
            return mixed.reshape(base.shape)
        self._settle()
        bflat = base.reshape(-1)
        for s, e in self._live_ranges():
            m = mixed[s:e]
            if self.normalize:
                m /= self.weight_sum
            m *= self.lam
            m += bflat[s:e]
        return mixed.reshape(base.shape)

    def _base_only(self, b: np.ndarray) -> np.ndarray:
        m = np.zeros_like(b)  # Σ over no expert
        if self.normalize:
            m /= self.weight_sum
        m *= self.lam
        m += b
        return m

    def _end(self) -> None:
        self._mixed = None
        self._stash = _Stash()


class _TiesFold(_DeltaFold):
    """TIES steps 2-6 in streaming form (docs/SEMANTICS.md): S = Σ D_k, P/N = Σ positive/negative D_k,
    WP/WN = Σ w_k over positive/negative D_k; mixed = where(S >= 0, P, N), div = where(S >= 0, WP, WN)."""

    normalize_default = True
    #: every expert's Δ of an element meets in one sign election and divisor: the planner reads block rows
    #: of all experts together (omitting one expert's block there would change the others' weight)
    joint_election: ClassVar[bool] = True
    _P: np.ndarray | None = None

    _fused = True

    def _begin(self) -> None:
        assert self._base is not None and self._ctx is not None
        n = self._base.size
        # reused buffers, not cleared: a block's first fold writes its sums; `_touched` says which have one
        self._P = self._scratch("out", n)  # becomes the output
        self._S = self._scratch("S", n)
        self._N = self._scratch("N", n)
        if self.normalize:
            self._WP = self._scratch("WP", n)
            self._WN = self._scratch("WN", n)
        self._bounds = block_bounds(self._ctx)
        self._touched = np.zeros(self._ctx.n_blocks, np.bool_)
        # experts' inputs kept for one fused pass at finish (`merge_kernels.ties_fused`) while they fit:
        # (values, input, trim, τ, w, zero_check)
        self._stash: list[tuple[np.ndarray, ExpertInput, bool, float, float, int]] | None = []
        self._stash_bytes = 0

    def _fits_stash(self, src: np.ndarray) -> bool:
        return (self._stash is not None and self._stash_bytes + src.nbytes <= _FUSE_BYTES
                and (not self._stash or self._stash[0][0].dtype == src.dtype))

    def _defers_zero_check(self, src: np.ndarray) -> bool:
        # the fused pass counts the nonzero |Δ| of the tile it has just read: no pass of its own
        return self._fits_stash(src)

    def _set_expert(self, w: float) -> None:
        # every chunked fold starts here: the kept inputs are earlier experts, so they are folded first (in
        # order), and before w is set, as folding them sets their own
        self._flush_stash()
        super()._set_expert(w)

    def _flush_stash(self) -> None:
        """Fold the kept inputs with the streaming kernels (in order) and stop keeping new ones."""
        stash, self._stash = self._stash, None
        for item in stash or ():
            self._fold_kept(*item)

    def _fold_kept(self, src: np.ndarray, x: ExpertInput, trim: bool, tau: float, w: float, zero_check: int
                   ) -> None:
        """Fold one kept input with the streaming kernels. A τ = 0 from the sketch not yet checked is checked
        first; if the bytes disagree, τ is found from them (`_fold_ties_trim`, checking at once). A DARE input
        (dare_ties, d < 1) is folded block by block (`_DeltaFold._fold_dare`)."""
        assert self._bflat is not None and self._ctx is not None
        if self._draws_mask(x):
            super()._fold_dare(x)
            return
        if zero_check and not _mk().kth_largest_is_zero(self._bflat, src, x.element_ranges_array(self._ctx),
                                                         zero_check):
            self._fold_ties_trim(x, x._element_ranges(self._ctx))
            return
        self._stream(src, x, trim, tau, w)

    def _draws_mask(self, x: ExpertInput) -> bool:
        return self.sparsification == "random" and self.densities[x.index] < 1

    def _fold_dare(self, x: ExpertInput) -> None:
        """dare_ties: keep the input for the fused pass (`merge_kernels.dare_ties_fused`, which draws each
        block's uniforms a tile at a time) while it fits, else fold it block by block."""
        src = x.fast_source()
        if src is not None and self._P is not None and self._bflat is not None and self._fits_stash(src):
            assert self._stash is not None
            self._stash.append((src, x, False, math.inf, self.weights[x.index], 0))
            self._stash_bytes += src.nbytes
            return
        super()._fold_dare(x)

    def _dare_block_fast(self, src: np.ndarray, b: int, s0: int, e0: int, u: np.ndarray, d: float,
                         w: float) -> bool:
        if self._bflat is None:
            return False
        S, P, N, wp, wn = self._sums()
        _mk().ties_dare_span(S[s0:e0], P[s0:e0], N[s0:e0], wp[s0:e0], wn[s0:e0], self._bflat[s0:e0],
                             src[s0:e0], u, np.float32(d), np.float32(w), self.normalize, not self._touched[b])
        self._touched[b] = True
        return True

    def _stream(self, src: np.ndarray, x: ExpertInput, trim: bool, tau: float, w: float) -> None:
        assert self._bflat is not None
        _mk().ties_add(*self._sums(), self._bflat, src, self._bounds,
                       np.array(x.selected_blocks, np.int64), self._touched, trim, np.float32(tau),
                       np.float32(w), self.normalize)

    def _sums(self) -> tuple[np.ndarray, ...]:
        assert self._P is not None
        wp = self._WP if self.normalize else _NO_F32
        wn = self._WN if self.normalize else _NO_F32
        return self._S, self._P, self._N, wp, wn

    def _init_sums(self) -> None:
        """Clear the sums of untouched blocks before a chunked fold (which adds to them)."""
        if not self._touched.all():
            _mk().ties_clear_untouched(*self._sums(), self._bounds, self._touched, self.normalize)

    def _fold_fast(self, x: ExpertInput, tau: float | None, zero_check: int = 0) -> bool:
        src = x.fast_source()
        if src is None or self._P is None or self._ctx is None or self._bflat is None:
            return False
        item = (src, x, tau is not None, math.inf if tau is None else tau, self.weights[x.index], zero_check)
        if self._stash is not None and self._fits_stash(src):
            self._stash.append(item)
            self._stash_bytes += src.nbytes
        else:
            self._flush_stash()
            self._fold_kept(*item)
        return True

    def _combine(self, s: int, e: int, D: np.ndarray, finite: bool | None) -> None:
        assert self._P is not None
        self._init_sums()
        n = e - s
        w = self._w
        self._S[s:e] += D
        t = self._scratch("t2", n)
        if finite or _all_finite(D):
            # D > 0: max(D, 0) = D, 1·w = w; otherwise ±0 — equal to the where() forms for finite D
            self._P[s:e] += np.maximum(D, 0.0, out=t)
            self._N[s:e] += np.minimum(D, 0.0, out=t)
            if self.normalize:
                np.greater(D, 0.0, out=t)
                t *= w
                self._WP[s:e] += t
                np.less(D, 0.0, out=t)
                t *= w
                self._WN[s:e] += t
        else:  # the literal formula (NaN D is neither positive nor negative)
            pos, neg = D > 0, D < 0
            zero, w32 = np.float32(0.0), np.float32(w)
            self._P[s:e] += np.where(pos, D, zero)
            self._N[s:e] += np.where(neg, D, zero)
            if self.normalize:
                self._WP[s:e] += np.where(pos, w32, zero)
                self._WN[s:e] += np.where(neg, w32, zero)

    def _finish(self) -> np.ndarray:
        P, base = self._P, self._base
        assert P is not None and base is not None
        if self._stash and self._finish_fused(P):
            return P.reshape(base.shape)
        S, P_, N, wp, wn = self._sums()
        _mk().ties_finish(P_, S, N, wp, wn, base.reshape(-1), self._bounds, self._touched, self.normalize,
                          np.float32(self.lam), self._skip)
        return P.reshape(base.shape)

    def _base_only(self, b: np.ndarray) -> np.ndarray:
        return b + np.float32(0.0) * np.float32(self.lam)  # `merge_kernels._untouched_span`

    def _finish_fused(self, P: np.ndarray) -> bool:
        """The fused pass over the kept inputs into P; False when the bytes of an input whose τ = 0 came
        from the sketch disagree with it (then the sums have been folded again by the streaming kernels,
        with τ found from the bytes, for `ties_finish`)."""
        assert self._stash and self._ctx is not None and self._bflat is not None
        stash, self._stash = self._stash, None
        raws = _mk().pack([src for src, *_ in stash])
        selected = np.zeros((len(stash), self._ctx.n_blocks), np.bool_)
        for k, (_src, x, *_rest) in enumerate(stash):
            selected[k, list(x.selected_blocks)] = True
        if self.sparsification == "random":
            self._finish_dare_fused(P, stash, raws, selected)
            return True
        checks = np.array([c for *_a, c in stash], np.int64)
        counts = np.zeros((len(stash), 2), np.int64)  # [nonzero finite |Δ|, inf or NaN] where checked
        _mk().ties_fused(P, self._bflat, raws, selected, self._bounds,
                         np.array([item[2] for item in stash], np.bool_),
                         np.array([item[3] for item in stash], np.float32),
                         np.array([item[4] for item in stash], np.float32), self.normalize, np.float32(self.lam),
                         checks > 0, counts, self._skip)
        bad = (checks > 0) & ((counts[:, 1] > 0) | (counts[:, 0] >= checks))
        if not bad.any():
            return True
        self._touched[:] = False  # the fused pass left no sums: fold every input again, in order
        for item, wrong in zip(stash, bad):
            self._fold_kept(*item[:5], item[5] if wrong else 0)
        return False

    def _finish_dare_fused(self, P: np.ndarray, stash: list[Any], raws: tuple[np.ndarray, ...],
                           selected: np.ndarray) -> None:
        """dare_ties's fused pass: each input's density (>= 1: no mask) and its blocks' generator seeds."""
        ctx = self._ctx
        assert ctx is not None and self._bflat is not None
        dens = np.array([self.densities[x.index] for _src, x, *_rest in stash], np.float32)
        seeds = np.zeros(selected.shape, np.int64)
        for k, (_src, x, *_rest) in enumerate(stash):
            if self._draws_mask(x):
                key = self.experts[x.index].key
                for b in x.selected_blocks:
                    seeds[k, b] = _block_seed(ctx.seed, key, ctx.name, b)
        _mk().dare_ties_fused(P, self._bflat, raws, selected, self._bounds, dens, seeds,
                              np.array([item[4] for item in stash], np.float32), self.normalize,
                              np.float32(self.lam), self._skip)

    def _end(self) -> None:
        self._P = None
        self._stash = None
        for name in ("_S", "_N", "_WP", "_WN"):
            self.__dict__.pop(name, None)


# --------------------------------------------------------------------------------------------------
# The methods
# --------------------------------------------------------------------------------------------------


class Linear(MergeOperator):
    """linear: Σ θ_k·w_k (/ W when normalized). An expert with nothing selected adds θ₀·w_k."""

    name = "linear"
    additive = True
    uses_theta = True
    normalize_default = True
    _acc: np.ndarray | None = None

    def coefficient(self, k: int) -> float:
        w = self.weights[k]
        return abs(w / self.weight_sum) if self.normalize else abs(w)

    def _begin(self) -> None:
        assert self._base is not None and self._ctx is not None
        ctx = self._ctx
        self._acc = self._scratch("out", self._base.size)  # garbage until each block's first fold
        self._pending = np.zeros(ctx.n_blocks, np.int64)  # per block: the first expert not folded into it
        self._bounds = block_bounds(ctx)
        self._w32 = np.array(self.weights, np.float32)
        self._stash = _Stash()
        self._set_pending(0)

    def _set_pending(self, j: int) -> None:
        """Every block has folded experts 0..j-1; skipped blocks count as done (the caller writes them)."""
        assert self._skip is not None
        self._pending[:] = j
        self._pending[self._skip] = self.n_experts

    def _fold_stash(self, through: int | None = None, divide: bool = False) -> None:
        """Fold the kept inputs, and the experts before and between them that selected nothing (θ₀), in one
        fused pass: every expert up to the last kept one, or before `through`; with `divide`, then the
        normalizing division (`_finish`)."""
        acc, base, ctx = self._acc, self._bflat, self._ctx
        assert acc is not None and base is not None and ctx is not None
        if not self._stash and through is None:
            return
        slot = np.full(self.n_experts, -1, np.int64)
        if self._stash:
            items, raws, selected = self._stash.take(ctx.n_blocks)
            for k, (_src, x) in enumerate(items):
                slot[x.index] = k
        else:  # nothing kept: the experts up to `through` are θ₀
            items, raws, selected = [], _mk().pack([base[:0]]), np.zeros((0, ctx.n_blocks), np.bool_)
        j1 = items[-1][1].index + 1 if through is None else through
        _mk().linear_fused(acc, base, raws, slot, selected, self._bounds, self._w32, self._pending, j1, self._skip,
                           np.float32(self.weight_sum), divide)
        self._set_pending(j1)

    def _add(self, x: ExpertInput) -> None:
        acc, base, ctx = self._acc, self._bflat, self._ctx
        assert acc is not None and base is not None and ctx is not None
        if not x.selected_blocks:
            return  # θ_k = θ₀ everywhere: folded lazily (`merge_kernels.linear_fold`)
        src = x.fast_source()
        if src is not None and self._stash.offer(src, x, self._fold_stash):
            return
        self._fold_stash()
        if src is not None:
            selected = np.zeros(ctx.n_blocks, np.bool_)
            selected[list(x.selected_blocks)] = True
            _mk().linear_fold(acc, base, src, self._bounds, selected, self._pending, self._w32, x.index)
            return
        # θ_k known only through Δ_k: bring every block up to expert k, then one chunked pass over the tensor
        self._fold_stash(through=x.index)
        first = x.index == 0
        if first:
            acc.fill(0)
        w = self.weights[x.index]
        n = base.size
        selected_r = x._element_ranges(ctx)
        segments: list[tuple[int, int, bool]] = []
        pos = 0
        for s, e in selected_r:
            if s > pos:
                segments.append((pos, s, False))
            segments.append((s, e, True))
            pos = e
        if pos < n:
            segments.append((pos, n, False))
        for s0, e0, sel in segments:
            for s, e in _chunks([(s0, e0)]):
                theta = self._theta_chunk(x, s, e) if sel else base[s:e]
                acc[s:e] += np.multiply(theta, w, out=self._scratch("D", e - s))
        self._set_pending(x.index + 1)

    def _finish(self) -> np.ndarray:
        acc, base = self._acc, self._base
        assert acc is not None and base is not None and self._bflat is not None
        self._fold_stash(through=self.n_experts, divide=self.normalize)
        return acc.reshape(base.shape)

    def _base_only(self, b: np.ndarray) -> np.ndarray:
        acc = np.zeros_like(b)
        for j, w in enumerate(np.array(self.weights, np.float32)):  # `merge_kernels._catch_up`, in order
            acc = (np.float32(0.0) + b * w) if j == 0 else (acc + b * w)
        if self.normalize:
            acc /= self.weight_sum
        return acc

    def _end(self) -> None:
        self._acc = None
        self._stash = _Stash()


class TaskArithmetic(_AdditiveFold):
    """task_arithmetic: θ₀ + λ·Σ Δ_k·w_k (/ W when normalized)."""

    name = "task_arithmetic"
    additive = True


class DareLinear(_AdditiveFold):
    """dare_linear: task_arithmetic on DARE-dropped, 1/d-rescaled task vectors."""

    name = "dare_linear"
    sparsification = "random"


class Breadcrumbs(_AdditiveFold):
    """breadcrumbs: task_arithmetic on task vectors without their largest and smallest |Δ|."""

    name = "breadcrumbs"
    needs_full_tensor_stats = True
    sparsification = "magnitude_outliers"


class Ties(_TiesFold):
    """ties: trim to the top-density |Δ| per tensor, elect signs, average the agreeing updates."""

    name = "ties"
    needs_full_tensor_stats = True
    sparsification = "magnitude"


class DareTies(_TiesFold):
    """dare_ties: TIES steps 2-6 on DARE task vectors."""

    name = "dare_ties"
    normalize_default = False
    sparsification = "random"


class Slerp(MergeOperator):
    """slerp between θ₀ and θ_1 with parameter t (whole tensors; an omitted tensor means θ_1 = θ₀)."""

    name = "slerp"
    tensor_granular = True
    uses_theta = True
    uses_torch = True
    _theta1: np.ndarray | None = None

    def _validate(self) -> None:
        if self.n_experts != 1:
            raise SpecError(f"slerp merges exactly two models, the base and one other; "
                            f"got {self.n_experts} others")
        if self.t is None:
            raise SpecError("slerp needs the parameter t")
        if not 0.0 <= self.t <= 1.0:
            raise SpecError(f"slerp: t {self.t!r} must be in [0, 1]")

    def coefficient(self, k: int) -> float:
        assert self.t is not None
        return abs(self.t)

    def _begin(self) -> None:
        self._theta1 = None

    def _add(self, x: ExpertInput) -> None:
        self._theta1 = x.theta if x.selected_blocks else self._base

    def _finish(self) -> np.ndarray:
        import torch  # torch's float64 norm and dot are the definition (their summation order sets the bits)

        theta0, theta1, t = self._base, self._theta1, self.t
        assert theta0 is not None and theta1 is not None and t is not None
        n = theta0.size
        v0 = torch.from_numpy(self._scratch("v0d", n, np.float64))
        v0.copy_(torch.from_numpy(theta0.reshape(-1)))
        n0 = float(torch.linalg.vector_norm(v0))
        if theta1 is theta0:
            v1, n1 = v0, n0
        else:
            v1 = torch.from_numpy(self._scratch("v1d", n, np.float64))
            v1.copy_(torch.from_numpy(np.asarray(theta1, order="C").reshape(-1)))
            n1 = float(torch.linalg.vector_norm(v1))
        dot = float(torch.dot(v0, v1)) / ((n0 if n0 > 1e-8 else 1.0) * (n1 if n1 > 1e-8 else 1.0))
        if abs(dot) > 0.9995:
            c0, c1 = 1 - t, t
        else:
            th0 = math.acos(dot)
            s = math.sin(th0)
            tht = th0 * t
            c0, c1 = math.sin(th0 - tht) / s, math.sin(tht) / s
        out = np.multiply(theta0, c0, out=np.empty_like(theta0))  # out=: a 0-d result stays an array
        out += np.multiply(theta1, c1, out=self._scratch("D", n).reshape(theta0.shape))
        return out

    def _end(self) -> None:
        self._theta1 = None


def _check_keys(op: MergeOperator) -> None:
    for k, e in enumerate(op.experts):
        if not isinstance(e.key, str) or not e.key:
            raise SpecError(f"{op.name}: expert {k} needs its checkpoint id as the DARE mask key")


OPERATORS: dict[str, type[MergeOperator]] = {
    cls.name: cls for cls in (Linear, TaskArithmetic, Ties, DareLinear, DareTies, Breadcrumbs, Slerp)
}


def make_operator(method: str, experts: Sequence[ExpertParams], *, normalize: bool | None = None,
                  lam: float = 1.0, t: float | None = None) -> MergeOperator:
    """The operator for ``method`` (SpecError for an unknown method or bad parameters)."""
    cls = OPERATORS.get(method)
    if cls is None:
        raise SpecError(f"unknown merge method {method!r}; known: {', '.join(sorted(OPERATORS))}")
    return cls(experts, normalize=normalize, lam=lam, t=t)
