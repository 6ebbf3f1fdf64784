"""sce: select the elements of highest variance across the experts, weight each expert by its mean squared task
vector, erase the minority sign (docs/SEMANTICS.md). torch's var, topk and mean are the definition (their
summation orders set the bits); numba kernels compute it per element in torch's orders, without K-sized
temporaries (`_merge_flat`), `kernels.topk_select` chooses among variances tied at the top-k cut as torch.topk
does, and torch, imported when a tensor is finished, sums the squares and does an array's last columns.

Under a partial selection the formula runs on the rows read only (the union of every expert's selected rows,
compacted into contiguous arrays); the other rows get the formula's value for an all-zero Δ, θ₀ + 0.0."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from mergepipe_db.core.dtypes import as_float32
from mergepipe_db.operators.base import kernels, one_thread_torch_pool
from mergepipe_db.operators.gather import GatherFold
from mergepipe_db.operators.order_stats import kth_largest_bits
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
    raw_formula = True

    def coefficient(self, k: int) -> float:
        return 1.0

    def _combine_all(self, base: np.ndarray, values: list[np.ndarray]) -> np.ndarray:
        import torch

        rows = self._rows_read()
        if rows is None:  # the whole tensor, as MergeKit
            out, _ = self._merge_flat(base.reshape(-1), [v.reshape(-1) for v in values], base.size)
            return out
        # the rows read, compacted: the omitted rows have every Δ_k = 0 (variance 0, never selected), so they
        # add nothing to count_nonzero(var) or to Σ tvs_k²; the mean still divides by the whole numel
        n_rows = self._read.shape[0]
        b2 = base.reshape(n_rows, -1)
        tvs = self._compact(values, rows)
        final, weights = self._merge_flat(np.take(b2, rows, axis=0).reshape(-1),
                                          [t.reshape(-1) for t in tvs], base.size)
        # an omitted row: the same steps on Δ_k = 0 (+0.0 unless the weights are not finite)
        zero = self._combine(torch.zeros((len(values), 1), dtype=torch.float32), weights)
        out = base + zero.numpy()[0]
        out.reshape(n_rows, -1)[rows] = final.reshape(len(rows), b2.shape[1])
        return out

    def _combine_raw(self, base: np.ndarray, raws: list[np.ndarray], read: np.ndarray) -> np.ndarray:
        out, _ = self._merge_flat(base.reshape(-1), raws, base.size, read)
        return out

    #: the last columns (this many, plus up to 63 more to a multiple of 64 before them) go through torch's
    #: `_combine`: torch's sum over dim 0 adds the K rows in order into +0.0, except in an array's last columns
    #: (its narrow-vector and scalar tails), whose order depends on the CPU's vector width
    TORCH_TAIL = 128

    def _merge_flat(self, base: np.ndarray, ds: list[np.ndarray], divisor: int, read: np.ndarray | None = None,
                    ) -> tuple[np.ndarray, Any]:
        """θ₀ + sce's update on flat float32 arrays (θ₀ and every Δ_k; given the read map `read`, each
        expert's stored values instead, Δ_k formed from them: `kernels.merge.delta_tile`), w_k = Σ tvs_k² /
        `divisor`: the torch formula of docs/SEMANTICS.md without K-sized temporaries, bit for bit. Returns it
        and the raw weights (a float32 tensor of K)."""
        import torch

        kern = kernels()
        n, n_experts = base.shape[0], len(ds)
        keep = self._keep(ds, None if read is None else (base, read), n=n)
        masked = keep is not None
        keep_arr = keep if keep is not None else np.zeros(1, np.uint8)
        # w_k: torch's sum of the squares, each row whole on one thread, as torch sums each row of the stacked
        # (K, n) array (one row on several threads would be split across them): on a worker of the one-thread
        # pool while the next expert's squares are made, two buffers taken in turn
        pool = one_thread_torch_pool()
        sq = (self.scratch("sce_sq", n), self.scratch("sce_sq2", n))
        sums = []
        for k, d in enumerate(ds):
            buf = sq[k % 2]
            if k >= 2:
                sums[k - 2].result()  # the sum that read this buffer is done
            if read is not None:
                kern.sce_masked_square_raw(buf, base, d, read[k], keep_arr, masked)
            else:
                kern.sce_masked_square(buf, d, keep_arr, masked)
            sums.append(pool.submit(_row_sum, torch.from_numpy(buf).view(1, -1)))
        weights = torch.stack([s.result() for s in sums]) / divisor
        total = torch.sum(weights).item()
        norm = torch.ones_like(weights) / n_experts if abs(total) < 1e-6 else weights / total
        out = np.empty(n, np.float32)
        bulk = 0 if n < 4 * self.TORCH_TAIL else n - self.TORCH_TAIL - n % 64
        if bulk and read is not None:
            kern.sce_combine_raw(out[:bulk], base, kern.pack(ds), read, n_experts, keep_arr, masked, norm.numpy())
        elif bulk:
            kern.sce_combine(out[:bulk], base, kern.pack(ds), n_experts, keep_arr, masked, norm.numpy())
        if bulk < n:  # the tail, by torch as written
            tail = [self._stored_tail(base, d, read[k], bulk) for k, d in enumerate(ds)] if read is not None \
                else [d[bulk:] for d in ds]
            tvs = torch.stack([torch.from_numpy(d) for d in tail])
            if masked:
                tvs = tvs * torch.from_numpy(keep_arr[bulk:]).to(torch.float32)
            out[bulk:] = (torch.from_numpy(base[bulk:]) + self._combine(tvs, weights)).numpy()
        return out, weights

    @staticmethod
    def _stored_tail(base: np.ndarray, raw: np.ndarray, read: np.ndarray, start: int) -> np.ndarray:
        """Δ from `start` on, from an expert's stored values and read map: +0.0 on the tiles not read."""
        from mergepipe_db.kernels.merge import RAW_TILE

        out = np.zeros(base.shape[0] - start, np.float32)
        for j in range(start // RAW_TILE, len(read)):
            if read[j]:
                s, e = max(j * RAW_TILE, start), min((j + 1) * RAW_TILE, base.shape[0])
                out[s - start:e - start] = as_float32(raw[s:e]) - base[s:e]
        return out

    def _keep(self, ds: list[np.ndarray], stored: tuple[np.ndarray, np.ndarray] | None = None, *,
              n: int | None = None) -> np.ndarray | None:
        """The `select_topk` mask (uint8 per element); None when it is 1 (nothing masked).

        torch.topk's k largest |var|: the k-th largest by radix select, and every element at or above it kept
        when those are exactly k. When variances equal to the k-th largest are split (some in, some out:
        frequent with BF16 experts, whose Δ take few values), torch.topk's choice among them, reproduced
        (`kernels.topk_select`), or torch.topk itself where that is not reproduced. Where the experts are
        stored in 16 bits, torch's choice is asked first (the same mask: either way it is torch.topk's). |var|
        is torch's, bit for bit (`sce_abs_var`)."""
        import torch

        n = ds[0].shape[0] if n is None else n  # the caller's n: a stored array may be empty (nothing read)
        density = self.params["select_topk"]
        if density >= 1:
            return None
        keep = self.scratch("sce_keep", n, np.uint8)
        if density <= 0 or n == 0:
            keep[:] = 0
            return keep
        kern = kernels()
        var = self.scratch("sce_var", n)
        if stored is not None:  # ds: the stored values, Δ_k formed from them, θ₀ and the read map
            nonzero = kern.sce_abs_var_raw(var, stored[0], kern.pack(ds), stored[1], len(ds))
        else:
            nonzero = kern.sce_abs_var(var, kern.pack(ds), len(ds))
        k = int(int(nonzero) * density)
        # two ways to torch.topk's mask without torch, each of which may decline; experts stored in 16 bits give
        # few distinct variances, so values tie at the cut in nearly every tensor: the choice among ties first
        ways = (self._exactly_k, self._tie_choice)
        if stored is not None and ds[0].dtype.itemsize == 2:
            ways = ways[::-1]
        if k <= 0:
            keep[:] = 0
        elif not any(way(var, k, keep) for way in ways):
            keep[:] = 0
            keep[torch.topk(torch.from_numpy(var), k, sorted=False).indices.numpy()] = 1
        return keep

    def _exactly_k(self, var: np.ndarray, k: int, keep: np.ndarray) -> bool:
        """keep = every element at or above the k-th largest, where those are exactly k (False, `keep`
        untouched, where the k-th largest ties with some left out)."""
        return kernels().sce_keep(var.view(np.uint32), np.uint32(kth_largest_bits(var, k, self)), k, keep)

    def _tie_choice(self, var: np.ndarray, k: int, keep: np.ndarray) -> bool:
        """torch.topk's choice, reproduced (`kernels.topk_select.torch_topk_mask`; False, `keep` untouched, where
        it declines)."""
        from mergepipe_db.kernels.topk_select import torch_topk_mask

        return torch_topk_mask(var, k, keep, self.scratch("sce_keys", var.shape[0], np.uint64))

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


def _row_sum(row: Any) -> Any:
    """torch's sum of a (1, n) float32 tensor's row (a task of `one_thread_torch_pool`: on one thread)."""
    return row.sum(dim=1)[0]
