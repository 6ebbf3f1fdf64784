"""Distributed merges on Dask (`mergepipe_db.distributed`): the output and manifest byte-identical to the
single-process merge, a worker killed mid-task (the task runs again, or the merge fails typed with nothing
visible), shard tasks of balanced bytes, the per-expert realized == planned check, the progress bar, the CLI.

One `LocalCluster` of 2 worker processes serves the module (its start-up costs seconds), created with
`distributed.scheduler.allowed-failures` = 1: a task is run again after one worker death (one test sets it to
0: the first death gives up). The catalog is DuckDB, or PostgreSQL under `MERGEPIPE_TEST_CATALOG` (`make test`
runs both)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import sqlalchemy as sa
from builders import make_spec
from conftest import ingest_family
from crashkit import cli, one_line_error

from mergepipe_db import Catalog
from mergepipe_db.db import schema
from mergepipe_db.errors import DistributedError, PlanExecutionMismatchError, WorkerLostError

pytestmark = pytest.mark.catalog

SHARD = 40_000  # the tiny family's output in 5 shards


@pytest.fixture(scope="module")
def client():
    import dask
    from distributed import Client, LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 1}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        yield c


def _table_counts(catalog: Catalog) -> dict[str, int]:
    with catalog.db.connect() as conn:
        return {t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())
                for t in schema.metadata.sorted_tables}


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes), manifest.json without its timings (wall times)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "manifest.json":
                doc = json.loads(data)
                data = json.dumps([doc["manifest_hash"], doc["manifest"]]).encode()
            out[str(p.relative_to(root))] = data
    return out


def _set_fault(value: str | None) -> None:
    """In a worker (or nanny) process: arm or disarm `core.faults` (a new worker process inherits its nanny's)."""
    if value is None:
        os.environ.pop("MERGEPIPE_FAULT", None)
    else:
        os.environ["MERGEPIPE_FAULT"] = value


def _forbid_catalog() -> None:
    """In a worker: any catalog connection or database engine made from now on raises."""
    import sqlalchemy

    from mergepipe_db.db import engine

    def refuse(*args, **kwargs):
        raise AssertionError("a worker touched the catalog")

    engine.Database.connect = refuse
    sqlalchemy.create_engine = refuse


def _allowed_failures(value: int, dask_scheduler=None) -> int:
    """On the scheduler: set how often a task may lose its worker before it fails; returns the old value."""
    old = dask_scheduler.allowed_failures
    dask_scheduler.allowed_failures = value
    return old


def _leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".mergepipe-staging-"))


def test_dask_merge_is_byte_identical_to_single_process(catalog, tiny_family, tmp_path, client, capsys) -> None:
    """Two methods (TIES at a partial budget, DARE at full): every output file, the manifest and its hash, the
    plan and the realized reads per expert as the single-process merge's; the catalog's block rows of both
    snapshots equal; several tasks ran; nothing of the attempts left; the progress bar counted the shards; the
    workers could not have opened a catalog connection."""
    names = ingest_family(catalog, tiny_family)
    client.run(_forbid_catalog)  # workers never touch the catalog
    for method, budget in (("ties", "0.3"), ("dare_linear", "1.0")):
        spec = make_spec(method, names)
        one = catalog.merge(spec, out=tmp_path / f"{method}-one", budget=budget, shard_bytes=SHARD)
        capsys.readouterr()
        many = catalog.merge(spec, out=tmp_path / f"{method}-dask", budget=budget, shard_bytes=SHARD, client=client,
                             progress=True)
        assert "5/5 [" in capsys.readouterr().err  # the progress bar counts shards done
        assert many.timings["n_tasks"] >= 2 and many.timings["n_workers"] == 2
        assert (many.manifest_hash, many.plan_hash) == (one.manifest_hash, one.plan_hash)
        assert many.realized_per_expert == one.realized_per_expert
        assert many.realized_bytes == many.planned_bytes == one.planned_bytes
        files = _files(tmp_path / f"{method}-dask")
        assert len([n for n in files if n.endswith(".safetensors")]) == 5
        assert files == _files(tmp_path / f"{method}-one")
        rows = []
        for res in (one, many):
            _, got = catalog.sql('SELECT tensor, block_idx, "offset", nbytes, xxh3, delta_l2, delta_max, pos_frac '
                                 f"FROM blocks WHERE checkpoint = '{res.checkpoint}' ORDER BY tensor_idx, block_idx")
            rows.append(got)
        assert rows[0] and rows[0] == rows[1]
    assert _leftovers(tmp_path) == []
    assert all(f.kind == "ok" for f in catalog.fsck())


