"""Executor: stream the base in checkpoint order, read only the planned expert byte ranges, merge, write.

Three threads, data flowing one way:
- reader: issues every read (base tensors in order, expert ranges with adjacent blocks coalesced) up to
  `READ_AHEAD_BYTES` ahead of the compute thread (reads overlap compute even while an operator holds a
  tensor's inputs for one fused pass at `finish`); the base tensors are read one tensor ahead on a helper
  thread (`_BaseAhead`), so a base read and the expert ranges are in flight together; with O_DIRECT where the
  file system allows it (`io.local.RangeReader.read_aligned`: no page-cache copy; on these machines buffered
  reads cost more kernel time than the merge's arithmetic), except ranges already whole in the page cache,
  which are copied from it. Realized expert bytes are counted where the reads are issued and must equal the
  plan's bytes (budget soundness).
- compute (the caller's thread): per tensor, the base in float32 and each expert's stored bytes read in place
  by the operator's fused kernels (`operators`, `kernels.merge`); the result cast to the output dtype.
- output (`_OutputWriter`): writes each tensor into its shard (O_DIRECT, sha256 while writing, fsync per
  shard); its helper thread hashes each written tensor and computes its block rows for the catalog (delta
  statistics against the base: `kernels.block_stats`, as at ingest).
Items are one tensor of one checkpoint, so memory is a few tensors whatever the number of experts; their
buffers come from a `BufferPool` and go back once used, so no fresh, zero-filled pages are faulted in per
tensor (on these VMs a page touched for the first time costs more than the read into it). Arrays are numpy
(BF16 as uint16 bits); torch is imported only for what needs it (DARE's masks, slerp, LoRA factors, F16
output), and then runs with one intra-op thread (`MERGEPIPE_COMPUTE_THREADS`
overrides): on a 2-core machine the other core serves the reader and the output thread.
The numba kernels whose work splits into independent parts (DARE's per-block generators, DELLA's per-row ranks,
and the large-array passes: DARE/DELLA's masks with their exact L1 sums, the masked folds and TIES sums,
breadcrumbs' radix histograms, nearswap; `kernels.merge` ``*_par``) run on numba's threads (`NUMBA_NUM_THREADS`,
default every core) in a fixed number of chunks whose integer sums and counts are combined in chunk order, so
their bits do not depend on how many threads there are.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES, DTYPE_BITS
from mergepipe_db.core.geometry import block_ranges, rows_per_block
from mergepipe_db.core.hashing import xxh3_hex, xxh3_stream
from mergepipe_db.core.plan import Plan, TensorInfo
from mergepipe_db.core.results import ExecutionResult, OutTensor
from mergepipe_db.errors import OutOfSpaceError, PlanExecutionMismatchError
from mergepipe_db.io import open_store, range_reader
from mergepipe_db.io.buffers import BufferPool
from mergepipe_db.io.heap import retained_heap
from mergepipe_db.pipeline import base_reuse

DEFAULT_SHARD_BYTES = 4 << 30
#: how far the reader may run ahead of the compute thread: bytes of items read and not yet taken (an item
#: larger than this is still read once nothing else is waiting), and items
READ_AHEAD_BYTES = 256 << 20
_READ_AHEAD_ITEMS = 64


def output_layout(plan: Plan, shard_bytes: int) -> tuple[list[OutTensor], list[str]]:
    """Output tensors (base order) assigned to shards of at most `shard_bytes` (a bigger tensor stands alone)."""
    out: list[OutTensor] = []
    shard, used = 0, 0
    for t in plan.base_tensors:
        dtype = plan.out_dtype if (plan.out_dtype and t.dtype in ARITHMETIC_DTYPES) else t.dtype
        nbytes = _nbytes(t.shape, dtype)
        if used and used + nbytes > shard_bytes:
            shard, used = shard + 1, 0
        out.append(OutTensor(t.idx, t.name, dtype, t.shape, nbytes, shard))
        used += nbytes
    n = shard + 1
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return out, names


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * DTYPE_BITS[dtype] // 8


@dataclass
class ReadItem:
    kind: str  # "base" | "expert"
    tensor_idx: int
    position: int
    data: np.ndarray  # the tensor's bytes, uint8 (experts: only selected ranges filled), or Δ in float32
    rows: list[tuple[int, int]]  # selected row ranges (experts)
    blocks: tuple[int, ...]
    nbytes_read: int
    arr: Any = None  # the BufferPool buffer behind `data`, given back once the item is used
    delta: bool = False  # `data` is Δ (float32), as the expert's source stated (`SourceRead.form`)


class Stopped(Exception):
    """The compute thread stopped the merge: the reader leaves without reading further."""


class ReadQueue:
    """The reader's queue to the compute thread, bounded in the bytes of the items waiting in it as well as
    in their number: the reader can read a whole tensor of every expert ahead while the compute thread runs
    a fused pass, and memory stays bounded whatever the number of experts."""

    def __init__(self, stop: threading.Event, max_bytes: int | None = None, max_items: int | None = None
                 ) -> None:
        self._q: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._stop = stop
        self._max_bytes = READ_AHEAD_BYTES if max_bytes is None else max_bytes
        self._max_items = _READ_AHEAD_ITEMS if max_items is None else max_items
        self._bytes = self._items = 0
        self.full_s = 0.0  # time the reader waited for room (the compute side was behind)

    def put(self, item: Any) -> None:
        """Queue an item (an `ReadItem`, None at the end, or an exception), waiting for room; `Stopped` once
        the merge is stopped."""
        nbytes = _item_bytes(item)
        with self._cv:
            t0 = time.perf_counter()
            while self._items and (self._items >= self._max_items or self._bytes + nbytes > self._max_bytes):
                if self._stop.is_set():
                    raise Stopped
                self._cv.wait(0.05)
            self.full_s += time.perf_counter() - t0
            self._items += 1
            self._bytes += nbytes
        self._q.put((item, nbytes))

    def get(self, timeout: float | None = None) -> Any:
        """The next item (`queue.Empty` after `timeout` seconds); its bytes leave the read-ahead."""
        item, nbytes = self._q.get(timeout=timeout)
        with self._cv:
            self._items -= 1
            self._bytes -= nbytes
            self._cv.notify()
        return item


def _item_bytes(item: Any) -> int:
    return item.data.nbytes if isinstance(item, ReadItem) else 0


class _BaseAhead(threading.Thread):
    """Reads the base tensors in checkpoint order on its own thread, at most one tensor ahead of the one the
    reader thread takes (`next`): the base's sequential stream and the expert ranges are then in flight at
    once, two requests queued on the disk instead of one. Measured on a 2-core VM, cold: the read pattern of a
    budget-0.1 merge alone takes 15–30 % less time; whole merges (CPU-bound in part) 0–7 % less. Memory: two
    base tensors more at most. A source tensor that later tensors copy too (passthrough reusing a layer) is
    read once: its bytes are kept until its last use, within `base_reuse.keep_bytes()`. Stops when `stop` is
    set."""

    def __init__(self, tensors: list[TensorInfo], pool: BufferPool, stop: threading.Event) -> None:
        super().__init__(name="mergepipe-base", daemon=True)
        self._tensors, self._pool, self._halt = tensors, pool, stop
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self.reader = range_reader(random=False)  # per path, the reader of the store holding it

    def run(self) -> None:
        uses = base_reuse.reuse_schedule(self._tensors, base_reuse.keep_bytes())
        kept: dict[tuple[str, int, int], np.ndarray] = {}  # a source tensor θ₀ of a later tensor too: its bytes
        try:
            for t, use in zip(self._tensors, uses):
                if self._halt.is_set():
                    return
                arr, pos = self._pool.take(t.offset, t.nbytes)
                if use.from_kept:  # read once per merge (`base_reuse`)
                    key = base_reuse.source_key(t)
                    np.copyto(arr[pos:pos + t.nbytes], kept.pop(key) if use.last else kept[key])
                elif t.nbytes:
                    self.reader.read_aligned(t.path, t.offset, arr, pos, t.nbytes)
                    if use.keep:
                        kept[base_reuse.source_key(t)] = arr[pos:pos + t.nbytes].copy()
                self._put((arr, pos))
        except BaseException as e:  # noqa: BLE001 - re-raised by `next` in the reader thread
            self._put(e)
        finally:
            self.reader.close()

    def _put(self, item: Any) -> None:
        while not self._halt.is_set():
            with contextlib.suppress(queue.Full):
                self._q.put(item, timeout=0.05)
                return

    def next(self) -> tuple[np.ndarray, int]:
        """The next base tensor's (buffer, pos), as `BufferPool.take` gave them; `Stopped` once stopped."""
        while True:
            try:
                item = self._q.get(timeout=0.05)
            except queue.Empty:
                if self._halt.is_set():
                    raise Stopped from None
                if not self.is_alive() and self._q.empty():
                    raise RuntimeError("the base reader stopped early") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item


