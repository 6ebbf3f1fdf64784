"""The byte-store interface (`mergepipe_db.io`): `open_store` picks a store by URI scheme, `stat` gives size and
version, freshness checks use it, `coalesce` is the one range merger, and the local store's inputs, outputs and
publish behave as the pipeline expects. Also: no module outside `io` issues a pread."""

from __future__ import annotations

import hashlib
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from mergepipe_db import io
from mergepipe_db.core.plan import FileStamp, Read
from mergepipe_db.errors import MergePipeError, StaleSourceError, UnsupportedStorageError
from mergepipe_db.io import local

PACKAGE = Path(__file__).resolve().parents[2] / "mergepipe_db"


# --- open_store: the scheme table ----------------------------------------------------------------


@pytest.mark.parametrize("where", ["/tmp/x.safetensors", "relative/dir", "file:///tmp/x", "FILE:///tmp/x",
                                   "weird:name"])
def test_plain_paths_and_file_uris_are_local(where: str) -> None:
    store = io.open_store(where)
    assert isinstance(store, local.LocalStore) and store.scheme == "file"
    assert io.open_store(Path(where)) is store  # one store per scheme


def test_unknown_scheme_is_a_named_one_line_error() -> None:
    with pytest.raises(UnsupportedStorageError) as e:
        io.open_store("gs://bucket/model.safetensors")
    assert isinstance(e.value, MergePipeError)
    msg = str(e.value)
    assert "\n" not in msg and "gs://" in msg and "file://" in msg and "s3://" in msg


def test_a_scheme_added_to_the_table_is_loaded_when_first_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(io.SCHEMES, "testfs", "mergepipe_db.io.local:LocalStore")
    assert io.scheme_of("TestFS://x/y") == "testfs"
    assert isinstance(io.open_store("testfs://x/y"), local.LocalStore)


# --- stat and freshness --------------------------------------------------------------------------


def test_stat_is_size_and_mtime_version(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * 100)
    os.utime(f, ns=(1_000_000_123, 2_000_000_456))
    store = io.open_store(f)
    assert store.stat(f) == io.Stat(100, 2_000_000_456)
    assert store.stat(f"file://{f}") == store.stat(str(f))
    with pytest.raises(FileNotFoundError):
        store.stat(tmp_path / "missing")


def test_check_fresh_compares_size_and_version(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * 100)
    st = f.stat()
    stamp = FileStamp(str(f), st.st_size, st.st_mtime_ns)
    io.check_fresh([stamp])
    local.check_fresh([stamp])  # still importable from the local store's module
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(StaleSourceError, match="mtime changed: True"):
        io.check_fresh([stamp])
    with pytest.raises(StaleSourceError, match="size 100 -> 100"):
        io.check_fresh([stamp])
    f.write_bytes(b"x" * 101)
    with pytest.raises(StaleSourceError, match="size 100 -> 101"):
        io.check_fresh([stamp])
    f.unlink()
    with pytest.raises(StaleSourceError, match="gone"):
        io.check_fresh([stamp])


# --- the one range merger ------------------------------------------------------------------------


def _coalesce_before(reads: tuple[Read, ...]) -> list[tuple[int, int, list[Read]]]:
    """`sources.selection.coalesce` as it was before `io.coalesce` replaced it."""
    groups: list[tuple[int, int, list[Read]]] = []
    for r in reads:
        if groups and groups[-1][0] + groups[-1][1] == r.offset:
            off, n, members = groups[-1]
            members.append(r)
            groups[-1] = (off, n + r.nbytes, members)
        else:
            groups.append((r.offset, r.nbytes, [r]))
    return groups


def _reads(rng: random.Random, n: int) -> tuple[Read, ...]:
    out, pos = [], rng.randrange(0, 50)
    for i in range(n):
        size = rng.choice((0, 1, 7, 64, 4096))
        out.append(Read(i, pos, size, ""))
        pos += size + rng.choice((0, 0, 0, 1, 100))  # mostly adjacent
    return tuple(out)


def test_coalesce_matches_the_selection_merger_it_replaced() -> None:
    from mergepipe_db.sources.selection import coalesce as selection_coalesce

    rng = random.Random(7)
    for n in (0, 1, 2, 5, 40, 300):
        reads = _reads(rng, n)
        assert list(io.coalesce(reads)) == _coalesce_before(reads)
        assert selection_coalesce(reads) == _coalesce_before(reads)


@dataclass(frozen=True)
class _Range:
    path: str
    offset: int
    nbytes: int


def _runs_before(asked: list[_Range], room: int) -> list[list[_Range]]:
    """`ReadAhead._next_run` as it was before (applied until the queue is empty)."""
    runs, q = [], list(asked)
    while q:
        run = [q.pop(0)]
        while q:
            r, last = q[0], run[-1]
            if (r.path != last.path or r.offset != last.offset + last.nbytes
                    or r.offset + r.nbytes - run[0].offset > room):
                break
            run.append(q.pop(0))
        runs.append(run)
    return runs


def test_coalesce_with_a_limit_and_files_matches_the_read_ahead_merger_it_replaced() -> None:
    rng = random.Random(3)
    for n in (1, 3, 50, 400):
        asked, pos = [], 0
        for _ in range(n):
            size = rng.choice((1, 100, 1000, 5000))
            path = rng.choice(("a", "a", "a", "b"))
            asked.append(_Range(path, pos, size))
            pos += size if rng.random() < 0.8 else size + 8
        for room in (1, 1000, 4096, 10**9):
            got = [members for _off, _n, members in io.coalesce(asked, limit=room, file=lambda r: r.path)]
            assert got == _runs_before(asked, room)


