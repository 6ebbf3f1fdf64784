"""The expert source interface: what ingest, the planner and the executor ask of one kind of expert.

A kind answers, before anything is catalogued (class-level): whether a path is of this kind (`detect`), how to
open it (`open_layout`), whether it fits a base (`check_coordinates`, the one coordinate check) and how it is
scanned into block statistics (`scans_itself`/`stored_delta`). Once catalogued, an instance per expert of a
plan (built from its `CheckpointInfo`) answers the planner — the reads and read cost of a selection
(`planned`, `cost`) — and the executor: `read` returns a `SourceRead` that states its form, θ bytes in the
stored dtype or Δ in float32. Properties answer what other modules used to ask of a kind string
(`ranked_by_block`, `ties_prunable`, `needs_torch`, `plain_blocks`, `can_be_base`).
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mergepipe_db.core.plan import CheckpointInfo, Read, TensorInfo

THETA = "theta"  # the expert's stored bytes (uint8, the stored dtype's layout), selected rows filled
DELTA = "delta"  # Δ itself, float32 in the base tensor's shape, 0 on rows not read


@dataclass(frozen=True)
class SourceRead:
    """What a source's `read` delivered for one tensor: `data` in the stated `form`, the selected row ranges and
    blocks, the bytes read, and the `BufferPool` buffer behind `data` (None when not pooled)."""

    form: str  # THETA | DELTA
    data: np.ndarray
    rows: list[tuple[int, int]]
    blocks: tuple[int, ...]
    nbytes_read: int
    arr: Any = None

    @property
    def is_delta(self) -> bool:
        return self.form == DELTA


class ExpertSource(ABC):
    """One kind of expert source; an instance reads one catalogued expert (`info`) for a plan."""

    #: the catalog's ``mp_checkpoint.kind`` of this source
    kind: ClassVar[str]
    #: a checkpoint of this kind holds a whole model and can be the base of experts
    can_be_base: ClassVar[bool] = False
    #: how ingest names one in messages ("checkpoint 'x' at ...")
    noun: ClassVar[str] = "checkpoint"
    #: the scan is the source's own (`scan`), not ingest's streaming scan
    scans_itself: ClassVar[bool] = False
    #: the stored values are Δ itself (ingest's streaming scan takes their statistics without the base's bytes)
    stored_delta: ClassVar[bool] = False
    #: its block rows are ranked one block at a time (not so for LoRA factor units)
    ranked_by_block: ClassVar[bool] = True
    #: TIES may prune its blocks from their statistics (the statistics are of the Δ the executor forms)
    ties_prunable: ClassVar[bool] = True
    #: reading it needs torch (LoRA factors)
    needs_torch: ClassVar[bool] = False
    #: its reads are plain blocks of the expert's stored tensor, delivered as θ (executor: base-only blocks)
    plain_blocks: ClassVar[bool] = True
    #: `pack` may store its blocks in the packed block store (then `sources.packed.PackedSource` reads it)
    packable: ClassVar[bool] = False
    #: `planned` may change the ranked reads (their costs or form): the planner counts bytes from its reads
    adjusts_reads: ClassVar[bool] = False

    def __init__(self, info: CheckpointInfo) -> None:
        self.info = info

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.info.name!r})"

    # --- ingest (class-level: nothing is catalogued yet) ------------------------------------------

    @classmethod
    def detect(cls, path: str | Path) -> bool:
        """Whether `path` is recognisably of this kind (ingest's kind detection)."""
        return False

    @classmethod
    def open_layout(cls, path: str | Path) -> Any:
        """The `CheckpointLayout` of `path` (headers, never tensor data)."""
        from mergepipe_db.formats.hf_layout import resolve_checkpoint

        return resolve_checkpoint(path)

    @classmethod
    def check_coordinates(cls, layout: Any, base: dict[str, Any], *, what: str) -> None:
        """Raise CoordinateMismatchError (LoraAdapterError) where `layout` does not fit the base's tensors."""
        raise NotImplementedError

    @classmethod
    def scan(cls, layout: Any, *, block_bytes: int, base: dict[str, Any], progress: bool = False
             ) -> tuple[list[dict], list[dict], list[dict], list[str], int]:
        """The source's own ingest scan (`scans_itself`): (file rows, tensor rows, block rows, sha256s, bytes)."""
        raise NotImplementedError

    # --- planning ---------------------------------------------------------------------------------

    def planned(self, et: TensorInfo, reads: tuple[Read, ...]) -> tuple[Read, ...]:
        """The reads of tensor `et` the plan records for the ranked `reads` (costs in `nbytes`)."""
        return reads

    def cost(self, et: TensorInfo, reads: tuple[Read, ...]) -> int:
        """Bytes reading `reads` of `et` costs: what the executor will count."""
        return sum(r.nbytes for r in self.planned(et, reads))

    # --- execution --------------------------------------------------------------------------------

    def read(self, t: TensorInfo, et: TensorInfo, reads: tuple[Read, ...], base: np.ndarray, reader: Any,
             verify: bool, pool: Any) -> SourceRead:
        """Read the planned units `reads` of expert tensor `et` (base tensor `t`, whose bytes are `base`).

        Every byte goes through `reader` (`RangeReader.read_aligned`/`read`/`read_into`), so realized bytes
        are counted where they are issued; `pool` (a `BufferPool`) may give the buffer."""
        from mergepipe_db.sources.selection import read_selected_into, selected_rows

        buf, n_read, arr = read_selected_into(reader, et, reads, self.info.name, verify, pool)
        blocks, rows = selected_rows(et, reads)
        return SourceRead(THETA, buf, rows, blocks, n_read, arr)

    def delta_tensor(self, t: TensorInfo, et: TensorInfo, reader: Any) -> Any:
        """Δ of the whole tensor in float32 (a torch tensor of the base's shape; export-delta)."""
        import torch

        x = tensor_from_bytes(reader.read(et.path, et.offset, et.nbytes), et.dtype, list(et.shape))
        th0 = tensor_from_bytes(reader.read(t.path, t.offset, t.nbytes), t.dtype, list(t.shape))
        return x.to(torch.float32) - th0.to(torch.float32)


def tensor_from_bytes(buf: bytes | bytearray, dtype: str, shape: list[int]) -> Any:
    """A torch tensor of `dtype` and `shape` over a copy of `buf`."""
    import torch

    from mergepipe_db.core.dtypes import torch_dtype

    if not len(buf):
        return torch.empty(shape, dtype=torch_dtype(dtype))
    return torch.frombuffer(bytearray(buf), dtype=torch_dtype(dtype)).reshape(shape)


def too_many(problems: list[str]) -> str:
    """The first five problems joined, and how many more there are."""
    more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
    return f"{'; '.join(problems[:5])}{more}"
