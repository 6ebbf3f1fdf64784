"""Loading the compiled merge kernels ahead of their first use, on a background thread.

Importing numba, setting up its compilation target and loading a first kernel from its on-disk cache take
~1 s (more with a cold page cache). A merge needs them at its first tensor; loaded there, that tensor waits
while the reader, its read-ahead full, leaves the disk idle. Started when a merge begins (`Catalog.merge`,
`Catalog.replay`), or earlier still by the `mergepipe merge` and `replay` commands, before they import the
catalog, the load overlaps imports, planning and catalog work instead. Then pyarrow, which the commit
needs. This module imports nothing heavy itself.

Where SciPy is installed, numba loads part of it when it sets up its NumPy support (it looks for BLAS:
`scipy.linalg.cython_blas`, 0.15 s warm, ~0.3 s more with a cold page cache). No merge kernel calls BLAS,
so the commands, which own their process, load numba with SciPy hidden (`own_process`).
"""

from __future__ import annotations

import contextlib
import sys
import threading

_lock = threading.Lock()
_thread: threading.Thread | None = None


def start(*, own_process: bool = False) -> None:
    """Begin loading the kernels, once per process; a failure is left for the executor to meet.

    `own_process`: the caller owns the process (the `mergepipe` command), so numba may be loaded without
    SciPy (`import_numba_without_scipy`); a library caller's process keeps numba's usual set-up.
    """
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_load, args=(own_process,), name="mergepipe-kernels", daemon=True)
            _thread.start()


def import_numba_without_scipy() -> bool:
    """Import numba and its NumPy support with SciPy hidden, unless either is imported already.

    numba then records that it has no BLAS, so `np.dot` and `np.linalg` do not compile in this process
    (no mergepipe kernel uses them); SciPy itself stays importable. True if this call imported numba.
    """
    if "numba" in sys.modules or "scipy" in sys.modules:
        return False
    sys.modules["scipy"] = None  # type: ignore[assignment] # makes `import scipy` raise ImportError
    try:
        import numba.np.arraymath  # noqa: F401 - where numba looks for SciPy's BLAS, once
    finally:
        if sys.modules.get("scipy", False) is None:  # still the placeholder: nothing imported SciPy since
            del sys.modules["scipy"]
    return True


def _load(own_process: bool) -> None:
    with contextlib.suppress(Exception):
        import numpy as np

        if own_process:
            import_numba_without_scipy()

        from mergepipe_db.kernels import compile_time

        compile_time.watch()  # before any kernel is loaded: a fresh install compiles them on first use
        from mergepipe_db.kernels import merge as merge_kernels

        merge_kernels.narrow_bf16(np.empty(1, np.uint16), np.zeros(1, np.float32))  # as the base-only path does
    with contextlib.suppress(Exception):
        # the commit's bulk insert into DuckDB goes through Arrow (`db.bulk`): imported here, while the merge
        # runs, not at the commit (0.1-0.5 s, cold)
        import pyarrow  # noqa: F401