def test_worker_killed_mid_task_task_runs_again(catalog, tiny_family, tmp_path, client) -> None:
    """One worker is SIGKILLed at its second written tensor (a task half done, a partial shard in its attempt
    directory): the scheduler runs the lost task again on a worker, and the merge's output equals the
    single-process merge's, with nothing of the dead attempt left."""
    names = ingest_family(catalog, tiny_family)
    spec = make_spec("ties", names)
    one = catalog.merge(spec, out=tmp_path / "one", budget="0.5", shard_bytes=SHARD)
    before = set(client.scheduler_info()["workers"])
    victim = sorted(before)[0]
    client.run(_set_fault, "tensor_written:2", workers=[victim])
    try:
        many = catalog.merge(spec, out=tmp_path / "dask", budget="0.5", shard_bytes=SHARD, client=client)
    finally:
        client.run(_set_fault, None)
    client.wait_for_workers(2)
    assert victim not in set(client.scheduler_info()["workers"])  # it died (its nanny started a new one)
    assert many.manifest_hash == one.manifest_hash
    assert _files(tmp_path / "dask") == _files(tmp_path / "one")
    assert _leftovers(tmp_path) == []


def test_shard_tasks_have_balanced_bytes() -> None:
    from mergepipe_db.distributed import split_tasks

    assert split_tasks([10] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_tasks([10] * 3, 8) == [[0], [1], [2]]
    assert split_tasks([100, 1, 1, 1, 1, 96], 2) == [[0], [1, 2, 3, 4, 5]]
    assert split_tasks([100, 1, 1, 1, 1, 50], 2) == [[0], [1, 2, 3, 4, 5]]
    assert split_tasks([1, 1, 100, 1, 1], 3) == [[0, 1], [2], [3, 4]]
    assert split_tasks([5], 4) == [[0]]
    for costs, k in (([3, 9, 1, 1, 7, 2, 2, 8, 5], 3), ([1] * 17, 5), ([50, 1, 1, 1], 3)):
        groups = split_tasks(costs, k)
        assert [s for g in groups for s in g] == list(range(len(costs)))  # each shard once, in order
        assert len(groups) <= k
        sums = [sum(costs[s] for s in g) for g in groups]
        # no group exceeds the ideal share by more than its largest shard
        assert all(s <= sum(costs) / k + max(costs) for s in sums)


def test_realized_per_expert_is_checked_against_the_plan(catalog, tiny_family, tmp_path) -> None:
    """The shard parts executed in this process (`execute_shards`, no cluster) combine into the whole
    merge's result; a part whose realized reads moved between experts (the total unchanged) is refused."""
    import dataclasses

    from mergepipe_db.jobs import plan_merge
    from mergepipe_db.pipeline.execute import combine_shard_results, execute, execute_shards, output_layout

    names = ingest_family(catalog, tiny_family)
    plan, _ = plan_merge(catalog.db, make_spec("ties", names), budget="0.5", seed=None, progress=False)
    layout = output_layout(plan, SHARD)
    (tmp_path / "whole").mkdir()
    whole = execute(plan, tmp_path / "whole", shard_bytes=SHARD)
    parts = []
    for i, shards in enumerate([[0, 1], [2], [3, 4]]):
        (tmp_path / f"p{i}").mkdir()
        parts.append((shards, execute_shards(plan, tmp_path / f"p{i}", layout, shards)))
        assert sorted(os.listdir(tmp_path / f"p{i}")) == [layout[1][s] for s in shards]
    got = combine_shard_results(plan, layout, parts[::-1])
    for field in ("shard_names", "shard_sha256", "shard_sizes", "out_tensors", "tensor_xxh3", "block_rows",
                  "realized_per_expert", "reads", "base_bytes", "output_bytes", "tensor_offsets", "header_lens"):
        assert getattr(got, field) == getattr(whole, field), field
    shards, res = next((s, r) for s, r in parts if r.realized_per_expert[0] and r.realized_per_expert[1])
    moved = [res.realized_per_expert[0] - 1, res.realized_per_expert[1] + 1, *res.realized_per_expert[2:]]
    bad = [(s, dataclasses.replace(r, realized_per_expert=moved) if s == shards else r) for s, r in parts]
    with pytest.raises(PlanExecutionMismatchError, match="per expert"):
        combine_shard_results(plan, layout, bad)
    with pytest.raises(PlanExecutionMismatchError, match="cover shards"):
        combine_shard_results(plan, layout, parts[:2])


def test_bad_distributed_arguments_are_typed(catalog, tiny_family, tmp_path, monkeypatch) -> None:
    from mergepipe_db import distributed

    names = ingest_family(catalog, tiny_family)
    before = _table_counts(catalog)
    spec = make_spec("linear", names)
    for kwargs in ({"workers": 0}, {"workers": -2}, {"scheduler": "localhost"}, {"workers": 2, "scheduler": "x"}):
        with pytest.raises(DistributedError):
            catalog.merge(spec, out=tmp_path / "o", **kwargs)
    monkeypatch.setattr(distributed, "CONNECT_TIMEOUT_S", 1)
    with pytest.raises(DistributedError, match="cannot reach the Dask scheduler"):
        catalog.merge(spec, out=tmp_path / "o", scheduler="tcp://127.0.0.1:9")
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as empty, Client(empty) as c, \
            pytest.raises(DistributedError, match="no workers"):
        catalog.merge(spec, out=tmp_path / "o", client=c)
    assert not (tmp_path / "o").exists()
    assert _table_counts(catalog) == before
    assert _leftovers(tmp_path) == []


def _cli_case(catalog, tiny_family, tmp_path):
    import yaml

    names = ingest_family(catalog, tiny_family)
    spec_path = tmp_path / "spec.yml"
    spec_path.write_text(yaml.safe_dump(make_spec("task_arithmetic", names, budget=0.4)))
    return spec_path, catalog.merge(spec_path, out=tmp_path / "one", shard_bytes=SHARD)


@pytest.mark.slow
def test_cli_workers_starts_a_local_cluster(catalog, catalog_url, tiny_family, tmp_path) -> None:
    """`mergepipe merge --workers 2`: a local cluster of its own (seconds to start), the same output."""
    spec_path, one = _cli_case(catalog, tiny_family, tmp_path)
    done = cli(["merge", str(spec_path), "--out", str(tmp_path / "dask"), "--catalog", catalog_url, "--workers", "2",
                "--shard-size", str(SHARD), "--json"])
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout)
    assert res["manifest_hash"] == one.manifest_hash and res["timings"]["n_workers"] == 2
    assert _files(tmp_path / "dask") == _files(tmp_path / "one")


