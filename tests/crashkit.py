"""Helpers for the crash, concurrency and fault tests, shared with `benchmarks/reliability.py`.

- `cli` / `popen_cli`: run `mergepipe` as a subprocess (SIGKILL needs a process of its own);
- `merge_kill_trials` / `ingest_kill_trials`: kill -9 a merge or an ingest at random moments and check,
  after each kill, that the catalog reopens, nothing partial is visible (`mergepipe sql`, `--out`), fsck finds
  only collectable leftovers, gc collects them, and a rerun gives the same output hashes;
- `ingest_fault_trials`: kill an ingest at each of its fault points (`faults.INGEST_POINTS`), asserting each
  kill happened, and check the same;
- `whole_snapshots`: the reader's check that every snapshot the catalog shows is complete;
- run as a script, a worker for the concurrency tests (`merge-retry`, `reader`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# One row per snapshot (base tables: a view would hide a snapshot whose checkpoint row is missing).
SNAPSHOT_SQL = """
SELECT s.id, s.ref, s.out_path,
  (SELECT COUNT(*) FROM mp_checkpoint c WHERE c.id = s.checkpoint_id) AS checkpoints,
  (SELECT MAX(c.n_tensors) FROM mp_checkpoint c WHERE c.id = s.checkpoint_id) AS n_tensors,
  (SELECT MAX(c.name) FROM mp_checkpoint c WHERE c.id = s.checkpoint_id) AS name,
  (SELECT COUNT(*) FROM mp_tensor t WHERE t.checkpoint_id = s.checkpoint_id) AS tensors,
  (SELECT COUNT(*) FROM mp_file f WHERE f.checkpoint_id = s.checkpoint_id) AS files,
  (SELECT COUNT(*) FROM mp_manifest m WHERE m.snapshot_id = s.id) AS manifests,
  (SELECT COUNT(*) FROM mp_lineage l WHERE l.snapshot_id = s.id) AS lineage,
  (SELECT COUNT(*) FROM mp_read r WHERE r.snapshot_id = s.id) AS reads
FROM mp_snapshot s ORDER BY s.id
"""
# Rows that belong to no checkpoint or snapshot (a half-written ingest or commit would leave these).
ORPHANS_SQL = """
SELECT
  (SELECT COUNT(*) FROM mp_checkpoint c WHERE c.kind = 'snapshot'
     AND NOT EXISTS (SELECT 1 FROM mp_snapshot s WHERE s.checkpoint_id = c.id)) AS snapshot_checkpoints,
  (SELECT COUNT(*) FROM mp_tensor t WHERE NOT EXISTS (SELECT 1 FROM mp_checkpoint c WHERE c.id = t.checkpoint_id))
     AS tensors,
  (SELECT COUNT(*) FROM mp_block b WHERE NOT EXISTS (SELECT 1 FROM mp_checkpoint c WHERE c.id = b.checkpoint_id))
     AS blocks,
  (SELECT COUNT(*) FROM mp_file f WHERE NOT EXISTS (SELECT 1 FROM mp_checkpoint c WHERE c.id = f.checkpoint_id))
     AS files,
  (SELECT COUNT(*) FROM mp_ref r WHERE NOT EXISTS (SELECT 1 FROM mp_snapshot s WHERE s.id = r.snapshot_id))
     AS refs
"""


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, **(extra or {}))
    env.pop("MERGEPIPE_DEBUG", None)
    env.pop("MERGEPIPE_FAULT", None)
    env.update(extra or {})
    return env


def cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`mergepipe ARGS` in a subprocess (text output captured)."""
    return subprocess.run([sys.executable, "-m", "mergepipe_db.cli", *args], capture_output=True, text=True,
                          env=cli_env(env), timeout=timeout, cwd=str(REPO))


def popen_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mergepipe_db.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(env), cwd=str(REPO))


def one_line_error(stderr: str, *types: str) -> bool:
    """True when `stderr` is exactly one `mergepipe: error: <Type>: ...` line naming one of `types`."""
    lines = stderr.splitlines()
    return (len(lines) == 1 and stderr.endswith("\n") and "Traceback" not in stderr
            and any(lines[0].startswith(f"mergepipe: error: {t}: ") for t in types))


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def output_hashes(out: Path) -> dict[str, str]:
    """sha256 of every weight/index file of an output directory, and its manifest hash."""
    got = {p.name: sha256_file(p) for p in sorted(Path(out).iterdir())
           if p.suffix == ".safetensors" or p.name == "model.safetensors.index.json"}
    got["manifest_hash"] = json.loads((Path(out) / "manifest.json").read_text())["manifest_hash"]
    return got


