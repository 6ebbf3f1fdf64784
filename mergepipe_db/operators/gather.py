"""`GatherFold`, the template of the methods that need every expert's whole tensor at once (sce, ram, ramplus_tl,
nearswap, arcee_fusion): each expert's Δ_k (or θ_k) is kept, in float32 and the tensor's shape, with Δ_k = 0 on
the rows of omitted blocks, and the method's formula runs once all experts are in. Memory: K + 1 tensors of the
tensor's size (as MergeKit holds them); the K are the rows of one (K, numel) buffer reused between tensors
(`_stacked`), filled straight from the stored values by a numba kernel (or, with ``raw_formula``, the K read
buffers themselves: half that for BF16).

A method with ``raw_formula`` also runs its formula from the experts' stored values (`_combine_raw`): each input
read in place is held, not copied, with a map of the tiles it read (`kernels.gather.map_read_tiles`; in a tile
read in part the elements not read are made θ₀'s, where θ₀ is finite and exact in the stored dtype), and the
method's kernels form Δ_k a tile at a time (`kernels.merge.delta_tile`: +0.0 on a tile not read, whose bytes are
never touched); a float32 copy is gathered at finish only where that path does not apply (an input not held,
stored dtypes that differ, rows compacted unless ``raw_covers_partial``).

A method with ``compacts_rows`` may run its formula on the rows read only under a partial selection: the fold
records which rows any expert read, `_rows_read` gives them (None when the whole tensor must be used) and
`_compact` stacks every expert's values there (an input held in place, or an expert with nothing selected, is
formed on those rows only: no whole tensor of it in float32); the method writes the omitted rows itself (its
formula's value for an all-zero Δ).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import numpy as np

from mergepipe_db.operators.base import MergeOperator, finite
from mergepipe_db.operators.inputs import ExpertInput

__all__ = ["GatherFold", "gather_kernels"]


def gather_kernels():  # noqa: ANN201 - the numba kernels, imported on first use
    """`mergepipe_db.kernels.gather`, imported on first use (numba's import and compilation cost seconds)."""
    from mergepipe_db.kernels import gather

    return gather


class GatherFold(MergeOperator):
    """Keeps each expert's Δ_k (``gather = "delta"``) or θ_k (``"theta"``) and calls ``_combine_all`` at finish.

    An expert with nothing selected has Δ_k = 0 (θ_k = θ₀) everywhere."""

    #: what the formula takes from each expert: "delta" (Δ_k = θ_k - θ₀) or "theta" (θ_k)
    gather: ClassVar[str] = "delta"
    #: options this method takes (name -> default), read from `self.options`
    option_defaults: ClassVar[dict[str, float]] = {}
    #: record the rows read (`_rows_read`, `_compact`): the formula may run on them alone under a partial selection
    compacts_rows: ClassVar[bool] = False
    #: every input is copied into its row of `_stacked` at add(): a tensor-granular method (arcee_fusion) may be
    #: handed inputs read in place, as the others are
    copies_inputs: ClassVar[bool] = True
    #: the formula also runs from the stored values of every expert (`_combine_raw`): inputs read in place are
    #: held instead of gathered
    raw_formula: ClassVar[bool] = False
    #: with ``compacts_rows``: the raw formula over the whole tensor gives, under a partial selection, the bytes
    #: of the formula on the rows read (an elementwise formula whose counts take an unread row as Δ = 0): it runs
    #: there too, instead of every input gathered into float32 and compacted
    raw_covers_partial: ClassVar[bool] = False

    def _validate(self) -> None:
        self.params: dict[str, float] = {}
        for name, default in self.option_defaults.items():
            self.params[name] = finite(self.options.get(name, default), name, self.name)
        self._check()

    def _check(self) -> None:
        """Method-specific checks (SpecError)."""
        return None

    def _begin(self) -> None:
        assert self._ctx is not None
        self._held: list[np.ndarray | None] = []
        #: expert index -> its stored values (flat) and their element ranges read, held for `_combine_raw`
        self._raws: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        #: row k: the tiles of `kernels.merge.RAW_TILE` elements expert k read (`_hold_raw`), made at first use
        self._read_map = np.zeros((0, 0), np.uint8)
        n = self._ctx.numel
        #: every expert's values, row k flat (reused between tensors): the arrays `_combine_all` gets are its rows
        self._stacked = self.scratch("gathered", self.n_experts * n).reshape(self.n_experts, n)
        if self.compacts_rows:
            self._read = np.zeros(self._ctx.n_rows, np.bool_)  # rows some expert read
            self._full = True  # every expert read every block whose Δ may be nonzero

    def _add(self, x: ExpertInput) -> None:
        if self.compacts_rows:
            assert self._ctx is not None
            self._full = self._full and x.full
            for s, e in x.selected_row_ranges(self._ctx):
                self._read[s:e] = True
        if not x.selected_blocks:
            self._held.append(None)
            return
        assert self._ctx is not None and self._bflat is not None
        row = self._stacked[x.index]
        src = x.stored_flat()
        if src is not None and self.raw_formula and self._hold_raw(x.index, src, x.element_ranges_array(self._ctx)):
            self._held.append(row.reshape(self._ctx.shape))  # filled only if the float32 formula runs after all
            return
        if src is not None:  # straight from the stored values, no intermediate θ_k or Δ_k
            kern = gather_kernels()
            fill = kern.gather_delta if self.gather == "delta" else kern.gather_theta
            fill(row, self._bflat, src, x.element_ranges_array(self._ctx))
        else:
            v = x.delta if self.gather == "delta" else x.theta
            assert v is not None
            row[:] = v.reshape(-1)
        self._held.append(row.reshape(self._ctx.shape))

    def _hold_raw(self, k: int, src: np.ndarray, ranges: np.ndarray) -> bool:
        """Hold expert k's stored values `src` (read in place, valid on the element `ranges`) for `_combine_raw`
        and map the tiles it read; False (nothing held: gather it) where a tile read in part cannot be made θ₀'s
        exactly where not read, or the dtype is not the others'."""
        from mergepipe_db.kernels.merge import RAW_TILE

        assert self._bflat is not None
        if any(r.dtype != src.dtype for r, _ in self._raws.values()):
            return False
        if not self._read_map.size:
            n_tiles = -(-self._bflat.size // RAW_TILE)
            self._read_map = self.scratch("read_map", self.n_experts * n_tiles, np.uint8).reshape(-1, n_tiles)
        bits, shift = (src, 16) if src.dtype == np.uint16 else (src.view(np.uint32), 0)
        if not gather_kernels().map_read_tiles(bits, self._bflat, ranges, shift, self._read_map[k]):
            return False
        self._raws[k] = (src, ranges)
        return True

    def held_inputs(self) -> frozenset[int]:
        return frozenset(self._raws)

    def _raw_inputs(self) -> list[np.ndarray] | None:
        """Every expert's stored values for `_combine_raw` (an expert with nothing selected: an empty array, its
        row of the read map all 0), or None where the float32 formula must run: an input not held, rows
        compacted."""
        if not self._raws or len(self._raws) + sum(h is None for h in self._held) != self.n_experts:
            return None
        if self.compacts_rows and not self.raw_covers_partial and self._rows_read() is not None:
            return None
        dtype = next(iter(self._raws.values()))[0].dtype
        out = []
        for k in range(self.n_experts):
            if k not in self._raws:  # nothing selected: Δ_k = 0 on every tile
                self._read_map[k] = 0
                out.append(np.empty(0, dtype))
            else:
                out.append(self._raws[k][0])
        return out

    def _combine_raw(self, base: np.ndarray, raws: list[np.ndarray], read: np.ndarray) -> np.ndarray:
        """`_combine_all` from every expert's stored values (flat, one dtype) and their read map (`read`: row k
        for expert k, `kernels.merge.delta_tile`'s), and θ₀."""
        raise NotImplementedError

    def _finish(self) -> np.ndarray:
        base = self._base
        assert base is not None
        if self._raws:
            raws = self._raw_inputs()
            if raws is not None:
                out = self._combine_raw(base, raws, self._read_map)
                return np.asarray(out, dtype=np.float32).reshape(base.shape)
        # the float32 formula after all. Rows compacted: `_compact` gathers the held inputs and the experts with
        # nothing selected on the rows read only; otherwise they are gathered here, over the whole tensor
        compacted = self.compacts_rows and self._rows_read() is not None
        if self._raws and not compacted:
            fill = self._gatherer()
            for k, (src, ranges) in self._raws.items():
                fill(self._stacked[k], self._bflat, src, ranges)
        vals = []
        for k, v in enumerate(self._held):
            if v is None:
                v = self._stacked[k].reshape(base.shape)
                if not compacted:  # Δ_k = 0, θ_k = θ₀ (compacted: `_compact` forms it on the rows read)
                    v[...] = 0.0 if self.gather == "delta" else base
            vals.append(v)
        return np.asarray(self._combine_all(base, vals), dtype=np.float32).reshape(base.shape)

    def _gatherer(self):  # noqa: ANN202 - a numba kernel
        """The kernel that fills Δ_k (or θ_k) from stored values on element ranges: `gather_delta`/`gather_theta`."""
        kern = gather_kernels()
        return kern.gather_delta if self.gather == "delta" else kern.gather_theta

    def _rows_read(self) -> np.ndarray | None:
        """The rows some expert read, ascending, under a partial selection that left some row unread; None under a
        full selection or when every row was read (the formula then runs on the whole tensor)."""
        if self._full or bool(self._read.all()):
            return None
        return np.flatnonzero(self._read)

    def _compact(self, values: list[np.ndarray], rows: np.ndarray) -> np.ndarray:
        """Every expert's values on `rows`, stacked: float32 (K, len(rows), row size). An input held in place is
        gathered from its stored values on those rows only (its element ranges moved to the compacted rows:
        a range lies in rows some expert read, which are consecutive there too); an expert with nothing
        selected gives Δ_k = 0 (θ_k = θ₀)."""
        n_rows = self._read.shape[0]
        rn = values[0].size // n_rows if values else 0
        out = np.empty((len(values), len(rows), rn), np.float32)
        base_rows = None
        for k, v in enumerate(values):
            if k in self._raws or self._held[k] is None:
                if base_rows is None:
                    assert self._bflat is not None
                    base_rows = np.take(self._bflat.reshape(n_rows, rn), rows, axis=0).reshape(-1)
                if self._held[k] is None:
                    out[k] = 0.0 if self.gather == "delta" else base_rows.reshape(len(rows), rn)
                    continue
                src, ranges = self._raws[k]
                at = np.searchsorted(rows, ranges[:, 0] // rn) * rn + ranges[:, 0] % rn
                moved = np.stack([at, at + (ranges[:, 1] - ranges[:, 0])], axis=1).astype(ranges.dtype)
                src_rows = np.take(src.reshape(n_rows, rn), rows, axis=0).reshape(-1)
                self._gatherer()(out[k].reshape(-1), base_rows, src_rows, moved)
            else:
                np.take(v.reshape(n_rows, -1), rows, axis=0, out=out[k])
        return out

    @abc.abstractmethod
    def _combine_all(self, base: np.ndarray, values: list[np.ndarray]) -> Any:
        """The merged tensor from θ₀ and every expert's Δ_k or θ_k (float32, the tensor's shape). Where the rows
        are compacted (``compacts_rows`` and `_rows_read` not None) the values of an input held in place or of an
        expert with nothing selected are not filled: take every expert's values from `_compact`."""

    def _end(self) -> None:
        self._held = []
        self._raws = {}
        self._read_map = np.zeros((0, 0), np.uint8)
        self._stacked = np.empty((0, 0), np.float32)
