"""linear: the weighted average of the models themselves, Σ θ_k·w_k (/ W when normalized), θ_k read in place."""

from __future__ import annotations

import numpy as np

from mergepipe_db.operators.base import MergeOperator, block_bounds, chunks, kernels
from mergepipe_db.operators.fold import Stash
from mergepipe_db.operators.inputs import ExpertInput
from mergepipe_db.operators.registry import register

__all__ = ["Linear"]


@register("linear")
class Linear(MergeOperator):
    """linear: Σ θ_k·w_k (/ W when normalized). An expert with nothing selected adds θ₀·w_k."""

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
        self._acc = self.scratch("out", self._base.size)  # garbage until each block's first fold
        self._pending = np.zeros(ctx.n_blocks, np.int64)  # per block: the first expert not folded into it
        self._bounds = block_bounds(ctx)
        self._w32 = np.array(self.weights, np.float32)
        self._stash = Stash()
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
            items, raws, selected = [], kernels().pack([base[:0]]), np.zeros((0, ctx.n_blocks), np.bool_)
        j1 = items[-1][1].index + 1 if through is None else through
        kernels().linear_fused(acc, base, raws, slot, selected, self._bounds, self._w32, self._pending, j1, self._skip,
                               np.float32(self.weight_sum), divide)
        self._set_pending(j1)

    def _add(self, x: ExpertInput) -> None:
        acc, base, ctx = self._acc, self._bflat, self._ctx
        assert acc is not None and base is not None and ctx is not None
        if not x.selected_blocks:
            return  # θ_k = θ₀ everywhere: folded lazily (`kernels.merge.linear_fold`)
        src = x.fast_source()
        if src is not None and self._stash.offer(src, x, self._fold_stash):
            return
        self._fold_stash()
        if src is not None:
            selected = np.zeros(ctx.n_blocks, np.bool_)
            selected[list(x.selected_blocks)] = True
            kernels().linear_fold(acc, base, src, self._bounds, selected, self._pending, self._w32, x.index)
            return
        # θ_k known only through Δ_k: bring every block up to expert k, then one chunked pass over the tensor
        self._fold_stash(through=x.index)
        first = x.index == 0
        if first:
            acc.fill(0)
        w = self.weights[x.index]
        n = base.size
        selected_r = x.element_ranges(ctx)
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
            for s, e in chunks([(s0, e0)]):
                theta = self._theta_chunk(x, s, e) if sel else base[s:e]
                acc[s:e] += np.multiply(theta, w, out=self.scratch("D", e - s))
        self._set_pending(x.index + 1)

    def _finish(self) -> np.ndarray:
        acc, base = self._acc, self._base
        assert acc is not None and base is not None and self._bflat is not None
        self._fold_stash(through=self.n_experts, divide=self.normalize)
        return acc.reshape(base.shape)

    def _base_only(self, b: np.ndarray) -> np.ndarray:
        acc = np.zeros_like(b)
        for j, w in enumerate(np.array(self.weights, np.float32)):  # `kernels.merge._catch_up`, in order
            acc = (np.float32(0.0) + b * w) if j == 0 else (acc + b * w)
        if self.normalize:
            acc /= self.weight_sum
        return acc

    def _end(self) -> None:
        self._acc = None
        self._stash = Stash()
