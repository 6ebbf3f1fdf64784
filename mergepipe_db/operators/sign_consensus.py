"""Sparsify + sign consensus: TIES and DARE-TIES (docs/SEMANTICS.md). Each expert's task vector is trimmed
(the top-density |Δ| of the tensor) or DARE-dropped, then every element's sign is elected over the experts
and the agreeing updates are averaged.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from mergepipe_db.core import sketch
from mergepipe_db.operators.base import all_finite, block_bounds, kernels
from mergepipe_db.operators.dare import block_seed
from mergepipe_db.operators.fold import DeltaFold, band_bounds
from mergepipe_db.operators.inputs import ExpertInput
from mergepipe_db.operators.order_stats import EDGES, LAST_BIN
from mergepipe_db.operators.registry import register

__all__ = ["FUSE_BYTES", "BreadcrumbsTies", "DareTies", "Della", "Ties", "TiesFold"]

#: TIES keeps the experts' stored bytes of a tensor for one fused pass while they add up to at most this
#: (beyond it, it folds them one by one): memory stays bounded whatever K. Their packed masks (dare_ties';
#: della's on a 2-D tensor: an eighth of a byte an element, a sixteenth of BF16 values) come on top; della's
#: masks of a byte an element (other shapes) count towards it
FUSE_BYTES = 1 << 30
_NO_F32 = np.empty(0, np.float32)


class TiesFold(DeltaFold):
    """TIES steps 2-6 in streaming form (docs/SEMANTICS.md): S = Σ D_k, P/N = Σ positive/negative D_k,
    WP/WN = Σ w_k over positive/negative D_k; mixed = where(S >= 0, P, N), div = where(S >= 0, WP, WN).

    A method of this family sets `sparsification` ("magnitude": the TIES trim, "random": DARE, None); the
    sign election, the fused passes and the result are shared."""

    normalize_default = True
    #: every expert's Δ of an element meets in one sign election and divisor: the planner reads block rows
    #: of all experts together (omitting one expert's block there would change the others' weight)
    joint_election: ClassVar[bool] = True
    _P: np.ndarray | None = None

    def _begin(self) -> None:
        assert self._base is not None and self._ctx is not None
        n = self._base.size
        # reused buffers, not cleared: a block's first fold writes its sums; `_touched` says which have one
        self._P = self.scratch("out", n)  # becomes the output
        self._S = self.scratch("S", n)
        self._N = self.scratch("N", n)
        if self.normalize:
            self._WP = self.scratch("WP", n)
            self._WN = self.scratch("WN", n)
        self._bounds = block_bounds(self._ctx)
        self._touched = np.zeros(self._ctx.n_blocks, np.bool_)
        # experts' inputs kept for one fused pass at finish (`kernels.merge.ties_fused`) while they fit:
        # (values, input, trim, τ, w, zero_check)
        self._stash: list[tuple[np.ndarray, ExpertInput, bool, float, float, int]] | None = []
        self._stash_bytes = 0
        self._dare_modes: dict[int, tuple[int, float]] = {}  # a kept DARE input's (mode, scale): `dare_ties_fused`
        self._bands: dict[int, tuple[float | None, float]] = {}  # a kept breadcrumbs input's (lo, hi): `_fold_band`
        #: a kept input's mask (bool, a byte an element; uint8, packed eight to a byte: dare_ties' L1 pass, della's
        #: on a 2-D tensor), its mode and s: `_keep_mask`
        self._masks: dict[int, tuple[np.ndarray, int, float]] = {}

    def _fits_stash(self, src: np.ndarray, extra: int = 0) -> bool:
        return (self._stash is not None and self._stash_bytes + src.nbytes + extra <= FUSE_BYTES
                and (not self._stash or self._stash[0][0].dtype == src.dtype))

    def _fold_trimmed(self, x: ExpertInput, ranges: list[tuple[int, int]]) -> None:
        """TIES step 1 (density < 1): keep |Δ| >= τ, τ the k-th largest |Δ| of the whole tensor."""
        assert self._ctx is not None
        k = int(self.densities[x.index] * self._ctx.numel)
        exact = x.full or x.sketch is None
        if exact and k > 0:
            tau_fast, zero_check = self._exact_tau_fast(x, ranges, k)
            if tau_fast is not None and self._fold_fast(x, tau_fast, zero_check):
                return
        if not exact and k > 0:
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
        input kept for a fused pass, by that pass (zero_check = k, see `TiesFold`)."""
        src = x.fast_source()
        if src is None or self._bflat is None or self._ctx is None:
            return None, 0
        base, ranges_arr = self._bflat, x.element_ranges_array(self._ctx)
        hist = x.sketch
        if hist is not None and int(hist.sum()) == self._ctx.numel:
            b, above = sketch.locate_kth_largest(hist, k)
            if b == sketch.ZERO_BIN:
                if self._defers_zero_check(src):
                    return 0.0, k
                if kernels().kth_largest_is_zero(base, src, ranges_arr, k):
                    return 0.0, 0
            if b not in (sketch.ZERO_BIN, LAST_BIN):
                tau = kernels().kth_largest_in_bin(base, src, ranges_arr, k, float(EDGES[b]), float(EDGES[b + 1]),
                                                   int(hist[b]), above)
                if tau is not None:
                    return tau, 0
        n_read = sum(e - s for s, e in ranges)
        return kernels().kth_largest_abs_delta(base, src, ranges_arr, n_read, self._ctx.numel, k), 0

    def _sketch_tau_fast(self, x: ExpertInput, k: int) -> tuple[float | None, int]:
        """(τ, zero_check): τ of a partly read tensor as `Magnitudes.topk_min` gives it, by a fused kernel in one
        pass, without the |Δ| of the rows read in memory; None (the caller takes that path) without θ_k's
        bytes, or when the sketch is incomplete or has values in its last bin (inf/NaN: their counts decide
        there). τ = 0 (the sketch's bin 0) holds unless a NaN is read: an input kept for the fused pass is
        checked by it (zero_check = numel + 1: no count of nonzero |Δ| reaches it, so only an inf or NaN
        read sends it back here, to the |Δ|-in-memory path; `TiesFold._finish_fused`)."""
        src, hist = x.fast_source(), x.sketch
        if src is None or hist is None or self._bflat is None or self._ctx is None:
            return None, 0
        if int(hist[LAST_BIN]) or int(hist.sum()) != self._ctx.numel:
            return None, 0
        b, _above = sketch.locate_kth_largest(hist, k)
        ranges_arr = x.element_ranges_array(self._ctx)
        if b == sketch.ZERO_BIN:
            if self._defers_zero_check(src):
                return 0.0, self._ctx.numel + 1
            _nonzero, special = kernels().absdelta_count(self._bflat, src, ranges_arr)
            return (None if special else 0.0), 0
        return kernels().sketch_tau(self._bflat, src, ranges_arr, hist, k, float(EDGES[b]), float(EDGES[b + 1])), 0

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
        first; if the bytes disagree, τ is found from them (`_fold_trimmed`, checking at once). A DARE input
        (dare_ties, d < 1) is folded block by block (`DeltaFold._fold_dare`)."""
        assert self._bflat is not None and self._ctx is not None
        if x.index in self._bands:  # breadcrumbs_ties: its band's streaming form
            self._fold_masked(x, x.element_ranges(self._ctx), None, *self._bands[x.index])
            return
        mask = self._masks.pop(x.index, None)  # dare_ties' is drawn again below (`_fold_dare`)
        if mask is not None and self.sparsification == "della":  # its kept mask, block by block
            keep = mask[0]
            if keep.dtype == np.uint8:  # packed
                keep = self.scratch("della_unpacked", self._ctx.numel, np.bool_)
                kernels().unpack_mask(keep, mask[0], self._bounds, np.array(x.selected_blocks, np.int64))
            self._fold_mask(x, src, self._block_spans(x), keep, mask[1], mask[2], w)
            return
        if self._draws_mask(x):
            super()._fold_dare(x)
            return
        if zero_check and not kernels().kth_largest_is_zero(self._bflat, src, x.element_ranges_array(self._ctx),
                                                             zero_check):
            self._fold_trimmed(x, x.element_ranges(self._ctx))
            return
        self._stream(src, x, trim, tau, w)

    def _draws_mask(self, x: ExpertInput) -> bool:
        return self.sparsification == "random" and self.densities[x.index] < 1

    def _fold_dare(self, x: ExpertInput) -> None:
        """dare_ties: keep the input for the fused pass (`kernels.merge.dare_ties_fused`, which draws each
        block's uniforms a tile at a time, or reads a kept mask) while it fits, else fold it block by block.
        With the L1 rescale its scale is found first (`DeltaFold._l1_scale`: the mask and the sums, one pass
        over the blocks), and the mask it draws is kept, packed eight to a byte (a buffer per place in the
        stash, reused from tensor to tensor), so the fused pass does not draw it again."""
        src = x.fast_source()
        if (self.sparsification == "random" and src is not None
                and self._P is not None and self._bflat is not None and self._fits_stash(src)):
            assert self._stash is not None
            if self.rescale_mode == "l1":
                packed = self._kept_mask_buffer("dare", len(self._stash), True)
                scale = self._l1_scale(x, src, packed)
                self._keep_mask(x, packed, 1 if scale != 1.0 else 0, scale)
                return
            self._dare_modes[x.index] = (2, 1.0) if self.rescale_mode == "classic" else (0, 1.0)
            self._stash.append((src, x, False, math.inf, self.weights[x.index], 0))
            self._stash_bytes += src.nbytes
            return
        super()._fold_dare(x)

    def _mask_buffer(self, x: ExpertInput) -> np.ndarray | None:
        """della: its mask is kept for the fused pass (`kernels.merge.dare_ties_fused` reads it a tile at a time)
        while its stored values fit: a buffer of its own per place in the stash, reused from tensor to tensor;
        packed eight to a byte on a 2-D tensor (`DeltaFold._della_keep`; not counted towards `FUSE_BYTES`, as
        dare_ties' are not), else a byte an element (counted). dare_ties keeps the mask its L1 pass draws
        (`_fold_dare`): None."""
        src = x.fast_source()
        ctx = self._ctx
        if self.sparsification != "della" or src is None or self._P is None or self._bflat is None or ctx is None:
            return None
        packed = self._packs_mask()
        if not self._fits_stash(src, 0 if packed else ctx.numel):
            return None
        return self._kept_mask_buffer("della", len(self._stash or ()), packed)

    def _keep_mask(self, x: ExpertInput, keep: np.ndarray, mode: int, scale: float) -> None:
        src = x.fast_source()
        assert src is not None and self._stash is not None
        self._masks[x.index] = (keep, mode, scale)
        self._stash.append((src, x, False, math.inf, self.weights[x.index], 0))
        self._stash_bytes += src.nbytes + (0 if keep.dtype == np.uint8 else keep.nbytes)  # packed: not counted

    def _dare_block_fast(self, src: np.ndarray, b: int, s0: int, e0: int, u: np.ndarray, d: float,
                         w: float) -> bool:
        if self._bflat is None:
            return False
        S, P, N, wp, wn = self._sums()
        kernels().ties_dare_span_par(S[s0:e0], P[s0:e0], N[s0:e0], wp[s0:e0], wn[s0:e0], self._bflat[s0:e0],
                                 src[s0:e0], u, np.float32(d), np.float32(w), self.normalize, not self._touched[b])
        self._touched[b] = True
        return True

    def _masked_block(self, b: int, s0: int, e0: int, bb: np.ndarray, xb: np.ndarray, keep: np.ndarray,
                      p: np.ndarray, step: int, mode: int, scale: float, w: float) -> None:
        S, P, N, wp, wn = self._sums()
        kernels().ties_masked_span_par(S[s0:e0], P[s0:e0], N[s0:e0], wp[s0:e0], wn[s0:e0], bb, xb, keep, p, step, mode,
                                   np.float32(scale), np.float32(w), self.normalize, not self._touched[b])
        self._touched[b] = True

    def _stream(self, src: np.ndarray, x: ExpertInput, trim: bool, tau: float, w: float) -> None:
        assert self._bflat is not None
        kernels().ties_add(*self._sums(), self._bflat, src, self._bounds,
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
            kernels().ties_clear_untouched(*self._sums(), self._bounds, self._touched, self.normalize)

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

    def _fold_band(self, x: ExpertInput, lo: float | None, hi: float) -> bool:
        """breadcrumbs_ties: keep the input for the fused pass with its band lo < |Δ| < hi (`ties_fused` takes it
        as the float32 neighbours inward, tau <= |Δ| <= hi') while it fits; False: the caller folds it now."""
        src = x.fast_source()
        if src is None or self._P is None or self._stash is None or not self._fits_stash(src):
            return False
        self._stash.append((src, x, True, float(band_bounds(lo, hi)[0]), self.weights[x.index], 0))
        self._stash_bytes += src.nbytes
        self._bands[x.index] = (lo, hi)
        return True

    def _combine(self, s: int, e: int, D: np.ndarray, finite: bool | None) -> None:
        assert self._P is not None
        self._init_sums()
        w = self._w
        if finite or all_finite(D):
            # D > 0: max(D, 0) = D, 1·w = w; otherwise ±0 — equal to the where() forms for finite D; one pass
            S, P, N, wp, wn = self._sums()
            kernels().ties_add_terms(S[s:e], P[s:e], N[s:e], wp[s:e], wn[s:e], D, np.float32(w), self.normalize)
        else:  # the literal formula (NaN D is neither positive nor negative)
            self._S[s:e] += D
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
        kernels().ties_finish(P_, S, N, wp, wn, base.reshape(-1), self._bounds, self._touched, self.normalize,
                              np.float32(self.lam), self._skip)
        return P.reshape(base.shape)

    def _base_only(self, b: np.ndarray) -> np.ndarray:
        return b + np.float32(0.0) * np.float32(self.lam)  # `kernels.merge._untouched_span`

    def _finish_fused(self, P: np.ndarray) -> bool:
        """The fused pass over the kept inputs into P; False when the bytes of an input whose τ = 0 came
        from the sketch disagree with it (then the sums have been folded again by the streaming kernels,
        with τ found from the bytes, for `ties_finish`)."""
        assert self._stash and self._ctx is not None and self._bflat is not None
        stash, self._stash = self._stash, None
        raws = kernels().pack([src for src, *_ in stash])
        selected = np.zeros((len(stash), self._ctx.n_blocks), np.bool_)
        for k, (_src, x, *_rest) in enumerate(stash):
            selected[k, list(x.selected_blocks)] = True
        if self.sparsification in ("random", "della"):
            self._finish_dare_fused(P, stash, raws, selected)
            return True
        checks = np.array([c for *_a, c in stash], np.int64)
        counts = np.zeros((len(stash), 2), np.int64)  # [nonzero finite |Δ|, inf or NaN] where checked
        his = [band_bounds(*self._bands[x.index])[1] if x.index in self._bands else np.float32(math.inf)
               for _src, x, *_rest in stash]
        kernels().ties_fused(P, self._bflat, raws, selected, self._bounds,
                             np.array([item[2] for item in stash], np.bool_),
                             np.array([item[3] for item in stash], np.float32), np.array(his, np.float32),
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
        """dare_ties's and della's fused pass: each input's density (>= 1: no mask) and its kept mask, or its
        blocks' generator seeds."""
        ctx = self._ctx
        assert ctx is not None and self._bflat is not None
        dens = np.array([self.densities[x.index] for _src, x, *_rest in stash], np.float32)
        masks = [self._masks.pop(x.index, None) for _src, x, *_rest in stash]
        seeds = np.zeros(selected.shape, np.int64)
        for k, (_src, x, *_rest) in enumerate(stash):
            if self._draws_mask(x) and masks[k] is None:
                key = self.experts[x.index].key
                for b in x.selected_blocks:
                    seeds[k, b] = block_seed(ctx.seed, key, ctx.name, b)
        modes = [self._dare_modes.get(x.index, (0, 1.0)) if mask is None else mask[1:]
                 for (_src, x, *_rest), mask in zip(stash, masks)]
        kernels().dare_ties_fused(P, self._bflat, raws, selected, self._bounds, dens, seeds,
                                  np.array([item[4] for item in stash], np.float32), self.normalize,
                                  np.float32(self.lam), self._skip, np.array([m for m, _s in modes], np.int64),
                                  np.array([sc for _m, sc in modes], np.float32),
                                  *kernels().kept_masks([None if mask is None else mask[0] for mask in masks]))

    def _end(self) -> None:
        self._P = None
        self._stash = None
        for name in ("_S", "_N", "_WP", "_WN"):
            self.__dict__.pop(name, None)


@register("ties")
class Ties(TiesFold):
    """ties: trim to the top-density |Δ| per tensor, elect signs, average the agreeing updates."""

    needs_full_tensor_stats = True
    sparsification = "magnitude"


@register("dare_ties")
class DareTies(TiesFold):
    """dare_ties: TIES steps 2-6 on DARE task vectors."""

    normalize_default = False
    sparsification = "random"


@register("breadcrumbs_ties")
class BreadcrumbsTies(TiesFold):
    """breadcrumbs_ties: TIES steps 2-6 on task vectors without their largest and smallest |Δ|."""

    needs_full_tensor_stats = True
    normalize_default = False
    sparsification = "magnitude_outliers"

    def _fold_trimmed(self, x: ExpertInput, ranges: list[tuple[int, int]]) -> None:
        self._fold_outliers(x, ranges)


@register("della")
class Della(TiesFold):
    """della: TIES steps 2-6 on DELLA-dropped task vectors (keep probability by |Δ| rank within each row)."""

    sparsification = "della"
