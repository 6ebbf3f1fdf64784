"""Reusable page-aligned buffers for reads and outputs (`BufferPool`)."""

from __future__ import annotations

import threading

import numpy as np

from mergepipe_db.io.local import ALIGN, aligned_empty

#: bytes of free buffers the pool keeps for reuse
_POOL_FREE_BYTES = 512 << 20


class BufferPool:
    """Reusable page-aligned byte buffers: taken for a read or an output tensor, given back when done, so
    a merge does not fault in fresh, kernel-zeroed pages for every tensor (on these VMs a page touched for the first
    time costs more than the read into it). Thread-safe. Memory is bounded by what is in flight (the read-ahead's
    bytes, the inputs an operator holds, the output queue) plus at most `_POOL_FREE_BYTES` of free buffers, not by
    the number of experts.
    """

    def __init__(self, max_free_bytes: int | None = None) -> None:
        self._free: list[np.ndarray] = []
        self._free_bytes = 0
        self._max_free = _POOL_FREE_BYTES if max_free_bytes is None else max_free_bytes
        self._lock = threading.Lock()

    def take(self, file_offset: int, nbytes: int) -> tuple[np.ndarray, int]:
        """(buffer, pos): bytes [file_offset, file_offset + nbytes) of a file go to buffer[pos:pos + nbytes],
        with a page of room on each side for O_DIRECT's whole-page reads (`RangeReader.read_aligned`).

        The smallest free buffer that fits, however much larger: its pages are in memory already, and on
        these VMs a page touched for the first time costs more than the read into it (a 2 GB K = 8 merge made
        2.9 GB of fresh buffers at full budget when only buffers up to twice the size were taken, 2.4 GB now;
        peak RSS the same)."""
        pos = ALIGN + file_offset % ALIGN
        need = pos + nbytes + ALIGN
        with self._lock:
            fits = [i for i, a in enumerate(self._free) if need <= a.shape[0]]
            if fits:
                best = min(fits, key=lambda i: self._free[i].shape[0])
                arr = self._free.pop(best)
                self._free_bytes -= arr.shape[0]
                return arr, pos
        return aligned_empty(need), pos

    def give(self, arr: np.ndarray | None) -> None:
        """Keep `arr` for reuse; beyond `_POOL_FREE_BYTES` kept, the longest unused go (unmapped), so
        buffers of a few large tensors (embeddings) do not stay resident for the rest of the merge."""
        if arr is not None:
            with self._lock:
                self._free.append(arr)
                self._free_bytes += arr.shape[0]
                while self._free_bytes > self._max_free and len(self._free) > 1:
                    self._free_bytes -= self._free.pop(0).shape[0]
