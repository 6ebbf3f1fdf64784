"""Freed memory kept for reuse while a merge runs (`retained_heap`), on glibc.

A merge allocates and frees large temporaries tensor after tensor: numpy's and torch's arrays, and what torch
allocates inside an operation (``torch.topk`` sorts a vector of (value, index) pairs, 16 bytes an element).
glibc serves a request above its mmap threshold (32 MiB at most) with fresh pages from the kernel and gives them
back when it is freed, so the next tensor's temporaries fault in and zero their pages again; on these VMs a page
touched for the first time costs more than reading into it (sce: 5.5 million page faults and 13 s of system
time in a 2 GB merge). Inside `retained_heap` glibc takes every request from its heap and keeps what is freed
(``mallopt``: no mmap, no trimming), so a later tensor reuses pages already faulted in; on leaving, the defaults
come back and ``malloc_trim`` returns the free pages to the kernel. Peak memory is what the merge holds at once,
plus what fragments the heap. Nested and concurrent merges (threads of one process) share one setting, held
until the last leaves. Elsewhere than glibc, or with ``MERGEPIPE_RETAIN_HEAP=0``, it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mergepipe_db.errors import EnvironmentSettingError

__all__ = ["retained_heap"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_DEFAULT_TRIM_THRESHOLD = 128 * 1024
_DEFAULT_MMAP_MAX = 65536
_NEVER_TRIM = (1 << 31) - 1  # mallopt takes an int

_lock = threading.Lock()
_holders = 0
_libc: Any = None
_looked_up = False


def _glibc() -> Any:
    """The C library when it is glibc (it has ``gnu_get_libc_version``), else None."""
    global _libc, _looked_up
    if not _looked_up:
        _looked_up = True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            if all(hasattr(libc, f) for f in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
                libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                libc.malloc_trim.argtypes = [ctypes.c_size_t]
                _libc = libc
        except OSError:
            _libc = None
    return _libc


@contextmanager
def retained_heap() -> Iterator[None]:
    """Within: freed memory stays in the process for reuse (module docstring)."""
    global _holders
    env = os.environ.get("MERGEPIPE_RETAIN_HEAP", "").strip()
    if env not in ("", "0", "1"):
        raise EnvironmentSettingError(f"MERGEPIPE_RETAIN_HEAP={env!r} is not 0 or 1")
    libc = None if env == "0" else _glibc()
    if libc is None:
        yield
        return
    with _lock:
        _holders += 1
        if _holders == 1:
            libc.mallopt(_M_MMAP_MAX, 0)
            libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
                libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
                libc.malloc_trim(0)
