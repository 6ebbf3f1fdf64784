"""Reliability run: kills, concurrent writers, malformed input and fuzzing, counted; writes results/reliability.md.

    .venv/bin/python -m benchmarks.reliability [--kills 32] [--ingest-kills 8] [--rounds 3] [--fuzz-seconds 60]
                                               [--catalog postgresql+psycopg://...] [--seed N]

The same checks as tests/faults/test_crash.py, test_concurrency.py, test_hostile.py, test_corruption.py,
test_full_disk.py and test_fuzz_inputs.py (helpers in tests/crashkit.py), run many more times:

* merge kills: a CLI merge is SIGKILLed at a fault point (`MERGEPIPE_FAULT=tensor_written:<random n>` and the
  other commit steps) or from outside at a random moment; after each kill the catalog reopens, `mergepipe sql`
  shows no partial snapshot, --out holds nothing or the complete output, fsck finds only leftovers gc collects,
  gc collects them, and a rerun (or the rolled-forward output) has the reference hashes;
* ingest kills: a CLI ingest of an expert is SIGKILLed while it reads (or earlier); the catalog holds the
  complete checkpoint or nothing of it, and a rerun gives the same content id;
* concurrent writers: rounds of four CLI merges on one ref (each commits or fails with a typed retryable error),
  then four workers retrying until every merge on the shared ref and on their own refs has committed, with a
  reader checking that every snapshot it sees is whole;
* malformed input: bad names, escaping indexes and symlinks, pickles, malformed safetensors, SQL reaching for
  files, bad specs, corrupted and drifted sources, a full disk — each must be refused with the named error;
* fuzzing: `pytest -m fuzz tests/core/test_fuzz_inputs.py` for --fuzz-seconds per target.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
RESULTS = REPO / "benchmarks" / "results"

import crashkit  # noqa: E402


def log(msg: str) -> None:
    print(f"[reliability] {msg}", flush=True)


class Catalogs:
    """Fresh catalogs: DuckDB files under `work`, or schemas of one PostgreSQL database (dropped at the end)."""

    def __init__(self, work: Path, pg_url: str | None) -> None:
        self.work, self.pg_url, self.schemas = work, pg_url, []
        self.urls: dict[str, str] = {}

    def new(self, name: str) -> str:
        self.urls[name] = self._new(name)
        return self.urls[name]

    def _new(self, name: str) -> str:
        if not self.pg_url:
            return str(self.work / f"{name}.duckdb")
        import sqlalchemy as sa

        schema = f"rel_{name}_{uuid.uuid4().hex[:8]}"
        engine = sa.create_engine(self.pg_url)
        with engine.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        engine.dispose()
        self.schemas.append(schema)
        sep = "&" if "?" in self.pg_url else "?"
        return f"{self.pg_url}{sep}options=-csearch_path%3D{schema}"

    def drop(self) -> None:
        if not self.pg_url:
            return
        import sqlalchemy as sa

        engine = sa.create_engine(self.pg_url)
        with engine.begin() as conn:
            for s in self.schemas:
                conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{s}" CASCADE'))
        engine.dispose()


def ingest_all(cat: Any, fam: Any) -> list[str]:
    cat.ingest(fam.base, name="base", block_bytes=4096)
    names = []
    for i, p in enumerate(fam.experts[:3]):
        cat.ingest(p, name=f"e{i}", base="base")
        names.append(f"e{i}")
    return names


# --- sections ------------------------------------------------------------------------------------------------


def merge_kills(cats: Catalogs, fam: Any, work: Path, n: int, seed: int) -> dict[str, Any]:
    from mergepipe_db import Catalog

    url = cats.new("kills")
    cat = Catalog.open(url)
    spec = crashkit.write_spec(work / "spec.yml", ingest_all(cat, fam))
    reference = crashkit.output_hashes(Path(cat.merge(spec, out=work / "reference", ref="reference").out))
    t0 = time.monotonic()
    stats = crashkit.merge_kill_trials(url, spec, work, n=n, rng=random.Random(seed), reference=reference,
                                       n_tensors=len(fam_tensors(fam)), seed=seed, log=log)
    d = stats.to_dict()
    d["seconds"] = time.monotonic() - t0
    d["snapshots_verified"] = verify_all_snapshots(cat)
    return d


def fam_tensors(fam: Any) -> list[str]:
    from mergepipe_db.formats.hf_layout import resolve_checkpoint

    return [t.name for h in resolve_checkpoint(fam.base).files for t in h.tensors]


def verify_all_snapshots(cat: Any) -> int:
    """Rehash every committed snapshot's files and tensors against its manifest; raise on any difference."""
    from mergepipe_db.admin.maintenance import committed_snapshots, verify_snapshot

    names = committed_snapshots(cat.db)
    for name in names:
        problems = verify_snapshot(cat.db, name)
        assert not problems, problems
    return len(names)


