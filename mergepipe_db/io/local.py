"""Local byte-range storage: the one place where checkpoint bytes are read, and counted.

Budget soundness is checked against these counters: `RangeReader.bytes_read` is incremented where each
`pread` is issued, so realized expert bytes can be compared with the plan (and with /proc/PID/io).
Expert files are opened with POSIX_FADV_RANDOM so the kernel's read-ahead does not pull in omitted blocks.
Large reads into page-aligned buffers (`read_aligned`) bypass the page cache with O_DIRECT where the file
system allows it: the device writes straight into the merge's buffer (no kernel copy, no page-cache churn),
reading the range widened to whole 4 KiB pages — the same pages a buffered read touches. A range already
held whole in the page cache (an ingest or another tool read it lately) is copied from there instead: O_DIRECT
would fetch it from the device again. `page_cached` asks the kernel (cachestat, Linux ≥ 6.5); where it cannot
tell, every large read is O_DIRECT. Ingest reads the same way: each file front to back on a thread of its own
(`SequentialReader`) and the base blocks it needs as soon as it knows them (`ReadAhead`), into buffers reused
once nothing refers to them (`RecyclingPool`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import itertools
import os
import queue
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mergepipe_db.core.plan import FileStamp
from mergepipe_db.errors import StaleSourceError


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


ALIGN = 4096  # O_DIRECT granularity: offsets, lengths and buffer addresses in whole pages


#: bytes per read request: on these virtio disks 8 MiB O_DIRECT requests stream ~1.3x faster than 64 MiB ones
_REQUEST = 8 << 20

_CACHESTAT = 451  # the syscall's number, the same on every architecture (Linux 6.5+)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else ALIGN  # the page cache's unit
_cachestat_fn: Any = None  # libc's syscall(), once looked up; False where cachestat is unavailable


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def page_cached(fd: int, offset: int, n: int) -> bool | None:
    """Whether every page of [offset, offset + n) of the file open as `fd` is in the page cache; None where
    the kernel cannot tell (no cachestat: Linux < 6.5, another OS, or a sandbox that forbids the call)."""
    global _cachestat_fn
    if _cachestat_fn is None:
        _cachestat_fn = False
        if sys.platform.startswith("linux") and os.environ.get("MERGEPIPE_NO_PAGE_CACHE_READS") != "1":
            with contextlib.suppress(OSError, AttributeError):
                fn = ctypes.CDLL(None, use_errno=True).syscall
                fn.restype = ctypes.c_long
                _cachestat_fn = fn
    if _cachestat_fn is False or n <= 0:
        return None
    rng, stat = _CachestatRange(offset, n), _Cachestat()
    if _cachestat_fn(_CACHESTAT, ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(stat), ctypes.c_uint(0)):
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # old kernel, or a sandbox: ask no more
            _cachestat_fn = False
        return None
    return stat.nr_cache == (offset + n - 1) // PAGE - offset // PAGE + 1


def memory_for_cache() -> int | None:
    """Bytes the page cache can grow by before the kernel reclaims: MemAvailable, capped by the room left under
    this cgroup's memory limit (cgroup v2) where there is one; None where neither can be read."""
    room: list[int] = []
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                room.append(int(line.split()[1]) * 1024)
                break
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            room.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    return max(min(room), 0) if room else None


def drop_cached(fd: int, offset: int, n: int | None) -> None:
    """Ask the kernel to drop the page cache's copy of [offset, offset + n) of `fd`, or from `offset` to the end
    of the file when `n` is None (the kernel drops the pages wholly inside; a no-op where `posix_fadvise` is
    missing). For data read once whose pages would otherwise crowd the cache."""
    if (n is None or n > 0) and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, 0 if n is None else n, os.POSIX_FADV_DONTNEED)


