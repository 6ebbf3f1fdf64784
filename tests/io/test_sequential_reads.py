"""The ingest's readers (`storage.SequentialReader`, `storage.ReadAhead`) and their buffers
(`storage.RecyclingPool`): the file's bytes in order whatever the read sizes, with O_DIRECT and without; a
buffer is written again only once nothing refers to it; ranges asked ahead come back in order, adjacent ones
read together; a failed read reaches the caller."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mergepipe_db.io import local as storage

PIECE = 64 << 10


def _file(tmp_path: Path, name: str, n: int, seed: int) -> tuple[Path, bytes]:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    path = tmp_path / name
    path.write_bytes(data)
    return path, data


@pytest.fixture(params=["direct", "buffered"])
def read_path(request, monkeypatch) -> str:
    if request.param == "buffered":
        monkeypatch.setenv("MERGEPIPE_NO_DIRECT_IO", "1")
    return request.param


def test_sequential_reader_hands_out_the_file_in_order(tmp_path: Path, read_path: str) -> None:
    path, data = _file(tmp_path, "a.bin", 5 * PIECE + 12345, seed=1)  # the last piece is partial
    reader = storage.SequentialReader(path, storage.RecyclingPool(PIECE, keep=2))
    got, at = [], 0
    try:
        for n in (7, PIECE - 7, 1, PIECE + 3, 3 * PIECE // 2, 0, 4096):  # inside pieces, across one, across two
            view = reader.read(n)
            assert bytes(view) == data[at:at + n]
            got.append(view)
            at += n
        assert bytes(reader.read_rest()) == data[at:]
        with pytest.raises(EOFError):
            reader.read(1)
    finally:
        reader.close()
    # every view handed out still holds its bytes: no buffer was reused while referenced
    assert b"".join(bytes(v) for v in got) == data[:at]


def test_reads_known_ahead_are_views_of_whole_pieces(tmp_path: Path, read_path: str, monkeypatch) -> None:
    """Given the sizes of the reads to come (`cuts`), pieces hold whole reads, so none is copied, whatever the
    reads' offsets; a read larger than a buffer is a piece of its own; past the cuts, the rest comes whole."""
    cuts = [13, 5000, 30000, 20000, 3 * PIECE, 1, 17000, 4096, 777]
    path, data = _file(tmp_path, "c.bin", sum(cuts) + 12345, seed=7)
    pieces: list[tuple[int, int]] = []
    real = storage.RangeReader.read_aligned

    def recording(self, path, offset, arr, pos, n):
        pieces.append((offset, n))
        return real(self, path, offset, arr, pos, n)

    monkeypatch.setattr(storage.RangeReader, "read_aligned", recording)
    reader = storage.SequentialReader(path, storage.RecyclingPool(PIECE, keep=4), cuts=cuts)
    at = 0
    try:
        for n in cuts:
            view = reader.read(n)
            assert isinstance(view, memoryview) and bytes(view) == data[at:at + n]
            at += n
        assert bytes(reader.read_rest()) == data[at:]
    finally:
        reader.close()
    room = PIECE - 2 * storage.ALIGN
    first = 13 + 5000 + 30000 + 20000  # fits in `room`; with the next read it would not
    assert first <= room < first + 3 * PIECE
    assert pieces == [(0, first), (first, 3 * PIECE), (first + 3 * PIECE, 1 + 17000 + 4096 + 777),
                      (sum(cuts), 12345)]


def test_a_view_keeps_its_buffer_from_being_reused(tmp_path: Path, monkeypatch) -> None:
    """A view held while the reader goes on through many pieces (each needing a buffer) keeps its bytes; the
    buffers nothing refers to are reused, so only a few are ever made."""
    path, data = _file(tmp_path, "b.bin", 40 * PIECE, seed=2)
    made = []
    real = storage.aligned_empty
    monkeypatch.setattr(storage, "aligned_empty", lambda n: made.append(n) or real(n))
    # in use at once: the held view's buffer, the piece read from, the one queued; a fourth is free for the next
    reader = storage.SequentialReader(path, storage.RecyclingPool(PIECE, keep=4), depth=1)
    try:
        held = reader.read(100)
        rest = [bytes(reader.read(PIECE - 100 if i == 0 else PIECE)) for i in range(40)]  # dropped at once
    finally:
        reader.close()
    assert bytes(held) == data[:100] and b"".join(rest) == data[100:]
    assert len(made) <= 5  # the held one, and a few reused for the other pieces