def _reader_thread(plan: Plan, q: ReadQueue, stop: threading.Event, counters: dict[str, int],
                   verify: bool, pool: BufferPool) -> None:
    base_ahead = _BaseAhead(plan.base_tensors, pool, stop)
    expert_reader = range_reader(random=True)
    base_ahead.start()
    try:
        for t in plan.base_tensors:
            if stop.is_set():
                return
            arr, pos = base_ahead.next()
            base = arr[pos:pos + t.nbytes]
            q.put(ReadItem("base", t.idx, -1, base, [], (), t.nbytes, arr))
            if t.dtype not in ARITHMETIC_DTYPES:
                continue
            for e in plan.experts:
                reads = plan.access.get((e.position, t.idx))
                if not reads:
                    continue
                got = plan.sources[e.position].read(t, e.tensors[t.name], reads, base, expert_reader, verify, pool)
                q.put(ReadItem("expert", t.idx, e.position, got.data, got.rows, got.blocks, got.nbytes_read, got.arr,
                            got.is_delta))
        base_ahead.join()
        counters["base"] = base_ahead.reader.bytes_read
        counters["expert"] = expert_reader.bytes_read
        counters["cached"] = base_ahead.reader.bytes_cached + expert_reader.bytes_cached
        q.put(None)
    except Stopped:
        return
    except BaseException as e:  # noqa: BLE001 - re-raised in the compute thread
        with contextlib.suppress(Stopped):
            q.put(e)
    finally:
        expert_reader.close()
        base_ahead.join()  # it has read every base tensor, or the merge is stopped (its error stops it)


