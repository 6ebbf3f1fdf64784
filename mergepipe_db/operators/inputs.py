"""Inputs of the merge operators: one expert's view of one tensor (`ExpertInput`), and the buffer and dtype
helpers that turn the caller's arrays (numpy, or torch tensors converted on entry) into float32 or stored values.

Arrays are numpy: a BF16 value is held as its uint16 bit pattern. torch is never imported here; a torch tensor
can only exist once the caller has imported it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mergepipe_db.core.dtypes import as_float32
from mergepipe_db.errors import UnsupportedDtypeError

if TYPE_CHECKING:
    from mergepipe_db.operators.base import ExpertParams, TensorContext

__all__ = ["ExpertInput", "empty_buffer", "float32_array", "stored_values"]


def empty_buffer(n: int, dtype: Any = np.float32) -> np.ndarray:
    """An uninitialised 1-D array for a long-lived scratch buffer: big ones page-aligned, in a mapping of their
    own (`mergepipe_db.io.local.aligned_empty`)."""
    dt = np.dtype(dtype)
    if n * dt.itemsize < (2 << 20):
        return np.empty(n, dt)
    from mergepipe_db.io.local import aligned_empty

    return aligned_empty(n * dt.itemsize).view(dt)


def is_torch(t: object) -> bool:
    """Whether `t` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is imported
    return torch is not None and isinstance(t, torch.Tensor)


def stored_values(t: Any, what: str) -> np.ndarray:
    """Stored values for `ExpertInput.from_raw`: float32/float16/float64, or BF16 as uint16 bit patterns."""
    if is_torch(t):
        import torch

        if not t.is_floating_point():
            raise UnsupportedDtypeError(f"{what} has dtype {t.dtype}, which merge arithmetic cannot use")
        t = t.detach().contiguous()
        return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
    a = np.asarray(t)
    if a.dtype.kind != "f" and a.dtype != np.uint16:
        raise UnsupportedDtypeError(f"{what} has dtype {a.dtype}, which merge arithmetic cannot use")
    return np.asarray(a, order="C")  # (not ascontiguousarray: it makes a 0-d tensor 1-d)


def float32_array(t: Any, what: str) -> np.ndarray | None:
    """A float32 array of `t` (numpy, or a torch tensor: shared when already float32 and contiguous)."""
    if t is None:
        return None
    if is_torch(t):
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
        self._base = float32_array(base, "base")
        self._ctx = ctx
        self._raw = None
        if self.selected_blocks:
            if theta is None and delta is None and raw is None:
                raise ValueError(f"expert {self.index}: blocks selected but neither theta, delta nor raw given")
            self._theta = float32_array(theta, f"expert {self.index} tensor")
            self._delta = float32_array(delta, f"expert {self.index} delta")
            if raw is not None and theta is None and delta is None:
                self._raw = stored_values(raw, f"expert {self.index} tensor")
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
                for s, e in self.element_ranges(self._ctx):
                    np.add(bf[s:e], df[s:e], out=tf[s:e])
                self._theta = theta
        return self._theta

    def _theta_from_raw(self) -> np.ndarray:
        """θ_k in float32: the stored values on the selected rows, θ₀ on the others."""
        raw = self._raw
        assert raw is not None
        if self._ctx is None or len(self.selected_blocks) == self._ctx.n_blocks:  # every row read
            return as_float32(raw)
        theta = self._need_base().copy()
        tf, rf = theta.reshape(-1), raw.reshape(-1)
        for s, e in self.element_ranges(self._ctx):
            tf[s:e] = as_float32(rf[s:e])
        return theta

    def fast_source(self) -> np.ndarray | None:
        """θ_k for the fused kernels (`mergepipe_db.kernels.merge`), flat and valid on the selected rows: the
        stored BF16 bit patterns (uint16) or float32 values; None when θ_k is only known through Δ_k."""
        raw = self._raw
        if self._theta is None and raw is not None and raw.dtype in (np.uint16, np.float32):
            return raw.reshape(-1)
        if self._theta is None and raw is not None:
            self._theta = self._theta_from_raw()
        if self._theta is not None:
            return self._theta.reshape(-1)
        return None

    def stored_flat(self) -> np.ndarray | None:
        """θ_k's stored values, flat (BF16 bit patterns as uint16, or float32) and valid on the selected rows, when
        θ_k is held as those only (neither θ_k nor Δ_k given or computed yet); None otherwise."""
        raw = self._raw
        if self._theta is None and self._delta is None and raw is not None and raw.dtype in (np.uint16, np.float32):
            return raw.reshape(-1)
        return None

    def element_ranges_array(self, ctx: TensorContext) -> np.ndarray:
        """Selected element ranges as an int64 array of [start, stop) rows (the kernels' ``ranges``)."""
        r = self.element_ranges(ctx)
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
                for s, e in self.element_ranges(self._ctx):
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

    def element_ranges(self, ctx: TensorContext) -> list[tuple[int, int]]:
        """Coalesced [start, stop) flat element ranges of the selected blocks, in order."""
        rn = ctx.row_numel
        return [(s * rn, e * rn) for s, e in self.selected_row_ranges(ctx) if rn]

    def bind(self, base: np.ndarray, ctx: TensorContext) -> None:
        """Take the operator's base and context where none was given (`MergeOperator.add`); checks shapes."""
        if self._base is None:
            self._base = base
        if self._ctx is None:
            self._ctx = ctx
        for t, what in ((self._theta, "theta"), (self._delta, "delta"), (self._raw, "raw")):
            if t is not None and tuple(t.shape) != tuple(ctx.shape):
                raise ValueError(f"expert {self.index}: {what} shape {tuple(t.shape)} != {tuple(ctx.shape)}")

    def theta_flat(self) -> np.ndarray | None:
        """θ_k flat (float32; converted from the stored values when those were given), or None when only Δ_k is
        at hand."""
        if self._theta is None and self._raw is not None:
            self._theta = self._theta_from_raw()
        return None if self._theta is None else self._theta.reshape(-1)

    def delta_flat(self) -> np.ndarray | None:
        """Δ_k flat (float32) when given or already computed, else None."""
        return None if self._delta is None else self._delta.reshape(-1)
