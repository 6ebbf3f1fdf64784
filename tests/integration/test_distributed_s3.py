"""Distributed (Dask) merges with object storage (`mergepipe_db.distributed` + `io.s3`, SeaweedFS `weed mini`):
``--out s3://...`` from a 2-worker cluster byte-identical to the single-process S3 merge (task attempts under
keys of their own, the winners' shards copied to the keys the index names, every task key gone); the
coordinator's storage options reaching workers that have no ``AWS_*`` environment (and the merge failing
typed, nothing visible, where they are not given); a worker killed during the merge (its task runs again, what
it wrote removed); workers killed past the retries (WorkerLostError, nothing under the prefix once `gc` ran).

One `LocalCluster` of 2 worker processes serves the module, started with no ``AWS_*`` variable in the
environment (its nannies, and the workers they restart, have none) and `allowed-failures` = 1."""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from mergepipe_db import Catalog
from mergepipe_db.db import schema
from mergepipe_db.errors import StorageConfigError, WorkerLostError
from mergepipe_db.io import s3 as s3io

pytestmark = pytest.mark.catalog

SHARD = 20_000  # the tiny family's output in several shards, tasks of more than one shard


@pytest.fixture(scope="module")
def client(s3_server):
    import dask
    from distributed import Client, LocalCluster

    with contextlib.ExitStack() as stack:
        saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("AWS_")}
        try:
            stack.enter_context(dask.config.set({"distributed.scheduler.allowed-failures": 1}))
            cluster = stack.enter_context(LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                                       dashboard_address=":0"))
        finally:
            os.environ.update(saved)
        yield stack.enter_context(Client(cluster))


@pytest.fixture(scope="module")
def s3_fam(s3_server, tmp_path_factory: pytest.TempPathFactory):
    """A tiny BF16 family (base + 2 experts) uploaded to the server: (family, prefix URI of its models)."""
    from s3server import BUCKET, upload_dir

    from mergepipe_db.demo.family import make_family

    fam = make_family(tmp_path_factory.mktemp("dask-s3"), n_experts=2, preset="tiny", dtype="bfloat16", seed=5,
                      shard_bytes=48 * 1024)
    prefix = f"s3://{BUCKET}/dfam-{uuid.uuid4().hex[:10]}"
    for d in (fam.base, *fam.experts):
        upload_dir(s3_server, Path(d), f"{prefix}/{Path(d).name}")
    return fam, prefix


def _options(s3_server, endpoint: str | None = None) -> dict[str, str]:
    env = s3_server.env()
    return {"endpoint": endpoint or env["AWS_ENDPOINT_URL"], "access_key_id": env["AWS_ACCESS_KEY_ID"],
            "secret_access_key": env["AWS_SECRET_ACCESS_KEY"], "region": env["AWS_REGION"]}


def _spec(fam) -> dict:
    return {"merge_method": "ties", "base_model": "base", "dtype": "bfloat16",
            "models": [{"model": Path(e).name, "parameters": {"weight": 0.5, "density": 0.6}} for e in fam.experts]}


def _ingest(cat: Catalog, s3_fam) -> None:
    fam, prefix = s3_fam
    cat.ingest(f"{prefix}/base", name="base")
    cat.ingest_many([f"{prefix}/{Path(e).name}" for e in fam.experts], base="base")


def _aws_env() -> list[str]:
    """In a worker: the AWS_* variables of its environment."""
    return sorted(k for k in os.environ if k.startswith("AWS_"))


def _table_counts(cat: Catalog) -> dict[str, int]:
    with cat.db.connect() as conn:
        return {t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())
                for t in schema.metadata.sorted_tables}


def _output(s3_server, out: str) -> dict[str, bytes]:
    """Every object of a published output, read from the server directly: shards by their index names with the
    attempt id taken out (in the index too), manifest.json without its timings."""
    from s3server import get_object, list_keys

    prefix = out.split("/", 3)[3]
    got = {}
    for key in list_keys(s3_server, out):
        name = key[len(prefix) + 1:]
        data = get_object(s3_server, f"{out}/{name}")
        if name == "manifest.json":
            doc = json.loads(data)
            data = json.dumps([doc["manifest_hash"], doc["manifest"]]).encode()
        elif name == "model.safetensors.index.json":
            data = re.sub(rb"\.[0-9a-f]{12}\.safetensors", b".safetensors", data)
        name = re.sub(r"\.[0-9a-f]{12}\.safetensors$", ".safetensors", name)
        got[name] = data
    return got