def execute(
    plan: Plan,
    staging: Path,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = False,
    verify_reads: bool = False,
    on_tensor: Any = None,
) -> ExecutionResult:
    """Run `plan`, writing output shards into the (existing, empty) `staging` directory."""
    layout = output_layout(plan, shard_bytes)
    return _execute_layout(plan, staging, layout, progress=progress, verify_reads=verify_reads, on_tensor=on_tensor)


def _execute_layout(plan: Plan, staging: Path, layout: tuple[list[OutTensor], list[str]], *, progress: bool,
                    verify_reads: bool, on_tensor: Any) -> ExecutionResult:
    base_reuse.keep_bytes()  # a bad MERGEPIPE_REUSE_BYTES fails here, before anything is read or written
    with retained_heap():  # each tensor's temporaries reuse the pages of the last one's (`io/heap.py`)
        return _execute_threads(plan, staging, layout, progress=progress, verify_reads=verify_reads,
                                on_tensor=on_tensor)


def _execute_threads(plan: Plan, staging: Path, layout: tuple[list[OutTensor], list[str]], *, progress: bool,
                     verify_reads: bool, on_tensor: Any) -> ExecutionResult:
    """`_execute` with torch's thread count set for the merge (`MERGEPIPE_COMPUTE_THREADS`, default 1) and
    restored after it."""
    from mergepipe_db.operators import operator_class

    needs_torch = (operator_class(plan.spec.method).uses_torch or any(s.needs_torch for s in plan.sources)
                   or any(ot.dtype == "F16" for ot in layout[0]))  # `cast_into`
    torch = sys.modules.get("torch")
    if needs_torch and torch is None:
        import torch
    if torch is None:
        return _execute(plan, staging, layout, progress=progress, verify_reads=verify_reads, on_tensor=on_tensor)
    threads = int(os.environ.get("MERGEPIPE_COMPUTE_THREADS", "1") or 1)
    prev_threads = torch.get_num_threads()
    if threads > 0 and threads != prev_threads:
        torch.set_num_threads(threads)
    try:
        return _execute(plan, staging, layout, progress=progress, verify_reads=verify_reads, on_tensor=on_tensor)
    finally:
        if torch.get_num_threads() != prev_threads:
            torch.set_num_threads(prev_threads)


def cast_into(out_bytes: np.ndarray, dtype: str, merged: np.ndarray) -> None:
    """Write float32 `merged` into `out_bytes` (uint8) as safetensors `dtype`, rounding as torch's ``.to``."""
    flat = merged.reshape(-1)
    if dtype == "F32":
        out_bytes.view(np.float32)[:] = flat
        return
    if dtype == "BF16":
        from mergepipe_db.kernels import merge as merge_kernels

        if merge_kernels.narrow_bf16(out_bytes.view(np.uint16), flat):
            return
    import torch  # a NaN into BF16, or F16: torch's own conversion is the definition

    from mergepipe_db.core.dtypes import torch_dtype

    torch.from_numpy(out_bytes).view(torch_dtype(dtype)).copy_(torch.from_numpy(flat))


class BaseOnly:
    """Blocks no expert selected, written from the operator's `base_only_table`: BF16 θ₀ bits to BF16 output
    bits by a lookup, with no widening, folding or rounding there (at a low budget, most of a tensor)."""

    def __init__(self, op: Any) -> None:
        from mergepipe_db.kernels import merge as merge_kernels

        self.table = op.base_only_table()
        self.lut = np.empty(1 << 16, np.uint16)
        self.exceptions = np.empty((0, 2), np.uint16)
        if self.table is not None:
            merge_kernels.narrow_bf16(self.lut, self.table)  # a NaN entry's bits are not used (`cast_into`)
            self.exceptions = merge_kernels.near_identity(self.table, self.lut)

    def skippable(self, plan: Plan, t: TensorInfo) -> np.ndarray | None:
        """The blocks of base tensor `t` that no expert reads (None: none, or an expert whose reads are not
        plain blocks of the base's layout: a delta or LoRA source (`ExpertSource.plain_blocks`), a whole-tensor
        read)."""
        if self.table is None:
            return None
        read = np.zeros(t.n_blocks, np.bool_)
        for e in plan.experts:
            reads = plan.access.get((e.position, t.idx))
            if not reads:
                continue
            if not plan.sources[e.position].plain_blocks or e.tensors[t.name].rows_per_block != t.rows_per_block:
                return None
            for r in reads:
                if r.block_idx < 0:
                    return None
                read[r.block_idx] = True
        return None if read.all() else ~read

    def cast_into(self, out_bytes: np.ndarray, merged: np.ndarray, base_bytes: np.ndarray, bounds: np.ndarray,
                  skip: np.ndarray) -> np.ndarray | None:
        """BF16 output: `merged` rounded on the blocks computed, the table's value of θ₀ on the skipped ones;
        with a NaN in either, the skipped blocks are filled from the table and torch converts (`cast_into`).
        Returns which blocks are θ₀'s bytes unchanged (skipped blocks with no pattern the table moves, such as
        −0 → +0), or None when none is: those are not written into `out_bytes` (`_OutputJob.pieces`)."""
        from mergepipe_db.kernels import merge as merge_kernels

        assert self.table is not None
        flat, base16 = merged.reshape(-1), base_bytes.view(np.uint16)
        unchanged = np.zeros(skip.shape[0], np.bool_)
        if merge_kernels.narrow_bf16_with_table(out_bytes.view(np.uint16), flat, base16, bounds, skip, self.table,
                                                self.lut, self.exceptions, unchanged):
            return unchanged if unchanged.any() else None
        for b in np.flatnonzero(skip).tolist():
            s, e = int(bounds[b]), int(bounds[b + 1])
            flat[s:e] = self.table[base16[s:e]]
        cast_into(out_bytes, "BF16", merged)
        return None


