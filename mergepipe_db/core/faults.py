"""Fault injection for crash tests: `MERGEPIPE_FAULT=<point>[:<n>]` kills the process (SIGKILL) the n-th
time (default first) execution reaches `point`. Unset in normal use: a no-op.

Points of a merge, in commit order: planned, tensor_written, shards_written, manifest_written,
catalog_committed, published. Points of an ingest (`INGEST_POINTS`): ingest_scanned (every file read and
hashed, the catalog not yet touched), ingest_rows_written (one checkpoint's rows written, the transaction
still open; reached once per checkpoint the call writes), ingest_committed (the transaction committed).
Point of a distributed merge's worker (`DASK_POINTS`): task_started (a shard task's attempt directory made,
nothing executed yet; `tensor_written` is reached on workers too).
"""

from __future__ import annotations

import os
import signal

ENV = "MERGEPIPE_FAULT"
MERGE_POINTS = ("planned", "tensor_written", "shards_written", "manifest_written", "catalog_committed", "published")
INGEST_POINTS = ("ingest_scanned", "ingest_rows_written", "ingest_committed")
DASK_POINTS = ("task_started",)
POINTS = MERGE_POINTS + INGEST_POINTS + DASK_POINTS
_hits: dict[str, int] = {}


def point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
