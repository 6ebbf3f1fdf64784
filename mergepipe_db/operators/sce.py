"""sce: select the elements of highest variance across the experts, weight each expert by its mean squared task
vector, erase the minority sign (docs/SEMANTICS.md). torch's var, topk and mean are the definition (their
summation orders set the bits); torch is imported when a tensor is finished.

Under a partial selection the formula runs on the rows read only (the union of every expert's selected rows,
compacted into contiguous arrays); the other rows get the formula's value for an all-zero Δ, θ₀ + 0.0."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from mergepipe_db.operators.gather import GatherFold
from mergepipe_db.operators.registry import register

__all__ = ["Sce"]


@register("sce")
class Sce(GatherFold):
    """sce with parameter select_topk (default 1: no selection)."""

    option_defaults: ClassVar[dict[str, float]] = {"select_topk": 1.0}
    #: the variance, the sign election and the weights couple every expert's Δ of an element: block rows of all
    #: experts are read together
    joint_election: ClassVar[bool] = True
    uses_torch = True
    compacts_rows = True

    def coefficient(self, k: int) -> float:
        return 1.0

    def _combine_all(self, base: np.ndarray, values: list[np.ndarray]) -> np.ndarray:
        import torch

        rows = self._rows_read()
        if rows is None:  # the whole tensor, as MergeKit
            tvs = torch.stack([torch.from_numpy(v) for v in values], dim=0)
            tvs = self._select(tvs)
            weights = tvs.square().reshape(tvs.shape[0], -1).mean(dim=1)
            return (torch.from_numpy(base) + self._combine(tvs, weights)).numpy()
        # the rows read, compacted: the omitted rows have every Δ_k = 0 (variance 0, never selected), so they
        # add nothing to count_nonzero(var) or to Σ tvs_k²; the mean still divides by the whole numel
        n_rows = self._read.shape[0]
        b2 = base.reshape(n_rows, -1)
        tvs = torch.from_numpy(self._compact(values, rows))
        if len(rows):  # (no row read: nothing to select, and torch.var of nothing warns)
            tvs = self._select(tvs)
        weights = tvs.square().reshape(tvs.shape[0], -1).sum(dim=1) / base.size
        final = self._combine(tvs, weights)
        # an omitted row: the same steps on Δ_k = 0 (+0.0 unless the weights are not finite)
        zero = self._combine(torch.zeros((len(values), 1), dtype=torch.float32), weights)
        out = base + zero.numpy()[0]
        out.reshape(n_rows, -1)[rows] = (torch.from_numpy(np.take(b2, rows, axis=0)) + final).numpy()
        return out

    def _select(self, tvs: Any) -> Any:
        """`tvs` with only the top `select_topk` fraction of the nonzero variances kept (all when it is 1)."""
        import torch

        density = self.params["select_topk"]
        if density >= 1:
            return tvs
        if density <= 0:
            mask = torch.zeros_like(tvs[0])
        else:
            var = torch.var(tvs, dim=0, unbiased=False)
            k = int(int(torch.count_nonzero(var)) * density)
            mask = torch.zeros_like(var)
            if k > 0:
                _, idx = torch.topk(var.abs().view(-1), k=k, largest=True)
                mask.view(-1)[idx] = 1
        return tvs * mask.unsqueeze(0)

    @staticmethod
    def _combine(tvs: Any, weights: Any) -> Any:
        """The update Σ_k tvs_k·(w_k·erase_k) / clamp(Σ_k w_k·erase_k, 1e-6), from the raw weights w_k."""
        import torch

        sign = tvs.sign()
        majority = (tvs.sum(dim=0) >= 0).to(tvs.dtype) * 2 - 1
        erase = sign == majority
        total = torch.sum(weights).item()
        if abs(total) < 1e-6:
            weights = torch.ones_like(weights) / weights.shape[0]
        else:
            weights = weights / total
        while weights.dim() < tvs.dim():
            weights = weights.unsqueeze(-1)
        erased = weights * erase
        merged = (tvs * erased).sum(dim=0)
        return merged / torch.sum(erased, dim=0).clamp(min=1e-6)