def _published_keys(s3_server, out: str) -> list[str]:
    """The keys under `out` a published output may have: the shards its index names, and objects that are
    not shards and not an attempt's staged files (index, manifest.json, side files) — `list_keys` must equal
    it (no task attempt's shard left, no staged manifest)."""
    from s3server import get_object, list_keys

    prefix = out.split("/", 3)[3]
    index = json.loads(get_object(s3_server, f"{out}/model.safetensors.index.json"))
    others = [k for k in list_keys(s3_server, out) if not k.endswith(".safetensors") and ".mergepipe-attempt-" not in k]
    assert {f"{prefix}/manifest.json", f"{prefix}/model.safetensors.index.json", f"{prefix}/config.json"} <= set(others)
    return sorted({f"{prefix}/{k}" for k in index["weight_map"].values()} | set(others))


def test_dask_merge_to_s3_is_byte_identical_and_options_reach_the_workers(s3_server, s3_env, catalog_url, s3_fam,
                                                                          client, monkeypatch) -> None:
    """s3:// inputs, --out s3://: workers with no AWS_* environment read and write through the coordinator's
    storage options; the output (every object), the manifest and its hash are the single-process S3 merge's;
    only the published keys are left under the prefix. The same merge with the options only in the
    coordinator's environment fails typed on the workers (they have no credentials), nothing visible."""
    from s3server import list_keys

    workers = set(client.scheduler_info()["workers"])
    assert client.run(_aws_env) == {w: [] for w in workers}  # checked outside the code under test
    cat = Catalog.open(catalog_url, storage_options=_options(s3_server))
    _ingest(cat, s3_fam)
    fam = s3_fam[0]
    one = cat.merge(_spec(fam), out=f"{s3_env}/one", budget=0.5, shard_bytes=SHARD)
    many = cat.merge(_spec(fam), out=f"{s3_env}/dask", budget=0.5, shard_bytes=SHARD, client=client)
    assert many.timings["n_tasks"] >= 2 and many.timings["n_workers"] == 2
    assert (many.manifest_hash, many.plan_hash) == (one.manifest_hash, one.plan_hash)
    assert many.realized_per_expert == one.realized_per_expert and many.realized_bytes == many.planned_bytes
    got, want = _output(s3_server, f"{s3_env}/dask"), _output(s3_server, f"{s3_env}/one")
    assert sum(n.endswith(".safetensors") for n in got) >= 3
    assert got == want
    assert list_keys(s3_server, f"{s3_env}/dask") == _published_keys(s3_server, f"{s3_env}/dask")
    assert cat.verify_snapshot("dask") == []
    assert [f for f in cat.fsck() if f.kind != "ok"] == []
    assert s3io.incomplete_uploads(f"{s3_env}/dask") == []

    s3io.set_storage_options(None)  # the coordinator keeps its environment (s3_env); the workers have none
    before = _table_counts(cat)
    with pytest.raises(StorageConfigError, match="no S3 credentials"):
        cat.merge(_spec(fam), out=f"{s3_env}/no-options", budget=0.5, shard_bytes=SHARD, client=client)
    assert list_keys(s3_server, f"{s3_env}/no-options") == []
    assert _table_counts(cat) == before

    # a shard larger than one server-side copy may make: refused before anything is written
    monkeypatch.setattr(s3io, "COPY_MAX_BYTES", (1 << 20) + SHARD // 2)
    s3io.set_storage_options(_options(s3_server))
    with pytest.raises(StorageConfigError, match="smaller --shard-size"):
        cat.merge(_spec(fam), out=f"{s3_env}/too-large", budget=0.5, shard_bytes=SHARD, client=client)
    assert list_keys(s3_server, f"{s3_env}/too-large") == []
    assert _table_counts(cat) == before


def test_cli_storage_options_reach_the_workers(s3_server, s3_env, catalog_url, s3_fam, client, tmp_path,
                                              monkeypatch) -> None:
    """`mergepipe merge --scheduler ADDR --out s3://... --storage-option ...` with no AWS_* anywhere (not in the
    CLI's environment, not in the workers'): the single-process merge's output and manifest hash."""
    import yaml
    from crashkit import cli

    cat = Catalog.open(catalog_url, storage_options=_options(s3_server))
    _ingest(cat, s3_fam)
    spec = tmp_path / "spec.yml"  # both merges from the file: a spec given as text also writes MergeKit's extras
    spec.write_text(yaml.safe_dump(_spec(s3_fam[0])))
    one = cat.merge(spec, out=f"{s3_env}/one", budget=0.5, shard_bytes=SHARD)
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    options = [a for k, v in _options(s3_server).items() for a in ("--storage-option", f"{k}={v}")]
    done = cli(["merge", str(spec), "--out", f"{s3_env}/cli", "--catalog", catalog_url, "--budget", "0.5",
                "--shard-size", str(SHARD), "--scheduler", client.scheduler.address, "--json", *options])
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout)
    assert res["manifest_hash"] == one.manifest_hash and res["timings"]["n_workers"] == 2
    assert _output(s3_server, f"{s3_env}/cli") == _output(s3_server, f"{s3_env}/one")


