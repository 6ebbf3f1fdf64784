"""The base of the merge operators: per-expert parameters, the tensor context, and `MergeOperator`, the streaming
fold protocol every method implements.

An operator folds the experts of one tensor in spec order: ``begin(base, ctx)``, then ``add(x)`` for
k = 0..K-1 (every expert, also one with nothing selected), then ``finish()``. Memory is a few tensors of the
tensor's size, whatever K. At full selection the result is identical, bit for bit, to the plain formulas
of docs/SEMANTICS.md; under a partial selection omitted rows contribute Δ = 0 and are never touched.

Bit-exactness rests on doing, per element, the same float32 operations in the same order as the formulas:
``x * s`` / ``x / s`` with the same Python float, sums into +0.0 accumulators in spec order. Adding a zero
term is skipped: an accumulator that starts at +0.0 and only receives sums is never -0.0, so ``acc + (±0)``
leaves its bits unchanged. Work is done in cache-sized chunks with reused scratch buffers (fresh pages
cost more than arithmetic on these machines). No I/O, no catalog.
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mergepipe_db.core.dtypes import as_float32
from mergepipe_db.core.geometry import block_ranges, row_count
from mergepipe_db.errors import SpecError
from mergepipe_db.operators.inputs import empty_buffer, float32_array

if TYPE_CHECKING:
    from mergepipe_db.operators.inputs import ExpertInput

__all__ = [
    "CHUNK",
    "ExpertParams",
    "MergeOperator",
    "TensorContext",
    "all_finite",
    "block_bounds",
    "chunks",
    "cores",
    "kernels",
    "live_ranges",
    "one_thread_torch_pool",
    "torch_on_one_thread",
]

CHUNK = 1 << 16  # elements per arithmetic step: scratch stays in L2


def kernels():  # noqa: ANN201 - the fused kernels (numba), imported on first use
    """`mergepipe_db.kernels.merge`, imported on first use (numba's import and compilation cost seconds)."""
    from mergepipe_db.kernels import merge as merge_kernels

    return merge_kernels


@dataclass(frozen=True)
class ExpertParams:
    """One expert's merge parameters (docs/SEMANTICS.md)."""

    key: str  #: expert checkpoint id (hex string): the DARE mask key
    weight: float = 1.0
    density: float = 1.0
    gamma: float = 0.01  #: breadcrumbs: fraction of the largest |Δ| dropped
    epsilon: float | None = None  #: della: the keep probabilities' spread (None: MergeKit's 0.15)


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
        return row_count(self.shape)

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


def cores() -> int:
    """The cores this process may run on (all of them where the OS cannot say)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


_torch_pools: list[Any] = []  # one, made on first use


def torch_on_one_thread() -> None:
    """Set torch to one thread in the calling thread (torch keeps a count per thread; other threads keep
    theirs)."""
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def one_thread_torch_pool() -> Any:
    """A pool of threads whose every task runs with torch on one thread: reductions whose sum order is a single
    thread's (karcher's dots, sce's sums of squares), two or more at once or beside the caller's own work.
    Made on first use.

    The count is set before every task, not once when a worker starts: a thread takes its count, at its first
    torch call, from the process-wide count that any thread set last (a worker that another thread's
    ``set_num_threads(2)`` preceded would sum on two)."""
    if not _torch_pools:
        from concurrent.futures import ThreadPoolExecutor

        class OneThreadTorchPool(ThreadPoolExecutor):
            def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:  # `map` submits through it too
                return super().submit(_on_one_thread, fn, *args, **kwargs)

        _torch_pools.append(OneThreadTorchPool(max_workers=max(2, min(cores(), 4)),
                                               thread_name_prefix="mergepipe-torch1"))
    return _torch_pools[0]


def _on_one_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    torch_on_one_thread()
    return fn(*args, **kwargs)


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
    rows = block_ranges(ctx.shape, ctx.rows_per_block)
    if len(rows) != ctx.n_blocks:
        raise ValueError(f"tensor {ctx.name!r}: {ctx.n_blocks} blocks in its context, {len(rows)} in its shape")
    rn = ctx.row_numel
    return np.array([s * rn for s, _e in rows] + [ctx.numel], np.int64)


def chunks(ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """[start, stop) steps of at most `CHUNK` elements over `ranges`."""
    for s, e in ranges:
        for c in range(s, e, CHUNK):
            yield c, min(e, c + CHUNK)


def finite(value: object, what: str, method: str) -> float:
    """`value` as a finite float; SpecError naming `what` of `method` otherwise."""
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SpecError(f"{method}: {what} must be a number, got {value!r}") from None
    if not math.isfinite(f):
        raise SpecError(f"{method}: {what} must be finite, got {value!r}")
    return f


def weight_sum(weights: Sequence[float]) -> float:
    """W = Σ w_k as a Python float summed in order; 1 when |W| < 1e-8."""
    total = 0.0
    for w in weights:
        total = total + w
    return 1.0 if abs(total) < 1e-8 else total


def all_finite(t: np.ndarray) -> bool:
    """True when every element is finite (a sum that overflows answers False: callers then take the
    exact slow path, which is always correct)."""
    return bool(np.isfinite(t.sum()))


class MergeOperator(abc.ABC):
    """Streaming fold of one tensor over the experts: ``begin``, ``add`` for k = 0..K-1, ``finish``.

    One operator serves every tensor of a merge; it keeps grow-only scratch buffers between tensors.
    ``finish`` returns a float32 array valid until the next ``begin``. Arithmetic on inf/NaN follows IEEE
    754 without numpy's floating-point warnings.

    A method subclassing this directly implements ``_begin``, ``_add`` and ``_finish`` (per-tensor state,
    one expert, the result), and where it applies ``_validate`` (parameter checks), ``coefficient``,
    ``_base_only`` (the `base_only_table`) and ``_end``; methods on task vectors subclass `fold.DeltaFold`.
    """

    #: the method name in specs, set by `registry.register`
    name: ClassVar[str]
    #: fixed-coefficient additive (linear, task_arithmetic): the omitted-update bound applies
    additive: ClassVar[bool] = False
    #: plan whole tensors (slerp)
    tensor_granular: ClassVar[bool] = False
    #: a tensor-granular operator that copies whatever it keeps of an input during add(): the executor may hand it
    #: inputs read in place or in reused buffers, as it does the others (those it keeps it names: `held_inputs`)
    copies_inputs: ClassVar[bool] = False
    #: reads θ_k (linear, slerp); the others use Δ_k
    uses_theta: ClassVar[bool] = False
    #: needs tensor-global thresholds (ties, breadcrumbs): a partial read takes them from the sketch
    needs_full_tensor_stats: ClassVar[bool] = False
    #: plan block rows of all experts together (ties, dare_ties; sql/plan_rank_grouped.sql)
    joint_election: ClassVar[bool] = False
    normalize_default: ClassVar[bool] = False
    #: imports torch for its results (karcher's loop): the executor sets its thread count first
    uses_torch: ClassVar[bool] = False
    #: inputs kept for a fused pass over the tensor (a `fold.Stash`, or TIES's list); empty or None: none held
    _stash: Any = None

    #: method options this operator takes (`MergeSpec.options`), with their defaults; others are refused
    option_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, experts: Sequence[ExpertParams], *, normalize: bool | None = None, lam: float = 1.0,
                 t: float | None = None, options: Any = None) -> None:
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
            self.weights.append(finite(e.weight, f"expert {k} weight", self.name))
            d = finite(e.density, f"expert {k} density", self.name)
            if not 0.0 < d <= 1.0:
                raise SpecError(f"{self.name}: expert {k} density {e.density!r} must be in (0, 1]")
            self.densities.append(d)
            g = finite(e.gamma, f"expert {k} gamma", self.name)
            if not 0.0 <= g <= 1.0:
                raise SpecError(f"{self.name}: expert {k} gamma {e.gamma!r} must be in [0, 1]")
            self.gammas.append(g)
        self.experts: tuple[ExpertParams, ...] = experts
        self.normalize = self.normalize_default if normalize is None else bool(normalize)
        self.lam = finite(lam, "lambda", self.name)
        self.t = None if t is None else finite(t, "t", self.name)
        self.weight_sum = weight_sum(self.weights)
        self._pool: dict[str, np.ndarray] = {}
        self._base: np.ndarray | None = None
        self._bflat: np.ndarray | None = None
        self._ctx: TensorContext | None = None
        self._next = 0
        self._skip: np.ndarray | None = None
        self._table: np.ndarray | None = None
        #: method-level options (`core.method_params`: rescale, select_topk, ..., filter_wise, max_iter, ...), by name;
        #: a method that declares `option_defaults` refuses the names it does not declare
        given = dict(options or {})
        unknown = sorted(set(given) - set(self.option_defaults)) if self.option_defaults else []
        if unknown:
            raise SpecError(f"{self.name}: unknown parameter {unknown[0]!r}"
                            + (f"; it takes {', '.join(sorted(self.option_defaults))}" if self.option_defaults else ""))
        self.options: dict[str, Any] = {**self.option_defaults, **given}
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
        b = float32_array(base, f"base tensor {ctx.name!r}")
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
        x.bind(self._base, self._ctx)
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

    def scratch(self, name: str, n: int, dtype: Any = np.float32) -> np.ndarray:
        """A reused 1-D buffer of n elements (contents undefined)."""
        buf = self._pool.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            self._pool.pop(name, None)
            buf = empty_buffer(max(n, 1), dtype)
            self._pool[name] = buf
        return buf[:n]

    def _delta_chunk(self, x: ExpertInput, s: int, e: int) -> np.ndarray:
        """Δ_k[s:e] (flat): a view of the given Δ, or θ_k − θ₀ into scratch."""
        d = x.delta_flat()
        if d is not None:
            return d[s:e]
        theta = x.theta_flat()
        assert theta is not None and self._bflat is not None
        return np.subtract(theta[s:e], self._bflat[s:e], out=self.scratch("delta", e - s))

    def _theta_chunk(self, x: ExpertInput, s: int, e: int) -> np.ndarray:
        """θ_k[s:e] (flat) on selected rows: a view of the given θ, or θ₀ + Δ_k into scratch."""
        theta = x.theta_flat()
        if theta is not None:
            return theta[s:e]
        d = x.delta_flat()
        assert d is not None and self._bflat is not None
        return np.add(self._bflat[s:e], d[s:e], out=self.scratch("theta", e - s))
