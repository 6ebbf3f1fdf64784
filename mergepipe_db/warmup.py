"""Loading the compiled merge kernels ahead of their first use, on a background thread.

Importing numba, setting up its compilation target and loading a first kernel from its on-disk cache take
~1 s (more with a cold page cache). A merge needs them at its first tensor; loaded there, that tensor waits
while the reader, its read-ahead full, leaves the disk idle. Started when a merge begins (`Catalog.merge`,
`Catalog.replay`), or earlier still by the `mergepipe merge` and `replay` commands, before they import the
catalog, the load overlaps imports, planning and catalog work instead. Then pyarrow, which the commit
needs. This module imports nothing heavy itself.
"""

from __future__ import annotations

import contextlib
import threading

_lock = threading.Lock()
_thread: threading.Thread | None = None


def start() -> None:
    """Begin loading the kernels, once per process; a failure is left for the executor to meet."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_load, name="mergepipe-kernels", daemon=True)
            _thread.start()


def _load() -> None:
    with contextlib.suppress(Exception):
        import numpy as np

        from mergepipe_db import merge_kernels

        merge_kernels.narrow_bf16(np.empty(1, np.uint16), np.zeros(1, np.float32))  # as executor._BaseOnly does
    with contextlib.suppress(Exception):
        # the commit's bulk insert into DuckDB goes through Arrow (`db.bulk`): imported here, while the merge
        # runs, not at the commit (0.1-0.5 s, cold)
        import pyarrow  # noqa: F401
