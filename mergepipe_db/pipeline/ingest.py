"""Ingest: catalogue a checkpoint once — files, tensors, row blocks, hashes and delta statistics.

Each file is read once, sequentially (O_DIRECT where the file system allows it, `io.local.SequentialReader`);
a reader thread reads and xxh3-hashes ahead (sha256 on a thread of its own) while the caller's thread hands
blocks to the delta statistics, so hashing overlaps with I/O. Peak memory is a few read pieces.
Experts of one base that list their tensors in the same order are read in lockstep (`ingest_many`,
`scan_group`), so each base block is read once for all of them rather than once per expert, and only if some
expert's block differs from it.
All rows of one call are written in a single transaction: a failure leaves the catalog as it was.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

from mergepipe_db import sources
from mergepipe_db.core import faults
from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES, DTYPE_BITS
from mergepipe_db.core.geometry import DEFAULT_BLOCK_BYTES, block_byte_range, block_ranges, row_count, rows_per_block
from mergepipe_db.core.hashing import xxh3_hex
from mergepipe_db.core.names import validate_checkpoint_name
from mergepipe_db.core.version import __version__
from mergepipe_db.db import schema
from mergepipe_db.db.checkpoints import now_iso, write_checkpoint
from mergepipe_db.db.engine import Database
from mergepipe_db.db.gram import has_tensor_gram, write_tensor_gram
from mergepipe_db.errors import (
    AlreadyCataloguedError,
    BadCheckpointError,
    DuplicateNameError,
    StaleSourceError,
    UnknownCheckpointError,
)
from mergepipe_db.formats.hf_layout import CheckpointLayout
from mergepipe_db.io import is_remote, open_store
from mergepipe_db.io.local import ALIGN, RecyclingPool, SequentialReader, memory_for_cache
from mergepipe_db.kernels import compile_time
from mergepipe_db.kernels.block_stats import zero_block_stats

_READ_AHEAD = 8  # blocks queued between the reader thread and the hashing/statistics thread
_STATS_WORKERS = 2  # blocks whose statistics are computed at once (this machine class has 2 cores)
_BASE_LEAD = 16 << 20  # member bytes read past a base block asked for before it is taken (`_reader`)
_MEMBER_READS = 8 << 20  # bytes per read request of a checkpoint's files, shared among the members read at once
_MIN_PIECE = 1 << 20  # the least bytes per read request, however many members share `_MEMBER_READS`
_BASE_PIECE = 8 << 20  # at most this many bytes per read request of the base (adjacent blocks read together)
_PIECES_KEPT = 12  # read buffers kept for reuse per file stream: about as many as are in flight downstream


@dataclass(frozen=True)
class IngestResult:
    checkpoint_id: str
    name: str
    kind: str
    n_tensors: int
    n_blocks: int
    total_bytes: int
    bytes_read: int
    created: bool  # False when the same content was already catalogued under this name

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class BaseTensor:
    """What ingest of an expert needs to know about the base's copy of a tensor."""

    idx: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    path: str
    offset: int
    rows_per_block: int
    block_xxh3: tuple[str, ...]


def load_base(conn: sa.Connection, name: str) -> tuple[dict[str, Any], dict[str, BaseTensor]]:
    """The base checkpoint row and its tensors by name (with block hashes), or UnknownCheckpointError."""
    c = schema.checkpoint
    row = conn.execute(sa.select(c).where(c.c.name == name)).mappings().first()
    if row is None:
        raise UnknownCheckpointError(f"unknown base checkpoint {name!r}; ingest it first (mergepipe ingest)")
    if not sources.source_class(row["kind"]).can_be_base:
        raise BadCheckpointError(f"base {name!r} is a {row['kind']} checkpoint; a base must be a full model")
    t, f, b = schema.tensor, schema.source_file, schema.block
    trows = conn.execute(
        sa.select(t.c.tensor_idx, t.c.name, t.c.dtype, t.c.shape, t.c.offset, t.c.rows_per_block, f.c.path)
        .join(f, f.c.id == t.c.file_id)
        .where(t.c.checkpoint_id == row["id"])
        .order_by(t.c.tensor_idx)
    ).all()
    hashes: dict[int, list[str]] = {}
    for tidx, _bidx, h in conn.execute(
        sa.select(b.c.tensor_idx, b.c.block_idx, b.c.xxh3)
        .where(b.c.checkpoint_id == row["id"])
        .order_by(b.c.tensor_idx, b.c.block_idx)
    ):
        hashes.setdefault(tidx, []).append(h)
    tensors = {
        r.name: BaseTensor(
            idx=r.tensor_idx,
            name=r.name,
            dtype=r.dtype,
            shape=tuple(json.loads(r.shape)),
            path=r.path,
            offset=r.offset,
            rows_per_block=r.rows_per_block,
            block_xxh3=tuple(hashes.get(r.tensor_idx, [])),
        )
        for r in trows
    }
    return dict(row), tensors


