"""Reads of ranges already in the page cache (`storage.page_cached`, `RangeReader.read_aligned`): copied from
the cache, the others read with O_DIRECT; the same bytes either way, and every byte counted once."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import cold_or_skip, pages_kept

from mergepipe_db.io import local as storage

PAGE = os.sysconf("SC_PAGE_SIZE")


def _file(tmp_path: Path, pages: int = 64) -> tuple[Path, bytes]:
    data = np.random.default_rng(3).integers(0, 256, pages * PAGE, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())  # clean pages: POSIX_FADV_DONTNEED can drop them
    return path, data


def test_page_cached_reports_the_pages_of_a_range(tmp_path: Path) -> None:
    path, data = _file(tmp_path)
    cold_or_skip(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead beyond what is read
        assert os.pread(fd, 3 * PAGE, 8 * PAGE) == data[8 * PAGE:11 * PAGE]
        assert storage.page_cached(fd, 8 * PAGE, 3 * PAGE) is True
        assert storage.page_cached(fd, 8 * PAGE + 5, 3 * PAGE - 10) is True  # inside those pages
        assert storage.page_cached(fd, 8 * PAGE - 1, 2) is False  # one byte on an uncached page
        assert storage.page_cached(fd, 10 * PAGE, PAGE + 1) is False
        assert storage.page_cached(fd, 40 * PAGE, PAGE) is False
    finally:
        os.close(fd)


def test_read_aligned_copies_cached_ranges_and_reads_the_others_directly(tmp_path: Path) -> None:
    path, data = _file(tmp_path)
    cold_or_skip(path)
    fd = os.open(path, os.O_RDONLY)
    try:  # warm the first half only
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert os.pread(fd, 32 * PAGE, 0) == data[:32 * PAGE]
    finally:
        os.close(fd)
    arr = storage.aligned_empty(len(data) + 2 * PAGE)
    with storage.RangeReader(random=True) as reader:
        lo, n = 3 * PAGE + 100, 20 * PAGE  # in the warm half: a copy from the cache, no O_DIRECT descriptor
        reader.read_aligned(str(path), lo, arr, PAGE + lo, n)
        assert bytes(arr[PAGE + lo:PAGE + lo + n]) == data[lo:lo + n]
        assert (reader.bytes_read, reader.bytes_cached) == (n, n)
        assert str(path) not in reader._direct_fds
        lo2, n2 = 40 * PAGE + 7, 10 * PAGE  # cold: from the device
        reader.read_aligned(str(path), lo2, arr, PAGE + lo2, n2)
        assert bytes(arr[PAGE + lo2:PAGE + lo2 + n2]) == data[lo2:lo2 + n2]
        assert (reader.bytes_read, reader.bytes_cached) == (n + n2, n)
        assert str(path) in reader._direct_fds  # O_DIRECT was asked for (None where the file system refuses it)


def test_without_cachestat_every_read_is_direct(tmp_path: Path, monkeypatch) -> None:
    """Where the kernel cannot tell (page_cached is None), reads go the O_DIRECT way, as before."""
    path, data = _file(tmp_path, pages=8)
    monkeypatch.setattr(storage, "page_cached", lambda fd, offset, n: None)
    arr = storage.aligned_empty(len(data) + 2 * PAGE)
    with storage.RangeReader(random=False) as reader:
        reader.read_aligned(str(path), 0, arr, PAGE, len(data))
        assert bytes(arr[PAGE:PAGE + len(data)]) == data
        assert (reader.bytes_read, reader.bytes_cached) == (len(data), 0)
        assert str(path) in reader._direct_fds


def test_a_partly_cached_range_is_copied_where_cached_and_read_directly_elsewhere(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Pieces of `_REQUEST` bytes (4 pages here) are decided one by one; runs of uncached pieces are single
    O_DIRECT reads; every byte is counted once and lands where it belongs."""
    path, data = _file(tmp_path)
    cold_or_skip(path)
    monkeypatch.setattr(storage, "REQUEST_BYTES", 4 * PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:  # warm pages 8-15 and 24-27: two whole pieces, one half piece (28-31 stays cold)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 8 * PAGE, 8 * PAGE)
        os.pread(fd, 4 * PAGE, 24 * PAGE)
        os.pread(fd, 2 * PAGE, 28 * PAGE)
    finally:
        os.close(fd)
    direct = []
    real_pread = storage.RangeReader._pread_all

    def spy(self, fd, path_, offset, buf, need):
        if fd == self._direct_fds.get(path_):
            direct.append((offset, offset + len(buf)))
        return real_pread(self, fd, path_, offset, buf, need)

    monkeypatch.setattr(storage.RangeReader, "_pread_all", spy)
    arr = storage.aligned_empty(len(data) + 2 * PAGE)
    lo, hi = 5 * PAGE + 11, 33 * PAGE - 5
    with storage.RangeReader(random=True) as reader:
        reader.read_aligned(str(path), lo, arr, PAGE + lo, hi - lo)
        assert bytes(arr[PAGE + lo:PAGE + hi]) == data[lo:hi]
        assert reader.bytes_read == hi - lo
        if reader._direct_fds.get(str(path)) is None:
            pytest.skip("O_DIRECT is refused on this file system")
        assert reader.bytes_cached == 12 * PAGE  # pieces 8-11, 12-15, 24-27
        # three direct runs, widened to whole pages: 5-7 (from the page holding lo), 16-23, 28-32
        assert direct == [(5 * PAGE, 8 * PAGE), (16 * PAGE, 24 * PAGE), (28 * PAGE, 33 * PAGE)]


def test_sha256_file_leaves_the_page_cache_as_it_found_it(tmp_path: Path) -> None:
    import hashlib

    path, data = _file(tmp_path, pages=64 * 1024)  # 256 MiB: sixteen 16 MiB pieces
    cold_or_skip(path)
    assert storage.sha256_file(path) == hashlib.sha256(data).hexdigest()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert storage.page_cached(fd, 0, PAGE) is False and storage.page_cached(fd, len(data) - PAGE, PAGE) is False
        assert not any(storage.page_cached(fd, off, 16 << 20) for off in range(0, len(data), 16 << 20))
        for _ in range(3):  # now cached: a rehash keeps it so
            with open(path, "rb") as fh:
                fh.read()
            if storage.page_cached(fd, 0, len(data)):
                break
        else:  # the precondition is the machine's, not the code's: other work's memory pressure evicts pages
            pytest.skip("256 MiB just read did not stay in the page cache (memory pressure from other work)")
        assert storage.sha256_file(path) == hashlib.sha256(data).hexdigest()
        assert all(pages_kept(path, PAGE))  # cached, or reclaimed by the kernel itself; never dropped
    finally:
        os.close(fd)


def test_drop_behind_drops_only_the_granules_not_cached_before(tmp_path: Path) -> None:
    """A file half cached before it is read: the granules that were cached stay, the rest leave once read,
    whether the reader's drops end inside a granule or not."""
    granule = 16 * PAGE
    path, data = _file(tmp_path, pages=8 * 16)  # eight granules
    cold_or_skip(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: the test's reads are what is cached
        for g in (0, 1, 4, 7):  # cached before: granules 0, 1, 4 and 7
            os.pread(fd, granule, g * granule)
        dropper = storage.DropBehind(path, every=5 * PAGE, granule=granule)
        for pos in range(0, len(data), 3 * PAGE):  # the reader, 3 pages at a time
            os.pread(fd, 3 * PAGE, pos)
            dropper.advance(min(pos + 3 * PAGE, len(data)))
        dropper.close()
        kept = pages_kept(path, PAGE)  # cached, or reclaimed by the kernel itself (these VMs reclaim on their own)
        assert [all(kept[g * 16:(g + 1) * 16]) for g in range(8)] == [True, True, False, False, True, False, False,
                                                                       True]
        assert not any(storage.page_cached(fd, off, PAGE) for g in (2, 3, 5, 6)
                       for off in range(g * granule, (g + 1) * granule, PAGE))
    finally:
        os.close(fd)