class DropBehind:
    """Drops the pages of a file read front to back from the page cache, behind the reader, so that the read
    leaves the cache as it found it: each `granule` of the file that was not wholly cached when this object was
    made is dropped once read; one that was stays cached. Where the kernel cannot tell (`page_cached` is
    None), `unknown` decides. Drops happen once the reader is `every` bytes past where the last one ended, the
    rest at `close`; not at each read: pages read a moment ago may still sit in the kernel's per-CPU LRU
    batches, where POSIX_FADV_DONTNEED cannot drop them (dropped block by block, ~95 % of a base's pages
    stayed cached)."""

    def __init__(self, path: str | Path, every: int = 64 << 20, granule: int = 1 << 20, *,
                 unknown: bool = True) -> None:
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._every, self._granule = every, granule
        self._kept = 0  # start of the page holding the first byte read and not yet dropped
        size = os.fstat(self._fd).st_size
        # residency taken before anything is read (read-ahead brings in what follows the reader)
        cached = (page_cached(self._fd, off, min(granule, size - off)) for off in range(0, size, granule))
        self._drop = [unknown if c is None else not c for c in cached]

    def advance(self, pos: int) -> None:
        """The reader has read up to `pos`."""
        if pos - self._kept >= self._every:
            self._drop_range(self._kept, pos)
            self._kept = pos - pos % PAGE  # its page was not wholly read: the next drop takes it

    def _drop_range(self, lo: int, hi: int) -> None:
        """Drop what of [lo, hi) lies in granules to drop, a run of them at a time."""
        g = lo // self._granule
        while lo < hi and g < len(self._drop):
            start = g
            while g < len(self._drop) and self._drop[g] == self._drop[start] and g * self._granule < hi:
                g += 1
            end = min(hi, g * self._granule)
            if self._drop[start]:
                drop_cached(self._fd, lo, end - lo)
            lo = end

    def close(self) -> None:
        """Drop the rest of the file (its granules to drop) and let it go."""
        if self._fd >= 0:
            self._drop_range(self._kept, len(self._drop) * self._granule)
            os.close(self._fd)
            self._fd = -1


def sha256_file(path: str | Path) -> str:
    """sha256 of a whole file, read front to back in 16 MiB pieces, leaving the page cache as it found it
    (`DropBehind`; where the kernel cannot tell what was cached, nothing is dropped): these bytes are read once,
    and on these VMs filling the cache costs more than the read."""
    import hashlib

    h = hashlib.sha256()
    buf = memoryview(bytearray(16 << 20))
    dropper = DropBehind(path, unknown=False)  # residency taken before anything is read
    try:
        with open(path, "rb", buffering=0) as fh:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := fh.readinto(buf):
                h.update(buf[:n])
                dropper.advance(fh.tell())
    finally:
        dropper.close()
    return h.hexdigest()


def aligned_empty(nbytes: int) -> np.ndarray:
    """A zero-initialised-on-touch uint8 array of `nbytes`, page-aligned (an anonymous mapping), freed when
    the last array viewing it goes.

    Plain 4 KiB pages, not transparent huge pages: a read buffer at a low budget is touched only where its
    blocks land, and a huge page zeroes 2 MiB for any touch. Measured on these VMs (linear K = 8 at 0.1 on
    2 GB models, warm, 3 alternating runs): system time 3.6-4.6 s with MADV_HUGEPAGE, 1.9 s without, the
    compute thread 0.8-1.0 s shorter; at full budget 7-8 s against 4.7-5.1 s.
    """
    import mmap

    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(m, dtype=np.uint8, count=nbytes)