# --- reading ---------------------------------------------------------------------------------------


@dataclass
class _Chunk:
    member: int  # which checkpoint of the scanned group (`scan_group`)
    file_idx: int
    tensor_name: str
    block_idx: int
    data: memoryview | bytearray
    xxh3: str  # of `data`
    base: memoryview | None  # the base's block; None when no member's block differs from it (or no base)


def _plan_blocks(layout: CheckpointLayout, block_bytes: int, base: dict[str, BaseTensor] | None):
    """Per file, the tensors in data order with their row blocks: [(file_idx, entry, rpb, ranges)]."""
    plan = []
    for fi, header in enumerate(layout.files):
        for entry in header.tensors:  # sorted by begin: reading them in order is sequential
            bits = DTYPE_BITS[entry.dtype]
            if base is not None:
                rpb = base[entry.name].rows_per_block
            else:
                rpb = rows_per_block(entry.shape, bits, block_bytes)
            plan.append((fi, entry, rpb, block_ranges(entry.shape, rpb)))
    return plan


def read_order(layout: CheckpointLayout) -> tuple[str, ...]:
    """The tensor names in the order a scan reads them (files in order, each front to back). Experts with the
    same order can be scanned together, sharing each base block they read (`scan_group`)."""
    return tuple(entry.name for header in layout.files for entry in header.tensors)


class _Sha256Thread:
    """sha256 of the files an ingest reads, on a thread of its own: the reader goes on reading while the
    bytes it read are hashed (hashlib releases the GIL), instead of hashing each block before the next read
    (1.5 GB/s, about as fast as these disks read). Updates are applied in the order given, so each file's
    digest is of its bytes in order; the queue is bounded, so a slow hash holds the reader back rather than
    memory growing."""

    _DONE = object()

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=_READ_AHEAD * 2)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mergepipe-sha256", daemon=True)
        self._thread.start()

    def update(self, hasher: Any, data: bytes | bytearray | memoryview) -> None:
        self._q.put((hasher, data))

    def digest_into(self, hasher: Any, out: list[str], idx: int) -> None:
        """Once every update given before is applied: ``out[idx] = hasher.hexdigest()``."""
        self._q.put((hasher, (out, idx)))

    def close(self) -> None:
        """Apply what is queued and stop; re-raises a failure of the thread."""
        if self._thread.is_alive():
            self._q.put(self._DONE)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (item := self._q.get()) is not self._DONE:
            if self._error is not None:
                continue  # keep taking items, so the reader is never left blocked on a full queue
            hasher, what = item
            try:
                if isinstance(what, tuple):
                    out, idx = what
                    out[idx] = hasher.hexdigest()
                else:
                    hasher.update(what)
            except BaseException as e:  # noqa: BLE001 - re-raised by close()
                self._error = e