def write_spec(path: Path, experts: list[str], *, method: str = "ties", budget: Any = 0.5, seed: int = 7) -> Path:
    import yaml

    models = [{"model": n, "parameters": {"weight": 1.0 / len(experts), "density": 0.5}} for n in experts]
    spec = {"merge_method": method, "base_model": "base", "models": models, "budget": budget, "seed": seed}
    Path(path).write_text(yaml.safe_dump(spec))
    return Path(path)


def whole_snapshots(catalog: Any, *, n_parents: int | None = None) -> list[str]:
    """Problems with what the catalog shows right now (empty when every snapshot is whole)."""
    problems = []
    _cols, rows = catalog.sql(SNAPSHOT_SQL)
    for sid, _ref, _out, cks, n_tensors, name, tensors, files, manifests, lineage, reads in rows:
        if not (cks == 1 and n_tensors and tensors == n_tensors and files >= 1 and manifests == 1
                and lineage >= 2 and reads >= 1 and (n_parents is None or lineage == n_parents)):
            problems.append(f"partial snapshot {sid} ({name}): checkpoints={cks} tensors={tensors}/{n_tensors} "
                            f"files={files} manifests={manifests} lineage={lineage} reads={reads}")
    _cols, rows = catalog.sql(ORPHANS_SQL)
    if any(rows[0]):
        problems.append(f"orphan rows (snapshot checkpoints, tensors, blocks, files, refs): {rows[0]}")
    return problems


def ref_history(catalog: Any, ref: str) -> tuple[int, list[str]]:
    """(version of `ref`, sorted checkpoint names of its snapshots)."""
    _c, rows = catalog.sql(f"SELECT version FROM refs WHERE name = '{ref}'")
    version = int(rows[0][0]) if rows else 0
    _c, rows = catalog.sql(f"SELECT checkpoint FROM snapshots WHERE ref = '{ref}'")
    return version, sorted((r[0] for r in rows), key=lambda n: int(n.rsplit("@", 1)[1]))


def staging_dirs(parent: Path) -> list[Path]:
    return sorted(Path(parent).glob(".mergepipe-staging-*"))


# --- kill trials -------------------------------------------------------------------------------------


@dataclass
class KillStats:
    trials: int = 0
    killed: int = 0  # SIGKILL delivered while the process ran
    finished_first: int = 0  # the process completed before an outside kill arrived
    rolled_back: int = 0  # killed before the catalog commit: old state, nothing visible
    rolled_forward: int = 0  # killed after the commit, before the rename: gc published it
    leftovers_collected: int = 0  # gc actions taken after kills
    reruns_identical: int = 0  # reruns (or rolled-forward outputs) with the reference hashes
    modes: Counter = field(default_factory=Counter)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["modes"] = dict(self.modes)
        return d


def _kill_when(proc: subprocess.Popen, ready: Any, delay: float, deadline: float = 120.0) -> bool:
    """Wait until `ready()` (or the process ends), then `delay` seconds, then SIGKILL. True if it was killed."""
    t0 = time.monotonic()
    while proc.poll() is None and not ready() and time.monotonic() - t0 < deadline:
        time.sleep(0.002)
    if delay > 0 and proc.poll() is None:
        time.sleep(delay)
    if proc.poll() is not None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    return True


