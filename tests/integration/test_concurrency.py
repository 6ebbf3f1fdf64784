"""Concurrent writers on one catalog: four processes merge at once (one shared ref, and refs of their own).

DuckDB admits one process at a time: every access takes a cross-process file lock with bounded waiting
(CatalogLockedError past MERGEPIPE_LOCK_TIMEOUT). PostgreSQL runs the same transactions under MVCC; the ref
moves by compare-and-set either way. Every run commits or fails with a typed retryable error (one line,
exit 1); committed snapshots are complete, ref versions are 1..n with no gap and no lost update, and readers
running during the commits only ever see whole snapshots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ingest_family
from crashkit import (
    SNAPSHOT_SQL,
    cli,
    one_line_error,
    output_hashes,
    popen_cli,
    ref_history,
    staging_dirs,
    whole_snapshots,
    write_spec,
)

from mergepipe_db.errors import CatalogLockedError, CommitConflictError

pytestmark = pytest.mark.catalog

CRASHKIT = Path(__file__).parents[1] / "crashkit.py"
N_PARENTS = 4  # base + 3 experts: lineage rows of every snapshot


def _reader(catalog_url: str, tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    stop, result = tmp_path / "reader.stop", tmp_path / "reader.json"
    proc = subprocess.Popen([sys.executable, str(CRASHKIT), "reader", "--catalog", catalog_url, "--stop", str(stop),
                             "--parents", str(N_PARENTS), "--result", str(result)])
    return proc, stop, result


def _stop_reader(proc: subprocess.Popen, stop: Path, result: Path) -> dict:
    stop.touch()
    assert proc.wait(timeout=300) == 0
    return json.loads(result.read_text())


def _assert_clean(catalog, tmp_path: Path) -> None:
    assert whole_snapshots(catalog, n_parents=N_PARENTS) == []
    assert [str(f) for f in catalog.fsck() if f.kind != "ok"] == []
    assert catalog.gc(dry_run=True) == [] and staging_dirs(tmp_path) == []


def test_four_cli_writers_on_one_ref_commit_or_fail_retryably(catalog, catalog_url, tiny_family, tmp_path) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = write_spec(tmp_path / "spec.yml", names)
    reader, stop, result = _reader(catalog_url, tmp_path)
    outs = [tmp_path / f"w{i}" for i in range(4)]
    procs = [popen_cli(["merge", str(spec), "--out", str(o), "--ref", "shared", "--catalog", catalog_url, "--quiet",
                        "--json"]) for o in outs]
    # A reader through the CLI too, while the writers run.
    cli_reads = []
    while any(p.poll() is None for p in procs):
        r = cli(["sql", SNAPSHOT_SQL, "--format", "json", "--catalog", catalog_url])
        assert r.returncode == 0, r.stderr
        cli_reads.append(json.loads(r.stdout))
    done = [(p.returncode, *p.communicate(timeout=300)) for p in procs]
    seen = _stop_reader(reader, stop, result)
    assert seen["problems"] == [] and seen["reads"] > 0

    committed = []
    for out, (rc, stdout, stderr) in zip(outs, done):
        if rc == 0:
            committed.append(json.loads(stdout)["version"])
            assert (out / "manifest.json").is_file()
        else:
            assert rc == 1 and one_line_error(stderr, "CommitConflictError", "CatalogLockedError"), stderr
            assert not out.exists()
    assert sorted(committed) == list(range(1, len(committed) + 1)) and committed
    assert ref_history(catalog, "shared") == (len(committed), [f"shared@{v}" for v in range(1, len(committed) + 1)])
    for rows in cli_reads:  # whole snapshots only, in what the CLI printed
        for row in rows:
            assert row["checkpoints"] == 1 and row["tensors"] == row["n_tensors"] and row["manifests"] == 1
            assert row["lineage"] == N_PARENTS and row["reads"] > 0
    _assert_clean(catalog, tmp_path)
    print(f"committed {len(committed)} of 4; {len(cli_reads)} CLI reads, {seen['reads']} reader reads")


def test_four_writers_retrying_lose_no_update(catalog, catalog_url, tiny_family, tmp_path) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = write_spec(tmp_path / "spec.yml", names)
    reference = output_hashes(Path(catalog.merge(spec, out=tmp_path / "reference", ref="reference").out))
    reader, stop, result = _reader(catalog_url, tmp_path)
    workers = []
    for i in range(4):
        jobs = [f"{tmp_path / f'w{i}-shared'}:shared", f"{tmp_path / f'w{i}-own'}:own{i}"]
        if i % 2:
            jobs.reverse()
        res = tmp_path / f"worker{i}.json"
        cmd = [sys.executable, str(CRASHKIT), "merge-retry", "--catalog", catalog_url, "--spec", str(spec),
               "--result", str(res)]
        for j in jobs:
            cmd += ["--job", j]
        workers.append((subprocess.Popen(cmd), res))
    for proc, _res in workers:
        assert proc.wait(timeout=600) == 0
    seen = _stop_reader(reader, stop, result)
    assert seen["problems"] == [] and seen["reads"] > 0

    results = [r for _p, res in workers for r in json.loads(res.read_text())]
    assert all(r["ok"] for r in results), results
    assert all(set(r["errors"]) <= {"CommitConflictError", "CatalogLockedError"} for r in results), results
    shared = sorted(r["version"] for r in results if r["ref"] == "shared")
    assert shared == [1, 2, 3, 4]  # each writer's update landed, none overwrote another
    assert ref_history(catalog, "shared") == (4, [f"shared@{v}" for v in range(1, 5)])
    for i in range(4):
        assert ref_history(catalog, f"own{i}") == (1, [f"own{i}@1"])
    for r in results:
        assert output_hashes(Path(r["out"])) == reference
    _assert_clean(catalog, tmp_path)
    retries = sum(r["attempts"] - 1 for r in results)
    print(f"8 merges committed with {retries} retries; reader saw up to {seen['max_snapshots_seen']} snapshots")


def test_racing_first_commits_to_a_new_ref_one_wins(catalog, tiny_family, tmp_path, monkeypatch) -> None:
    """Two merges create the same ref at once: one commits, the other gets CommitConflictError (on PostgreSQL
    the loser's INSERT waits on the winner's unique key, then fails: translated, not a raw database error)."""
    from mergepipe_db.pipeline import commit as cm

    names = ingest_family(catalog, tiny_family)
    spec = write_spec(tmp_path / "spec.yml", names)
    b_planned, inside = threading.Event(), threading.Event()
    real_insert, real_commit, real_version = cm._insert_output_checkpoint, cm.commit, cm.ref_version

    def version_b_first(conn, ref):
        v = real_version(conn, ref)
        if threading.current_thread().name == "b":
            b_planned.set()  # b expects version 0 too
        return v

    def slow_insert(conn, plan, result, cid, name, out, staging):
        real_insert(conn, plan, result, cid, name, out, staging)
        if out.name == "a":
            inside.set()  # the winner is inside its transaction, ref row written, not committed
            threading.Event().wait(1.5)

    def gated_commit(db, plan, result, **kw):
        assert (b_planned if kw["out"].name == "a" else inside).wait(120)
        return real_commit(db, plan, result, **kw)

    monkeypatch.setattr(cm, "ref_version", version_b_first)
    monkeypatch.setattr(cm, "_insert_output_checkpoint", slow_insert)
    monkeypatch.setattr(cm, "commit", gated_commit)
    outcome: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            outcome[name] = catalog.merge(spec, out=tmp_path / name, ref="fresh")
        except Exception as e:  # noqa: BLE001 - inspected below
            outcome[name] = e

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not isinstance(outcome["a"], Exception), outcome["a"]
    assert isinstance(outcome["b"], CommitConflictError) and outcome["b"].retryable, outcome["b"]
    assert (tmp_path / "a" / "manifest.json").is_file() and not (tmp_path / "b").exists()
    assert ref_history(catalog, "fresh") == (1, ["fresh@1"])
    _assert_clean(catalog, tmp_path)


def test_stale_expected_version_is_a_conflict_and_publishes_nothing(catalog, tiny_family, tmp_path,
                                                                     monkeypatch) -> None:
    from mergepipe_db.pipeline import commit as cm

    names = ingest_family(catalog, tiny_family)
    spec = write_spec(tmp_path / "spec.yml", names)
    catalog.merge(spec, out=tmp_path / "first", ref="r")
    catalog.merge(spec, out=tmp_path / "second", ref="r")
    for stale in (0, 1):  # as if planned before the other writer's commits
        monkeypatch.setattr(cm, "ref_version", lambda conn, ref, v=stale: v)
        with pytest.raises(CommitConflictError):
            catalog.merge(spec, out=tmp_path / f"stale{stale}", ref="r")
        assert not (tmp_path / f"stale{stale}").exists()
    assert ref_history(catalog, "r") == (2, ["r@1", "r@2"])
    _assert_clean(catalog, tmp_path)


@pytest.mark.skipif(bool(os.environ.get("MERGEPIPE_TEST_CATALOG")), reason="PostgreSQL needs no catalog lock (MVCC)")
def test_catalog_lock_timeout_is_a_one_line_retryable_error(catalog, catalog_url, tiny_family, tmp_path,
                                                            monkeypatch) -> None:
    assert catalog.db.is_duckdb
    from filelock import FileLock

    from mergepipe_db.pipeline import commit as cm

    names = ingest_family(catalog, tiny_family)
    spec = write_spec(tmp_path / "spec.yml", names)
    lock = FileLock(str(catalog.db.duckdb_path) + ".lock")
    with lock:
        r = cli(["sql", "SELECT 1", "--catalog", catalog_url], {"MERGEPIPE_LOCK_TIMEOUT": "0.3"})
        assert r.returncode == 1 and one_line_error(r.stderr, "CatalogLockedError"), r.stderr
        assert "MERGEPIPE_LOCK_TIMEOUT" in r.stderr
        monkeypatch.setenv("MERGEPIPE_LOCK_TIMEOUT", "0.2")
        with pytest.raises(CatalogLockedError) as ei:
            catalog.sql("SELECT 1")
        assert ei.value.retryable

    # Another process takes the lock after the merge executed, just before its commit, and keeps it.
    real_commit, holder = cm.commit, FileLock(str(catalog.db.duckdb_path) + ".lock")

    def commit_while_locked(db, plan, result, **kw):
        holder.acquire()
        return real_commit(db, plan, result, **kw)

    monkeypatch.setattr(cm, "commit", commit_while_locked)
    try:
        with pytest.raises(CatalogLockedError):
            catalog.merge(spec, out=tmp_path / "out", ref="r")
    finally:
        holder.release()
    monkeypatch.undo()
    assert not (tmp_path / "out").exists() and staging_dirs(tmp_path) == []
    leftovers = [f for f in catalog.fsck() if f.kind != "ok"]
    assert leftovers and all(f.kind == "leftover" for f in leftovers)  # the intent the lock kept it from dropping
    assert catalog.gc(dry_run=False)
    res = catalog.merge(spec, out=tmp_path / "out", ref="r")
    assert res.version == 1
    _assert_clean(catalog, tmp_path)