class _FileStream:
    """One checkpoint's files read front to back (`io.local.SequentialReader`: O_DIRECT where it can), each
    hashed (sha256, on `hashing`'s thread) as it is read; a file no tensor is read from is still read and
    hashed, in turn, so `sha` lines up with `layout.files` (its digests are final once `hashing` is closed).
    What it reads leaves the page cache as it found it: what is read through the cache (where O_DIRECT is
    refused) is dropped behind the reader (`io.local.DropBehind`; `drop_unknown`: drop where the kernel cannot
    tell what was cached)."""

    def __init__(self, layout: CheckpointLayout, hashing: _Sha256Thread, cuts: list[list[int]], *, piece: int,
                 drop_unknown: bool = False) -> None:
        self.layout = layout
        self.sha: list[str] = [""] * len(layout.files)
        self._cuts = cuts  # per file, the sizes of the reads to come: the header, then each block in order
        self._pool = RecyclingPool.for_reads(piece, keep=_PIECES_KEPT)
        self._hashing = hashing
        self._drop_unknown = drop_unknown
        self._opened = 0  # files opened so far; the current one is the last of them while _file is open
        self._file: SequentialReader | None = None
        self._pos = 0  # bytes of the current file read
        self._hasher: Any = None
        self._dropper: Any = None

    def read(self, file_idx: int, n: int) -> memoryview | bytearray:
        while self._opened <= file_idx:
            self._next_file()
        data = self._read(n)
        self._hashing.update(self._hasher, data)
        if self._dropper is not None:
            self._dropper.advance(self._pos)
        return data

    def _read(self, n: int) -> memoryview | bytearray:
        assert self._file is not None
        try:
            data = self._file.read(n)
        except (EOFError, StaleSourceError) as e:
            raise BadCheckpointError(f"{self._file.path}: file ended early (changed while reading?)") from e
        self._pos += n
        return data

    def finish(self) -> list[str]:
        self._end_file()
        while self._opened < len(self.layout.files):
            self._next_file()
            self._end_file()
        return self.sha

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._dropper is not None:
            self._dropper.close()
            self._dropper = None

    def _next_file(self) -> None:
        self._end_file()
        header = self.layout.files[self._opened]
        self._opened += 1
        store = open_store(header.path)
        self._dropper = store.drop_behind(header.path, unknown=self._drop_unknown)  # before anything is read
        self._file = store.sequential_reader(header.path, self._pool,
                                                               cuts=self._cuts[self._opened - 1])
        self._pos = 0
        self._hasher = hashlib.sha256()
        self._hashing.update(self._hasher, self._read(header.data_start))

    def _end_file(self) -> None:
        if self._file is not None:
            self._hashing.update(self._hasher, self._file.read_rest())  # whatever follows the last tensor read
            self.close()
            self._hashing.digest_into(self._hasher, self.sha, self._opened - 1)


def _file_reads(layout: CheckpointLayout, plan) -> list[list[int]]:
    """Per file of `layout`, the sizes of the reads a scan makes of it, in order: the header, then each block of
    its tensors (a file's tensors lie back to back, read in the order of their bytes)."""
    cuts = [[header.data_start] for header in layout.files]
    for fi, entry, _rpb, ranges in plan:
        bits = DTYPE_BITS[entry.dtype]
        cuts[fi].extend(block_byte_range(entry.shape, bits, rows)[1] for rows in ranges)
    return cuts