class RangeReader:
    """Reads byte ranges from files with `os.preadv`, counting every byte it asks the kernel for.

    Thread-safe: one fd per path, shared; counters guarded by a lock. `random=True` advises the kernel
    not to read ahead (expert files); base files are read sequentially and keep read-ahead. `bytes_read`
    counts the requested bytes (what the plan charges); an O_DIRECT read also fetches the rest of the first
    and last 4 KiB page, exactly as a buffered read pulls in whole pages.
    """

    def __init__(self, *, random: bool) -> None:
        self._random = random
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_cached = 0  # of bytes_read, those `read_aligned` copied from the page cache
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

    def _direct_fd(self, path: str) -> int | None:
        """An O_DIRECT descriptor for `path`, or None where the file system refuses it (tmpfs, ...)."""
        with self._lock:
            if path in self._direct_fds:
                return self._direct_fds[path]
            fd: int | None = None
            flag = getattr(os, "O_DIRECT", 0)
            if flag and os.environ.get("MERGEPIPE_NO_DIRECT_IO") != "1":
                try:
                    fd = os.open(path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
                except OSError:
                    fd = None
            self._direct_fds[path] = fd
            return fd

    def _count(self, path: str, offset: int, n: int) -> None:
        """Charge the request [offset, offset + n) of `path` (the one place reads are counted)."""
        with self._lock:
            self.bytes_read += n
            self.reads += 1

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        """Fill `buf` with the bytes at [offset, offset + len(buf)) of `path`."""
        self._pread_all(self._fd(path), path, offset, buf, len(buf))
        self._count(path, offset, len(buf))

    def _pread_all(self, fd: int, path: str, offset: int, buf: memoryview, need: int) -> None:
        """Read into `buf` from `offset` until at least `need` bytes arrived (a short read past EOF ends it),
        in requests of at most `_REQUEST` bytes."""
        done = 0
        while done < need:
            n = os.preadv(fd, [buf[done:done + _REQUEST]], offset + done)
            if n == 0:
                raise StaleSourceError(f"source file {path} is shorter than the catalog says (truncated?)")
            done += n

    def read_aligned(self, path: str, offset: int, arr: np.ndarray, pos: int, n: int) -> None:
        """Fill ``arr[pos:pos + n]`` with the bytes at [offset, offset + n) of `path`.

        `arr` is page-aligned (`aligned_empty`) with ``pos % ALIGN == offset % ALIGN`` and room for the
        pages around the range; with O_DIRECT the whole pages are read in place, so bytes of `arr` next to
        the range (up to a page on each side) receive the file's neighbouring bytes. Without O_DIRECT (or
        once the file system rejects it) this is a plain buffered read of the range. The range is looked at
        in pieces of `_REQUEST` bytes (at multiples of it in the file): a piece whole in the page cache
        (`page_cached`) is copied from there, and each run of the other pieces is one O_DIRECT read.
        """
        fd, end = self._fd(path), offset + n
        edges = [offset, *range((offset // _REQUEST + 1) * _REQUEST, end, _REQUEST), end]
        pieces = zip(edges, edges[1:])
        for cached, group in itertools.groupby(pieces, key=lambda p: bool(page_cached(fd, p[0], p[1] - p[0]))):
            run = list(group)  # consecutive pieces alike: one read
            lo, hi = run[0][0], run[-1][1]
            self._read_run(path, lo, hi - lo, arr, pos + lo - offset, cached)

    def _read_run(self, path: str, offset: int, n: int, arr: np.ndarray, pos: int, cached: bool) -> None:
        """`read_aligned` of one run: copied from the page cache, or with O_DIRECT where the file allows."""
        if cached:
            self.read_into(path, offset, memoryview(arr[pos:pos + n]))
            with self._lock:
                self.bytes_cached += n
            return
        fd = self._direct_fd(path)
        if fd is not None and pos % ALIGN == offset % ALIGN:
            lo = offset - offset % ALIGN
            hi = -(-(offset + n) // ALIGN) * ALIGN
            start = pos - (offset - lo)
            if start >= 0 and start + (hi - lo) <= arr.shape[0]:
                try:
                    self._pread_all(fd, path, lo, memoryview(arr[start:start + hi - lo]), offset + n - lo)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    with self._lock:  # the file system accepted the open but not the read: buffered from now on
                        self._direct_fds[path] = None
                    os.close(fd)
                else:
                    self._count(path, offset, n)
                    return
        self.read_into(path, offset, memoryview(arr[pos:pos + n]))

    def read(self, path: str, offset: int, length: int) -> bytearray:
        buf = bytearray(length)
        self.read_into(path, offset, memoryview(buf))
        return buf

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            for dfd in self._direct_fds.values():
                if dfd is not None:
                    os.close(dfd)
            self._fds.clear()
            self._direct_fds.clear()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RecyclingPool:
    """Page-aligned buffers of `size` bytes for reads, reused once nothing refers to them any more, without
    being given back (unlike the executor's `BufferPool`): for readers whose bytes go on, as views, to several
    threads that finish with them in no set order (an ingest's sha256, xxh3 and statistics).

    The reference count says when: a view of a buffer, or a numpy array or `Py_buffer` made from one, holds a
    reference to it, so a buffer still in use downstream is never handed out again. Reuse matters on these VMs:
    a device writing into fresh memory faults each page in and zeroes it first, which cost about as much as the
    page-cache copy that O_DIRECT saves. At most `keep` buffers are kept; past them (or for more than `size`
    bytes) a new buffer is made, never waited for. One thread takes buffers at a time."""

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self._keep = keep
        self._bufs: list[np.ndarray] = []

    @classmethod
    def for_reads(cls, room: int, keep: int) -> RecyclingPool:
        """A pool whose buffers take one read of up to `room` bytes at any file offset (see `room`)."""
        return cls(room + 2 * ALIGN, keep)

    @property
    def room(self) -> int:
        """The most bytes one read may span in a buffer, whatever its offset in the file: O_DIRECT reads whole
        pages, so a page of slack on each side."""
        return self.size - 2 * ALIGN

    def take(self, n: int) -> np.ndarray:
        """A buffer of at least `n` bytes that nothing else refers to."""
        if n > self.size:
            return aligned_empty(n)
        for arr in self._bufs:
            if sys.getrefcount(arr) <= 3:  # the list's reference, `arr` and getrefcount's argument
                return arr
        arr = aligned_empty(self.size)
        if len(self._bufs) < self._keep:
            self._bufs.append(arr)
        return arr


class SequentialReader:
    """One file read front to back, `depth` pieces ahead of the caller, on a thread of its own, each piece with
    `RangeReader.read_aligned`: O_DIRECT where the file system allows it and the piece is not in the page cache,
    so the device writes into the pool's buffers and the page cache is neither filled nor copied out of (on
    these VMs that copy was most of an ingest reader's CPU); a piece already cached is copied from there;
    buffered where O_DIRECT is refused.

    `cuts`: the sizes of the caller's reads, in order, where known: a piece then holds whole reads (as many as
    fit in a pool buffer, or one larger read), so each `read` is a view into one piece's buffer, never a copy;
    past them (or without them) pieces are as large as the buffers. `read(n)` returns the next n bytes: a view
    when they lie in one piece, else a copy. Raises EOFError if the file ends first (StaleSourceError if it
    shrank while read). Not thread-safe: one caller. The pool may serve several readers one after another
    (`close` ends this one's thread)."""

    _END = object()

    def __init__(self, path: str | Path, pool: RecyclingPool, *, cuts: Iterable[int] = (), depth: int = 2) -> None:
        self.path = str(path)
        self._pool = pool
        self._size = os.stat(self.path).st_size
        self._cuts = list(cuts)
        self._pieces: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._reader = RangeReader(random=True)  # no read-ahead where the reads end up buffered
        self._buf: memoryview = memoryview(b"")
        self._at = 0  # position of the next byte to hand out in `_buf`
        self._done = False
        self._thread = threading.Thread(target=self._run, name="mergepipe-sequential-read", daemon=True)
        self._thread.start()

    def _spans(self) -> Iterator[tuple[int, int]]:
        """(offset, bytes) of each piece: the cuts grouped whole up to a buffer's room, then the rest of the
        file a buffer at a time."""
        room = self._pool.room
        off = group = 0
        for n in self._cuts:
            if group and group + n > room:
                yield off, group
                off, group = off + group, 0
            group += n
        if group:
            yield off, group
            off += group
        while off < self._size:
            yield off, min(room, self._size - off)
            off += room

    def _run(self) -> None:
        try:
            for off, n in self._spans():
                if self._stop.is_set():
                    return
                arr = self._pool.take(n + 2 * ALIGN)
                pos = off % ALIGN
                self._reader.read_aligned(self.path, off, arr, pos, n)
                self._pieces.put(memoryview(arr)[pos:pos + n])  # type: ignore[arg-type]  # numpy arrays are buffers
            self._pieces.put(self._END)
        except BaseException as e:  # noqa: BLE001 - handed to the caller by read()
            self._pieces.put(e)

    def _next_piece(self) -> bool:
        if self._done:
            return False
        item = self._pieces.get()
        if item is self._END:
            self._done = True
            return False
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._buf, self._at = item, 0
        return True

    def read(self, n: int) -> memoryview | bytearray:
        if self._at == len(self._buf) and n > 0 and not self._next_piece():
            raise EOFError(f"{self.path}: file ended early")
        if n <= len(self._buf) - self._at:
            view = self._buf[self._at:self._at + n]
            self._at += n
            return view
        out = bytearray(n)
        got = 0
        while got < n:
            if self._at == len(self._buf) and not self._next_piece():
                raise EOFError(f"{self.path}: file ended early")
            k = min(n - got, len(self._buf) - self._at)
            out[got:got + k] = self._buf[self._at:self._at + k]
            self._at += k
            got += k
        return out

    def read_rest(self) -> bytearray:
        """Every byte not handed out yet."""
        out = bytearray(self._buf[self._at:])
        self._at = len(self._buf)
        while self._next_piece():
            out += self._buf
            self._at = len(self._buf)
        return out

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # unblock the thread if it waits on a full queue
            with contextlib.suppress(Exception):
                self._pieces.get(timeout=0.05)
        self._reader.close()
        self._buf = memoryview(b"")


class ReadAhead:
    """Byte ranges asked for ahead (`ask`) and taken later in the same order (`take`), read in between on a
    thread of its own with `RangeReader.read_aligned` (O_DIRECT where it can, as `SequentialReader`) into the
    pool's buffers; ranges asked one after another that follow each other in one file are read as one request
    of up to `pool.room` bytes. For reads known ahead at positions the kernel's read-ahead would not foresee
    (it would also fetch what lies between them). `take` raises what the read raised."""

    def __init__(self, pool: RecyclingPool) -> None:
        self._pool = pool
        self._asked: collections.deque[tuple[str, int, int]] = collections.deque()
        self._cond = threading.Condition()
        self._ready: queue.Queue = queue.Queue()
        self._reader = RangeReader(random=True)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mergepipe-read-ahead", daemon=True)
        self._thread.start()

    def ask(self, path: str, offset: int, n: int) -> None:
        with self._cond:
            self._asked.append((path, offset, n))
            self._cond.notify()

    def take(self) -> memoryview:
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _next_run(self) -> list[tuple[str, int, int]] | None:
        """The oldest ranges asked that follow each other in one file, up to `pool.room` bytes (at least one)."""
        with self._cond:
            while not self._asked and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            run = [self._asked.popleft()]
            while self._asked:
                path, off, n = self._asked[0]
                last_path, last_off, last_n = run[-1]
                if path != last_path or off != last_off + last_n or off + n - run[0][1] > self._pool.room:
                    break
                run.append(self._asked.popleft())
            return run

    def _run(self) -> None:
        try:
            while (run := self._next_run()) is not None:
                path, lo = run[0][0], run[0][1]
                n = run[-1][1] + run[-1][2] - lo
                arr = self._pool.take(n + 2 * ALIGN)  # room for the whole pages around the range
                pos = lo % ALIGN
                self._reader.read_aligned(path, lo, arr, pos, n)
                view = memoryview(arr)  # type: ignore[arg-type]  # numpy arrays are buffers
                for _path, off, k in run:
                    self._ready.put(view[pos + off - lo:pos + off - lo + k])
        except BaseException as e:  # noqa: BLE001 - handed to the caller by take()
            self._ready.put(e)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        self._reader.close()


def fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