def merge_kill_trials(catalog_url: str, spec_path: Path, work: Path, *, n: int, rng: random.Random,
                      reference: dict[str, str], n_tensors: int, ref: str = "crash", seed: int = 0,
                      log: Any = None) -> KillStats:
    """Kill `n` CLI merges of `spec_path` at random moments; check the invariants after each (AssertionError)."""
    from mergepipe_db.core import faults

    stats = KillStats(seed=seed)
    window = 0.3  # seconds after the staging directory appears, adapted so most outside kills land
    modes = ["fault", "outside", "fault", "outside-early", "point"]
    for i in range(n):
        out = work / f"out{i:03d}"
        mode = modes[i % len(modes)] if i < len(modes) else rng.choice(modes)
        env = {}
        if mode == "fault":
            env["MERGEPIPE_FAULT"] = f"tensor_written:{rng.randint(1, n_tensors)}"
        elif mode == "point":
            env["MERGEPIPE_FAULT"] = rng.choice([p for p in faults.MERGE_POINTS if p != "tensor_written"])
        proc = popen_cli(["merge", str(spec_path), "--out", str(out), "--ref", ref, "--catalog", catalog_url,
                          "--quiet"], env)
        if mode == "outside":
            delay = rng.uniform(0, window)
            landed = _kill_when(proc, lambda o=out: bool(list(work.glob(f".mergepipe-staging-{o.name}-*"))), delay)
            window = window * 1.15 if landed else max(0.02, window * 0.6)
        elif mode == "outside-early":
            _kill_when(proc, lambda: False, rng.uniform(0.05, 2.0), deadline=0)
        try:
            _stdout, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        what = f"trial {i} ({mode} {env.get('MERGEPIPE_FAULT', '')}, seed {stats.seed})"
        assert proc.returncode in (0, -signal.SIGKILL), f"{what}: exit {proc.returncode}: {stderr}"
        stats.trials += 1
        stats.modes[mode + ("-finished" if proc.returncode == 0 else "")] += 1
        if proc.returncode == 0:
            stats.finished_first += 1
        else:
            stats.killed += 1
        outcome, collected = check_after_merge_kill(catalog_url, spec_path, work, out, ref=ref,
                                                    reference=reference, what=what, cli_check=i % 2 == 0)
        if proc.returncode != 0:
            stats.rolled_back += outcome == "rolled_back"
            stats.rolled_forward += outcome == "rolled_forward"
        stats.leftovers_collected += collected
        stats.reruns_identical += 1
        if log is not None:
            log(f"{what}: exit {proc.returncode}, {outcome}")
    return stats


def check_after_merge_kill(catalog_url: str, spec_path: Path, work: Path, out: Path, *, ref: str,
                           reference: dict[str, str], what: str, cli_check: bool = True) -> tuple[str, int]:
    """The invariants after one killed merge. Returns the outcome ('completed', 'rolled_back' or
    'rolled_forward') and the number of leftovers gc collected."""
    from mergepipe_db import Catalog
    from mergepipe_db.admin.fsck import problems

    reopened = Catalog.open(catalog_url)  # the catalog reopens (DuckDB replays its WAL here)
    cols, rows = reopened.sql("SELECT * FROM snapshots")
    listed = [dict(zip(cols, row)) for row in rows if dict(zip(cols, row))["out_path"] == str(out)]
    if listed or cli_check:  # the same through the CLI (a subprocess: costs a second, so not every time)
        r = cli(["sql", "SELECT * FROM snapshots", "--format", "json", "--catalog", catalog_url])
        assert r.returncode == 0, f"{what}: mergepipe sql failed: {r.stderr}"
        shown = [row for row in json.loads(r.stdout) if row["out_path"] == str(out)]
        assert [row["id"] for row in shown] == [row["id"] for row in listed], f"{what}: {shown} vs {listed}"
    assert len(listed) <= 1, f"{what}: {listed}"
    partial = whole_snapshots(reopened)
    assert not partial, f"{what}: {partial}"
    if out.exists():
        assert listed, f"{what}: {out} is visible but no snapshot was committed for it"
        assert output_hashes(out) == reference, f"{what}: {out} differs from the reference merge"
        outcome = "completed"
    elif listed:
        outcome = "rolled_forward"
    else:
        outcome = "rolled_back"
    found = reopened.fsck()
    assert not problems(found), f"{what}: fsck: {[str(f) for f in problems(found)]}"
    actions = reopened.gc(dry_run=False)
    assert reopened.gc(dry_run=True) == [], f"{what}: gc left something"
    assert not staging_dirs(work), f"{what}: staging left after gc: {staging_dirs(work)}"
    assert all(f.kind == "ok" for f in reopened.fsck()), f"{what}: fsck after gc: {reopened.fsck()}"
    if outcome == "rolled_forward":
        assert output_hashes(out) == reference, f"{what}: rolled-forward output differs from the reference"
    elif outcome == "rolled_back":
        assert not out.exists(), f"{what}: {out} appeared"
        res = reopened.merge(spec_path, out=out, ref=ref)
        assert res.manifest_hash == reference["manifest_hash"], f"{what}: rerun gives another manifest hash"
        assert output_hashes(out) == reference, f"{what}: rerun output differs from the reference"
    version, names = ref_history(reopened, ref)
    assert names == [f"{ref}@{v}" for v in range(1, version + 1)], f"{what}: ref history {version} {names}"
    return outcome, len(actions)


def _has_open(pid: int, root: Path) -> bool:
    """True when process `pid` has a file under `root` open (read from /proc)."""
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(root)):
                    return True
    except OSError:
        return False
    return False