def _reader(layouts, plans, base, out: queue.Queue, shas: list[list[str]], stop: threading.Event,
            drop_unknown: bool) -> None:
    """Reader thread: every member's files front to back (sha256 on a thread of its own) in lockstep, tensor
    by tensor and block by block, each block with its xxh3; the base block once, handed with that block of
    every member, and only when some member's block differs from it (its xxh3 is not the base's): a block
    equal to the base's has zero Δ, known without the base's bytes. Fine-tunes often leave whole tensors as
    they were (a third of a benchmark expert's bytes), so an expert ingested alone skips that much of its base.

    The base is read without the kernel's read-ahead, which would fetch the skipped ranges too (up to 16 MiB
    past each read here); instead, a base block known to be needed is asked for (`io.local.ReadAhead`) as soon
    as the members' blocks are hashed and taken `_BASE_LEAD` bytes of member data later. Each member's files
    are read in pieces of `_MEMBER_READS` bytes shared among the members (so memory does not grow with their
    number)."""
    hashing = _Sha256Thread()
    piece = max(_MIN_PIECE, _MEMBER_READS // len(layouts) // ALIGN * ALIGN)
    streams = [_FileStream(layout, hashing, _file_reads(layout, plan), piece=piece, drop_unknown=drop_unknown)
               for layout, plan in zip(layouts, plans)]
    base_store = open_store(next(iter(base.values())).path) if base else open_store(".")
    base_reader = base_store.read_ahead(RecyclingPool.for_reads(_BASE_PIECE, keep=_PIECES_KEPT))
    base_drops: dict[str, Any] = {}  # per base file (read in the members' order)
    waiting: collections.deque[tuple[Any, ...]] = collections.deque()  # blocks whose base read is ahead
    waiting_bytes = 0

    def hand_out(limit: int) -> None:
        nonlocal waiting_bytes
        while waiting and waiting_bytes > limit:
            entries, name, bi, bt, rel, length, datas, hashes, need = waiting.popleft()
            waiting_bytes -= length * len(datas)
            bdata = None
            if bt is not None:
                if need:
                    bdata = base_reader.take()
                base_drops[bt.path].advance(bt.offset + rel + length)
            for k, (fi, _e, _r, _g) in enumerate(entries):
                out.put(_Chunk(k, fi, name, bi, datas[k], hashes[k], bdata))

    try:
        for entries in zip(*plans):  # the same tensor in every member (the group shares one read order)
            if stop.is_set():
                return
            _fi, entry, _rpb, ranges = entries[0]
            bits = DTYPE_BITS[entry.dtype]
            bt = base[entry.name] if base is not None and entry.dtype in ARITHMETIC_DTYPES else None
            if bt is not None and bt.path not in base_drops:  # before its first read: what it finds cached stays
                base_drops[bt.path] = open_store(bt.path).drop_behind(bt.path, unknown=drop_unknown)
            for bi, rows in enumerate(ranges):
                rel, length = block_byte_range(entry.shape, bits, rows)
                datas = [streams[k].read(fi, length) for k, (fi, _e, _r, _g) in enumerate(entries)]
                hashes = [xxh3_hex(data) for data in datas]
                need = False
                if bt is not None:
                    base_hash = bt.block_xxh3[bi] if bi < len(bt.block_xxh3) else None
                    need = any(h != base_hash for h in hashes)
                    if need:
                        base_reader.ask(bt.path, bt.offset + rel, length)
                waiting.append((entries, entry.name, bi, bt, rel, length, datas, hashes, need))
                waiting_bytes += length * len(datas)
                hand_out(_BASE_LEAD)
        hand_out(-1)
        finished = [stream.finish() for stream in streams]
        hashing.close()  # every digest written
        shas.extend(finished)
        out.put(None)
    except BaseException as e:  # noqa: BLE001 - handed to the consumer thread
        out.put(e)
    finally:
        with contextlib.suppress(BaseException):
            hashing.close()
        for stream in streams:
            stream.close()
        for dropper in base_drops.values():
            dropper.close()
        base_reader.close()


ScanResult = tuple[list[dict], list[dict], list[dict], list[str], int]


_GRAM = "_gram"  # a row's inner-product statistics, written to mp_tensor_gram (`_write`), not to its own table


def _expert_block_stats(data: Any, base: Any, dtype: str, start: int) -> dict[str, Any]:
    """A block's catalog statistics (those of `delta_block_stats`) and its inner-product statistics (under
    `_GRAM`), in one fused pass over the bytes in memory (`block_and_gram_stats`)."""
    from mergepipe_db.kernels.gram_stats import block_and_gram_stats

    row, gram = block_and_gram_stats(data, base, dtype, start)
    return {**row, _GRAM: gram}


def _cross_products(changed: list[tuple[int, Any]], base: Any, dtype: str) -> list[tuple[int, int, float]]:
    """⟨Δ_i, Δ_j⟩ of one block for every pair of members (i, j), i < j, whose Δ is not 0 there (`cross_products`:
    float64 sums of float32 Δ products; the tensor's sum is taken in float64 here)."""
    from mergepipe_db.kernels.gram_stats import cross_products

    return cross_products(changed, base, dtype)


def _base_block_square(data: Any, dtype: str) -> dict[str, Any]:
    from mergepipe_db.kernels.gram_stats import base_square

    return {_GRAM: base_square(data, dtype)}


def _tensor_gram(rows: list[dict[str, Any]], delta: bool) -> dict[str, Any]:
    """A tensor's inner-product statistics from its blocks' (a block equal to the base's contributes 0); a delta
    checkpoint's base was not read, so it has no <θ₀, Δ>."""
    from mergepipe_db.kernels.gram_stats import GRAM_DIM

    parts = [g for g in (r.pop(_GRAM, None) for r in rows) if g is not None]
    proj = np.zeros(GRAM_DIM) if not parts else np.sum([g[2] for g in parts], axis=0)
    return {"base_dot": None if delta else math.fsum(g[0] for g in parts), "delta_sq": math.fsum(g[1] for g in parts),
            "proj": proj}


def scan(
    layout: CheckpointLayout,
    *,
    block_bytes: int,
    base: dict[str, BaseTensor] | None,
    progress: bool = False,
    delta: bool = False,
) -> ScanResult:
    """Read every file once; return (file rows, tensor rows, block rows, file sha256s, bytes read).

    `delta`: the tensors hold Δ itself (a delta checkpoint): statistics are of the stored values, blocked
    like the base's rows, and no base bytes are read.

    Rows lack `checkpoint_id` (known only once all content is hashed); ids are filled in by the caller.
    """
    return scan_group([layout], block_bytes=block_bytes, base=base, progress=progress, delta=delta)[0]


def scan_group(
    layouts: list[CheckpointLayout],
    *,
    block_bytes: int,
    base: dict[str, BaseTensor] | None,
    progress: bool = False,
    delta: bool = False,
) -> list[ScanResult]:
    """`scan` of several experts of one base at once, each base block read once for all of them.

    The members must share one `read_order` (and so, with their base, one blocking): they are read in
    lockstep, tensor by tensor, each file still front to back. Memory stays a few blocks, whatever their number.
    """
    import xxhash
    from tqdm import tqdm

    if len(layouts) > 1 and (base is None or len({read_order(layout) for layout in layouts}) != 1):
        raise ValueError("scan_group: the members must be experts of one base with one read order")
    plans = [_plan_blocks(layout, block_bytes, base) for layout in layouts]
    total = sum(h.file_size for layout in layouts for h in layout.files)
    base_bytes = 0 if delta or base is None else sum(
        t.nbytes for header in layouts[0].files for t in header.tensors if t.dtype in ARITHMETIC_DTYPES)
    # Read once, these bytes leave the page cache as they are read, unless they were cached before: on these
    # VMs filling the cache costs more than the read (one 2 GB expert, cold: 11.5 s keeping its pages and the
    # base's, 5.0 s dropping them; a cache pushed into reclaim reads ~3x slower still). Where the kernel cannot
    # tell what was cached, only a read of more than half of what the cache can still take is dropped.
    room = memory_for_cache()
    drop_unknown = room is not None and total + base_bytes > room // 2
    q: queue.Queue = queue.Queue(maxsize=_READ_AHEAD)
    shas: list[list[str]] = []
    stop = threading.Event()
    thread = threading.Thread(target=_reader, args=(layouts, plans, None if delta else base, q, shas, stop,
                                                    drop_unknown), daemon=True)
    thread.start()
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="ingest", leave=False)
    tensor_rows: list[list[dict]] = [[] for _ in layouts]
    block_rows: list[list[dict]] = [[] for _ in layouts]
    # Statistics run on a small pool (the kernels release the GIL): a window of blocks in flight.
    pool = ThreadPoolExecutor(max_workers=_STATS_WORKERS)
    pending: collections.deque[tuple[dict[str, Any], Future]] = collections.deque()

    def settle(limit: int) -> None:
        while len(pending) > limit:
            row, fut = pending.popleft()
            row.update(fut.result())

    try:
        for entries in zip(*plans):
            _fi, entry, rpb, ranges = entries[0]
            bt = base[entry.name] if base is not None else None
            arithmetic = bt is not None and entry.dtype in ARITHMETIC_DTYPES
            hashers = [xxhash.xxh3_128() for _ in layouts]
            stat_rows: list[list[dict[str, Any]]] = [[] for _ in layouts]  # blocks with delta statistics
            own_rows: list[list[dict[str, Any]]] = [[] for _ in layouts]  # a base's blocks (||θ||², gram_stats)
            original = base is None and not delta and entry.dtype in ARITHMETIC_DTYPES
            row_numel = math.prod(entry.shape[1:]) if len(entry.shape) >= 2 else 1
            all_equal = [True for _ in layouts]
            crossing = arithmetic and not delta and len(layouts) > 1  # experts read together: exact ⟨Δ_i, Δ_j⟩
            cross: list[Future] = []
            for bi, rows in enumerate(ranges):
                rel, length = block_byte_range(entry.shape, DTYPE_BITS[entry.dtype], rows)
                changed: list[tuple[int, Any]] = []  # (member, block bytes) of the members whose Δ is not 0 here
                block_base = None
                for k, (fi, own, _r, _g) in enumerate(entries):  # `own`: where the tensor lies in member k's files
                    item = q.get()
                    if isinstance(item, BaseException):
                        raise item
                    assert item is not None and (item.member, item.tensor_name, item.block_idx) == (k, entry.name, bi)
                    hashers[k].update(item.data)
                    h = item.xxh3
                    row: dict[str, Any] = {
                        "tensor_idx": len(tensor_rows[k]),
                        "block_idx": bi,
                        "row_start": rows[0],
                        "row_stop": rows[1],
                        "offset": layouts[k].files[fi].absolute_offset(own) + rel,
                        "nbytes": length,
                        "xxh3": h,
                        "delta_l2": None, "delta_l1": None, "delta_max": None, "pos_frac": None, "sketch": None,
                    }
                    same_as_base = bt is not None and bi < len(bt.block_xxh3) and bt.block_xxh3[bi] == h
                    if arithmetic:
                        if same_as_base and not delta:
                            row.update(zero_block_stats(length, entry.dtype))
                        else:
                            assert delta or item.base is not None  # the reader reads the base for such a block
                            pending.append((row, pool.submit(_expert_block_stats, item.data, item.base, entry.dtype,
                                                             rows[0] * row_numel)))
                            settle(_STATS_WORKERS * 2)
                            if crossing:
                                changed.append((k, item.data))
                                block_base = item.base
                        stat_rows[k].append(row)
                        all_equal[k] &= same_as_base or delta
                    elif bt is not None:
                        all_equal[k] &= same_as_base
                    elif original:
                        pending.append((row, pool.submit(_base_block_square, item.data, entry.dtype)))
                        settle(_STATS_WORKERS * 2)
                        own_rows[k].append(row)
                    block_rows[k].append(row)
                    bar.update(length)
                if len(changed) > 1:
                    cross.append(pool.submit(_cross_products, changed, block_base, entry.dtype))
            settle(0)
            cross_sums: dict[tuple[int, int], float] = {}
            for fut in cross:
                for i, j, dot in fut.result():
                    cross_sums[(i, j)] = cross_sums.get((i, j), 0.0) + dot
            for k, (fi, own, _r, _g) in enumerate(entries):
                l2sq = math.fsum(r["delta_l2"] ** 2 for r in stat_rows[k])
                equal = all_equal[k] and all(r["delta_max"] == 0.0 for r in stat_rows[k])
                tensor_rows[k].append({
                    "tensor_idx": len(tensor_rows[k]),
                    "name": entry.name,
                    "dtype": entry.dtype,
                    "shape": json.dumps(list(entry.shape)),
                    "file_idx": fi,
                    "offset": layouts[k].files[fi].absolute_offset(own),
                    "nbytes": entry.nbytes,
                    "n_rows": row_count(entry.shape),
                    "rows_per_block": rpb,
                    "n_blocks": len(ranges),
                    "xxh3": hashers[k].hexdigest(),
                    "delta_l2": (l2sq ** 0.5) if arithmetic else None,
                    "equal_to_base": equal if bt is not None else None,
                    _GRAM: ({**_tensor_gram(stat_rows[k], delta),
                             "cross": {j if i == k else i: v for (i, j), v in cross_sums.items() if k in (i, j)}
                             if crossing else None} if arithmetic
                            else {"base_sq": math.fsum(r.pop(_GRAM) for r in own_rows[k])} if original else None),
                })
        tail = q.get()
        if isinstance(tail, BaseException):
            raise tail
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        stop.set()
        while thread.is_alive():  # unblock the reader if it waits on a full queue
            with contextlib.suppress(queue.Empty):
                q.get(timeout=0.05)
        bar.close()
    results: list[ScanResult] = []
    for k, layout in enumerate(layouts):
        file_rows = []
        for fi, header in enumerate(layout.files):
            size, version = _stamp(header.path)
            file_rows.append({
                "file_idx": fi,
                "relpath": _relpath(header.path, layout.root),
                "path": open_store(header.path).absolute(header.path),
                "size": size,
                "mtime_ns": version,
                "sha256": shas[k][fi],
                "header_len": header.header_len,
            })
        results.append((file_rows, tensor_rows[k], block_rows[k], shas[k], sum(h.file_size for h in layout.files)))
    return results