def test_coalesce_runs_span_their_members_and_look_one_range_ahead() -> None:
    rs = [_Range("a", 0, 10), _Range("a", 10, 5), _Range("a", 15, 20), _Range("a", 40, 1)]
    assert [(o, n, len(m)) for o, n, m in io.coalesce(rs, limit=20)] == [(0, 15, 2), (15, 20, 1), (40, 1, 1)]
    seen: list[_Range] = []

    def watched():  # noqa: ANN202
        for r in rs:
            seen.append(r)
            yield r

    off, n, members = next(io.coalesce(watched(), limit=20))
    assert (off, n, members) == (0, 15, rs[:2]) and seen == rs[:3]
    assert list(io.coalesce([])) == []


# --- the local store's reads ---------------------------------------------------------------------


def test_pread_into_stops_at_the_end_of_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "a.bin"
    data = os.urandom(10_000)
    f.write_bytes(data)
    monkeypatch.setattr(local, "REQUEST_BYTES", 4096)  # several requests per read
    fd = os.open(f, os.O_RDONLY)
    try:
        buf = bytearray(12_000)
        assert local.pread_into(fd, memoryview(buf), 100) == 9_900 and bytes(buf[:9_900]) == data[100:]
        buf = bytearray(5_000)
        assert local.pread_into(fd, memoryview(buf), 1_000, need=10) >= 10 and buf[:10] == data[1_000:1_010]
        assert local.pread_into(fd, memoryview(bytearray(10)), 20_000) == 0
    finally:
        os.close(fd)


def test_input_file_reads_ranges_and_pieces(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    data = os.urandom(50_000)
    f.write_bytes(data)
    store = io.open_store(f)
    with store.open_input(f) as fh:
        assert fh.size == 50_000 and fh.regular
        assert fh.read(10, 100) == data[10:110]
        assert fh.read(49_990, 100) == data[49_990:]  # short at the end
        pieces = [bytes(p) for p in fh.pieces(5, 30_000, 7_000)]
        assert [len(p) for p in pieces] == [7_000] * 4 + [2_000] and b"".join(pieces) == data[5:30_005]
        assert b"".join(bytes(p) for p in fh.pieces(45_000, 10_000, 4_096)) == data[45_000:]
    with store.open_input(tmp_path) as d:
        assert not d.regular
    with pytest.raises(FileNotFoundError):
        store.open_input(tmp_path / "missing")
    assert store.read_small(f, 10) == data[:10]
    assert store.sha256(f) == hashlib.sha256(data).hexdigest()


def test_range_reader_counts_what_it_reads(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    data = os.urandom(20_000)
    f.write_bytes(data)
    with io.open_store(f).range_reader(random=True) as reader:
        assert isinstance(reader, local.RangeReader)
        assert reader.read(str(f), 100, 1_000) == data[100:1_100]
        assert reader.bytes_read == 1_000
        with pytest.raises(StaleSourceError, match="shorter"):
            reader.read(str(f), 19_000, 2_000)


# --- the local store's writes --------------------------------------------------------------------


@pytest.mark.parametrize("direct", [False, True])
def test_writer_writes_hashes_and_refuses_to_overwrite(tmp_path: Path, direct: bool) -> None:
    f = tmp_path / "o.bin"
    data = os.urandom(3 * (8 << 20) + 5)
    h = hashlib.sha256()
    out = io.open_store(f).writer(f, direct=direct, hasher=h)
    out.write(memoryview(data[:1000]))
    out.write(memoryview(data[1000:]))
    out.finish(fsync=True)
    assert f.read_bytes() == data and h.hexdigest() == hashlib.sha256(data).hexdigest()
    with pytest.raises(FileExistsError):
        io.open_store(f).writer(f)
    again = io.open_store(f).writer(f, exclusive=False)
    again.write(memoryview(b"abc"))
    again.finish(fsync=False)
    assert f.read_bytes() == b"abc"


def test_write_new_sync_and_publish(tmp_path: Path) -> None:
    store = io.open_store(tmp_path)
    staging, final = tmp_path / "staging", tmp_path / "final"
    staging.mkdir()
    store.write_new(staging / "manifest.json", b"{}\n")
    with pytest.raises(FileExistsError):
        store.write_new(staging / "manifest.json", b"{}\n")
    store.sync(staging / "manifest.json")
    store.sync(staging)
    store.publish(staging, final)
    assert not staging.exists() and (final / "manifest.json").read_bytes() == b"{}\n"
    with pytest.raises(FileNotFoundError):
        store.publish(staging, tmp_path / "other")


# --- the rule: one pread path --------------------------------------------------------------------


def test_no_module_outside_io_issues_a_pread() -> None:
    offenders = []
    for p in sorted(PACKAGE.rglob("*.py")):
        if p.parent.name == "io" and p.parent.parent == PACKAGE:
            continue
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bos\.(pread|preadv|readv)\b", line):
                offenders.append(f"{p.relative_to(PACKAGE)}:{i}")
    assert not offenders, offenders
    io_pread_calls = [line for p in (PACKAGE / "io").glob("*.py")
                      for line in p.read_text(encoding="utf-8").splitlines() if re.search(r"os\.pread", line)]
    assert len(io_pread_calls) == 1  # `local.pread_into`
