"""arcee_fusion: keep the other model's update where its importance, |Δ| times the row's KL divergence between
the softmaxes of θ_1 and θ₀, reaches median + 1.5·IQR of the tensor's importances (docs/SEMANTICS.md). torch's
softmax, log and sum are the definition (the importance, the quantiles' selection and the result are numba
passes doing torch's float32 operations); torch is imported when a tensor is finished."""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mergepipe_db.errors import MethodParameterError
from mergepipe_db.operators.base import cores
from mergepipe_db.operators.gather import GatherFold, gather_kernels
from mergepipe_db.operators.registry import register

__all__ = ["QUANTILE_SAMPLE_SIZE", "SLICE_ALIGN", "ArceeFusion", "kl_rows", "row_slices"]

#: MergeKit's sampling size: a tensor with more elements has its quantiles taken from this many importances
#: drawn with replacement (here by a generator keyed by the merge seed and the tensor name)
QUANTILE_SAMPLE_SIZE = 1_000_000


#: the KL's element-wise torch calls run on row slices that start at multiples of this many elements, so that
#: each element takes the path it takes in one call on the whole tensor (torch's vector loops, their scalar tail
#: only at the very end): the bits of one call (tests/kernels/test_gather_kernels.py checks it on this torch)
SLICE_ALIGN = 64
_pools: list[ThreadPoolExecutor] = []  # one, made on first use