def _stamp(path: Any) -> tuple[int, int]:
    """(size, version) of a checkpoint file as the catalog records them: the mtime in ns of a local file, the
    ETag's `io.s3.etag_version` of an object."""
    st = open_store(path).stat(path)
    return st.size, int(st.version)


def _relpath(path: Any, root: Any) -> str:
    if is_remote(path):
        return str(path)[len(str(root).rstrip("/")) + 1:]
    return os.path.relpath(path, root)


def checkpoint_id(kind: str, base_id: str | None, block_bytes: int, tensor_rows: list[dict]) -> str:
    """Content-derived id: same tensors (names, dtypes, shapes, bytes), kind, base and blocking → same id."""
    canon = {
        "kind": kind,
        "base": base_id,
        "block_bytes": block_bytes,
        "tensors": [[t["name"], t["dtype"], t["shape"], t["xxh3"]] for t in tensor_rows],
    }
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _unchanged(conn: sa.Connection, name: str, layout: CheckpointLayout) -> dict[str, Any] | None:
    """The existing row when `name` is catalogued from the very same files (same size and mtime)."""
    c, f = schema.checkpoint, schema.source_file
    row = conn.execute(sa.select(c).where(c.c.name == name)).mappings().first()
    if row is None:
        return None
    files = conn.execute(sa.select(f.c.path, f.c.size, f.c.mtime_ns).where(f.c.checkpoint_id == row["id"])).all()
    here = {}
    for h in layout.files:
        here[open_store(h.path).absolute(h.path)] = _stamp(h.path)
    if {p: (s, m) for p, s, m in files} == here:
        return dict(row)
    return None