def ingest_kill_trials(catalog_url: str, experts: list[Path], *, rng: random.Random,
                       reference_ids: dict[str, str], seed: int = 0, log: Any = None) -> KillStats:
    """Kill a CLI ingest of each expert (name = its directory name) at a random moment; check after each."""
    from mergepipe_db import Catalog

    stats = KillStats(seed=seed)
    for i, path in enumerate(experts):
        name = Path(path).name
        before = _counts(Catalog.open(catalog_url))
        proc = popen_cli(["ingest", str(path), "--name", name, "--base", "base", "--catalog", catalog_url, "-q"])
        mode = ("outside-reading", "outside-late", "outside-early")[i % 3]
        root = Path(path).resolve()
        if mode == "outside-early":
            _kill_when(proc, lambda: False, rng.uniform(0.05, 1.5), deadline=0)
        else:  # once the expert's files are open: while it reads, or a little later (writing the catalog)
            delay = rng.uniform(0, 0.25) if mode == "outside-reading" else rng.uniform(0.2, 1.5)
            _kill_when(proc, lambda p=proc, r=root: _has_open(p.pid, r), delay)
        _o, stderr = proc.communicate(timeout=300)
        what = f"ingest trial {i} ({name}, {mode}, seed {seed})"
        assert proc.returncode in (0, -signal.SIGKILL), f"{what}: exit {proc.returncode}: {stderr}"
        stats.trials += 1
        stats.killed += proc.returncode != 0
        stats.finished_first += proc.returncode == 0
        stats.modes[mode + ("" if proc.returncode else "-finished")] += 1
        reopened = Catalog.open(catalog_url)
        _c, rows = reopened.sql(ORPHANS_SQL)
        assert not any(rows[0]), f"{what}: orphan rows {rows[0]}"
        _c, rows = reopened.sql(f"SELECT id, n_tensors FROM checkpoints WHERE name = '{name}'")
        after = _counts(reopened)
        if rows:
            cid, n_t = rows[0]
            assert cid == reference_ids[name], f"{what}: catalogued with another id"
            _c, nt = reopened.sql(f"SELECT COUNT(*), SUM(n_blocks) FROM tensors WHERE checkpoint = '{name}'")
            _c, nb = reopened.sql(f"SELECT COUNT(*) FROM blocks WHERE checkpoint = '{name}'")
            assert nt[0][0] == n_t and nb[0][0] == nt[0][1], f"{what}: partial checkpoint {nt} {nb}"
            stats.rolled_forward += proc.returncode != 0
        else:
            assert after == before, f"{what}: catalog changed without the checkpoint: {before} -> {after}"
            stats.rolled_back += 1
        res = reopened.ingest(path, name=name, base="base")
        assert res.checkpoint_id == reference_ids[name], f"{what}: rerun gives another id"
        stats.reruns_identical += 1
        if log is not None:
            log(f"{what}: exit {proc.returncode}, {'committed' if rows else 'unchanged'}")
    return stats


def ingest_fault_trials(new_catalog: Any, base: Path, experts: list[Path], *, block_bytes: int,
                        reference_ids: dict[str, str], log: Any = None) -> KillStats:
    """Kill one CLI ingest of all `experts` (one call: one transaction; names = their directory names) at each
    fault point inside ingest (`faults.INGEST_POINTS`; ingest_rows_written once after each checkpoint's rows),
    each in a fresh catalog (`new_catalog(stem)`: a context manager giving its URL) holding only the base.
    After each kill: the process died of SIGKILL at the point (else AssertionError: the point was not reached);
    the catalog holds no trace of the experts when killed before the commit, all of them, complete and with
    their reference ids, after it; no orphan rows; fsck finds nothing; a rerun ingests the reference ids."""
    from mergepipe_db import Catalog
    from mergepipe_db.core import faults

    stats = KillStats()
    names = [Path(p).name for p in experts]
    specs = []
    for point in faults.INGEST_POINTS:
        nths = range(1, len(experts) + 1) if point == "ingest_rows_written" else [1]
        specs += [f"{point}:{n}" for n in nths]
    for i, spec in enumerate(specs):
        what = f"ingest fault {spec}"
        with new_catalog(f"fault{i}") as url:
            Catalog.open(url).ingest(base, name="base", block_bytes=block_bytes)
            before = _counts(Catalog.open(url))
            args = ["ingest", *map(str, experts), *[a for n in names for a in ("--name", n)], "--base", "base",
                    "--catalog", url, "-q"]
            r = cli(args, {"MERGEPIPE_FAULT": spec})
            assert r.returncode == -signal.SIGKILL, f"{what}: not killed (exit {r.returncode}): {r.stderr}"
            stats.trials += 1
            stats.killed += 1
            stats.modes[spec.partition(":")[0]] += 1
            reopened = Catalog.open(url)
            _c, rows = reopened.sql(ORPHANS_SQL)
            assert not any(rows[0]), f"{what}: orphan rows {rows[0]}"
            _c, rows = reopened.sql("SELECT name, id FROM checkpoints WHERE name <> 'base' ORDER BY name")
            if spec.startswith("ingest_committed"):
                assert dict(rows) == {n: reference_ids[n] for n in names}, f"{what}: {rows}"
                for n in names:
                    _c, nt = reopened.sql(f"SELECT COUNT(*), SUM(n_blocks) FROM tensors WHERE checkpoint = '{n}'")
                    _c, nb = reopened.sql(f"SELECT COUNT(*) FROM blocks WHERE checkpoint = '{n}'")
                    _c, want = reopened.sql(f"SELECT n_tensors FROM checkpoints WHERE name = '{n}'")
                    assert nt[0][0] == want[0][0] and nb[0][0] == nt[0][1], f"{what}: partial {n}: {nt} {nb}"
                stats.rolled_forward += 1
            else:
                assert rows == [] and _counts(reopened) == before, f"{what}: catalog changed: {rows}"
                stats.rolled_back += 1
            found = reopened.fsck()
            assert all(f.kind == "ok" for f in found), f"{what}: fsck: {[str(f) for f in found if f.kind != 'ok']}"
            results = reopened.ingest_many(experts, names=names, base="base")
            assert {res.name: res.checkpoint_id for res in results} == {n: reference_ids[n] for n in names}, what
            stats.reruns_identical += 1
            if log is not None:
                log(f"{what}: killed, {'committed' if rows else 'unchanged'}")
    return stats


