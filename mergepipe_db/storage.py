"""Local byte-range storage: the one place where checkpoint bytes are read, and counted.

Budget soundness is checked against these counters: `RangeReader.bytes_read` is incremented where each
`pread` is issued, so realized expert bytes can be compared with the plan (and with /proc/PID/io).
Expert files are opened with POSIX_FADV_RANDOM so the kernel's read-ahead does not pull in omitted blocks.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mergepipe_db.errors import StaleSourceError


@dataclass(frozen=True)
class FileStamp:
    """What ingest recorded about a file, for stale detection."""

    path: str
    size: int
    mtime_ns: int


def check_fresh(stamps: Iterable[FileStamp]) -> None:
    """Raise StaleSourceError for the first file whose size or mtime changed since ingest."""
    for s in stamps:
        try:
            st = os.stat(s.path)
        except FileNotFoundError as e:
            raise StaleSourceError(f"source file {s.path} is gone since it was ingested") from e
        if st.st_size != s.size or st.st_mtime_ns != s.mtime_ns:
            raise StaleSourceError(
                f"source file {s.path} changed since it was ingested (size {s.size} -> {st.st_size}, "
                f"mtime changed: {st.st_mtime_ns != s.mtime_ns}); re-ingest it or restore it"
            )


class RangeReader:
    """Reads byte ranges from files with `os.preadv`, counting every byte it asks the kernel for.

    Thread-safe: one fd per path, shared; counters guarded by a lock. `random=True` advises the kernel
    not to read ahead (expert files); base files are read sequentially and keep read-ahead.
    """

    def __init__(self, *, random: bool) -> None:
        self._random = random
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                advice = os.POSIX_FADV_RANDOM if self._random else os.POSIX_FADV_SEQUENTIAL
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, advice)
                self._fds[path] = fd
            return fd

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        """Fill `buf` with the bytes at [offset, offset + len(buf)) of `path`."""
        fd = self._fd(path)
        want = len(buf)
        done = 0
        while done < want:
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n == 0:
                raise StaleSourceError(f"source file {path} is shorter than the catalog says (truncated?)")
            done += n
        with self._lock:
            self.bytes_read += want
            self.reads += 1

    def read(self, path: str, offset: int, length: int) -> bytearray:
        buf = bytearray(length)
        self.read_into(path, offset, memoryview(buf))
        return buf

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def xxh3_hex(data: bytes | bytearray | memoryview) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