def ingest(
    db: Database,
    path: str | Path,
    *,
    name: str,
    base: str | None = None,
    block_bytes: int | None = None,
    kind: str = "full",
    progress: bool = False,
) -> IngestResult:
    """Catalogue the checkpoint at `path` as `name` (an expert of `base` when given). Idempotent."""
    return ingest_many(db, [(path, name)], base=base, block_bytes=block_bytes, kind=kind, progress=progress)[0]


@dataclass
class _Pending:
    """A checkpoint of an `ingest_many` call that is not yet catalogued: what its scan needs, then its rows."""

    path: str | Path
    name: str
    kind: str
    layout: CheckpointLayout
    scanned: ScanResult | None = None
    #: the members of its scan group, itself included, in member order (their ⟨Δ_i, Δ_j⟩ are exact)
    group: list[_Pending] | None = None


def ingest_many(
    db: Database,
    items: list[tuple[str | Path, str]],
    *,
    base: str | None = None,
    block_bytes: int | None = None,
    kind: str = "full",
    progress: bool = False,
) -> list[IngestResult]:
    """Catalogue each (path, name) of `items`, experts of `base` when given; results in the same order.

    Full experts that share a read order (`read_order`: the usual case for one family) are scanned together,
    so the base is read once for all of them rather than once each. Every new checkpoint is written in one
    transaction: if any of them fails (a name taken, coordinates that differ, an unreadable file), none is.
    Checkpoints already catalogued from the same files are reported unchanged and not read.
    """
    if block_bytes is not None and block_bytes < 1:
        raise BadCheckpointError(f"--block-bytes must be a positive number of bytes, got {block_bytes}")
    compile_time.watch()  # the block statistics' kernels compile on a fresh install's first ingest: counted
    seen: set[str] = set()
    todo: list[_Pending] = []
    for path, name in items:
        validate_checkpoint_name(name)
        if name in seen:
            raise DuplicateNameError(f"name {name!r} is given to more than one checkpoint")
        seen.add(name)
        k = sources.detect_kind(path, kind, base)  # e.g. a directory with adapter_config.json: lora
        todo.append(_Pending(path, name, k, sources.source_class(k).open_layout(path)))

    results: dict[str, IngestResult] = {}
    base_row: dict[str, Any] | None = None
    base_tensors: dict[str, BaseTensor] | None = None
    with db.connect() as conn:
        for p in todo:
            existing = _unchanged(conn, p.name, p.layout)
            if existing is not None and existing["kind"] == "full" and not has_tensor_gram(conn, existing["id"]):
                existing = None  # catalogued before mp_tensor_gram: scanned again, which adds its statistics
            if existing is not None:
                n_blocks = conn.execute(
                    sa.select(sa.func.count()).select_from(schema.block).where(
                        schema.block.c.checkpoint_id == existing["id"])
                ).scalar_one()
                results[p.name] = IngestResult(existing["id"], p.name, existing["kind"], existing["n_tensors"],
                                               int(n_blocks), existing["total_bytes"], 0, False)
        todo = [p for p in todo if p.name not in results]
        if base is not None and todo:
            base_row, base_tensors = load_base(conn, base)
    if base_row is not None and base_tensors is not None:
        for p in todo:
            src = sources.source_class(p.kind)
            src.check_coordinates(p.layout, base_tensors, what=f"{src.noun} {p.name!r} at {p.path}")
        bb = int(base_row["block_bytes"])  # experts inherit the base's blocking
    else:
        bb = int(block_bytes or DEFAULT_BLOCK_BYTES)

    groups: dict[tuple[str, ...], list[_Pending]] = {}  # θ experts by read order: one scan each group
    for p in todo:
        src = sources.source_class(p.kind)
        if src.scans_itself:  # LoRA: ΔW formed from its factors
            assert base_tensors is not None
            p.scanned = src.scan(p.layout, block_bytes=bb, base=base_tensors, progress=progress)
        elif src.stored_delta or base_tensors is None:
            p.scanned = scan(p.layout, block_bytes=bb, base=base_tensors, progress=progress, delta=src.stored_delta)
        else:
            groups.setdefault(read_order(p.layout), []).append(p)
    for members in groups.values():
        scanned = scan_group([p.layout for p in members], block_bytes=bb, base=base_tensors, progress=progress)
        for p, result in zip(members, scanned):
            p.scanned = result
            p.group = members

    if todo:
        faults.point("ingest_scanned")
        with db.connect() as conn:
            for p in todo:
                results[p.name] = _write(conn, p, base_id=base_row["id"] if base_row else None, block_bytes=bb)
                faults.point("ingest_rows_written")
        faults.point("ingest_committed")
    return [results[name] for _path, name in items]