def row_slices(rows: int, width: int, parts: int) -> list[tuple[int, int]]:
    """At most `parts` contiguous [start, stop) row ranges covering `rows` rows of `width` elements, each
    starting at a multiple of `SLICE_ALIGN` elements; one range when there are too few rows to cut."""
    step = SLICE_ALIGN // math.gcd(width, SLICE_ALIGN)  # rows per aligned unit
    units = rows // step
    if parts <= 1 or units < parts:
        return [(0, rows)]
    cuts = [step * (units * i // parts) for i in range(parts)] + [rows]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _thread_pool() -> ThreadPoolExecutor:
    if not _pools:
        _pools.append(ThreadPoolExecutor(max_workers=cores(), thread_name_prefix="mergepipe-fusion"))
    return _pools[0]


def kl_rows(p, q, kl, eps: float) -> None:  # noqa: ANN001 - torch tensors
    """kl = Σ_row p·log(p/q) of some rows, p and q the softmaxes (+ eps in place; q becomes the terms)."""
    import torch

    p.add_(eps)
    q.add_(eps)
    torch.sum(torch.div(p, q, out=q).log_().mul_(p), dim=-1, keepdim=True, out=kl)


def sample_seed(seed: int, tensor_name: str) -> int:
    """The generator seed of a large tensor's quantile sample."""
    key = hashlib.sha256(f"{seed}\x1farcee_fusion\x1f{tensor_name}".encode()).digest()
    return int.from_bytes(key[:8], "little") & (2**63 - 1)


@register("arcee_fusion")
class ArceeFusion(GatherFold):
    """arcee_fusion between θ₀ and θ_1 (whole tensors: the threshold is a quantile of the whole tensor)."""

    gather = "theta"
    uses_theta = True
    tensor_granular = True
    uses_torch = True

    def _check(self) -> None:
        if self.n_experts != 1:
            raise MethodParameterError(f"arcee_fusion merges exactly two models, the base and one other; got "
                                       f"{self.n_experts} others")

    def coefficient(self, k: int) -> float:
        return 1.0

    def _combine_all(self, base: np.ndarray, values: list[np.ndarray]) -> np.ndarray:
        import torch

        assert self._ctx is not None
        t0, t1 = torch.from_numpy(base), torch.from_numpy(values[0])
        if base.ndim == 0 or base.size == 0:
            return self._literal(t0, t1)
        # torch's operations of the formula, in place and into reused buffers: the same kernels (F.softmax is
        # aten's _softmax), no fresh pages per tensor
        eps = 1e-8
        threads = torch.get_num_threads()
        # on every core: torch computes each row's softmax on one thread, so the bits do not depend on how many
        # (tests/kernels/test_gather_kernels.py checks it); the executor's one thread for the rest
        torch.set_num_threads(max(threads, cores()))
        try:
            p = torch.ops.aten._softmax.out(t1, -1, False, out=self._scratch_tensor("fusion_p", base.shape))
            q = torch.ops.aten._softmax.out(t0, -1, False, out=self._scratch_tensor("fusion_q", base.shape))
        finally:
            torch.set_num_threads(threads)
        # log(p/q)·p = p·log(p/q), summed per row: on every core by row slices (`row_slices`), each slice one
        # thread's torch calls, where the tensor has rows enough
        width = base.shape[-1]
        p2, q2 = p.view(-1, width), q.view(-1, width)
        kl = torch.from_numpy(self.scratch("fusion_kl", p2.shape[0])).view(-1, 1)
        slices = row_slices(p2.shape[0], width, cores())
        if len(slices) == 1:
            kl_rows(p2, q2, kl, eps)
        else:
            pool = _thread_pool()
            for done in [pool.submit(kl_rows, p2[a:b], q2[a:b], kl[a:b], eps) for a, b in slices]:
                done.result()
        # importance = |θ_1 - θ₀| · kl, the mask and the result: one numba pass each, torch's float32 operations
        kern = gather_kernels()
        b, x = base.reshape(-1), values[0].reshape(-1)
        importance = self.scratch("importance", base.size)
        no_nan = kern.fusion_importance(importance, b, x, kl.reshape(-1).numpy())
        flat = torch.from_numpy(importance)
        if flat.numel() > QUANTILE_SAMPLE_SIZE:
            seed = sample_seed(self._ctx.seed, self._ctx.name)
            if flat.numel() < 1 << 32:  # torch.randint's indices (one 32-bit draw each), drawn and gathered in one pass
                from mergepipe_db.kernels import torch_rand

                sample = self.scratch("sample", QUANTILE_SAMPLE_SIZE)
                torch_rand.randint_gather(importance, seed, sample,
                                          self.scratch("sample_idx", QUANTILE_SAMPLE_SIZE, np.uint32))
                flat = torch.from_numpy(sample)
            else:
                g = torch.Generator(device="cpu")
                g.manual_seed(seed)
                flat = flat[torch.randint(flat.numel(), (QUANTILE_SAMPLE_SIZE,), generator=g)]
        qs = (torch.tensor([0.25, 0.5, 0.75]) * (flat.numel() - 1)).long()
        if no_nan:  # the values at qs of the ascending sort, by radix select (NaN sorts last: torch's sort then)
            picked = np.empty(3, np.float32)
            kern.kth_smallest(np.ascontiguousarray(flat.numpy()), qs.numpy(), picked)
            q1, median, q3 = torch.from_numpy(picked)
        else:
            q1, median, q3 = torch.sort(flat)[0][qs]
        threshold = median + 1.5 * (q3 - q1)
        out = self.scratch("fusion_out", b.size)  # finish() may return a reused buffer
        kern.fusion_apply(out, b, x, importance, np.float32(threshold.item()))
        return out.reshape(base.shape)

    def _scratch_tensor(self, name: str, shape: tuple[int, ...]):  # noqa: ANN202 - a torch tensor
        import torch

        return torch.from_numpy(self.scratch(name, int(np.prod(shape, dtype=np.int64)))).view(shape)

    def _literal(self, t0, t1):  # noqa: ANN001, ANN202 - torch tensors
        """The formula in torch, for a 0-d or empty tensor."""
        import torch
        import torch.nn.functional as F  # noqa: N812

        assert self._ctx is not None
        diff = (t1 - t0).abs()
        eps = 1e-8
        p = F.softmax(t1, dim=-1) + eps
        q = F.softmax(t0, dim=-1) + eps
        kl = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
        importance = diff * kl
        flat = importance.reshape(-1)
        srt, _ = torch.sort(flat)
        qs = (torch.tensor([0.25, 0.5, 0.75]) * (srt.numel() - 1)).long()
        q1, median, q3 = srt[qs]
        threshold = median + 1.5 * (q3 - q1)
        mask = (importance >= threshold).float()
        return (t0 + (t1 - t0) * mask).numpy()
