"""The additive family: task arithmetic and the methods that feed it sparsified task vectors, DARE's random drop
(dare_linear) and the magnitude-outlier trim (breadcrumbs): θ₀ + λ·Σ T_k·w_k (/ W when normalized).
"""

from __future__ import annotations

import numpy as np

from mergepipe_db.operators.base import block_bounds, kernels
from mergepipe_db.operators.fold import DeltaFold, Stash, band_bounds
from mergepipe_db.operators.inputs import ExpertInput
from mergepipe_db.operators.registry import register

__all__ = ["AdditiveFold", "Breadcrumbs", "DareLinear", "DellaLinear", "TaskArithmetic"]


class AdditiveFold(DeltaFold):
    """task_arithmetic and the methods that follow it with T_k: mixed = Σ T_k·w_k; θ₀ + mixed·λ.

    A method of this family sets `sparsification` (and ``_fold_trimmed`` for a magnitude trim); the sums,
    the fused passes and the result are shared."""

    _mixed: np.ndarray | None = None

    def _begin(self) -> None:
        assert self._base is not None
        # written on the blocks not skipped (the caller writes the others) by the first fused pass, or zeroed
        # by `_settle` before a streamed fold
        self._mixed = self.scratch("out", self._base.size)
        self._started = False
        self._stash = Stash()
        self._bands: dict[int, tuple[float | None, float]] = {}  # a kept breadcrumbs input's (lo, hi): `_fold_band`
        self._masks: dict[int, tuple[np.ndarray, float]] = {}  # a kept random drop's (mask, scale): `_keep_mask`

    def _fold_stash(self, finish: bool = False) -> None:
        """Fold the kept inputs (in order) in one fused pass (`kernels.merge.delta_fused`, or `masked_fused` when
        some keep a drawn mask), which starts the sum if nothing has yet; with `finish`, it also ends each element
        as `_finish` does."""
        if not self._stash:
            return
        assert self._mixed is not None and self._ctx is not None and self._bflat is not None
        items, raws, selected = self._stash.take(self._ctx.n_blocks)
        w = np.array([self.weights[x.index] for _src, x in items], np.float32)
        masks = [self._masks.pop(x.index, None) for _src, x in items]
        if any(mask is not None for mask in masks):  # dare_linear, della_linear (density 1: no mask)
            kernels().masked_fused(self._mixed, self._bflat, raws, selected, block_bounds(self._ctx), w,
                                   *kernels().kept_masks([None if mask is None else mask[0] for mask in masks]),
                                   np.array([1.0 if mask is None else mask[1] for mask in masks], np.float32),
                                   self._skip, not self._started, finish, self.normalize,
                                   np.float32(self.weight_sum), np.float32(self.lam))
            self._started = True
            return
        inf = np.float32(np.inf)
        bands = [self._bands.get(x.index) for _src, x in items]
        bounds = np.array([(-inf, inf) if b is None else band_bounds(*b) for b in bands], np.float32).reshape(-1, 2)
        kernels().delta_fused(self._mixed, self._bflat, raws, selected, block_bounds(self._ctx), w,
                              np.array([b is not None for b in bands], np.bool_), bounds[:, 0].copy(),
                              bounds[:, 1].copy(), self._skip, not self._started, finish, self.normalize,
                              np.float32(self.weight_sum), np.float32(self.lam))
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
        kernels().dare_delta_span_par(self._mixed[s0:e0], self._bflat[s0:e0], src[s0:e0], u,
                                  np.float32(d), np.float32(w))
        return True

    def _masked_block(self, b: int, s0: int, e0: int, bb: np.ndarray, xb: np.ndarray, keep: np.ndarray,
                      p: np.ndarray, step: int, mode: int, scale: float, w: float) -> None:
        assert self._mixed is not None
        self._settle()
        kernels().masked_delta_span_par(self._mixed[s0:e0], bb, xb, keep, p, step, mode, np.float32(scale),
                                    np.float32(w))

    def _mask_buffer(self, x: ExpertInput) -> np.ndarray | None:
        """dare_linear and della_linear: the mask is kept for the fused pass (`kernels.merge.masked_fused`) while
        the expert's stored values and the mask fit a group, the kept inputs folded first when they would not
        fit beside it; a buffer per place in the group, reused from tensor to tensor. The mask is packed eight
        to a byte where its pass packs it (DARE's L1 pass, `DeltaFold._dare_keep_l1`; DELLA's on a 2-D tensor,
        `DeltaFold._della_keep`), else a byte an element."""
        src = x.fast_source()
        ctx = self._ctx
        if src is None or ctx is None or self._mixed is None or self._bflat is None:
            return None
        packed = self._packs_mask()
        size = kernels().mask_bytes(ctx.numel, ctx.n_blocks) if packed else ctx.numel
        if not self._stash.make_room(src, self._fold_stash, size):
            return None
        return self._kept_mask_buffer("additive", len(self._stash.items), packed)

    def _keep_mask(self, x: ExpertInput, keep: np.ndarray, mode: int, scale: float) -> None:
        src = x.fast_source()
        assert src is not None
        self._masks[x.index] = (keep, scale)  # mode 0 is scale 1: Δ · 1 = Δ in `masked_fused`
        kept = self._stash.offer(src, x, self._fold_stash, keep.nbytes)
        assert kept, "_mask_buffer made room for it"

    def _fold_band(self, x: ExpertInput, lo: float | None, hi: float) -> bool:
        """breadcrumbs: keep the input for the fused pass with its band lo < |Δ| < hi (`delta_fused`)."""
        src = x.fast_source()
        if src is None or self._mixed is None or not self._stash.offer(src, x, self._fold_stash):
            return False
        self._bands[x.index] = (lo, hi)
        return True

    def _fold_fast(self, x: ExpertInput, tau: float | None, zero_check: int = 0) -> bool:
        src = x.fast_source() if tau is None else None
        if src is None or self._mixed is None or self._ctx is None or self._bflat is None:
            return False
        if self._stash.offer(src, x, self._fold_stash):
            return True
        self._settle()
        w = np.float32(self.weights[x.index])
        kernels().delta_add(self._mixed, self._bflat, src, x.element_ranges_array(self._ctx), w)
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
        self._stash = Stash()
        self._masks = {}


@register("task_arithmetic")
class TaskArithmetic(AdditiveFold):
    """task_arithmetic: θ₀ + λ·Σ Δ_k·w_k (/ W when normalized)."""

    additive = True


@register("dare_linear")
class DareLinear(AdditiveFold):
    """dare_linear: task_arithmetic on DARE-dropped, 1/d-rescaled task vectors."""

    sparsification = "random"


@register("breadcrumbs")
class Breadcrumbs(AdditiveFold):
    """breadcrumbs: task_arithmetic on task vectors without their largest and smallest |Δ|."""

    needs_full_tensor_stats = True
    sparsification = "magnitude_outliers"

    def _fold_trimmed(self, x: ExpertInput, ranges: list[tuple[int, int]]) -> None:
        self._fold_outliers(x, ranges)


@register("della_linear")
class DellaLinear(AdditiveFold):
    """della_linear: task_arithmetic on DELLA-dropped task vectors (row-rank keep probabilities)."""

    sparsification = "della"
