"""Ingest: catalogue a checkpoint once — files, tensors, row blocks, hashes and delta statistics.

Each file is read once, sequentially; a reader thread reads (and sha256-hashes) ahead while the caller's
thread computes xxh3 and delta statistics, so hashing overlaps with I/O. Peak memory is a few blocks.
All rows of one checkpoint are written in a single transaction: a failure leaves the catalog as it was.
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from mergepipe_db import __version__, ranking
from mergepipe_db.blocks import DEFAULT_BLOCK_BYTES, block_byte_range, block_ranges, row_count, rows_per_block
from mergepipe_db.db import schema
from mergepipe_db.db.bulk import bulk_insert
from mergepipe_db.db.engine import Database
from mergepipe_db.errors import (
    BadCheckpointError,
    CoordinateMismatchError,
    DuplicateNameError,
    UnknownCheckpointError,
)
from mergepipe_db.formats.dtypes import ARITHMETIC_DTYPES, DTYPE_BITS
from mergepipe_db.formats.hf_layout import CheckpointLayout, resolve_checkpoint
from mergepipe_db.storage import RangeReader, xxh3_hex

KINDS = ("full", "delta", "lora", "snapshot")
_READ_AHEAD = 8  # blocks queued between the reader thread and the hashing/statistics thread
_STATS_WORKERS = 2  # blocks whose statistics are computed at once (this machine class has 2 cores)


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


def validate_checkpoint_name(name: str) -> None:
    from mergepipe_db.formats.safetensors import validate_tensor_name

    try:
        validate_tensor_name(name)
    except BadCheckpointError as e:
        raise BadCheckpointError(f"invalid checkpoint name {name!r}: {e}") from e


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def load_base(conn: sa.Connection, name: str) -> tuple[dict[str, Any], dict[str, BaseTensor]]:
    """The base checkpoint row and its tensors by name (with block hashes), or UnknownCheckpointError."""
    c = schema.checkpoint
    row = conn.execute(sa.select(c).where(c.c.name == name)).mappings().first()
    if row is None:
        raise UnknownCheckpointError(f"unknown base checkpoint {name!r}; ingest it first (mergepipe ingest)")
    if row["kind"] not in ("full", "snapshot"):
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


def check_coordinates(layout: CheckpointLayout, base: dict[str, BaseTensor], *, what: str) -> None:
    """Raise CoordinateMismatchError listing the first differences between an expert and its base."""
    mine = {t.name: t for h in layout.files for t in h.tensors}
    problems: list[str] = []
    for name in sorted(set(base) - set(mine)):
        problems.append(f"missing tensor {name!r}")
    for name in sorted(set(mine) - set(base)):
        problems.append(f"extra tensor {name!r}")
    for name in sorted(set(mine) & set(base)):
        a, b = mine[name], base[name]
        if tuple(a.shape) != b.shape:
            problems.append(f"{name!r} shape {list(a.shape)} != base {list(b.shape)}")
        elif a.dtype != b.dtype:
            problems.append(f"{name!r} dtype {a.dtype} != base {b.dtype}")
    if problems:
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CoordinateMismatchError(f"{what} does not share the base's coordinates: {'; '.join(problems[:5])}{more}")


# --- reading ---------------------------------------------------------------------------------------


@dataclass
class _Chunk:
    file_idx: int
    tensor_name: str
    block_idx: int
    data: bytearray
    base: bytearray | None


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


def _reader(layout, plan, base, out: queue.Queue, sha: list[str], stop: threading.Event) -> None:
    """Reader thread: sequential reads of every file (sha256 while reading), plus base blocks."""
    try:
        base_reader = RangeReader(random=False)
        current = -1
        fh = None
        hasher = None
        for fi, entry, _rpb, ranges in plan:
            if stop.is_set():
                return
            if fi != current:
                if fh is not None:
                    rest = fh.read()
                    hasher.update(rest)
                    fh.close()
                    sha.append(hasher.hexdigest())
                current = fi
                header = layout.files[fi]
                fh = open(header.path, "rb", buffering=0)  # noqa: SIM115 - closed explicitly below
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                hasher = hashlib.sha256()
                prefix = _read_exact(fh, header.data_start)
                hasher.update(prefix)
            bits = DTYPE_BITS[entry.dtype]
            for bi, rows in enumerate(ranges):
                rel, length = block_byte_range(entry.shape, bits, rows)
                data = _read_exact(fh, length)
                hasher.update(data)
                bdata = None
                if base is not None and entry.dtype in ARITHMETIC_DTYPES:
                    bt = base[entry.name]
                    bdata = base_reader.read(bt.path, bt.offset + rel, length)
                out.put(_Chunk(fi, entry.name, bi, data, bdata))
        if fh is not None:
            rest = fh.read()
            hasher.update(rest)
            fh.close()
            sha.append(hasher.hexdigest())
        base_reader.close()
        out.put(None)
    except BaseException as e:  # noqa: BLE001 - handed to the consumer thread
        out.put(e)


def _read_exact(fh, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = fh.readinto(view[got:])
        if not k:
            raise BadCheckpointError(f"{fh.name}: file ended early (changed while reading?)")
        got += k
    return buf


def _delta_stats(data: bytearray, base: bytearray | None, dtype: str) -> dict[str, Any]:
    """Statistics of Δ = data − base (base None: data is Δ itself), one fused pass (kernels.delta_stats)."""
    from mergepipe_db import kernels, sketch

    l2, l1, mx, pos, hist = kernels.delta_stats(data, bytes(len(data)) if base is None else base, dtype)
    return {"delta_l2": l2, "delta_l1": l1, "delta_max": mx, "pos_frac": pos, "sketch": sketch.encode(hist)}


def _zero_stats(nbytes: int, dtype: str) -> dict[str, Any]:
    import numpy as np

    from mergepipe_db import sketch

    count = nbytes * 8 // DTYPE_BITS[dtype]
    hist = np.zeros(sketch.NBINS, dtype=np.int64)
    hist[0] = count
    return {"delta_l2": 0.0, "delta_l1": 0.0, "delta_max": 0.0, "pos_frac": 0.0, "sketch": sketch.encode(hist)}


def scan(
    layout: CheckpointLayout,
    *,
    block_bytes: int,
    base: dict[str, BaseTensor] | None,
    progress: bool = False,
    delta: bool = False,
) -> tuple[list[dict], list[dict], list[dict], list[str], int]:
    """Read every file once; return (file rows, tensor rows, block rows, file sha256s, bytes read).

    `delta`: the tensors hold Δ itself (a delta checkpoint): statistics are of the stored values, blocked
    like the base's rows, and no base bytes are read.

    Rows lack `checkpoint_id` (known only once all content is hashed); ids are filled in by the caller.
    """
    import xxhash
    from tqdm import tqdm

    plan = _plan_blocks(layout, block_bytes, base)
    total = sum(h.file_size for h in layout.files)
    q: queue.Queue = queue.Queue(maxsize=_READ_AHEAD)
    sha: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(target=_reader, args=(layout, plan, None if delta else base, q, sha, stop), daemon=True)
    thread.start()
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="ingest", leave=False)
    tensor_rows: list[dict] = []
    block_rows: list[dict] = []
    # Statistics run on a small pool (the kernels release the GIL): a window of blocks in flight.
    pool = ThreadPoolExecutor(max_workers=_STATS_WORKERS)
    pending: collections.deque[tuple[dict[str, Any], Future]] = collections.deque()

    def settle(limit: int) -> None:
        while len(pending) > limit:
            row, fut = pending.popleft()
            row.update(fut.result())

    try:
        for fi, entry, rpb, ranges in plan:
            header = layout.files[fi]
            tx = xxhash.xxh3_128()
            bt = base[entry.name] if base is not None else None
            tensor_blocks: list[dict[str, Any]] = []
            all_equal = True
            for bi, rows in enumerate(ranges):
                item = q.get()
                if isinstance(item, BaseException):
                    raise item
                assert item is not None and item.tensor_name == entry.name and item.block_idx == bi
                tx.update(item.data)
                h = xxh3_hex(item.data)
                rel, length = block_byte_range(entry.shape, DTYPE_BITS[entry.dtype], rows)
                row: dict[str, Any] = {
                    "tensor_idx": len(tensor_rows),
                    "block_idx": bi,
                    "row_start": rows[0],
                    "row_stop": rows[1],
                    "offset": header.absolute_offset(entry) + rel,
                    "nbytes": length,
                    "xxh3": h,
                    "delta_l2": None, "delta_l1": None, "delta_max": None, "pos_frac": None, "sketch": None,
                }
                if bt is not None and entry.dtype in ARITHMETIC_DTYPES:
                    same = not delta and bi < len(bt.block_xxh3) and bt.block_xxh3[bi] == h
                    if same:
                        row.update(_zero_stats(length, entry.dtype))
                    else:
                        pending.append((row, pool.submit(_delta_stats, item.data, item.base, entry.dtype)))
                        settle(_STATS_WORKERS * 2)
                    tensor_blocks.append(row)
                    all_equal &= same or delta
                elif bt is not None:
                    all_equal &= bi < len(bt.block_xxh3) and bt.block_xxh3[bi] == h
                block_rows.append(row)
                bar.update(length)
            settle(0)
            l2sq = math.fsum(r["delta_l2"] ** 2 for r in tensor_blocks)
            all_equal &= all(r["delta_max"] == 0.0 for r in tensor_blocks)
            tensor_rows.append({
                "tensor_idx": len(tensor_rows),
                "name": entry.name,
                "dtype": entry.dtype,
                "shape": json.dumps(list(entry.shape)),
                "file_idx": fi,
                "offset": header.absolute_offset(entry),
                "nbytes": entry.nbytes,
                "n_rows": row_count(entry.shape),
                "rows_per_block": rpb,
                "n_blocks": len(ranges),
                "xxh3": tx.hexdigest(),
                "delta_l2": (l2sq ** 0.5) if bt is not None and entry.dtype in ARITHMETIC_DTYPES else None,
                "equal_to_base": all_equal if bt is not None else None,
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
    file_rows = []
    for fi, header in enumerate(layout.files):
        st = os.stat(header.path)
        file_rows.append({
            "file_idx": fi,
            "relpath": os.path.relpath(header.path, layout.root),
            "path": str(Path(header.path).resolve()),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "sha256": sha[fi],
            "header_len": header.header_len,
        })
    return file_rows, tensor_rows, block_rows, sha, total


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
        st = os.stat(h.path)
        here[str(Path(h.path).resolve())] = (st.st_size, st.st_mtime_ns)
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
    from mergepipe_db import sources

    validate_checkpoint_name(name)
    kind = sources.detect_kind(path, kind, base)  # full | delta | lora (a dir with adapter_config.json)
    if block_bytes is not None and block_bytes < 1:
        raise BadCheckpointError(f"--block-bytes must be a positive number of bytes, got {block_bytes}")
    layout = sources.lora_layout(path) if kind == "lora" else resolve_checkpoint(path)

    base_row: dict[str, Any] | None = None
    base_tensors: dict[str, BaseTensor] | None = None
    with db.connect() as conn:
        existing = _unchanged(conn, name, layout)
        if existing is not None:
            n_blocks = conn.execute(
                sa.select(sa.func.count()).select_from(schema.block).where(
                    schema.block.c.checkpoint_id == existing["id"])
            ).scalar_one()
            return IngestResult(existing["id"], name, existing["kind"], existing["n_tensors"], int(n_blocks),
                                existing["total_bytes"], 0, False)
        if base is not None:
            base_row, base_tensors = load_base(conn, base)
    if base_tensors is not None:
        if kind == "full":
            check_coordinates(layout, base_tensors, what=f"checkpoint {name!r} at {path}")
        else:
            sources.check_coordinates(kind, layout, base_tensors, what=f"{kind} checkpoint {name!r} at {path}")
        bb = int(base_row["block_bytes"])  # experts inherit the base's blocking
    else:
        bb = int(block_bytes or DEFAULT_BLOCK_BYTES)

    file_rows, tensor_rows, block_rows, _sha, bytes_read = (sources.scan_lora if kind == "lora" else scan)(
        layout, block_bytes=bb, base=base_tensors, progress=progress, delta=kind == "delta")
    base_id = base_row["id"] if base_row else None
    cid = checkpoint_id(kind, base_id, bb, tensor_rows)
    file_ids = [hashlib.sha256(f"{cid}/{fr['relpath']}".encode()).hexdigest()[:32] for fr in file_rows]
    for fr, fid in zip(file_rows, file_ids):
        fr["id"], fr["checkpoint_id"] = fid, cid
    for tr in tensor_rows:
        tr["checkpoint_id"] = cid
        tr["file_id"] = file_ids[tr.pop("file_idx")]
    for br in block_rows:
        br["checkpoint_id"] = cid
    total_bytes = sum(t["nbytes"] for t in tensor_rows)

    with db.connect() as conn:
        c = schema.checkpoint
        by_name = conn.execute(sa.select(c.c.id).where(c.c.name == name)).scalar()
        by_id = conn.execute(sa.select(c.c.name).where(c.c.id == cid)).scalar()
        if by_name == cid:
            # Same content; only the files' stamps changed (e.g. touched). Refresh them.
            for fr in file_rows:
                conn.execute(schema.source_file.update().where(schema.source_file.c.id == fr["id"])
                             .values(size=fr["size"], mtime_ns=fr["mtime_ns"], path=fr["path"]))
            return IngestResult(cid, name, kind, len(tensor_rows), len(block_rows), total_bytes, bytes_read, False)
        if by_name is not None:
            raise DuplicateNameError(
                f"name {name!r} is already used by a checkpoint with other content; choose another --name")
        if by_id is not None:
            raise DuplicateNameError(f"this content is already catalogued as {by_id!r}")
        conn.execute(c.insert().values(
            id=cid, name=name, kind=kind, base_id=base_id, root=str(Path(layout.root).resolve()),
            config=json.dumps(layout.config) if layout.config is not None else None,
            block_bytes=bb, n_tensors=len(tensor_rows), total_bytes=total_bytes,
            has_stats=base_id is not None, created_at=now_iso(), tool_version=__version__,
        ))
        bulk_insert(conn, schema.source_file, file_rows)
        bulk_insert(conn, schema.tensor, tensor_rows)
        bulk_insert(conn, schema.block, ranking.in_rank_order(block_rows))
        ranking.write(conn, cid)
    return IngestResult(cid, name, kind, len(tensor_rows), len(block_rows), total_bytes, bytes_read, True)