def ingest_kills(cats: Catalogs, work: Path, n: int, seed: int) -> dict[str, Any]:
    from mergepipe_db import Catalog
    from mergepipe_db.demo.family import make_family

    fam = make_family(work / "ingest-fam", n_experts=n, preset="tiny", dtype="bfloat16", seed=5, shard_bytes=48 << 10)
    scratch = Catalog.open(str(work / "ingest-scratch.duckdb"))
    scratch.ingest(fam.base, name="base", block_bytes=4096)
    ids = {p.name: scratch.ingest(p, name=p.name, base="base").checkpoint_id for p in fam.experts}
    url = cats.new("ingest")
    Catalog.open(url).ingest(fam.base, name="base", block_bytes=4096)
    t0 = time.monotonic()
    stats = crashkit.ingest_kill_trials(url, list(fam.experts), rng=random.Random(seed), reference_ids=ids,
                                        seed=seed, log=log)
    d = stats.to_dict()
    d["seconds"] = time.monotonic() - t0
    return d


def concurrency(cats: Catalogs, fam: Any, work: Path, rounds: int) -> dict[str, Any]:
    from mergepipe_db import Catalog

    url = cats.new("concurrency")
    cat = Catalog.open(url)
    spec = crashkit.write_spec(work / "cspec.yml", ingest_all(cat, fam))
    reference = crashkit.output_hashes(Path(cat.merge(spec, out=work / "creference", ref="creference").out))
    crashkit_py = str(REPO / "tests" / "crashkit.py")
    stop, result = work / "reader.stop", work / "reader.json"
    reader = subprocess.Popen([sys.executable, crashkit_py, "reader", "--catalog", url, "--stop", str(stop),
                               "--parents", "4", "--result", str(result)])
    runs, committed, errors = 0, 0, Counter()
    for r in range(rounds):  # four one-shot CLI writers on one ref
        outs = [work / f"c{r}-{i}" for i in range(4)]
        procs = [crashkit.popen_cli(["merge", str(spec), "--out", str(o), "--ref", "shared", "--catalog", url,
                                     "--quiet"]) for o in outs]
        for o, p in zip(outs, procs):
            _out, err = p.communicate(timeout=600)
            runs += 1
            if p.returncode == 0:
                committed += 1
                assert crashkit.output_hashes(o) == reference
            else:
                assert p.returncode == 1 and crashkit.one_line_error(err, "CommitConflictError",
                                                                    "CatalogLockedError"), err
                errors[err.split(":")[2].strip()] += 1
                assert not o.exists()
    version, names = crashkit.ref_history(cat, "shared")
    assert version == committed and names == [f"shared@{v}" for v in range(1, committed + 1)], (version, names)
    workers = []
    for i in range(4):  # four workers that retry until both their merges commit
        res = work / f"worker{i}.json"
        jobs = [f"{work / f'r-{i}-shared'}:retry", f"{work / f'r-{i}-own'}:own{i}"][:: 1 if i % 2 else -1]
        cmd = [sys.executable, crashkit_py, "merge-retry", "--catalog", url, "--spec", str(spec), "--result", str(res)]
        for j in jobs:
            cmd += ["--job", j]
        workers.append((subprocess.Popen(cmd), res))
    for p, _res in workers:
        assert p.wait(timeout=900) == 0
    stop.touch()
    assert reader.wait(timeout=300) == 0
    seen = json.loads(result.read_text())
    results = [x for _p, res in workers for x in json.loads(res.read_text())]
    assert all(x["ok"] for x in results), results
    retries = sum(x["attempts"] - 1 for x in results)
    retry_errors = Counter(e for x in results for e in x["errors"])
    assert crashkit.ref_history(cat, "retry") == (4, [f"retry@{v}" for v in range(1, 5)])
    for x in results:
        assert crashkit.output_hashes(Path(x["out"])) == reference
    assert seen["problems"] == [], seen["problems"][:3]
    assert crashkit.whole_snapshots(cat, n_parents=4) == []
    return {"one_shot_runs": runs, "one_shot_committed": committed, "one_shot_errors": dict(errors),
            "retrying_merges": len(results), "retrying_committed": sum(x["ok"] for x in results),
            "retries": retries, "retry_errors": dict(retry_errors), "reader_reads": seen["reads"],
            "reader_problems": len(seen["problems"]), "snapshots_verified": verify_all_snapshots(cat)}


