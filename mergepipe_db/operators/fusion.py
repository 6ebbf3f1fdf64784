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

__all__ = ["CHUNK_ELEMENTS", "QUANTILE_SAMPLE_SIZE", "SLICE_ALIGN", "ArceeFusion", "kl_by_row_chunks", "kl_rows",
           "row_chunks", "row_slices"]

#: MergeKit's sampling size: a tensor with more elements has its quantiles taken from this many importances
#: drawn with replacement (here by a generator keyed by the merge seed and the tensor name)
QUANTILE_SAMPLE_SIZE = 1_000_000


#: the KL's element-wise torch calls run on row slices that start at multiples of this many elements, so that
#: each element takes the path it takes in one call on the whole tensor (torch's vector loops, their scalar tail
#: only at the very end): the bits of one call (tests/kernels/test_gather_kernels.py checks it on this torch)
SLICE_ALIGN = 64
#: elements of a chunk of rows whose softmaxes and KL terms stay in the caches (p and q: 2 × 1 MiB); measured
#: on a 2-core VM, the KL of an 11.5 M-element tensor took 32 ms as whole-tensor calls, 24 ms in chunks of 2^16,
#: 19 ms of 2^18 and of 2^20
CHUNK_ELEMENTS = 1 << 18
_EPS = 1e-8  # MergeKit's, added to both softmaxes
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


def row_chunks(rows: int, width: int, elements: int = CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """Contiguous [start, stop) row ranges covering `rows` rows of `width` elements, of about `elements`
    elements each where the rows can be cut so (a range starts at a multiple of `SLICE_ALIGN` elements, as
    `row_slices`'s)."""
    step = SLICE_ALIGN // math.gcd(width, SLICE_ALIGN)
    return row_slices(rows, width, min(-(-rows * width // elements), rows // step))


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


def kl_by_row_chunks(t0, t1, kl, chunks: list[tuple[int, int]], buffers) -> None:  # noqa: ANN001 - torch tensors
    """kl[a:b] = Σ_row p·log(p/q) (`kl_rows`) with p = softmax(t1[a:b]), q = softmax(t0[a:b]) (rows of the 2-D
    views t0, t1) for each chunk [a, b) of rows in turn, p and q in `buffers` (two flat float32 tensors of the
    longest chunk's elements); torch's calls in this thread. A chunk starts at a multiple of `SLICE_ALIGN`
    elements (`row_slices`), and a row's softmax is the row's alone, so the bits are those of one call each on
    the whole tensor (tests/kernels/test_gather_kernels.py checks it on this torch)."""
    import torch

    width = t0.shape[-1]
    for a, b in chunks:
        n = (b - a) * width
        p, q = buffers[0][:n].view(b - a, width), buffers[1][:n].view(b - a, width)
        torch.ops.aten._softmax.out(t1[a:b], -1, False, out=p)
        torch.ops.aten._softmax.out(t0[a:b], -1, False, out=q)
        kl_rows(p, q, kl[a:b], _EPS)


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
        # torch's operations of the formula, in place and into reused buffers (F.softmax is aten's _softmax):
        # p = softmax(θ_1), q = softmax(θ₀) and Σ_row p·log(p/q), a chunk of rows at a time, so that the passes
        # over p and q run in a core's cache; a contiguous part of the rows on each core (`kl_by_row_chunks`)
        width = base.shape[-1]
        rows = base.size // width
        kl = torch.from_numpy(self.scratch("fusion_kl", rows)).view(-1, 1)
        parts = row_slices(rows, width, cores())
        chunks = [row_chunks(b - a, width) for a, b in parts]
        longest = max((b - a) * width for group in chunks for a, b in group)
        buffers = [(self._scratch_tensor(f"fusion_p{i}", (longest,)),
                    self._scratch_tensor(f"fusion_q{i}", (longest,))) for i in range(len(parts))]
        t0r, t1r = t0.view(rows, width), t1.view(rows, width)
        jobs = [(t0r[a:b], t1r[a:b], kl[a:b], group, pq)
                for (a, b), group, pq in zip(parts, chunks, buffers)]
        if len(jobs) == 1:
            kl_by_row_chunks(*jobs[0])
        else:
            pool = _thread_pool()
            for done in [pool.submit(kl_by_row_chunks, *job) for job in jobs]:
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