def test_cli_scheduler(catalog, catalog_url, tiny_family, tmp_path, client) -> None:
    """`mergepipe merge --scheduler ADDR` (the module's cluster): the single-process merge's output and
    manifest hash; `--workers 0` one line, exit 1, nothing written."""
    spec_path, one = _cli_case(catalog, tiny_family, tmp_path)
    done = cli(["merge", str(spec_path), "--out", str(tmp_path / "dask"), "--catalog", catalog_url, "--scheduler",
                client.scheduler.address, "--shard-size", str(SHARD), "--json"])
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout)
    assert res["manifest_hash"] == one.manifest_hash and res["timings"]["n_workers"] == 2
    assert _files(tmp_path / "dask") == _files(tmp_path / "one")
    before = _table_counts(catalog)
    bad = cli(["merge", str(spec_path), "--out", str(tmp_path / "bad"), "--catalog", catalog_url, "--workers", "0"])
    assert bad.returncode == 1 and one_line_error(bad.stderr, "DistributedError"), bad.stderr
    assert not (tmp_path / "bad").exists() and _table_counts(catalog) == before


def test_workers_killed_past_retries_fail_typed_with_nothing_visible(catalog, tiny_family, tmp_path, client
                                                                     ) -> None:
    """The scheduler set to retry no task (`allowed_failures` 0) and both workers dying as they start a task:
    the merge is WorkerLostError; the output directory, the catalog and the staging area are as before.
    (Last in the module: the nannies start fresh, cold workers.)"""
    names = ingest_family(catalog, tiny_family)
    before = _table_counts(catalog)
    retries = client.run_on_scheduler(_allowed_failures, 0)
    client.run(_set_fault, "task_started")
    try:
        with pytest.raises(WorkerLostError, match="nothing was published"):
            catalog.merge(make_spec("ties", names), out=tmp_path / "dask", budget="0.5", shard_bytes=SHARD,
                          client=client)
    finally:
        client.run_on_scheduler(_allowed_failures, retries)
        client.run(_set_fault, None, on_error="ignore")  # a worker the merge did not kill (a dead one: ignored)
        # the nannies start new workers; no test uses them after this one, so the wait is bounded (a nanny that
        # did not restart its worker once left `make test` waiting here for good)
        with contextlib.suppress(TimeoutError):
            client.wait_for_workers(2, timeout=60)
    assert not (tmp_path / "dask").exists()
    assert _table_counts(catalog) == before
    assert _leftovers(tmp_path) == []
    assert catalog.gc(dry_run=True) == []
