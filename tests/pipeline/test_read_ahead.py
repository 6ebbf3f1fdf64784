"""The executor's read-ahead queue: bounded in bytes and items, an oversized item still admitted alone,
a stopped merge releases a waiting reader; and a merge with a read-ahead smaller than any tensor gives the
same bytes as the naive full read."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import pytest
import torch
from builders import make_spec, reference_for
from conftest import ingest_family
from reference_merge import assert_bytes_equal, load_output

from mergepipe_db.pipeline import execute as executor
from mergepipe_db.pipeline.execute import ReadItem, ReadQueue, Stopped


def _item(nbytes: int) -> ReadItem:
    return ReadItem("expert", 0, 0, torch.empty(nbytes, dtype=torch.uint8), [], (), nbytes)


def _put_waits(q: ReadQueue, item: object) -> tuple[threading.Thread, list[object]]:
    """Start putting `item` on another thread and check that the put is still waiting 0.2 s later."""
    done: list[object] = []

    def put() -> None:
        try:
            q.put(item)
            done.append("put")
        except Stopped:
            done.append("stopped")

    t = threading.Thread(target=put, daemon=True)
    t.start()
    time.sleep(0.2)
    assert done == [], "the put should wait for room"
    return t, done


def test_read_ahead_waits_for_room_in_bytes_and_items() -> None:
    q = ReadQueue(threading.Event(), max_bytes=100, max_items=3)
    q.put(_item(60))
    t, done = _put_waits(q, _item(50))  # 60 + 50 > 100: waits until the first is taken
    assert q.get().data.numel() == 60
    t.join(5)
    assert done == ["put"]
    q.put(_item(10))
    q.put(_item(10))  # 3 items, 70 bytes: full by count
    t, done = _put_waits(q, _item(1))
    q.get()
    t.join(5)
    assert done == ["put"]


def test_oversized_item_is_admitted_alone_and_stop_releases_the_reader() -> None:
    stop = threading.Event()
    q = ReadQueue(stop, max_bytes=100, max_items=8)
    q.put(_item(1000))  # nothing waiting: read even though it exceeds the bound
    t, done = _put_waits(q, _item(1))
    stop.set()
    t.join(5)
    assert done == ["stopped"]
    assert q.get().data.numel() == 1000  # the stopped put queued nothing
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)


@pytest.mark.catalog
@pytest.mark.parametrize("method", ["linear", "ties"])
def test_merge_with_a_tiny_read_ahead_is_bit_identical(catalog, tiny_family, tmp_path, monkeypatch,
                                                       method) -> None:
    monkeypatch.setattr(executor, "READ_AHEAD_BYTES", 1)
    names = ingest_family(catalog, tiny_family)
    catalog.merge(make_spec(method, names), out=tmp_path / "out", budget="1.0")
    assert_bytes_equal(load_output(tmp_path / "out"), reference_for(catalog, tiny_family, method, names))
    assert Path(tmp_path / "out" / "manifest.json").exists()


def test_buffer_pool_keeps_a_bounded_amount_of_free_memory() -> None:
    """Free buffers are kept for reuse up to the pool's bound; beyond it the longest unused are dropped,
    so the buffers of a few large tensors do not stay resident for the rest of a merge. A read takes the
    smallest free buffer that fits, however much larger."""
    pool = executor.BufferPool(max_free_bytes=3 << 20)
    big, pos = pool.take(0, 2 << 20)
    small, _ = pool.take(0, 1 << 19)
    pool.give(big)
    pool.give(small)  # 2 MiB + 0.5 MiB + pages of slack: within the bound, both kept
    assert pool.take(0, 2 << 20)[0] is big
    pool.give(big)
    other, _ = pool.take(0, 5 << 20)  # no fit: a fresh buffer
    pool.give(other)  # over the bound: the longest unused (small, then big) go
    assert pool.take(0, 5 << 20)[0] is other

    roomy = executor.BufferPool(max_free_bytes=64 << 20)
    bufs = [roomy.take(0, n)[0] for n in (5 << 20, 2 << 20)]
    for arr in bufs:
        roomy.give(arr)
    assert roomy.take(0, 1 << 19)[0] is bufs[1]  # the smallest free buffer that fits serves a smaller read
    assert roomy.take(0, 1 << 19)[0] is bufs[0]  # then a larger one rather than a fresh one: its pages are in
    assert all(roomy.take(0, 1 << 19)[0] is not arr for arr in bufs)  # memory; none free: a fresh one


@pytest.mark.catalog
def test_an_error_in_the_output_statistics_stops_the_merge_and_publishes_nothing(catalog, tiny_family, tmp_path,
                                                                                 monkeypatch) -> None:
    """The output writer's statistics helper runs beside it: its first error is the merge's error, no
    thread is left behind, nothing appears at --out, and the same merge then commits."""
    names = ingest_family(catalog, tiny_family)
    calls: list[int] = []
    real = executor.out_block_rows

    def failing(ot, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(ot.idx)
        if len(calls) == 3:
            raise RuntimeError("statistics failed")
        return real(ot, *args, **kwargs)

    monkeypatch.setattr(executor, "out_block_rows", failing)
    with pytest.raises(RuntimeError, match="statistics failed"):
        catalog.merge(make_spec("linear", names), out=tmp_path / "out", budget="1.0")
    assert not (tmp_path / "out").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith(("mergepipe-output", "mergepipe-stats"))]
    monkeypatch.setattr(executor, "out_block_rows", real)
    catalog.merge(make_spec("linear", names), out=tmp_path / "out", budget="1.0")
    assert_bytes_equal(load_output(tmp_path / "out"), reference_for(catalog, tiny_family, "linear", names))


def test_an_error_reading_the_base_stops_the_merge_and_publishes_nothing(catalog, tiny_family, tmp_path,
                                                                        monkeypatch) -> None:
    """The base is read ahead on a thread of its own (`_BaseAhead`): its error is the merge's error, no reader
    thread is left behind, nothing appears at --out, and the same merge then commits."""
    from mergepipe_db.io import local as storage

    names = ingest_family(catalog, tiny_family)
    base_files = {str(p.resolve()) for p in tiny_family.base.glob("*.safetensors")}
    calls: list[str] = []
    real = storage.RangeReader.read_aligned

    def failing(self, path, *args, **kwargs):  # noqa: ANN001, ANN202
        if str(Path(path).resolve()) in base_files:
            calls.append(path)
            if len(calls) == 3:
                raise OSError(5, "base read failed")
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(storage.RangeReader, "read_aligned", failing)
    with pytest.raises(OSError, match="base read failed"):
        catalog.merge(make_spec("ties", names), out=tmp_path / "out", budget="0.5")
    assert len(calls) == 3 and not (tmp_path / "out").exists()
    assert not [t for t in threading.enumerate() if t.name in ("mergepipe-base", "mergepipe-output")]
    monkeypatch.setattr(storage.RangeReader, "read_aligned", real)
    catalog.merge(make_spec("linear", names), out=tmp_path / "out", budget="1.0")
    assert_bytes_equal(load_output(tmp_path / "out"), reference_for(catalog, tiny_family, "linear", names))