def _die_after_writing() -> None:
    """In a worker: the next shard task writes all its shards, then the process is SIGKILLed before it returns."""
    import signal

    from mergepipe_db.pipeline import execute

    real = execute.execute_shards

    def write_then_die(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    execute.execute_shards = write_then_die


def test_worker_killed_during_an_s3_merge(s3_server, s3_env, catalog_url, s3_fam, client) -> None:
    """One worker SIGKILLed after its task wrote its shards, before it returned: the task runs again on a worker,
    the output equals the single-process merge's, and the dead attempt's objects (seen written, through a
    counting proxy the workers used) are gone: only the published keys are under the prefix."""
    from s3server import CountingProxy, list_keys

    cat = Catalog.open(catalog_url, storage_options=_options(s3_server))
    _ingest(cat, s3_fam)
    fam = s3_fam[0]
    one = cat.merge(_spec(fam), out=f"{s3_env}/one", budget=0.5, shard_bytes=SHARD)
    victim = sorted(client.scheduler_info()["workers"])[0]
    proxy = CountingProxy(s3_server.endpoint)
    try:
        s3io.set_storage_options(_options(s3_server, proxy.endpoint))
        client.run(_die_after_writing, workers=[victim])
        many = cat.merge(_spec(fam), out=f"{s3_env}/dask", budget=0.5, shard_bytes=SHARD, client=client)
    finally:
        proxy.close()
        s3io.set_storage_options(_options(s3_server))
    client.wait_for_workers(2)
    assert victim not in set(client.scheduler_info()["workers"])  # it died (its nanny started a new one)
    assert many.manifest_hash == one.manifest_hash
    assert _output(s3_server, f"{s3_env}/dask") == _output(s3_server, f"{s3_env}/one")
    task_key = re.compile(r"/dask/model-\d+-of-\d+\.t[0-9a-f-]+\.[0-9a-f]{12}\.safetensors$")
    written = {r["path"] for r in proxy.records if r["method"] in ("PUT", "POST") and r["status"] < 300
               and task_key.search(r["path"])}
    copied_from = [r for r in proxy.records if r["method"] == "PUT" and r["status"] < 300
                   and "/dask/" in r["path"] and not task_key.search(r["path"]) and r["path"].endswith(".safetensors")]
    n_shards = len([n for n in _output(s3_server, f"{s3_env}/dask") if n.endswith(".safetensors")])
    assert len(copied_from) == n_shards  # each shard copied once to its published key
    assert len(written) > n_shards  # the dead attempt's shards were written too...
    assert list_keys(s3_server, f"{s3_env}/dask") == _published_keys(s3_server, f"{s3_env}/dask")  # ...and removed
    assert [f for f in cat.fsck() if f.kind != "ok"] == []


def _allowed_failures(value: int, dask_scheduler=None) -> int:
    old = dask_scheduler.allowed_failures
    dask_scheduler.allowed_failures = value
    return old


def _set_fault(value: str | None) -> None:
    if value is None:
        os.environ.pop("MERGEPIPE_FAULT", None)
    else:
        os.environ["MERGEPIPE_FAULT"] = value


def _executing(dask_worker=None) -> int:
    return dask_worker.state.executing_count


def _settle(client, workers: set[str]) -> None:
    """Wait (up to 60 s) until none of `workers` still alive executes a task (cancelled tasks run on)."""
    import time

    for _ in range(300):
        alive = [w for w in workers if w in client.scheduler_info()["workers"]]
        if not alive or not any(client.run(_executing, workers=alive, on_error="ignore").values()):
            return
        time.sleep(0.2)
    raise AssertionError("a task of the failed merge kept running")


def test_workers_killed_past_retries_during_an_s3_merge(s3_server, s3_env, catalog_url, s3_fam, client) -> None:
    """No retries (`allowed_failures` 0) and every worker dying in its second written tensor: WorkerLostError,
    the catalog as before, no manifest.json or index under the prefix, and nothing at all once `gc` ran
    (objects and unfinished uploads). (Last on the module's cluster: the nannies start fresh workers.)"""
    from s3server import list_keys

    cat = Catalog.open(catalog_url, storage_options=_options(s3_server))
    _ingest(cat, s3_fam)
    before = _table_counts(cat)
    out = f"{s3_env}/dask"
    original = set(client.scheduler_info()["workers"])
    retries = client.run_on_scheduler(_allowed_failures, 0)
    client.run(_set_fault, "tensor_written:2")
    try:
        with pytest.raises(WorkerLostError, match="nothing was published"):
            cat.merge(_spec(s3_fam[0]), out=out, budget=0.5, shard_bytes=SHARD, client=client)
        _settle(client, original)  # no task of the failed merge still running: nothing written after gc
    finally:
        client.run_on_scheduler(_allowed_failures, retries)
        client.run(_set_fault, None, on_error="ignore")
        client.wait_for_workers(2)
    assert _table_counts(cat) == before
    keys = list_keys(s3_server, out)
    assert not any(k.endswith(("/manifest.json", "/model.safetensors.index.json")) for k in keys)
    cat.gc(dry_run=False)
    assert list_keys(s3_server, out) == [] and s3io.incomplete_uploads(out) == []
    assert [f for f in cat.fsck() if f.kind != "ok"] == []


def _kill_scheduler_at_task_start(pid: int) -> None:
    """In a worker: the next shard task SIGKILLs the scheduler (process `pid`) as it starts, then waits forever
    (it writes nothing: the test ends the worker)."""
    import signal
    import time

    from mergepipe_db.core import faults

    def point(name: str) -> None:
        if name == "task_started":
            os.kill(pid, signal.SIGKILL)
            time.sleep(3600)

    faults.point = point


def test_scheduler_lost_mid_merge_is_typed_with_nothing_visible(s3_server, s3_env, catalog_url, s3_fam,
                                                                tmp_path) -> None:
    """A scheduler and a worker in processes of their own (`dask scheduler`, `dask worker`); the scheduler
    SIGKILLed as the merge's first task starts: DistributedError, the catalog as before, nothing under the
    output prefix (before any gc), no intent left."""
    import signal
    import subprocess
    import sys
    import time

    from distributed import Client
    from s3server import list_keys

    from mergepipe_db.errors import DistributedError

    cat = Catalog.open(catalog_url, storage_options=_options(s3_server))
    _ingest(cat, s3_fam)
    before = _table_counts(cat)
    sched_file = tmp_path / "scheduler.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MERGEPIPE_FAULT"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this module's functions, by reference
    procs = [subprocess.Popen([sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port", "0",
                               "--no-dashboard", "--scheduler-file", str(sched_file)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        for _ in range(300):
            if sched_file.is_file() and sched_file.stat().st_size:
                break
            time.sleep(0.1)
        address = json.loads(sched_file.read_text())["address"]
        procs.append(subprocess.Popen([sys.executable, "-m", "dask", "worker", address, "--nthreads", "1", "--no-nanny",
                                       "--no-dashboard"], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        with Client(address, timeout=30) as c:
            c.wait_for_workers(1, timeout=30)
            c.run(_kill_scheduler_at_task_start, procs[0].pid)
        out = f"{s3_env}/lost"
        with pytest.raises(DistributedError, match="lost the Dask cluster"):
            cat.merge(_spec(s3_fam[0]), out=out, budget=0.5, shard_bytes=SHARD, scheduler=address)
        assert procs[0].wait(timeout=10) == -signal.SIGKILL  # the scheduler was killed (by the worker)
    finally:
        for p in procs[::-1]:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    assert _table_counts(cat) == before
    assert list_keys(s3_server, out) == []
