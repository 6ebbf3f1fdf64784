"""Reads counted at the byte-store boundary, outside the executor's own counters: every read issued through the
local store's range reader (`io.local.RangeReader`) while a `ReadLog` is installed (the `byte_reads` fixture in
conftest.py), attributed to the checkpoints whose files were read, and checked against the plan and the
manifest (`merge_counted`)."""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
from pathlib import Path


class ReadLog:
    """Every read issued through the byte reader's public methods (`io.local.RangeReader.read_aligned`,
    `read_into`, `read`, wrapped at class level: every instance, every thread), as (path, offset, bytes asked
    for). A read made inside another (`read` calls `read_into`) counts once: the outer one."""

    METHODS = {"read_aligned": "n", "read_into": "buf", "read": "length"}

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = threading.local()
        self.calls: list[tuple[str, int, int]] = []

    def clear(self) -> None:
        with self._lock:
            self.calls = []

    def take(self) -> list[tuple[str, int, int]]:
        with self._lock:
            calls, self.calls = self.calls, []
        return calls

    def wrap(self, original, size_arg: str):
        sig = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                a = sig.bind(*args, **kwargs).arguments
                size = a[size_arg]
                n = size if isinstance(size, int) else memoryview(size).nbytes
                with self._lock:
                    self.calls.append((os.path.realpath(a["path"]), int(a["offset"]), int(n)))
            self._depth.n = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted


def catalogued_files(catalog) -> tuple[dict[str, set[str]], dict[tuple[str, int], set[str]]]:
    """Which checkpoints each catalogued file belongs to (by real path), and each packed block's blob in a block
    store ((real path, offset): the checkpoints whose blocks it holds)."""
    _c, rows = catalog.sql("SELECT c.name, f.path FROM mp_file f JOIN mp_checkpoint c ON c.id = f.checkpoint_id")
    owner: dict[str, set[str]] = {}
    for name, path in rows:
        owner.setdefault(os.path.realpath(path), set()).add(name)
    _c, rows = catalog.sql('SELECT c.name, b.store_path, b."offset" FROM mp_packed_block p '
                           "JOIN mp_blob b ON b.hash = p.blob_hash JOIN mp_checkpoint c ON c.id = p.checkpoint_id")
    blobs: dict[tuple[str, int], set[str]] = {}
    for name, path, offset in rows:
        blobs.setdefault((os.path.realpath(path), int(offset)), set()).add(name)
    return owner, blobs


def reads_per_expert(files, calls: list[tuple[str, int, int]], experts: list[str],
                     base_role_bytes: int = 0) -> dict[frozenset, int]:
    """Expert bytes of `calls`, by the files each expert is catalogued with (`catalogued_files`: its files and
    its packed blocks in a block store), keyed by groups of experts: one expert each, unless packed experts
    share a block (one blob in the store, content-addressed), whose reads cannot tell them apart. Reads of the
    base's files are left out, unless the base is also merged as an expert: then what they total beyond
    `base_role_bytes` (its reads as θ₀) is that expert's; a read of any other file fails the test."""
    owner, blobs = files
    merged = set(experts)
    group = {n: frozenset([n]) for n in experts}
    attributed: list[tuple[frozenset, int]] = []
    base_reads = 0
    for path, offset, n in calls:
        names = owner.get(path) or blobs.get((path, offset), set())
        if names == {"base"}:
            base_reads += n
            continue
        mine = names & merged
        assert mine, f"read of {n} bytes at {offset} of {path}, a file no merged expert is catalogued with ({names})"
        if len(mine) > 1:
            joined = frozenset().union(*(group[m] for m in mine))
            for m in joined:
                group[m] = joined
        attributed.append((frozenset(mine), n))
    out: dict[frozenset, int] = {g: 0 for g in group.values()}
    for names, n in attributed:
        out[group[next(iter(names))]] += n
    if "base" in merged:
        out[group["base"]] += base_reads - base_role_bytes
    return out


def merge_counted(catalog, byte_reads: ReadLog, files, spec: dict, out: Path, budget, **kw):
    """Plan, then merge, counting the expert bytes read at the byte store (`byte_reads`; `files`:
    `catalogued_files`): per expert they must equal the plan's bytes for that expert and the manifest's
    realized bytes; the base's reads as θ₀ are not counted. Returns (merge result, plan, manifest)."""
    plan = catalog.plan(spec, budget=budget)
    byte_reads.clear()
    res = catalog.merge(spec, out=out, budget=budget, **kw)
    calls = byte_reads.take()
    manifest = json.loads((out / "manifest.json").read_text())["manifest"]
    assert res.plan_hash == plan.plan_hash, f"budget {budget}: planned twice, two plans"
    names = {e.position: e.checkpoint.name for e in plan.experts}
    # the base merged as an expert too (a model listed twice): its files' reads beyond θ₀'s are that expert's;
    # θ₀'s share is the executor's base counter, so there the split (not the total) is taken from the code
    counted = reads_per_expert(files, calls, list(names.values()), res.base_bytes)
    planned = dict.fromkeys(counted, 0)
    realized = dict.fromkeys(counted, 0)
    for e in plan.experts:
        g = next(g for g in counted if e.checkpoint.name in g)
        planned[g] += e.planned_bytes
        realized[g] += manifest["realized"]["per_expert"][e.position]
    assert counted == planned == realized, (
        f"budget {budget}: expert bytes read at the byte store {counted}, planned {planned}, "
        f"realized (manifest) {realized}")
    assert sum(counted.values()) == plan.planned_bytes == manifest["planned_bytes"] <= plan.budget_bytes
    return res, plan, manifest