class _F32Pool:
    """Grow-only float32 buffers reused across tensors (no fresh, zero-filled pages per tensor)."""

    def __init__(self) -> None:
        self._bufs: dict[str, Any] = {}

    def convert(self, name: str, src: np.ndarray, ranges: list[tuple[int, int]] | None = None) -> np.ndarray:
        """Stored values `src` (float32, float16, or BF16 as uint16 bits) as float32 in the reused buffer
        `name`, in `src`'s shape (exact: widening loses nothing); with `ranges`, only those flat element
        ranges [start, stop) are converted, the rest is undefined."""
        from mergepipe_db.kernels import merge as merge_kernels
        from mergepipe_db.operators import empty_buffer

        n = src.size
        buf = self._bufs.get(name)
        if buf is None or buf.size < n:
            self._bufs.pop(name, None)
            buf = empty_buffer(max(n, 1), np.float32)
            self._bufs[name] = buf
        out, flat = buf[:n], src.reshape(-1)
        for s, e in ranges if ranges is not None else [(0, n)]:
            if src.dtype == np.uint16:
                merge_kernels.widen_into(out[s:e], flat[s:e])
            else:
                np.copyto(out[s:e], flat[s:e], casting="safe")
        return out.reshape(src.shape)

    def detach(self, name: str) -> None:
        """Hand buffer `name` over to whoever holds it: the next `convert` into `name` makes a new one."""
        self._bufs.pop(name, None)


@dataclass
class _OutputJob:
    ot: OutTensor
    data: np.ndarray  # the output tensor's bytes (uint8)
    base: np.ndarray | None  # the base tensor's bytes when dtypes agree (delta statistics of the output)
    give_back: tuple[np.ndarray | None, ...]  # BufferPool buffers to return once written
    tensor: TensorInfo
    #: per block, whether its output bytes are θ₀'s (`BaseOnly.cast_into`): those are taken from `base`, and
    #: `data` holds only the others; `bounds` are the blocks' byte offsets in the tensor
    unchanged: np.ndarray | None = None
    bounds: np.ndarray | None = None

    def pieces(self) -> Iterator[memoryview]:
        """The output tensor's bytes in order: runs of `unchanged` blocks from θ₀'s buffer, the rest from
        `data`."""
        data = memoryview(self.data)
        if self.unchanged is None or not data.nbytes:  # an empty tensor is one empty piece: it is still written
            yield data
            return
        assert self.base is not None and self.bounds is not None
        base = memoryview(self.base)
        flags, bounds = self.unchanged.tolist(), self.bounds.tolist()
        start = 0
        for b in range(1, len(flags) + 1):
            if b == len(flags) or flags[b] != flags[start]:
                lo, hi = bounds[start], bounds[b]
                if hi > lo:
                    yield (base if flags[start] else data)[lo:hi]
                start = b


#: output tensors written and waiting for (or in) the statistics helper of `_OutputWriter`
_STATS_BACKLOG = 2