def _write(conn: sa.Connection, p: _Pending, *, base_id: str | None, block_bytes: int) -> IngestResult:
    """The rows of one scanned checkpoint (`write_checkpoint`), in the caller's transaction (or, for the same
    content under the same name, its files' refreshed stamps)."""
    assert p.scanned is not None
    file_rows, tensor_rows, block_rows, _sha, bytes_read = p.scanned
    cid = checkpoint_id(p.kind, base_id, block_bytes, tensor_rows)
    file_ids = [hashlib.sha256(f"{cid}/{fr['relpath']}".encode()).hexdigest()[:32] for fr in file_rows]
    for fr, fid in zip(file_rows, file_ids):
        fr["id"], fr["checkpoint_id"] = fid, cid
    partner_ids = [None if q.scanned is None else checkpoint_id(q.kind, base_id, block_bytes, q.scanned[1])
                   for q in (p.group or [])]
    grams, crosses = [], []
    for tr in tensor_rows:
        tr["checkpoint_id"] = cid
        tr["file_id"] = file_ids[tr.pop("file_idx")]
        g = tr.pop(_GRAM, None)
        if g is not None:
            grams.append((tr["tensor_idx"], g))
            for j, dot in (g.get("cross") or {}).items():
                crosses.append((tr["tensor_idx"], partner_ids[j], dot))
    for br in block_rows:
        br["checkpoint_id"] = cid
    total_bytes = sum(t["nbytes"] for t in tensor_rows)

    c = schema.checkpoint
    by_name = conn.execute(sa.select(c.c.id).where(c.c.name == p.name)).scalar()
    by_id = conn.execute(sa.select(c.c.name).where(c.c.id == cid)).scalar()
    if by_name == cid:
        # Same content; only the files' stamps changed (e.g. touched). Refresh them.
        for fr in file_rows:
            conn.execute(schema.source_file.update().where(schema.source_file.c.id == fr["id"])
                         .values(size=fr["size"], mtime_ns=fr["mtime_ns"], path=fr["path"]))
        if not has_tensor_gram(conn, cid):  # catalogued before mp_tensor_gram existed
            write_tensor_gram(conn, cid, grams, crosses)
        return IngestResult(cid, p.name, p.kind, len(tensor_rows), len(block_rows), total_bytes, bytes_read, False)
    if by_name is not None:
        raise DuplicateNameError(
            f"name {p.name!r} is already used by a checkpoint with other content; choose another --name")
    if by_id is not None:
        raise AlreadyCataloguedError(f"this content is already catalogued as {by_id!r} (ingest is by content); "
                                     f"use {by_id!r}")
    write_checkpoint(conn, {
        "id": cid, "name": p.name, "kind": p.kind, "base_id": base_id,
        "root": open_store(p.layout.root).absolute(p.layout.root),
        "config": json.dumps(p.layout.config) if p.layout.config is not None else None,
        "block_bytes": block_bytes, "n_tensors": len(tensor_rows), "total_bytes": total_bytes,
        "has_stats": base_id is not None, "created_at": now_iso(), "tool_version": __version__,
    }, file_rows, tensor_rows, block_rows)
    write_tensor_gram(conn, cid, grams, crosses)
    return IngestResult(cid, p.name, p.kind, len(tensor_rows), len(block_rows), total_bytes, bytes_read, True)
