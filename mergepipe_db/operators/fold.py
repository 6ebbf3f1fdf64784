"""The shared Δ-fold machinery: `DeltaFold`, the template of every method on task vectors (T_k formed from Δ_k
by no trim, a magnitude trim or DARE's random drop, then folded into the method's sums), and `Stash`, the
experts' values kept for one fused pass over a tensor (linear, the additive family).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np

from mergepipe_db.errors import SpecError
from mergepipe_db.operators.base import MergeOperator, all_finite, chunks, kernels
from mergepipe_db.operators.dare import block_seed, check_mask_keys, dare_uniforms_packed
from mergepipe_db.operators.inputs import ExpertInput
from mergepipe_db.operators.order_stats import Magnitudes

__all__ = ["GROUP_BYTES", "DeltaFold", "Stash", "band_bounds", "della_probabilities"]

#: linear and task arithmetic keep up to this many bytes of experts' stored values, then fold them in one
#: fused pass (`Stash`) and start again: the accumulator is read and written once per group, not per expert.
#: 256 MiB (two experts' embeddings of a 1B-parameter model) keeps peak RSS flat in K: 2 GB models, full read,
#: 1.61-1.77 GiB for K = 2…16 (512 MiB: 1.61-2.09 GiB), at the same speed
GROUP_BYTES = 256 << 20


def band_bounds(lo: float | None, hi: float) -> tuple[np.float32, np.float32]:
    """Breadcrumbs' band lo < |Δ| < hi (``lo`` None: no lower test) as the fused kernels take it, bounds
    included: (lo', hi') their float32 neighbours inward, so that lo' <= a <= hi' exactly when lo < a < hi for
    float32 a (NaN in neither)."""
    inf = np.float32(math.inf)
    return np.nextafter(np.float32(-inf if lo is None else lo), inf), np.nextafter(np.float32(hi), -inf)


def della_probabilities(base: np.ndarray, raw: np.ndarray, shape: tuple[int, ...], rows: int, d: float, eps: float
                        ) -> np.ndarray:
    """DELLA's keep probabilities of one block, Δ = widen(raw) − base (θ₀ and the stored values, or +0.0 and Δ,
    flat): ranks of |Δ| along dim 1 (a 0-d or 1-d tensor is
    one row), ascending, ties in index order (a stable sort), rank_norm = (rank - 1)/(n - 1) (0 when n = 1),
    p = (d - ε) + rank_norm·2·ε, in float32 as MergeKit computes it (`kernels.row_ranks`)."""
    from mergepipe_db.kernels.row_ranks import della_probabilities as probabilities

    return probabilities(base, raw, shape, rows, d, eps)


def _l1_ratio(before: float, after: float) -> float:
    """The L1 rescale ‖Δ‖₁ / ‖kept Δ‖₁ from the exact sums; 1.0 when either is below 1e-7 (NaN stays NaN)."""
    return 1.0 if (before < 1e-7 or after < 1e-7) else before / after


class Stash:
    """Experts' stored values (as `ExpertInput.fast_source` gives them) kept for one fused pass over a
    tensor, at most `GROUP_BYTES` of them, all of one dtype."""

    def __init__(self) -> None:
        self.items: list[tuple[np.ndarray, ExpertInput]] = []
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self.items)

    def __iter__(self) -> Iterator[tuple[np.ndarray, ExpertInput]]:
        return iter(self.items)

    def full_for(self, src: np.ndarray, extra: int = 0) -> bool:
        """Whether `src` (with `extra` bytes kept beside it) cannot join the kept inputs (their pass must run
        first)."""
        return bool(self.items) and (self.nbytes + src.nbytes + extra > GROUP_BYTES
                                     or self.items[0][0].dtype != src.dtype)

    def make_room(self, src: np.ndarray, fold: Callable[[], None], extra: int = 0) -> bool:
        """Whether `src` (with `extra` bytes kept beside it) can be kept, running `fold` first when it cannot
        join the kept inputs; False when it alone exceeds a group."""
        if self.full_for(src, extra):
            fold()
        return src.nbytes + extra <= GROUP_BYTES

    def offer(self, src: np.ndarray, x: ExpertInput, fold: Callable[[], None], extra: int = 0) -> bool:
        """Keep `src` (and count `extra` bytes kept beside it, as a mask) for the next fused pass, running
        `fold` first when it cannot join the kept inputs; False (nothing kept) when it alone exceeds a group:
        the caller folds it by itself."""
        if not self.make_room(src, fold, extra):
            return False
        self.items.append((src, x))
        self.nbytes += src.nbytes + extra
        return True

    def take(self, n_blocks: int) -> tuple[list[tuple[np.ndarray, ExpertInput]], Any, np.ndarray]:
        """(items, their values as `kernels.merge.pack` gives them, selected[item, block]); the stash is empty
        afterwards."""
        items, self.items, self.nbytes = self.items, [], 0
        selected = np.zeros((len(items), n_blocks), np.bool_)
        for k, (_src, x) in enumerate(items):
            selected[k, list(x.selected_blocks)] = True
        return items, kernels().pack([src for src, _x in items]), selected


class DeltaFold(MergeOperator):
    """Operators on task vectors: D_k = T_k · w_k folded over the selected rows only.

    Masks are applied as float 0/1 indicators (``D * 1 = D``, ``D * 0 = ±0``), which equals
    ``where(keep, ·, 0.0)`` whenever D is finite; a chunk holding inf/NaN takes the literal ``where``.
    The sign of a zero D never matters: it only meets +0.0-started accumulators.

    A method subclassing this sets `sparsification` and implements ``_begin``, ``_combine`` (fold D_k
    into its sums), ``_finish`` and ``_base_only``; a magnitude trim implements ``_fold_trimmed``
    (`order_stats.Magnitudes` and ``_fold_masked`` do the work); ``_fold_fast``, ``_dare_block_fast`` and
    ``_masked_block`` (a random drop's T with a rescale other than DARE's classic one) are optional fused kernels.
    `additive.AdditiveFold` and `sign_consensus.TiesFold` are the two families.
    """

    #: How T_k is formed from Δ_k when density < 1: None (T_k = Δ_k), "magnitude" (TIES trim),
    #: "magnitude_outliers" (breadcrumbs) or "random" (DARE). At density 1, T_k = Δ_k for all of them.
    sparsification: ClassVar[str | None] = None

    def _add(self, x: ExpertInput) -> None:
        assert self._ctx is not None
        ranges = x.element_ranges(self._ctx)
        if not ranges:
            return
        if self.sparsification is None or self.densities[x.index] >= 1:
            self._fold(x, ranges)
        elif self.sparsification in ("random", "della"):
            self._fold_dare(x)
        else:
            self._fold_trimmed(x, ranges)

    def _validate(self) -> None:
        if self.sparsification in ("random", "della"):
            check_mask_keys(self)
            mode = self.rescale_mode
            if mode not in ("classic", "l1", "none"):
                raise SpecError(f"{self.name}: rescale must be l1, none or classic, got {mode!r}")
        if self.sparsification == "della":
            for k, d in enumerate(self.densities):
                eps = self.epsilon(k)
                if d < 1 and not (d - eps > 0 and d + eps < 1):
                    raise SpecError(f"{self.name}: expert {k} epsilon {eps:g} with density {d:g}: needs "
                                    f"density - epsilon > 0 and density + epsilon < 1")

    @property
    def rescale_mode(self) -> str:
        """How a random drop rescales what it keeps: "classic" (1/d, DELLA 1/p: the default of an operator
        made without the option, and of every plan recorded before it), "l1" (‖Δ‖₁ / ‖kept Δ‖₁) or "none"."""
        return str(self.options.get("rescale", "classic"))

    def epsilon(self, k: int) -> float:
        """DELLA's spread of expert k's keep probabilities (MergeKit's default 0.15)."""
        e = self.experts[k].epsilon
        return 0.15 if e is None else float(e)

    def _fold(self, x: ExpertInput, ranges: list[tuple[int, int]]) -> None:
        """T_k = Δ_k."""
        w = self.weights[x.index]
        if self._fold_fast(x, None):
            return
        self._set_expert(w)
        for s, e in chunks(ranges):
            d = self._delta_chunk(x, s, e)
            self._combine(s, e, np.multiply(d, w, out=self.scratch("D", e - s)), None)

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

    def _fold_trimmed(self, x: ExpertInput, ranges: list[tuple[int, int]]) -> None:
        """Fold T_k of a magnitude trim (density < 1; `sparsification` "magnitude" or "magnitude_outliers")."""
        raise NotImplementedError(f"{self.name}: sparsification {self.sparsification!r} has no trim")

    def _dare_block_fast(self, src: np.ndarray, b: int, s0: int, e0: int, u: np.ndarray, d: float,
                         w: float) -> bool:
        """Fold block b's DARE task vector (uniforms `u`) with a fused kernel, if this operator has one."""
        return False

    # -- trims ---------------------------------------------------------------------------------------

    def _magnitudes(self, x: ExpertInput, ranges: list[tuple[int, int]]) -> Magnitudes:
        n_read = sum(e - s for s, e in ranges)
        a = self.scratch("abs", n_read)
        assert self._ctx is not None and self._bflat is not None
        src = x.fast_source()
        if src is not None:
            ranges_arr = x.element_ranges_array(self._ctx)
            # a few long ranges (a full read): each on numba's threads; many short ones: one serial pass
            absdelta = kernels().absdelta_par if ranges_arr.shape[0] <= 8 else kernels().absdelta
            absdelta(a, self._bflat, src, ranges_arr)
        else:
            off = 0
            for s, e in chunks(ranges):
                np.abs(self._delta_chunk(x, s, e), out=a[off : off + e - s])
                off += e - s
        hist = None if (x.full or x.sketch is None) else x.sketch
        return Magnitudes(a, self._ctx.numel, hist, self)

    def _fold_band(self, x: ExpertInput, lo: float | None, hi: float) -> bool:
        """Breadcrumbs' band lo < |Δ| < hi folded by a fused pass at finish (breadcrumbs_ties: `TiesFold`); False
        here: the caller folds it now (`_fold_masked`)."""
        return False

    def _fold_masked(self, x: ExpertInput, ranges: list[tuple[int, int]], mags: Magnitudes | None,
                     lo: float | None, hi: float | None) -> None:
        """T_k = where(keep, Δ_k, 0.0): keep = |Δ| >= lo when ``hi`` is None (TIES), else
        lo < |Δ| < hi (breadcrumbs; ``lo`` None: no lower test). From θ_k's stored bytes, one numba pass per
        chunk forms T_k·w (`kernels.merge.masked_delta`, the literal formula); otherwise numpy, chunk by chunk."""
        w = self.weights[x.index]
        self._set_expert(w)
        src = x.fast_source()
        if src is not None and self._bflat is not None:
            band = hi is not None
            lo32 = np.float32(-math.inf if lo is None else lo)
            hi32 = np.float32(math.inf if hi is None else hi)
            for s, e in chunks(ranges):  # the literal formula in one pass (`kernels.merge.masked_delta`)
                T = self.scratch("D", e - s)
                finite = kernels().masked_delta_par(T, self._bflat[s:e], src[s:e], lo32, hi32, lo is not None, band,
                                                np.float32(w))
                self._combine(s, e, T, True if finite else None)
            return
        assert mags is not None  # |Δ| of the rows read: the numpy path takes them from there
        a = mags.a
        off = 0
        for s, e in chunks(ranges):
            n = e - s
            ac = a[off : off + n]
            off += n
            d = self._delta_chunk(x, s, e)
            D = np.multiply(d, w, out=self.scratch("D", n))
            if all_finite(D):
                ind = self.scratch("ind", n)
                if hi is None:
                    assert lo is not None
                    np.greater_equal(ac, lo, out=ind)
                else:
                    np.less(ac, hi, out=ind)
                    if lo is not None:
                        D *= np.greater(ac, lo, out=self.scratch("ind2", n))
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

    def _fold_outliers(self, x: ExpertInput, ranges: list[tuple[int, int]]) -> None:
        """Breadcrumbs' trim (density < 1): keep lo < |Δ| < hi (docs/SEMANTICS.md, breadcrumbs)."""
        assert self._ctx is not None
        n = self._ctx.numel
        target = int(self.densities[x.index] * n)
        n_top = int(self.gammas[x.index] * n)
        n_bot = n - target - n_top
        if n_bot < 0:
            n_top += n_bot
            n_bot = 0
        ks = [k for k, used in ((n_top, n_top > 0), (n - n_bot + 1, n_bot > 0)) if used]
        src = x.fast_source() if x.full else None
        cuts = None
        if src is not None and self._bflat is not None and ks and len(ranges) <= 64:
            # every block that may differ was read: the cut points from the stored values on the rows read
            # (zeros elsewhere); None when some |Δ| is inf or NaN
            from mergepipe_db.kernels.kth_select import kth_largest_abs_deltas_sampled

            cuts = kth_largest_abs_deltas_sampled(self._bflat, src, x.element_ranges_array(self._ctx), n, ks)
        if cuts is not None:
            hi = cuts[0] if n_top > 0 else math.inf
            lo = cuts[-1] if n_bot > 0 else None
            if not self._fold_band(x, lo, hi):
                self._fold_masked(x, ranges, None, lo, hi)
            return
        mags = self._magnitudes(x, ranges)
        mags.prepare(ks)
        hi = math.inf if n_top == 0 else mags.topk_min(n_top)
        lo = -math.inf if n_bot == 0 else mags.bottomk_max(n_bot)
        if math.isnan(hi) or math.isnan(lo):
            return  # a comparison with NaN is false everywhere: T_k = 0
        self._fold_masked(x, ranges, mags, None if lo == -math.inf else lo, hi)

    def _keep_probability(self, k: int, base: np.ndarray, raw: np.ndarray, rows: int) -> Any:
        """Keep probability of each element of a block (float32, the block's flat shape; Δ = widen(raw) − base)
        or one for all (a Python float): DARE's d_k; DELLA's (d - ε) + 2ε·rank_norm, ranks of |Δ| along dim 1
        (row-local)."""
        d = self.densities[k]
        if self.sparsification != "della":
            return d
        assert self._ctx is not None
        return della_probabilities(base, raw, self._ctx.shape, rows, d, self.epsilon(k))

    def _block_spans(self, x: ExpertInput) -> list[tuple[int, int, int]]:
        """(block, first element, end element) of each selected block with elements, in order."""
        ctx = self._ctx
        assert ctx is not None
        rn = ctx.row_numel
        return [(b, rs * rn, re * rn) for b in x.selected_blocks for rs, re in [ctx.block_rows(b)]
                if re * rn > rs * rn]

    def _mask_blocks(self, x: ExpertInput, spans: list[tuple[int, int, int]]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """What a mask kernel takes of expert x's blocks `spans` ((block, start, end)): each block's generator
        seed, its [start, end) elements, its first byte in a packed mask (`kernels.merge.mask_block_offset`), and
        how many elements they hold."""
        ctx = self._ctx
        assert ctx is not None
        key = self.experts[x.index].key
        seeds = np.array([block_seed(ctx.seed, key, ctx.name, b) for b, _s0, _e0 in spans], np.int64)
        bounds = np.array([(s0, e0) for _b, s0, e0 in spans], np.int64).reshape(-1, 2)
        offsets = kernels().mask_block_offset.py_func(bounds[:, 0], np.array([b for b, _s0, _e0 in spans], np.int64))
        return seeds, bounds, offsets, int(np.sum(bounds[:, 1] - bounds[:, 0]))

    @staticmethod
    def _mask_out(keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A mask kernel's two outputs for `keep`: (keep, no bits) where it is bool, a byte an element; (no keep,
        keep) where it is uint8, to be packed eight to a byte (`kernels.merge.pack_bits`)."""
        if keep.dtype == np.uint8:
            return np.empty(0, np.bool_), keep
        return keep, np.empty(0, np.uint8)

    def _dare_keep_l1(self, x: ExpertInput, src: np.ndarray, keep: np.ndarray, spans: list[tuple[int, int, int]]
                      ) -> float:
        """DARE's mask of expert k on its selected blocks into `keep` (bool, indexed by element; uint8: packed,
        `kernels.merge.pack_bits`) and its L1 scale s = ‖Δ_k‖₁ / ‖kept Δ_k‖₁ over them, in one pass from the
        stored values `src`: each block's uniforms drawn a tile at a time and used at once
        (`kernels.merge.dare_keep_blocks`), blocks on numba's threads."""
        from mergepipe_db.kernels.exact_sum import ExactSum

        assert self._bflat is not None
        seeds, bounds, offsets, n = self._mask_blocks(x, spans)
        sums = (ExactSum(), ExactSum())  # the kept |Δ|, the dropped |Δ|
        d32 = np.float32(self.densities[x.index])  # u < d, the Python float cast to float32 (NEP 50)
        kernels().dare_keep_blocks(*self._mask_out(keep), offsets, self._bflat, src, bounds, seeds, d32,
                                   sums[0].reserve(n), sums[1].reserve(n))
        return _l1_ratio(sums[0].value_with(sums[1]), sums[0].value())

    def _della_keep(self, x: ExpertInput, src: np.ndarray, keep: np.ndarray, spans: list[tuple[int, int, int]],
                    l1: bool) -> float:
        """DELLA's mask of expert k (a 2-D tensor) on its selected blocks into `keep` (bool, indexed by element;
        uint8: packed, `kernels.merge.pack_bits`) and, with `l1`, its L1 scale s = ‖Δ_k‖₁ / ‖kept Δ_k‖₁ over
        them (else 1.0), in one pass from the stored values `src`: a row's probabilities, uniforms, mask and
        sums at a time (`kernels.row_ranks.della_keep_blocks`), blocks on numba's threads."""
        from mergepipe_db.kernels.exact_sum import ExactSum
        from mergepipe_db.kernels.row_ranks import della_keep_blocks

        ctx = self._ctx
        assert ctx is not None and self._bflat is not None
        seeds, bounds, offsets, n = self._mask_blocks(x, spans)
        sums = (ExactSum(), ExactSum())  # the kept |Δ|, the dropped |Δ|
        d, eps = self.densities[x.index], self.epsilon(x.index)
        della_keep_blocks(*self._mask_out(keep), offsets, self._bflat, src, bounds, seeds, ctx.row_numel,
                          np.float32(eps), np.float32(d - eps), l1, sums[0].reserve(n if l1 else 0),
                          sums[1].reserve(n if l1 else 0))
        return _l1_ratio(sums[0].value_with(sums[1]), sums[0].value()) if l1 else 1.0

    def _block_uniforms(self, x: ExpertInput) -> Iterator[tuple[int, int, int, np.ndarray]]:
        """(block, first element, end element, its DARE uniforms) of each selected block with elements, in order;
        every block's uniforms are drawn first, the blocks' generators on numba's threads."""
        ctx = self._ctx
        assert ctx is not None
        spans = self._block_spans(x)
        u_all = self.scratch("u", sum(e0 - s0 for _, s0, e0 in spans))
        offsets = dare_uniforms_packed(ctx.seed, self.experts[x.index].key, ctx.name,
                                       [(b, e0 - s0) for b, s0, e0 in spans], u_all)
        for i, (b, s0, e0) in enumerate(spans):
            yield b, s0, e0, u_all[offsets[i]:offsets[i + 1]]

    def _fold_random(self, x: ExpertInput) -> None:
        """DARE and DELLA with a rescale other than DARE's classic one (docs/SEMANTICS.md): keep = u < p per
        selected block; T_k = where(keep, Δ_k·s, 0.0) with s = ‖Δ_k‖₁ / ‖kept Δ_k‖₁ over the rows read ("l1",
        exactly rounded sums: `kernels.exact_sum`), s = 1 ("none"), or where(keep, Δ_k / p, 0.0) ("classic",
        DELLA). Fused kernels: one pass per block forms the mask (and the sums), a second folds T_k
        (`_masked_block`); "none" and "classic" fold each block at once, "l1" once the sums are known. A family
        with a fused pass over all experts may instead keep the mask ("l1", "none") and its scale for it
        (`_mask_buffer`, `_keep_mask`)."""
        from mergepipe_db.kernels.exact_sum import ExactSum

        ctx = self._ctx
        assert ctx is not None
        k = x.index
        w = self.weights[k]
        mode = self.rescale_mode
        l1 = mode == "l1"
        della = self.sparsification == "della"
        src = x.fast_source() if self._bflat is not None else None
        sums = (ExactSum(), ExactSum())  # the kept |Δ|, the dropped |Δ|
        kept = self._mask_buffer(x) if mode != "classic" and src is not None else None
        keep_all = kept if kept is not None else self.scratch("keep", ctx.numel, np.bool_) if l1 else None
        d32 = np.array([self.densities[k]], np.float32)  # u < d, the Python float cast to float32 (NEP 50)
        if kept is None:  # a kept mask is folded later, with the others
            self._set_expert(w)
        rowwise = della and src is not None and keep_all is not None and len(ctx.shape) == 2
        if (l1 and not della and src is not None) or rowwise:  # from the stored values: mask and sums in one pass
            assert keep_all is not None and src is not None
            spans = self._block_spans(x)
            scale = self._della_keep(x, src, keep_all, spans, l1) if della else \
                self._dare_keep_l1(x, src, keep_all, spans)
            if kept is not None:
                self._keep_mask(x, kept, 1 if scale != 1.0 else 0, scale)
            else:
                self._fold_mask(x, src, spans, keep_all, 1 if scale != 1.0 else 0, scale, w)
            return
        later: list[tuple[int, int, int]] = []
        for b, s0, e0, u in self._block_uniforms(x):
            n = e0 - s0
            bb, xb = self._block_operands(x, src, s0, e0)
            if della:
                p, step = self._keep_probability(k, bb, xb, n // ctx.row_numel), 1
            else:
                p, step = d32, 0
            keep = keep_all[s0:e0] if keep_all is not None else self.scratch("keep_block", n, np.bool_)
            kernels().random_keep_par(keep, bb, xb, u, p, step, l1, sums[0].reserve(n), sums[1].reserve(n))
            if l1 or kept is not None:
                later.append((b, s0, e0))
            else:
                self._masked_block(b, s0, e0, bb, xb, keep, p, step, 2 if mode == "classic" else 0, 1.0, w)
        if not later:
            return
        if kept is not None:
            scale = _l1_ratio(sums[0].value_with(sums[1]), sums[0].value()) if l1 else 1.0
            self._keep_mask(x, kept, 1 if scale != 1.0 else 0, scale)
            return
        assert keep_all is not None
        scale = _l1_ratio(sums[0].value_with(sums[1]), sums[0].value())
        self._fold_mask(x, src, later, keep_all, 1 if scale != 1.0 else 0, scale, w)

    def _fold_mask(self, x: ExpertInput, src: np.ndarray | None, spans: list[tuple[int, int, int]],
                   keep: np.ndarray, mode: int, scale: float, w: float) -> None:
        """Fold expert x's drawn mask `keep` (the tensor's flat shape) on the blocks `spans` ((block, start,
        end)): T = where(keep, Δ·s (mode 1) | Δ (0), 0.0), block by block (`_masked_block`)."""
        d32 = np.array([self.densities[x.index]], np.float32)  # unread in modes 0 and 1
        for b, s0, e0 in spans:
            bb, xb = self._block_operands(x, src, s0, e0)
            self._masked_block(b, s0, e0, bb, xb, keep[s0:e0], d32, 0, mode, scale, w)

    def _packs_mask(self) -> bool:
        """Whether the pass that draws this tensor's random drop masks can pack them eight to a byte: DARE's L1
        pass (`_dare_keep_l1`), DELLA's rows on a 2-D tensor (`_della_keep`)."""
        assert self._ctx is not None
        return len(self._ctx.shape) == 2 if self.sparsification == "della" else self.rescale_mode == "l1"

    def _kept_mask_buffer(self, family: str, place: int, packed: bool) -> np.ndarray:
        """The reused buffer of the mask kept at `place` of a family's fused pass: uint8, packed eight to a
        byte (`kernels.merge.mask_bytes`), or bool, a byte an element."""
        assert self._ctx is not None
        if packed:
            return self.scratch(f"{family}_bits{place}", kernels().mask_bytes(self._ctx.numel, self._ctx.n_blocks),
                                np.uint8)
        return self.scratch(f"{family}_keep{place}", self._ctx.numel, np.bool_)

    def _mask_buffer(self, x: ExpertInput) -> np.ndarray | None:
        """Where to draw expert x's random drop mask (bool, the tensor's flat shape; or uint8, packed, where the
        pass that draws it packs it: `_dare_keep_l1`, `_della_keep` on a 2-D tensor; rescale l1 or none) when it
        is to be kept for a fused pass over all experts (`_keep_mask`) instead of folded block by block; None:
        folded block by block (this default: no fused pass)."""
        return None

    def _keep_mask(self, x: ExpertInput, keep: np.ndarray, mode: int, scale: float) -> None:
        """Keep expert x's mask (bool, the tensor's flat shape: its selected blocks drawn; or uint8, packed, as
        `_mask_buffer` gave it) with its rescale (`kernels.merge._masked` mode 0 or 1, and s) for the fused
        pass."""
        raise NotImplementedError

    def _l1_scale(self, x: ExpertInput, src: np.ndarray, bits: np.ndarray) -> float:
        """DARE's L1 scale s of expert k over its selected blocks, as `_fold_random` finds it, from the stored
        values `src` (one pass: the uniforms, the mask and the two sums), the mask packed into `bits` for a
        fused pass (`sign_consensus.TiesFold`)."""
        ctx = self._ctx
        assert ctx is not None and self._bflat is not None and self.sparsification == "random"
        return self._dare_keep_l1(x, src, bits, self._block_spans(x))

    def _block_operands(self, x: ExpertInput, src: np.ndarray | None, s0: int, e0: int
                        ) -> tuple[np.ndarray, np.ndarray]:
        """(θ₀, θ_k) of elements [s0, e0) as the kernels take them (Δ = widen(θ_k) − θ₀): the stored values
        when at hand, else (+0.0, Δ_k) (Δ − 0.0 = Δ, bit for bit)."""
        if src is not None:
            assert self._bflat is not None
            return self._bflat[s0:e0], src[s0:e0]
        n = e0 - s0
        delta = self.scratch("block_delta", n)
        for s, e in chunks([(s0, e0)]):
            delta[s - s0 : e - s0] = self._delta_chunk(x, s, e)
        zeros = self.scratch("block_zeros", n)
        zeros[:] = 0.0
        return zeros, delta

    def _masked_block(self, b: int, s0: int, e0: int, bb: np.ndarray, xb: np.ndarray, keep: np.ndarray,
                      p: np.ndarray, step: int, mode: int, scale: float, w: float) -> None:
        """Fold block b's T = where(keep, Δ (mode 0) | Δ·s (1) | Δ / p (2), 0.0) (`kernels.merge._masked`;
        scale, w: Python floats, taken as float32 as numpy takes them). This default forms T and folds T·w
        with `_combine`; a family with a fused kernel overrides it."""
        n = e0 - s0
        T = self.scratch("T", n)
        kernels().masked_task_vector(T, bb, xb, keep, p, step, mode, np.float32(scale))
        T *= w
        for s, e in chunks([(s0, e0)]):
            self._combine(s, e, T[s - s0 : e - s0], None)

    def _fold_dare(self, x: ExpertInput) -> None:
        """DARE: T_k = where(rand < d, Δ_k / d, 0.0), masks drawn per selected block only."""
        if self.sparsification == "della" or self.rescale_mode != "classic":
            self._fold_random(x)
            return
        ctx = self._ctx
        assert ctx is not None
        k = x.index
        w, d = self.weights[k], self.densities[k]
        self._set_expert(w)
        src = x.fast_source()
        for b, s0, e0, u in self._block_uniforms(x):
            if src is not None and self._dare_block_fast(src, b, s0, e0, u, d, w):
                continue
            for s, e in chunks([(s0, e0)]):
                n = e - s
                uc = u[s - s0 : e - s0]
                delta = self._delta_chunk(x, s, e)
                D = np.divide(delta, d, out=self.scratch("D", n))
                D *= w
                if all_finite(D):
                    D *= np.less(uc, d, out=self.scratch("ind", n))
                    self._combine(s, e, D, True)
                else:  # the literal formula
                    T = np.where(uc < d, delta / d, np.float32(0.0))
                    T *= w
                    self._combine(s, e, T, None)