def test_recycling_pool_hands_out_a_buffer_again_only_once_unreferenced() -> None:
    pool = storage.RecyclingPool(PIECE, keep=2)
    a = pool.take(PIECE)
    view = memoryview(a)[10:20]  # type: ignore[arg-type]
    del a
    b = pool.take(PIECE)
    assert b.ctypes.data != np.frombuffer(view, dtype=np.uint8).ctypes.data - 10  # `a` is still viewed
    del b
    arr = np.frombuffer(view, dtype=np.uint8)  # an array made from the view refers to it too
    del view
    c = pool.take(PIECE)
    assert c.ctypes.data != arr.ctypes.data - 10
    del c, arr
    again = pool.take(PIECE)
    assert any(again is kept for kept in pool._bufs)  # nothing refers to either: a kept one comes back
    big = pool.take(PIECE + 1)
    assert big.shape[0] >= PIECE + 1 and not any(big is kept for kept in pool._bufs)  # larger: not pooled


def test_read_ahead_returns_the_ranges_in_order_and_reads_adjacent_ones_together(tmp_path: Path, read_path: str,
                                                                                   monkeypatch) -> None:
    p1, d1 = _file(tmp_path, "x.bin", 3 * PIECE, seed=3)
    p2, d2 = _file(tmp_path, "y.bin", PIECE, seed=4)
    calls: list[tuple[str, int, int]] = []
    real = storage.RangeReader.read_aligned

    def counting(self, path, offset, arr, pos, n):
        calls.append((Path(path).name, offset, n))
        return real(self, path, offset, arr, pos, n)

    monkeypatch.setattr(storage.RangeReader, "read_aligned", counting)
    asks = [(p1, 100, 1000), (p1, 1100, 2000), (p1, 3100, 5),  # adjacent: one read
            (p1, 10000, 50),  # a gap: a read of its own
            (p2, 10050, 70),  # another file
            (p1, 2 * PIECE, PIECE // 2), (p1, 2 * PIECE + PIECE // 2, PIECE // 2)]  # adjacent, but one piece at most
    ahead = storage.ReadAhead(storage.RecyclingPool(PIECE, keep=2))
    try:
        for path, off, n in asks:
            ahead.ask(str(path), off, n)
        views = [ahead.take() for _ in asks]
    finally:
        ahead.close()
    for (path, off, n), view in zip(asks, views):
        assert bytes(view) == (d1 if path == p1 else d2)[off:off + n]
    assert calls[:3] == [("x.bin", 100, 3005), ("x.bin", 10000, 50), ("y.bin", 10050, 70)]
    assert calls[3:] == [("x.bin", 2 * PIECE, PIECE // 2), ("x.bin", 2 * PIECE + PIECE // 2, PIECE // 2)]


def test_a_failed_read_reaches_the_caller(tmp_path: Path, monkeypatch) -> None:
    path, _data = _file(tmp_path, "z.bin", 2 * PIECE, seed=5)

    def failing(self, path, offset, arr, pos, n):
        raise OSError(5, "injected I/O error")

    monkeypatch.setattr(storage.RangeReader, "read_aligned", failing)
    ahead = storage.ReadAhead(storage.RecyclingPool(PIECE, keep=1))
    try:
        ahead.ask(str(path), 0, 10)
        with pytest.raises(OSError, match="injected"):
            ahead.take()
    finally:
        ahead.close()
    reader = storage.SequentialReader(path, storage.RecyclingPool(PIECE, keep=1))
    try:
        with pytest.raises(OSError, match="injected"):
            reader.read(10)
    finally:
        reader.close()


def test_a_file_that_shrinks_while_read_is_reported(tmp_path: Path) -> None:
    path, data = _file(tmp_path, "s.bin", 4 * PIECE, seed=6)
    reader = storage.SequentialReader(path, storage.RecyclingPool(PIECE, keep=1), depth=1)
    try:
        assert bytes(reader.read(10)) == data[:10]
        os.truncate(path, PIECE)
        with pytest.raises((EOFError, storage.StaleSourceError)):
            reader.read_rest()
    finally:
        reader.close()
