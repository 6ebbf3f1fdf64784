"""Delta checkpoints: the tensors hold Δ itself, in any arithmetic dtype (read upcast to float32); only the
tensors named are covered, every other tensor has Δ = 0 (docs/SEMANTICS.md, "Expert sources")."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES
from mergepipe_db.core.plan import Read, TensorInfo
from mergepipe_db.errors import CoordinateMismatchError
from mergepipe_db.sources.base import DELTA, ExpertSource, SourceRead, tensor_from_bytes, too_many


class DeltaSource(ExpertSource):
    """A delta checkpoint of a base; read as Δ (float32)."""

    kind: ClassVar[str] = "delta"
    noun: ClassVar[str] = "delta checkpoint"
    stored_delta: ClassVar[bool] = True
    plain_blocks: ClassVar[bool] = False

    @classmethod
    def check_coordinates(cls, layout: Any, base: dict[str, Any], *, what: str) -> None:
        """Every tensor names a base tensor of the same shape, in an arithmetic dtype (may differ from the base's)."""
        problems: list[str] = []
        n = 0
        for h in layout.files:
            for t in h.tensors:
                n += 1
                b = base.get(t.name)
                if b is None:
                    problems.append(f"tensor {t.name!r} is not in the base")
                elif tuple(t.shape) != b.shape:
                    problems.append(f"{t.name!r} shape {list(t.shape)} != base {list(b.shape)}")
                elif t.dtype not in ARITHMETIC_DTYPES or b.dtype not in ARITHMETIC_DTYPES:
                    problems.append(f"{t.name!r}: a delta needs arithmetic dtypes (delta {t.dtype}, base {b.dtype})")
        if not n:
            problems.append("it holds no tensors")
        if problems:
            raise CoordinateMismatchError(f"{what} does not fit the base's coordinates: {too_many(problems)}")

    def read(self, t: TensorInfo, et: TensorInfo, reads: tuple[Read, ...], base: np.ndarray, reader: Any,
             verify: bool, pool: Any) -> SourceRead:
        """Δ in float32, base shape, 0 on the rows not read."""
        from mergepipe_db.core.dtypes import numpy_storage_dtype
        from mergepipe_db.sources.selection import read_selected, selected_rows

        buf, n_read = read_selected(reader, et, reads, self.info.name, verify)
        blocks, rows = selected_rows(et, reads)
        raw = buf.view(numpy_storage_dtype(et.dtype)).reshape(t.shape)
        delta = np.zeros(t.shape, dtype=np.float32)
        fill_rows(delta, raw, rows)
        return SourceRead(DELTA, delta, rows, blocks, n_read)

    def delta_tensor(self, t: TensorInfo, et: TensorInfo, reader: Any) -> Any:
        import torch

        x = tensor_from_bytes(reader.read(et.path, et.offset, et.nbytes), et.dtype, list(et.shape))
        return x.to(torch.float32)


def fill_rows(dst: np.ndarray, src: np.ndarray, rows: list[tuple[int, int]]) -> None:
    """dst[rows] = src[rows] as float32 (`src`: stored values, BF16 as uint16 bits)."""
    from mergepipe_db.core.dtypes import as_float32

    if dst.ndim == 0:
        dst[...] = as_float32(src)
        return
    for s, e in rows:
        dst[s:e] = as_float32(src[s:e])
