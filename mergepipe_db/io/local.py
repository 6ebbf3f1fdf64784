"""The local byte store (`LocalStore`, for plain paths and ``file://`` URIs): the one place where checkpoint and
output files are opened, read, written and published, and where reads are counted.

Budget soundness is checked against these counters: `RangeReader.bytes_read` is incremented where each
`pread` is issued, so realized expert bytes can be compared with the plan (and with /proc/PID/io). Every read
goes through one pread loop (`pread_into`).
Expert files are opened with POSIX_FADV_RANDOM so the kernel's read-ahead does not pull in omitted blocks.
Large reads into page-aligned buffers (`read_aligned`) bypass the page cache with O_DIRECT where the file
system allows it: the device writes straight into the merge's buffer (no kernel copy, no page-cache churn),
reading the range widened to whole 4 KiB pages — the same pages a buffered read touches. A range already
held whole in the page cache (an ingest or another tool read it lately) is copied from there instead: O_DIRECT
would fetch it from the device again. `page_cached` asks the kernel (cachestat, Linux ≥ 6.5); where it cannot
tell, every large read is O_DIRECT. Ingest reads the same way: each file front to back on a thread of its own
(`SequentialReader`) and the base blocks it needs as soon as it knows them (`ReadAhead`), into buffers reused
once nothing refers to them (`RecyclingPool`). Output files are written with O_DIRECT too (`DirectSink`,
behind `LocalOutputFile`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import itertools
import operator
import os
import queue
import stat as stat_mode
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mergepipe_db.core.names import show_path
from mergepipe_db.errors import OutOfSpaceError, StaleSourceError
from mergepipe_db.io.base import ByteStore, Location, Stat
from mergepipe_db.io.base import check_fresh as check_fresh  # importable from here as before
from mergepipe_db.io.ranges import coalesce

ALIGN = 4096  # O_DIRECT granularity: offsets, lengths and buffer addresses in whole pages


#: bytes per read request: on these virtio disks 8 MiB O_DIRECT requests stream ~1.3x faster than 64 MiB ones
REQUEST_BYTES = 8 << 20

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


def pread_into(fd: int, buf: memoryview, offset: int, need: int | None = None) -> int:
    """The package's one pread loop: read into `buf` from `offset` until at least `need` bytes (all of `buf`
    by default) arrived or the file ended, in requests of at most `REQUEST_BYTES` bytes. Returns the bytes read:
    fewer than `need` only at the end of the file."""
    need = len(buf) if need is None else need
    done = 0
    while done < need:
        n = os.preadv(fd, [buf[done:done + REQUEST_BYTES]], offset + done)
        if n == 0:
            break
        done += n
    return done


def sha256_file(path: str | Path) -> str:
    """sha256 of a whole file, read front to back in 16 MiB pieces, leaving the page cache as it found it
    (`DropBehind`; where the kernel cannot tell what was cached, nothing is dropped): these bytes are read once,
    and on these VMs filling the cache costs more than the read."""
    import hashlib

    h = hashlib.sha256()
    buf = memoryview(bytearray(16 << 20))
    dropper = DropBehind(path, unknown=False)  # residency taken before anything is read
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            pos = 0
            while n := pread_into(fd, buf, pos):
                h.update(buf[:n])
                pos += n
                dropper.advance(pos)
        finally:
            os.close(fd)
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
    """Reads byte ranges from files (`pread_into`), counting every byte it asks the kernel for.

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
        """Read into `buf` from `offset` until at least `need` bytes arrived (`pread_into`); StaleSourceError
        where the file ends first."""
        if pread_into(fd, buf, offset, need) < need:
            raise StaleSourceError(f"source file {path} is shorter than the catalog says (truncated?)")

    def read_aligned(self, path: str, offset: int, arr: np.ndarray, pos: int, n: int) -> None:
        """Fill ``arr[pos:pos + n]`` with the bytes at [offset, offset + n) of `path`.

        `arr` is page-aligned (`aligned_empty`) with ``pos % ALIGN == offset % ALIGN`` and room for the
        pages around the range; with O_DIRECT the whole pages are read in place, so bytes of `arr` next to
        the range (up to a page on each side) receive the file's neighbouring bytes. Without O_DIRECT (or
        once the file system rejects it) this is a plain buffered read of the range. The range is looked at
        in pieces of `REQUEST_BYTES` bytes (at multiples of it in the file): a piece whole in the page cache
        (`page_cached`) is copied from there, and each run of the other pieces is one O_DIRECT read.
        """
        fd, end = self._fd(path), offset + n
        edges = [offset, *range((offset // REQUEST_BYTES + 1) * REQUEST_BYTES, end, REQUEST_BYTES), end]
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


class _Asked(NamedTuple):
    """A range asked of a `ReadAhead`."""

    path: str
    offset: int
    nbytes: int


_ASKED_PATH = operator.attrgetter("path")


class ReadAhead:
    """Byte ranges asked for ahead (`ask`) and taken later in the same order (`take`), read in between on a
    thread of its own with `RangeReader.read_aligned` (O_DIRECT where it can, as `SequentialReader`) into the
    pool's buffers; ranges asked one after another that follow each other in one file are read as one request
    of up to `pool.room` bytes. For reads known ahead at positions the kernel's read-ahead would not foresee
    (it would also fetch what lies between them). `take` raises what the read raised."""

    def __init__(self, pool: RecyclingPool) -> None:
        self._pool = pool
        self._asked: collections.deque[_Asked] = collections.deque()
        self._cond = threading.Condition()
        self._ready: queue.Queue = queue.Queue()
        self._reader = RangeReader(random=True)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mergepipe-read-ahead", daemon=True)
        self._thread.start()

    def ask(self, path: str, offset: int, n: int) -> None:
        with self._cond:
            self._asked.append(_Asked(path, offset, n))
            self._cond.notify()

    def take(self) -> memoryview:
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _next_run(self) -> tuple[int, int, list[_Asked]] | None:
        """The oldest ranges asked that follow each other in one file, up to `pool.room` bytes (at least one):
        (offset, nbytes, ranges)."""
        with self._cond:
            while not self._asked and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            run = next(coalesce(self._asked, limit=self._pool.room, file=_ASKED_PATH))
            for _ in run[2]:
                self._asked.popleft()
            return run

    def _run(self) -> None:
        try:
            while (run := self._next_run()) is not None:
                lo, n, asked = run
                arr = self._pool.take(n + 2 * ALIGN)  # room for the whole pages around the range
                pos = lo % ALIGN
                self._reader.read_aligned(asked[0].path, lo, arr, pos, n)
                view = memoryview(arr)  # type: ignore[arg-type]  # numpy arrays are buffers
                for a in asked:
                    self._ready.put(view[pos + a.offset - lo:pos + a.offset - lo + a.nbytes])
        except BaseException as e:  # noqa: BLE001 - handed to the caller by take()
            self._ready.put(e)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        self._reader.close()


def fsync_file(path: str | Path) -> None:
    """Make a file written by other means (a copied side file), or a directory's entries, durable."""
    fd = os.open(str(path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new(path: str | Path, data: bytes) -> None:
    """Create `path` (FileExistsError if it exists) holding `data`, fsynced (the directory is not)."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staging: str | Path, final: str | Path) -> None:
    """Rename `staging` to `final` (atomic on one file system) and fsync `final`'s parent directory."""
    os.rename(staging, final)
    fsync_file(Path(final).parent)


def read_small(path: str | Path, limit: int) -> bytes:
    """At most `limit` bytes from the start of a small file (a JSON side file)."""
    with open(path, "rb") as fh:
        return fh.read(limit)


class LocalInputFile:
    """A file open for a few reads (a header; a tensor's pieces for a check), with `pread_into`. Opened with
    O_NONBLOCK so that a FIFO or a device given as a checkpoint does not block; `regular` says whether it is
    a regular file, `size` its size. Raises OSError as `os.open` does."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(self._fd)
        except BaseException:
            os.close(self._fd)
            raise
        self.size = st.st_size
        self.regular = stat_mode.S_ISREG(st.st_mode)

    def read(self, offset: int, n: int) -> bytes:
        """The bytes at [offset, offset + n), fewer where the file ends first."""
        buf = bytearray(n)
        got = pread_into(self._fd, memoryview(buf), offset)
        return bytes(buf) if got == n else bytes(buf[:got])

    def pieces(self, offset: int, n: int, piece: int) -> Iterator[memoryview]:
        """The bytes at [offset, offset + n) in pieces of at most `piece` bytes, ending early where the file
        does; each piece is valid until the next one is asked for."""
        buf = memoryview(bytearray(min(piece, n)))
        while n > 0:
            got = pread_into(self._fd, buf[:min(piece, n)], offset)
            if not got:
                return
            yield buf[:got]
            offset += got
            n -= got

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> LocalInputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _no_space(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class DirectSink:
    """Sequential file writes that bypass the page cache: bytes gather in a page-aligned buffer written
    with O_DIRECT in whole pages; the last, partial page is written padded and the file then truncated to
    its exact length. On these machines a buffered write costs more kernel time than the merge's math.
    Two buffers: one fills while a helper thread writes the other, and a second helper feeds it to the
    file's hash (`hasher`, in order), so the caller's statistics, the hashing and the disk overlap. A write's
    error is raised by a later `write` or by `finish`."""

    _BUF = 8 << 20

    def __init__(self, fd: int, hasher: Any = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._fd: int | None = fd
        self._bufs = (aligned_empty(self._BUF), aligned_empty(self._BUF))
        self._buf = self._bufs[0]
        self._fill = 0
        self._written = 0  # bytes of the file handed to the helper so far (a multiple of the page size)
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="mergepipe-direct-write")
        self._hasher = hasher
        self._hash_helper = None if hasher is None else ThreadPoolExecutor(1, thread_name_prefix="mergepipe-hash")
        self._pending: list[Any] = []  # the Futures of the other buffer's write and hash

    @classmethod
    def open(cls, path: str | Path, hasher: Any = None) -> DirectSink | None:
        """A sink for the (just created, empty) file, or None where O_DIRECT is refused (tmpfs, ...)."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag or os.environ.get("MERGEPIPE_NO_DIRECT_IO") == "1":
            return None
        try:
            fd = os.open(path, os.O_WRONLY | flag | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        return cls(fd, hasher)

    def write(self, mv: memoryview) -> None:
        src = np.frombuffer(mv, dtype=np.uint8)
        pos = 0
        while pos < src.shape[0]:
            n = min(self._BUF - self._fill, src.shape[0] - pos)
            self._buf[self._fill:self._fill + n] = src[pos:pos + n]
            self._fill += n
            pos += n
            if self._fill == self._BUF:
                self._flush(self._BUF)

    def _flush(self, n: int, n_hashed: int | None = None) -> None:
        """Hand the current buffer's first n bytes to the helpers (the first `n_hashed` of them, default n,
        are the file's: the rest pads to a whole page); continue in the other buffer once its own write
        and hash are done."""
        assert self._fd is not None
        done = [self._helper.submit(self._pwrite, self._fd, self._buf, n, self._written)]
        if self._hash_helper is not None:
            hashed = memoryview(self._buf[:n if n_hashed is None else n_hashed])
            done.append(self._hash_helper.submit(self._hasher.update, hashed))
        self._written += n
        self._fill = 0
        self._buf = self._bufs[1] if self._buf is self._bufs[0] else self._bufs[0]
        previous, self._pending = self._pending, done
        for f in previous:
            f.result()

    @staticmethod
    def _pwrite(fd: int, buf: np.ndarray, n: int, offset: int) -> None:
        view = memoryview(buf[:n])
        done = 0
        while done < n:
            done += os.pwritev(fd, [view[done:]], offset + done)

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def finish(self, fd: int) -> None:
        """Write what is buffered (padded to whole pages), wait for the writes and cut the file to its
        exact size via `fd`."""
        size = self._written + self._fill
        if self._fill:
            padded = -(-self._fill // ALIGN) * ALIGN
            self._buf[self._fill:padded] = 0
            self._flush(padded, self._fill)
        self._drain()
        os.ftruncate(fd, size)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):  # closing after a failure: the first error was reported
                self._drain()
            self._helper.shutdown(wait=True)
            if self._hash_helper is not None:
                self._hash_helper.shutdown(wait=True)
            os.close(fd)


class LocalOutputFile:
    """An output file written front to back: created (exclusively unless `exclusive` is False, then
    truncated; with `append`, opened or created and written at its end), written with plain writes or, with
    `direct`, through a `DirectSink` (O_DIRECT, where the file system allows it); `hasher` (hashlib-like), where
    given, is fed every byte written in order. `size` is the file's length when opened (0 unless appending). A
    full disk is OutOfSpaceError (from `write` or `finish`); FileExistsError where an exclusive file exists."""

    def __init__(self, path: str | Path, *, exclusive: bool = True, direct: bool = False, hasher: Any = None,
                 append: bool = False) -> None:
        self.path = Path(path)
        self._hasher = hasher
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        if append:
            assert not direct, "O_DIRECT writes whole pages: no appending"
            flags |= os.O_APPEND
        else:
            flags |= os.O_EXCL if exclusive else os.O_TRUNC
        self._fd: int | None = os.open(self.path, flags, 0o644)
        self.size = os.fstat(self._fd).st_size
        self._sink: DirectSink | None = None
        if direct:  # the sink's helper hashes what it writes
            self._sink = DirectSink.open(self.path, hasher)

    @property
    def direct(self) -> bool:
        """Whether the file is written with O_DIRECT."""
        return self._sink is not None

    def write(self, mv: memoryview) -> None:
        """Append `mv` (a flat byte view)."""
        assert self._fd is not None
        if self._sink is None and self._hasher is not None:
            self._hasher.update(mv)
        off = 0
        try:
            if self._sink is not None:
                self._sink.write(mv)
            else:
                while off < len(mv):
                    off += os.write(self._fd, mv[off:])
        except OSError as e:
            if _no_space(e):
                raise OutOfSpaceError(f"{show_path(self.path)}: no space left while writing") from e
            raise

    def finish(self, *, fsync: bool = True) -> None:
        """Write what is buffered, fsync unless told not to, and close."""
        assert self._fd is not None
        fd, self._fd = self._fd, None
        try:
            if self._sink is not None:
                try:
                    self._sink.finish(fd)
                except OSError as e:
                    if _no_space(e):
                        raise OutOfSpaceError(f"{show_path(self.path)}: no space left while writing") from e
                    raise
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
            self._close_sink()

    def _close_sink(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    def abort(self) -> None:
        """Let the file go after a failure (left in place, partial)."""
        self._close_sink()
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _local(location: Location) -> str:
    """The path of a plain path or a ``file://`` URI."""
    text = str(location)
    if text[:7].lower() == "file://":
        from urllib.parse import unquote, urlsplit

        return unquote(urlsplit(text).path)
    return text


class LocalStore(ByteStore):
    """Files on a local (POSIX) file system: plain paths and ``file://`` URIs. Readers and writers take
    plain paths (what the catalog records); the other methods take either."""

    scheme = "file"

    def stat(self, location: Location) -> Stat:
        """Size and modification time in ns (the version that ingest records as ``mtime_ns``)."""
        st = os.stat(_local(location))
        return Stat(st.st_size, st.st_mtime_ns)

    def range_reader(self, *, random: bool) -> RangeReader:
        return RangeReader(random=random)

    def sequential_reader(self, location: Location, pool: RecyclingPool, *, cuts: Iterable[int] = (),
                          depth: int = 2) -> SequentialReader:
        return SequentialReader(_local(location), pool, cuts=cuts, depth=depth)

    def read_ahead(self, pool: RecyclingPool) -> ReadAhead:
        return ReadAhead(pool)

    def open_input(self, location: Location) -> LocalInputFile:
        return LocalInputFile(_local(location))

    def read_small(self, location: Location, limit: int) -> bytes:
        return read_small(_local(location), limit)

    def sha256(self, location: Location) -> str:
        return sha256_file(_local(location))

    def writer(self, location: Location, *, exclusive: bool = True, direct: bool = False, hasher: Any = None
               ) -> LocalOutputFile:
        return LocalOutputFile(_local(location), exclusive=exclusive, direct=direct, hasher=hasher)

    def appender(self, location: Location) -> LocalOutputFile:
        return LocalOutputFile(_local(location), append=True)

    def write_new(self, location: Location, data: bytes) -> None:
        write_new(_local(location), data)

    def sync(self, location: Location) -> None:
        fsync_file(_local(location))

    def publish(self, staging: Location, final: Location) -> None:
        publish(_local(staging), _local(final))

    def drop_behind(self, location: Location, *, unknown: bool) -> DropBehind:
        return DropBehind(_local(location), unknown=unknown)

    def absolute(self, location: Location) -> str:
        return str(Path(_local(location)).resolve())
