"""How long this process spent compiling kernels: numba compiles a kernel on its first call after an install (or
an edit) and caches it on disk, so the first merge or ingest of a fresh install can spend seconds here that later
runs do not. The commands say so on a terminal after such a run (`note`), so that a slow first run is
not taken for the tool's speed.

`watch` registers a listener for numba's "numba:compile" event, which numba raises only where a kernel was not
in its cache (loads from the cache raise none); nested compilations (a kernel compiling the functions it calls)
count once, as their outermost. This module imports numba only in `watch`, which the kernels' warm-up thread and
the ingest pipeline call once numba is loaded anyway.
"""

from __future__ import annotations

import threading
import time

__all__ = ["compiled", "note", "watch"]

_lock = threading.Lock()
_watching = False
_count = 0
_seconds = 0.0


def watch() -> None:
    """Start counting this process's kernel compilations (once; imports numba)."""
    global _watching
    with _lock:
        if _watching:
            return
        _watching = True
    from numba.core import event

    class _CompileListener(event.Listener):
        def __init__(self) -> None:
            self._local = threading.local()  # numba compiles under one lock, but each thread nests on its own

        def on_start(self, ev: event.Event) -> None:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self._local.t0 = time.perf_counter()
            self._local.depth = depth + 1

        def on_end(self, ev: event.Event) -> None:
            global _count, _seconds
            self._local.depth -= 1
            if self._local.depth == 0:
                with _lock:
                    _count += 1
                    _seconds += time.perf_counter() - self._local.t0

    event.register("numba:compile", _CompileListener())


def compiled() -> tuple[int, float]:
    """(kernels compiled, seconds spent compiling them) since `watch` was first called; (0, 0.0) before."""
    with _lock:
        return _count, _seconds


def note(since: tuple[int, float] = (0, 0.0)) -> str | None:
    """The commands' line for stderr when a second or more went to compiling kernels after `since` (an earlier
    `compiled()`), else None."""
    count, seconds = compiled()
    count, seconds = count - since[0], seconds - since[1]
    if seconds < 1.0:
        return None
    return (f"note: {seconds:.1f} s of this run went to compiling {count} kernel(s) on their first use since "
            f"install; they are cached now, so later runs skip this")
