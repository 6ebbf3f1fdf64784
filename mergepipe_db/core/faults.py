"""Fault injection for crash tests: `MERGEPIPE_FAULT=<point>[:<n>]` kills the process (SIGKILL) the n-th
time (default first) execution reaches `point`. Points, in commit order: planned, tensor_written,
shards_written, manifest_written, catalog_committed, published. Unset in normal use: a no-op.
"""

from __future__ import annotations

import os
import signal

ENV = "MERGEPIPE_FAULT"
POINTS = ("planned", "tensor_written", "shards_written", "manifest_written", "catalog_committed", "published")
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