# --- malformed input battery -------------------------------------------------------------------------------------


class Battery:
    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}

    def expect(self, category: str, errors: tuple[type, ...] | type, fn: Any, *args: Any, **kw: Any) -> None:
        ok = self.counts.setdefault(category, [0, 0])
        ok[1] += 1
        try:
            fn(*args, **kw)
        except errors as e:
            if "\n" not in str(e):
                ok[0] += 1
                return
            log(f"{category}: multi-line message: {e!r}")
        except Exception as e:  # noqa: BLE001 - counted as not rejected properly
            log(f"{category}: {fn.__name__}{args!r}: unexpected {type(e).__name__}: {e}")
            return
        else:
            log(f"{category}: {fn.__name__}{args!r} was accepted")


def malformed(cats: Catalogs, fam: Any, work: Path) -> dict[str, list[int]]:
    import torch
    from safetensors.torch import save_file
    from test_hostile import (
        BAD_INDEX_DOCS,
        BAD_NAMES,
        DUCKDB_ESCAPES,
        ESCAPING_SHARDS,
        POSTGRES_ESCAPES,
        _Payload,
        _raw_safetensors,
    )
    from test_merge import BAD_SPECS

    from mergepipe_db import Catalog
    from mergepipe_db import errors as E

    url = cats.new("malformed")
    cat = Catalog.open(url)
    b = Battery()
    d = work / "malformed"
    d.mkdir()
    for i, name in enumerate(BAD_NAMES):
        b.expect("tensor names (empty, >1024 B, NUL, control)", E.BadTensorNameError, cat.ingest,
                 _raw_safetensors(d / f"n{i}.safetensors", ["ok", name]), name=f"n{i}")
    for name in ("", "a\x00b", "line\nbreak", "y" * 1025):
        b.expect("checkpoint names", E.BadCheckpointError, cat.ingest, _raw_safetensors(d / "okname.safetensors",
                                                                                       ["ok"]), name=name)
    save_file({"w": torch.ones(2)}, str(d / "outside.safetensors"))
    for i, shard in enumerate(ESCAPING_SHARDS):
        ck = d / f"shard{i}"
        ck.mkdir()
        (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
        b.expect("shard names escaping the directory", E.ShardIndexError, cat.ingest, ck, name=f"s{i}")
    for i, doc in enumerate(BAD_INDEX_DOCS):
        ck = d / f"index{i}"
        ck.mkdir()
        (ck / "model.safetensors.index.json").write_text(doc)
        b.expect("malformed index json", E.ShardIndexError, cat.ingest, ck, name=f"i{i}")
    for i, (link_name, target, err) in enumerate([
            ("model.safetensors", d / "outside.safetensors", E.SymlinkEscapeError),
            ("config.json", Path("/etc/passwd"), E.SymlinkEscapeError)]):
        ck = d / f"link{i}"
        ck.mkdir()
        if link_name == "config.json":
            save_file({"w": torch.ones(2)}, str(ck / "model.safetensors"))
        (ck / link_name).symlink_to(target)
        b.expect("symlinks out of the checkpoint", err, cat.ingest, ck, name=f"l{i}")
    ck = d / "link-shard"
    ck.mkdir()
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "m-1.safetensors"}}))
    (ck / "m-1.safetensors").symlink_to(d / "outside.safetensors")
    b.expect("symlinks out of the checkpoint", E.ShardSymlinkEscapeError, cat.ingest, ck, name="ls")

    marker = d / "PWNED"
    payload = pickle.dumps(_Payload(marker))
    targets = []
    for suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
        (d / f"evil{suffix}").write_bytes(payload)
        targets.append(d / f"evil{suffix}")
    (d / "evil_dir").mkdir()
    (d / "evil_dir" / "pytorch_model.bin").write_bytes(payload)
    (d / "evil_index").mkdir()
    (d / "evil_index" / "pytorch_model.bin").write_bytes(payload)
    (d / "evil_index" / "model.safetensors.index.json").write_text(json.dumps({"weight_map":
                                                                               {"w": "pytorch_model.bin"}}))
    for t in [*targets, d / "evil_dir", d / "evil_index"]:
        b.expect("pickle checkpoints (never unpickled)", E.PickleRefusedError, cat.ingest, t, name="evil")
    (d / "disguised").mkdir()
    (d / "disguised" / "model.safetensors").write_bytes(payload)
    b.expect("pickle checkpoints (never unpickled)", E.SafetensorsFormatError, cat.ingest, d / "disguised",
             name="evil")
    assert not marker.exists(), "a pickle payload ran"

    header = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    for i, blob in enumerate([b"", b"\x01", (2**63).to_bytes(8, "little"), len(b"{bad").to_bytes(8, "little")
                              + b"{bad", len(header).to_bytes(8, "little") + header + b"\0" * 12,
                              len(header).to_bytes(8, "little") + header + b"\0" * 4,
                              (2).to_bytes(8, "little") + b"[]", (4).to_bytes(8, "little") + b"\xff\xfe{}"]):
        (d / f"bad{i}.safetensors").write_bytes(blob)
        b.expect("malformed safetensors files", E.SafetensorsFormatError, cat.ingest, d / f"bad{i}.safetensors",
                 name=f"b{i}")

    ingest_all(cat, fam)
    secret = d / "secret.csv"
    secret.write_text("a\nTOPSECRET\n")
    leak = d / "leak.csv"
    for q in DUCKDB_ESCAPES if cat.db.is_duckdb else POSTGRES_ESCAPES:
        b.expect("mergepipe sql reaching for files or writing", (E.ReadOnlySqlError, E.CatalogError), cat.sql,
                 q.format(secret=secret, dir=d, leak=leak))
    assert not leak.exists()
    for case, (spec, err) in BAD_SPECS.items():
        b.expect("bad merge specs", err, cat.merge, spec, out=d / f"spec-{case.replace(' ', '_')}")
    ok = "merge_method: linear\nbase_model: base\nmodels: [{model: e0, parameters: {weight: 1}}]\n"
    for i, text in enumerate([ok + "budget: 1e300TiB", ok + "seed: 2020-13-45", ok + "seed: !!float x",
                              ok + "seed: 99999999999999999999999", ok.replace("weight: 1", "weight: 1" + "0" * 400),
                              "a: " + "[" * 5000, "- " * 3000 + "x", "\x00", "{merge_method: [}"]):
        (d / f"spec{i}.yml").write_text(text)
        b.expect("bad merge specs", E.SpecError, cat.merge, d / f"spec{i}.yml", out=d / f"yspec{i}")

    # Sources corrupted or changed after ingest (a copy of the family, so the others keep theirs).
    src = work / "corrupt-fam"
    shutil.copytree(fam.root, src)
    ccat = Catalog.open(cats.new("corrupt"))
    ccat.ingest(src / "base", name="base", block_bytes=4096)
    experts = sorted(p for p in src.iterdir() if p.name.startswith("expert_"))[:3]
    for i, p in enumerate(experts):
        ccat.ingest(p, name=f"e{i}", base="base")
    cspec = crashkit.write_spec(d / "cspec.yml", ["e0", "e1", "e2"], method="task_arithmetic", budget=0.5)
    plan = ccat.plan(cspec)
    e = plan.experts[0]
    t, r = max(((e.tensors[t.name], r) for t in plan.base_tensors for r in plan.access.get((0, t.idx), ())
                if r.block_idx >= 0), key=lambda x: x[1].nbytes)
    st = os.stat(t.path)
    with open(t.path, "r+b") as fh:
        fh.seek(r.offset + r.nbytes // 2)
        v = fh.read(1)
        fh.seek(r.offset + r.nbytes // 2)
        fh.write(bytes([v[0] ^ 0x40]))
    os.utime(t.path, ns=(st.st_atime_ns, st.st_mtime_ns))
    b.expect("corrupted and drifted sources", E.IntegrityError, ccat.merge, cspec, out=d / "c0", verify_reads=True)
    victim = sorted(experts[1].glob("*.safetensors"))[0]
    os.truncate(victim, victim.stat().st_size - 100)
    b.expect("corrupted and drifted sources", E.StaleSourceError, ccat.merge, cspec, out=d / "c1")
    victim.unlink()
    b.expect("corrupted and drifted sources", E.StaleSourceError, ccat.merge, cspec, out=d / "c2")

    full_disk(b, cat, d)
    return b.counts


def full_disk(b: Battery, cat: Any, d: Path) -> None:
    from mergepipe_db.errors import OutOfSpaceError

    if os.geteuid() != 0:
        log("full disk: skipped (mounting a tmpfs needs root)")
        return
    spec = crashkit.write_spec(d / "fspec.yml", ["e0", "e1", "e2"])
    for i, kib in enumerate((64, 184, 200)):  # out of space in the shard, the side files, the manifest
        mnt = d / f"small{i}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(mnt)], capture_output=True)
        if r.returncode != 0:
            log(f"full disk: skipped (mount failed: {r.stderr.decode().strip()})")
            return
        try:
            b.expect("full disk (small tmpfs)", OutOfSpaceError, cat.merge, spec, out=mnt / "out", ref=f"full{i}")
            assert list(mnt.iterdir()) == [], "leftovers on the full disk"
        finally:
            subprocess.run(["umount", str(mnt)], check=True)


# --- fuzzing -------------------------------------------------------------------------------------------------------


def fuzz(seconds: float, work: Path) -> dict[str, Any]:
    report = work / "fuzz.json"
    env = dict(os.environ, MERGEPIPE_FUZZ_SECONDS=str(seconds), MERGEPIPE_FUZZ_REPORT=str(report))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "fuzz", "-p", "no:cacheprovider", "-s",
                        "tests/core/test_fuzz_inputs.py"], cwd=str(REPO), env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"fuzz run failed:\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
    return json.loads(report.read_text())


# --- report ----------------------------------------------------------------------------------------------------------


def write_report(res: dict[str, Any], args: argparse.Namespace, backend: str, wall: float) -> str:
    from benchmarks.common import machine_line, md_table

    rows = []
    mk = res.get("merge_kills")
    if isinstance(mk, dict):
        rows.append(["merge kills survived (kill -9 at random moments)",
                     f"{mk['killed'] + mk['finished_first']} / {mk['trials']}",
                     f"{mk['killed']} killed mid-run ({mk['rolled_back']} rolled back, {mk['rolled_forward']} "
                     f"rolled forward by gc, {mk['killed'] - mk['rolled_back'] - mk['rolled_forward']} after the "
                     f"rename), {mk['finished_first']} finished before the kill; "
                     f"{mk['leftovers_collected']} leftovers collected by gc; {mk['reruns_identical']} reruns "
                     f"with the reference manifest hash; modes {mk['modes']}"])
    ik = res.get("ingest_kills")
    if isinstance(ik, dict):
        rows.append(["ingest kills survived", f"{ik['trials']} / {ik['trials']}",
                     f"{ik['killed']} killed ({ik['rolled_back']} left no row, {ik['rolled_forward']} complete), "
                     f"{ik['finished_first']} finished first; {ik['reruns_identical']} reruns with the same content "
                     f"id; modes {ik['modes']}"])
    cc = res.get("concurrency")
    if isinstance(cc, dict):
        rows.append(["concurrent one-shot runs committed / failed retryably",
                     f"{cc['one_shot_committed']} / {cc['one_shot_runs'] - cc['one_shot_committed']}",
                     f"{cc['one_shot_runs']} CLI merges, 4 at a time on one ref; failures: {cc['one_shot_errors']} "
                     "(one line, exit 1, nothing published); ref versions 1..n, no gap"])
        rows.append(["concurrent retrying runs committed / retries",
                     f"{cc['retrying_committed']} / {cc['retries']}",
                     f"{cc['retrying_merges']} merges by 4 workers (shared ref + own refs); retried on "
                     f"{cc['retry_errors']}; shared ref at version 4 with 4 snapshots: no lost update"])
        rows.append(["reader queries during commits", str(cc["reader_reads"]),
                     f"{cc['reader_problems']} partial snapshots seen"])
    mal = res.get("malformed")
    if isinstance(mal, dict):
        ok = sum(v[0] for v in mal.values())
        total = sum(v[1] for v in mal.values())
        rows.append(["malformed inputs rejected", f"{ok} / {total}",
                     "; ".join(f"{k}: {v[0]}/{v[1]}" for k, v in mal.items())])
    fz = res.get("fuzz")
    if isinstance(fz, dict):
        rows.append(["fuzz executions", str(sum(v["executions"] for v in fz.values())),
                     "; ".join(f"{k}: {v['executions']} in {v['seconds']:.0f} s" for k, v in fz.items())
                     + " (hypothesis; only MergePipeError escaped)"])
    lost = res.get("nothing_lost")
    if isinstance(lost, dict):
        rows.append(["nothing lost", "yes" if lost["problems"] == 0 else "NO",
                     f"fsck after every kill and at the end: {lost['problems']} missing/corrupt; "
                     f"{lost['snapshots_verified']} committed snapshots rehashed against their manifests"])
    failed = {k: v for k, v in res.items() if isinstance(v, str) and k != "backend"}
    for k, v in failed.items():
        rows.append([k, "FAILED", v.splitlines()[0][:300]])
    text = (
        f"# Reliability ({backend}): kills, concurrent writers, malformed input, fuzzing\n\n"
        f"Generated by `.venv/bin/python -m benchmarks.reliability --kills {args.kills} --ingest-kills "
        f"{args.ingest_kills} --rounds {args.rounds} --fuzz-seconds {args.fuzz_seconds:g} --seed {args.seed}` "
        f"on {backend} ({wall:.0f} s wall; {machine_line()}). The same checks run in the test suite "
        "(tests/faults/test_crash.py, test_concurrency.py, test_hostile.py, test_corruption.py, test_full_disk.py, "
        "test_fuzz_inputs.py), a few times each; here they run many times.\n\n"
        + md_table(["check", "count", "detail"], rows)
        + "\nAfter every kill: the catalog reopens, `mergepipe sql \"SELECT * FROM snapshots\"` lists no partial "
        "snapshot, --out holds nothing or the complete output, `fsck` reports only leftovers that `gc --apply` "
        "collects, gc collects them, and the rerun (or the output gc rolled forward) has the reference manifest "
        "hash and file hashes.\n"
    )
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=32, help="merge kill trials (default 32)")
    p.add_argument("--ingest-kills", type=int, default=8, help="ingest kill trials (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of four one-shot concurrent writers (default 3)")
    p.add_argument("--fuzz-seconds", type=float, default=60, help="seconds per fuzz target (default 60; 0 skips)")
    p.add_argument("--catalog", help="PostgreSQL URL to run on (default: DuckDB files); "
                   "default also $MERGEPIPE_TEST_CATALOG")
    p.add_argument("--seed", type=int, default=None, help="seed of the random kill moments")
    p.add_argument("--work", help="working directory (default: a new temporary directory, removed at the end)")
    p.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/reliability.md "
                   "(reliability-postgresql.md on PostgreSQL)")
    args = p.parse_args(argv)
    args.seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    pg = args.catalog or os.environ.get("MERGEPIPE_TEST_CATALOG") or None
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="mergepipe-reliability-"))
    work.mkdir(parents=True, exist_ok=True)
    cats = Catalogs(work, pg)
    backend = "PostgreSQL" if pg else "DuckDB"
    log(f"work {work}, backend {backend}, seed {args.seed}")
    t_start = time.monotonic()
    res: dict[str, Any] = {"seed": args.seed, "backend": backend}
    from mergepipe_db.demo.family import make_family

    fam = make_family(work / "fam", n_experts=3, preset="tiny", dtype="bfloat16", seed=1, shard_bytes=48 << 10)
    sections = [
        ("merge_kills", lambda: merge_kills(cats, fam, work / "kills", args.kills, args.seed)),
        ("ingest_kills", lambda: ingest_kills(cats, work / "ingest", args.ingest_kills, args.seed)),
        ("concurrency", lambda: concurrency(cats, fam, work / "concurrency", args.rounds)),
        ("malformed", lambda: malformed(cats, fam, work)),
        ("fuzz", lambda: fuzz(args.fuzz_seconds, work)),
    ]
    if args.fuzz_seconds <= 0:
        sections.pop()
    for d in ("kills", "ingest", "concurrency"):
        (work / d).mkdir(exist_ok=True)
    for name, fn in sections:
        t0 = time.monotonic()
        try:
            res[name] = fn()
            log(f"{name}: {json.dumps(res[name], default=str)} ({time.monotonic() - t0:.0f} s)")
        except Exception as e:  # noqa: BLE001 - reported in the table, exit status 1
            res[name] = f"{type(e).__name__}: {e}"
            log(f"{name} FAILED:\n{traceback.format_exc()}")
    problems, verified = 0, 0
    from mergepipe_db import Catalog
    from mergepipe_db.admin.fsck import problems as fsck_problems

    for name in ("kills", "ingest", "concurrency"):  # not "corrupt": its sources were damaged on purpose
        if name in cats.urls:
            found = fsck_problems(Catalog.open(cats.urls[name]).fsck(full=True))
            problems += len(found)
            for f in found:
                log(f"fsck {name}: {f}")
    for key in ("merge_kills", "concurrency"):
        if isinstance(res.get(key), dict):
            verified += res[key].get("snapshots_verified", 0)
    res["nothing_lost"] = {"problems": problems, "snapshots_verified": verified}
    wall = time.monotonic() - t_start
    text = write_report(res, args, backend, wall)
    print(text)
    if not args.no_write:  # reliability.md (DuckDB) or reliability-postgresql.md
        name = "reliability" if not pg else "reliability-postgresql"
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.md").write_text(text)
        (RESULTS / "raw").mkdir(exist_ok=True)
        (RESULTS / "raw" / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    cats.drop()
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(isinstance(v, str) and k not in ("backend",) for k, v in res.items()) else 0


if __name__ == "__main__":
    sys.exit(main())