class _OutputWriter(threading.Thread):
    """Writes output tensors into their shards in order (sha256 while writing, fsync at each shard's end)
    beside the compute thread, which only hands tensors over. A helper thread hashes each written tensor and
    computes its block rows (`_catalogue`; CPU work, while this thread waits on the disk), in order, at most
    `_STATS_BACKLOG` tensors behind. The first error stops both; `put` and `finish` re-raise it in the caller."""

    def __init__(self, staging: Path, shard_names: list[str], by_shard: dict[int, list[OutTensor]],
                 block_bytes: int, pool: BufferPool, on_tensor: Any) -> None:
        super().__init__(name="mergepipe-output", daemon=True)
        self._q: queue.Queue = queue.Queue(maxsize=2)
        self._staging, self._names, self._by_shard = staging, shard_names, by_shard
        self._bb, self._pool, self._on_tensor = block_bytes, pool, on_tensor
        self.error: BaseException | None = None
        self.tensor_xxh3: list[str] = []
        self.block_rows: list[dict[str, Any]] = []
        self.shard_sha: list[str] = []
        self.busy = 0.0  # this thread's time per tensor (writing; waiting when the statistics fall behind)
        self.stats_busy = 0.0  # the helper's
        self._writer: Any = None
        self._backlog: collections.deque[concurrent.futures.Future] = collections.deque()

    def put(self, job: _OutputJob | None) -> None:
        while True:
            if self.error is not None:
                raise self.error
            try:
                self._q.put(job, timeout=0.05)
                return
            except queue.Full:
                if not self.is_alive():
                    raise RuntimeError("output writer stopped") from self.error

    def finish(self) -> None:
        self.put(None)
        self.join()
        if self.error is not None:
            raise self.error

    def run(self) -> None:
        from mergepipe_db.core import faults
        from mergepipe_db.formats.safetensors import SafetensorsWriter

        current = -1
        stats = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mergepipe-stats")
        try:
            while True:
                job = self._q.get()
                if job is None:
                    break
                t0 = time.perf_counter()
                ot = job.ot
                if ot.shard != current:
                    if self._writer is not None:
                        self.shard_sha.append(self._writer.close(fsync=True))
                        self._writer = None
                    current = ot.shard
                    entries = [(o.name, o.dtype, o.shape) for o in self._by_shard[ot.shard]]
                    self._writer = SafetensorsWriter(self._staging / self._names[ot.shard], entries,
                                                     {"format": "pt"}, exclusive=True, direct=True)
                if job.unchanged is None:
                    self._writer.write(ot.name, memoryview(job.data))
                else:
                    for piece in job.pieces():
                        self._writer.write_part(ot.name, piece)
                self._backlog.append(stats.submit(self._catalogue, job))
                while len(self._backlog) > _STATS_BACKLOG:
                    self._collect(self._backlog.popleft())
                self.busy += time.perf_counter() - t0
                faults.point("tensor_written")
                if self._on_tensor is not None:
                    self._on_tensor(job.tensor)
            t0 = time.perf_counter()
            while self._backlog:
                self._collect(self._backlog.popleft())
            if self._writer is not None:
                self.shard_sha.append(self._writer.close(fsync=True))
                self._writer = None
            self.busy += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - re-raised by put/finish in the compute thread
            self.error = e
            for fut in self._backlog:
                fut.cancel()
            self._backlog.clear()
            if self._writer is not None:
                with contextlib.suppress(Exception):  # already failing: the first error is the one to report
                    self._writer.close(fsync=False)
                self._writer = None
            with contextlib.suppress(queue.Empty):
                while True:
                    self._q.get_nowait()
        finally:
            stats.shutdown(wait=True)

    def _catalogue(self, job: _OutputJob) -> tuple[str, list[dict[str, Any]]]:
        """(xxh3, block rows) of a written output tensor; its buffers go back to the pool."""
        t0 = time.perf_counter()
        data = memoryview(job.data)
        base_view = None if job.base is None else memoryview(job.base)
        tensor_hash = xxh3_stream()
        rows = list(out_block_rows(job.ot, data, self._bb, base_view, job.unchanged, tensor_hash, job.bounds))
        out = tensor_hash.hexdigest(), rows
        del data, base_view
        for arr in job.give_back:
            self._pool.give(arr)
        self.stats_busy += time.perf_counter() - t0
        return out

    def _collect(self, fut: concurrent.futures.Future) -> None:
        xxh3, rows = fut.result()
        self.tensor_xxh3.append(xxh3)
        self.block_rows.extend(rows)