def _counts(catalog: Any) -> tuple[int, ...]:
    _c, rows = catalog.sql("SELECT (SELECT COUNT(*) FROM mp_checkpoint), (SELECT COUNT(*) FROM mp_file), "
                           "(SELECT COUNT(*) FROM mp_tensor), (SELECT COUNT(*) FROM mp_block)")
    return tuple(rows[0])


# --- concurrency workers (run as a script) ----------------------------------------------------------


def _merge_retry(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each job OUT:REF: merge, and on a retryable error (lost compare-and-set, lock timeout) merge again."""
    from mergepipe_db import Catalog
    from mergepipe_db.db.engine import retry_delay
    from mergepipe_db.errors import MergePipeError

    cat = Catalog.open(args.catalog)
    results = []
    for job in args.job:
        out, ref = job.rsplit(":", 1)
        errors: list[str] = []
        result: dict[str, Any] = {"out": out, "ref": ref, "ok": False, "attempts": args.attempts}
        for attempt in range(args.attempts):
            try:
                res = cat.merge(args.spec, out=out, ref=ref)
                result = {"out": out, "ref": ref, "ok": True, "attempts": attempt + 1, "snapshot": res.snapshot_id,
                          "version": res.version, "manifest_hash": res.manifest_hash}
                break
            except MergePipeError as e:
                errors.append(type(e).__name__)
                if not e.retryable:
                    result = {"out": out, "ref": ref, "ok": False, "attempts": attempt + 1, "message": str(e)}
                    break
                time.sleep(retry_delay(attempt) * random.uniform(0.5, 1.5))
        result["errors"] = errors
        results.append(result)
    return results


def _reader(args: argparse.Namespace) -> dict[str, Any]:
    from mergepipe_db import Catalog

    cat = Catalog.open(args.catalog)
    reads, seen, problems = 0, 0, []
    while not Path(args.stop).exists():
        found = whole_snapshots(cat, n_parents=args.parents)
        problems += found
        _c, rows = cat.sql("SELECT COUNT(*) FROM snapshots")
        seen = max(seen, int(rows[0][0]))
        reads += 1
        time.sleep(0.01)
    return {"reads": reads, "max_snapshots_seen": seen, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge-retry")
    m.add_argument("--catalog", required=True)
    m.add_argument("--spec", required=True)
    m.add_argument("--job", action="append", required=True, help="OUT:REF (repeatable)")
    m.add_argument("--attempts", type=int, default=20)
    m.add_argument("--result", required=True)
    r = sub.add_parser("reader")
    r.add_argument("--catalog", required=True)
    r.add_argument("--stop", required=True)
    r.add_argument("--parents", type=int, default=None)
    r.add_argument("--result", required=True)
    args = p.parse_args(argv)
    result = _merge_retry(args) if args.cmd == "merge-retry" else _reader(args)
    Path(args.result).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