def _execute(
    plan: Plan,
    staging: Path,
    layout: tuple[list[OutTensor], list[str]],
    *,
    progress: bool,
    verify_reads: bool,
    on_tensor: Any,
) -> ExecutionResult:
    from tqdm import tqdm

    from mergepipe_db.core.dtypes import as_float32, numpy_storage_dtype
    from mergepipe_db.operators import (
        ExpertInput,
        ExpertParams,
        TensorContext,
        block_bounds,
        live_ranges,
        make_operator,
        operator_class,
    )

    out_tensors, shard_names = layout  # `output_layout`
    by_shard: dict[int, list[OutTensor]] = {}
    for ot in out_tensors:
        by_shard.setdefault(ot.shard, []).append(ot)
    spec = plan.spec
    params = [ExpertParams(key=e.checkpoint.id, weight=e.weight, density=e.density, gamma=e.gamma,
                           epsilon=m.epsilon) for e, m in zip(plan.experts, spec.models)]
    pool32 = _F32Pool()
    buffers = BufferPool()
    stop = threading.Event()
    q = ReadQueue(stop)
    counters: dict[str, int] = {}
    reader = threading.Thread(target=_reader_thread, args=(plan, q, stop, counters, verify_reads, buffers),
                              daemon=True)
    output = _OutputWriter(staging, shard_names, by_shard, plan.base.block_bytes, buffers, on_tensor)
    timings = {"read_wait": 0.0, "compute": 0.0, "write_wait": 0.0}
    reads: dict[tuple[int, int], int] = {}
    realized = [0] * len(plan.experts)
    held: dict[int, np.ndarray | None] = {}  # expert position -> its buffer, while the operator reads it
    shard_sizes: list[int] = []
    total = sum(t.nbytes for t in plan.base_tensors)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="merge", disable=not progress, leave=False)
    # the reader starts first: its reads overlap the operator's set-up (cold, loading the numba kernels takes
    # ~1 s, before the first tensor)
    reader.start()
    output.start()

    def next_item() -> ReadItem:
        t0 = time.perf_counter()
        item = q.get()
        timings["read_wait"] += time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        return item

    try:
        op: Any = make_operator(spec.method, params, normalize=spec.normalize, lam=spec.lam, t=spec.t,
                                options=spec.options) if plan.tensor_params is None else None
        if op is not None and plan.coefficients:  # a geometric method's coefficients from catalog statistics
            op.use_coefficients(plan.coefficients)
        table = BaseOnly(op) if op is not None and any(ot.dtype == "BF16" for ot in out_tensors) else None
        tensor_ops = _TensorOps(plan) if op is None else None
        # an operator that keeps θ_k past add() (slerp keeps its one expert until finish) gets fresh memory
        op_class = operator_class(spec.method)
        reuse_theta = not op_class.tensor_granular or op_class.copies_inputs
        for t, ot in zip(plan.base_tensors, out_tensors):
            if tensor_ops is not None:  # a config resolved per tensor: this tensor's operator and parameters
                op, params = tensor_ops.get(t.idx)
            base_item = next_item()
            assert base_item.kind == "base" and base_item.tensor_idx == t.idx
            t0 = time.perf_counter()
            out_arr = unchanged = None
            if t.dtype in ARITHMETIC_DTYPES:
                ctx = TensorContext(name=t.name, shape=t.shape, rows_per_block=t.rows_per_block,
                                    n_blocks=t.n_blocks, seed=spec.seed)
                skip = table.skippable(plan, t) if table is not None and t.dtype == ot.dtype == "BF16" else None
                bounds = block_bounds(ctx)
                # the operator does not read θ₀ on skipped blocks: they are left unconverted
                base32 = pool32.convert("base", base_item.data.view(numpy_storage_dtype(t.dtype)).reshape(t.shape),
                                        live_ranges(bounds, skip))
                op.begin(base32, ctx, skip)
                for e in plan.experts:
                    key = (e.position, t.idx)
                    full = plan.full_selection.get(key, True)
                    sketch = plan.sketches.get(key)
                    if key not in plan.access:
                        op.add(ExpertInput(index=e.position, params=params[e.position], selected_blocks=(),
                                           full=full, sketch=sketch, base=base32, theta=None))
                        continue
                    timings["compute"] += time.perf_counter() - t0
                    item = next_item()
                    t0 = time.perf_counter()
                    assert item.kind == "expert" and item.position == e.position and item.tensor_idx == t.idx
                    reads[key] = item.nbytes_read
                    realized[e.position] += item.nbytes_read
                    et = e.tensors[t.name]
                    pooled_theta = False  # θ_k converted into pool32's shared "theta" buffer
                    if item.delta:  # Δ given directly (sources: delta, LoRA)
                        x = ExpertInput(index=e.position, params=params[e.position], selected_blocks=item.blocks,
                                        full=full, sketch=sketch, base=base32, delta=item.data)
                    elif reuse_theta and et.dtype in ("BF16", "F32"):  # read in place by the fused kernels
                        raw = item.data.view(numpy_storage_dtype(et.dtype)).reshape(t.shape)
                        x = ExpertInput.from_raw(e.position, params[e.position], item.blocks, full, sketch,
                                                 base=base32, raw=raw, ctx=ctx)
                    else:  # F16, and every dtype for an operator that keeps θ_k (slerp): θ_k in float32
                        raw = item.data.view(numpy_storage_dtype(et.dtype)).reshape(t.shape)
                        pooled_theta = reuse_theta
                        if len(item.blocks) == t.n_blocks:
                            # a copy: the item's buffer goes back to the pool once add() returns
                            theta = pool32.convert("theta", raw) if reuse_theta else as_float32(raw)
                        else:
                            theta = pool32.convert("theta", base32) if reuse_theta else base32.copy()
                            for start, stop_ in item.rows:
                                theta[start:stop_] = as_float32(raw[start:stop_])
                        x = ExpertInput(index=e.position, params=params[e.position], selected_blocks=item.blocks,
                                        full=full, sketch=sketch, base=base32, theta=theta)
                    op.add(x)
                    del x
                    held[e.position] = item.arr
                    kept = op.held_inputs()  # inputs kept for a fused pass; the others' bytes are done with
                    if e.position in kept and pooled_theta:
                        pool32.detach("theta")  # the kept input holds it: the next expert gets its own
                    for k in [k for k in held if k not in kept]:
                        buffers.give(held.pop(k))
                merged = op.finish()
                for arr in held.values():
                    buffers.give(arr)
                held.clear()
                out_arr, pos = buffers.take(0, ot.nbytes)
                out_bytes = out_arr[pos:pos + ot.nbytes]
                if skip is not None:
                    assert table is not None
                    unchanged = table.cast_into(out_bytes, merged, base_item.data, bounds, skip)
                else:
                    cast_into(out_bytes, ot.dtype, merged)
                del merged, base32
            else:
                out_bytes = base_item.data
            timings["compute"] += time.perf_counter() - t0

            t0 = time.perf_counter()
            same_coords = t.dtype in ARITHMETIC_DTYPES and ot.dtype == t.dtype and (
                plan.recipe is None or plan.recipe.tensors[t.idx].base == (plan.recipe.base, t.name))
            byte_bounds = None
            if unchanged is not None:
                assert same_coords and t.rows_per_block == rows_per_block(ot.shape, DTYPE_BITS[ot.dtype],
                                                                          plan.base.block_bytes)
                byte_bounds = bounds * (DTYPE_BITS[ot.dtype] // 8)
            output.put(_OutputJob(ot, out_bytes, base_item.data if same_coords else None,
                                  (out_arr, base_item.arr), t, unchanged, byte_bounds))
            del base_item
            timings["write_wait"] += time.perf_counter() - t0
            bar.update(t.nbytes)
        t0 = time.perf_counter()
        output.finish()
        timings["write_wait"] += time.perf_counter() - t0
        tail = q.get()
        if isinstance(tail, BaseException):
            raise tail
    except OSError as e:
        import errno

        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutOfSpaceError(f"out of space while writing the output in {staging.parent}: nothing was "
                                  f"published") from e
        raise
    finally:
        stop.set()
        while reader.is_alive():
            with contextlib.suppress(queue.Empty):
                q.get(timeout=0.05)
        if output.is_alive():
            with contextlib.suppress(BaseException):
                output.finish()
        bar.close()
    timings["output"] = output.busy
    timings["output_stats"] = output.stats_busy
    timings["read_ahead_full"] = q.full_s

    for shard in sorted(by_shard):  # a part of the layout (`execute_shards`) writes only its own shards
        path = staging / shard_names[shard]
        shard_sizes.append(open_store(path).stat(path).size)
    offsets, header_lens = _shard_offsets(out_tensors, by_shard)
    if counters.get("expert", -1) != plan.planned_bytes or sum(realized) != plan.planned_bytes:
        raise PlanExecutionMismatchError(
            f"realized expert bytes {counters.get('expert')} != planned {plan.planned_bytes}: "
            f"budget-soundness invariant violated")
    return ExecutionResult(
        shard_names=shard_names, shard_sha256=output.shard_sha, shard_sizes=shard_sizes, out_tensors=out_tensors,
        tensor_xxh3=output.tensor_xxh3, block_rows=output.block_rows, realized_per_expert=realized, reads=reads,
        base_bytes=counters.get("base", 0), output_bytes=sum(shard_sizes), cached_bytes=counters.get("cached", 0),
        timings=timings,
        tensor_offsets=offsets, header_lens=header_lens,
    )


class _TensorOps:
    """The operator and expert parameters of each output tensor of a config resolved per tensor, built from the
    tensor's resolved parameters by name (`operators.by_name`); tensors with equal parameters share one."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._cache: dict[str, tuple[Any, list[Any]]] = {}

    def get(self, idx: int) -> tuple[Any, list[Any]]:
        from mergepipe_db.core.hashing import canonical_json
        from mergepipe_db.operators.by_name import expert_params, operator_from_params

        assert self._plan.tensor_params is not None
        mparams, gparams = self._plan.tensor_params[idx]
        key = canonical_json([mparams, gparams]).decode()
        if key not in self._cache:
            params = [expert_params(e.checkpoint.id, p) for e, p in zip(self._plan.experts, mparams)]
            op = operator_from_params(self._plan.spec.method, params, gparams)
            if self._plan.coefficients:  # a geometric method's coefficients from catalog statistics
                op.use_coefficients(self._plan.coefficients)
            self._cache[key] = (op, params)
        return self._cache[key]


def _shard_offsets(out_tensors: list[OutTensor], by_shard: dict[int, list[OutTensor]]) -> tuple[list[int], list[int]]:
    from mergepipe_db.formats.safetensors import build_header

    absolute: dict[int, int] = {}
    header_lens = []
    for shard in sorted(by_shard):
        prefix, spans = build_header([(o.name, o.dtype, o.shape) for o in by_shard[shard]], {"format": "pt"})
        header_lens.append(len(prefix) - 8)
        for o, (begin, _end) in zip(by_shard[shard], spans):
            absolute[o.idx] = len(prefix) + begin
    return [absolute[o.idx] for o in out_tensors], header_lens


def out_block_rows(ot: OutTensor, data: memoryview, block_bytes: int, base: memoryview | None = None,
                unchanged: np.ndarray | None = None, tensor_hash: Any = None, bounds: np.ndarray | None = None
                ) -> Iterator[dict[str, Any]]:
    """Block rows of an output tensor (offsets relative to the tensor; made absolute at commit).

    With the base's bytes (same dtype), each block also gets its delta statistics against the base, so a
    snapshot can be ranked block by block when it is merged again; blocks equal to the base cost a hash, and
    those `unchanged` marks (θ₀'s bytes, not in `data`: `_OutputJob`) not even a comparison. `tensor_hash`
    (an xxh3_128 stream) is fed the whole tensor, block by block while each is in cache.
    """
    from mergepipe_db.kernels import block_stats

    bits = DTYPE_BITS[ot.dtype]
    rpb = rows_per_block(ot.shape, bits, block_bytes)
    rb = 0 if len(ot.shape) <= 1 else _nbytes(ot.shape[1:], ot.dtype)
    ranges = block_ranges(ot.shape, rpb)
    hashed = 0
    for bi, (start, stop) in enumerate(ranges):
        if len(ot.shape) <= 1:
            lo, hi = 0, ot.nbytes
        else:
            lo, hi = start * rb, stop * rb
        same = unchanged is not None and bool(unchanged[bi])
        if same:  # the executor's blocks are this layout's (`_execute` checks the base's rows per block)
            assert base is not None and bounds is not None and (lo, hi) == (bounds[bi], bounds[bi + 1])
        block = (base if same else data)[lo:hi]
        h = xxh3_hex(block)
        if tensor_hash is not None and lo == hashed:
            tensor_hash.update(block)
            hashed = hi
        row = {"tensor_idx": ot.idx, "block_idx": bi, "row_start": start, "row_stop": stop, "rel": lo,
               "nbytes": hi - lo, "xxh3": h, "rows_per_block": rpb, "delta_l2": None, "delta_l1": None,
               "delta_max": None, "pos_frac": None, "sketch": None}
        if base is not None:
            if same or block_stats.same_bytes(block, base[lo:hi]):
                row.update(block_stats.zero_block_stats(hi - lo, ot.dtype))
            else:
                row.update(block_stats.delta_block_stats(block, base[lo:hi], ot.dtype))
        yield row
    if tensor_hash is not None and hashed != len(data):  # the blocks did not tile the tensor (none, for one)
        tensor_hash.reset()
        tensor_hash.update(data)



# -- a part of a merge, executed elsewhere (`mergepipe_db.distributed`) -----------------------------------------


def restrict_plan(plan: Plan, tensor_idxs: set[int]) -> Plan:
    """The part of `plan` that computes base tensors `tensor_idxs`: the same plan with only their tensors,
    reads, selections and sketches, and `planned_bytes` the bytes of those reads (what its execution must
    realize). Not a plan to hash or record: its `plan_hash` is the whole plan's."""
    import dataclasses

    access = {k: v for k, v in plan.access.items() if k[1] in tensor_idxs}
    return dataclasses.replace(
        plan, base_tensors=[t for t in plan.base_tensors if t.idx in tensor_idxs], access=access,
        full_selection={k: v for k, v in plan.full_selection.items() if k[1] in tensor_idxs},
        sketches={k: v for k, v in plan.sketches.items() if k[1] in tensor_idxs},
        planned_bytes=sum(r.nbytes for reads in access.values() for r in reads))


def execute_shards(plan: Plan, staging: Path, layout: tuple[list[OutTensor], list[str]], shards: list[int], *,
                   verify_reads: bool = False) -> ExecutionResult:
    """Execute the output shards `shards` (ascending indices into `layout`, the whole merge's
    `output_layout`) of `plan` into `staging`, under their final names. Its result covers only those shards
    and their tensors (`realized_per_expert` counts their reads; `tensor_offsets`/`header_lens` are left
    empty): `combine_shard_results` assembles the whole merge's result from the parts."""
    out_tensors, names = layout
    wanted = set(shards)
    part = [ot for ot in out_tensors if ot.shard in wanted]
    sub = restrict_plan(plan, {ot.idx for ot in part})
    res = _execute_layout(sub, staging, (part, names), progress=False, verify_reads=verify_reads, on_tensor=None)
    res.shard_names = [names[i] for i in sorted(wanted)]
    res.tensor_offsets, res.header_lens = [], []
    return res


def combine_shard_results(plan: Plan, layout: tuple[list[OutTensor], list[str]],
                          parts: list[tuple[list[int], ExecutionResult]]) -> ExecutionResult:
    """The whole merge's `ExecutionResult` from the results of `execute_shards` (with the shards each
    covered), every shard of `layout` exactly once; the same result a single `execute` returns. Realized
    expert bytes must equal the plan's per expert (`ExpertPlan.planned_bytes`) and in total, or
    `PlanExecutionMismatchError`."""
    out_tensors, names = layout
    parts = sorted(parts, key=lambda p: p[0][0])
    covered = [s for shards, _ in parts for s in shards]
    if covered != list(range(len(names))):
        raise PlanExecutionMismatchError(f"shard results cover shards {covered}, expected each of "
                                         f"0..{len(names) - 1} once")
    realized = [0] * len(plan.experts)
    sha: list[str] = []
    sizes: list[int] = []
    xxh3: list[str] = []
    rows: list[dict[str, Any]] = []
    reads: dict[tuple[int, int], int] = {}
    base_bytes = cached = 0
    timings: dict[str, float] = {}
    for _shards, r in parts:
        if len(r.realized_per_expert) != len(realized):
            raise PlanExecutionMismatchError("a shard result counts reads for another number of experts")
        realized = [a + b for a, b in zip(realized, r.realized_per_expert)]
        sha += r.shard_sha256
        sizes += r.shard_sizes
        xxh3 += r.tensor_xxh3
        rows += r.block_rows
        reads.update(r.reads)
        base_bytes += r.base_bytes
        cached += r.cached_bytes
        for k, v in r.timings.items():  # summed over the parts: worker time, not wall time
            timings[k] = timings.get(k, 0.0) + v
    planned = [e.planned_bytes for e in plan.experts]
    if realized != planned or sum(realized) != plan.planned_bytes:
        raise PlanExecutionMismatchError(
            f"realized expert bytes per expert {realized} != planned {planned}: budget-soundness invariant "
            f"violated")
    if len(xxh3) != len(out_tensors) or len(sha) != len(names):
        raise PlanExecutionMismatchError("shard results do not cover every output tensor and shard")
    by_shard: dict[int, list[OutTensor]] = {}
    for ot in out_tensors:
        by_shard.setdefault(ot.shard, []).append(ot)
    offsets, header_lens = _shard_offsets(out_tensors, by_shard)
    return ExecutionResult(
        shard_names=names, shard_sha256=sha, shard_sizes=sizes, out_tensors=out_tensors, tensor_xxh3=xxh3,
        block_rows=rows, realized_per_expert=realized, reads=reads, base_bytes=base_bytes,
        output_bytes=sum(sizes), cached_bytes=cached, timings=timings, tensor_offsets=offsets,
        header_lens=header_lens)
