"""`Catalog`: the public, programmatic face of mergepipe_db. The CLI is a thin shell over it.

Data flows one way: catalog (ingest) → plan (planner) → execute (executor) → commit (commit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from mergepipe_db.core.manifest import build_manifest
from mergepipe_db.core.plan import Plan
from mergepipe_db.core.spec import Budget, MergeSpec, load_spec, parse_budget
from mergepipe_db.db import schema
from mergepipe_db.db.engine import Database, resolve_url
from mergepipe_db.errors import DuplicateNameError, SpecError, UnknownCheckpointError
from mergepipe_db.pipeline.ingest import IngestResult


@dataclass(frozen=True)
class MergeResult:
    snapshot_id: str
    checkpoint: str
    ref: str
    version: int
    out: str
    plan_hash: str
    manifest_hash: str
    budget_bytes: int
    full_bytes: int
    planned_bytes: int
    realized_bytes: int
    realized_per_expert: list[int]
    base_bytes: int
    output_bytes: int
    cached_bytes: int  # of the base and expert bytes read, those copied from the page cache, not the disk
    bound: float | None
    seconds: float
    timings: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Catalog:
    """A catalog of checkpoints, tensors and blocks, and the merges made from them.

    Holds no database connection between calls (a DuckDB file admits one process at a time).
    """

    def __init__(self, db: Database) -> None:
        self.db = db

    @classmethod
    def open(cls, url: str | None = None) -> Catalog:
        """Open the catalog at `url` (SQLAlchemy URL or DuckDB file path; default from the environment).

        A new, empty database is initialised; an out-of-date one raises CatalogOutOfDateError.
        """
        cat = cls(Database(resolve_url(url)))
        with cat.db.connect():
            pass
        return cat

    @classmethod
    def lazy(cls, url: str | None = None) -> Catalog:
        """Like `open` but without touching the database (for `db upgrade`)."""
        return cls(Database(resolve_url(url)))

    def upgrade(self) -> tuple[str | None, str]:
        return self.db.upgrade()

    # -- ingest ---------------------------------------------------------------------------------------

    def ingest(self, path: str | Path, *, name: str | None = None, base: str | None = None,
               block_bytes: int | None = None, kind: str = "full", progress: bool = False) -> IngestResult:
        """Catalogue a checkpoint (HF directory or .safetensors file). Idempotent for the same content.

        `kind`: ``full`` (default; a directory with adapter_config.json is taken as ``lora``), ``delta`` (tensors
        hold Δ) or ``lora`` (a PEFT adapter directory); delta and lora need `base`."""
        from mergepipe_db.pipeline.ingest import ingest

        if name is None:
            name = _default_name(path)
        return ingest(self.db, path, name=name, base=base, block_bytes=block_bytes, kind=kind, progress=progress)

    def ingest_many(self, paths: list[str | Path], *, names: list[str] | None = None, base: str | None = None,
                    block_bytes: int | None = None, kind: str = "full", progress: bool = False
                    ) -> list[IngestResult]:
        """`ingest` of several checkpoints (default names: each directory's or file's name), results in order.

        Experts of `base` that list their tensors in the same order (one family, saved alike) are read
        together, so the base is read once for all of them instead of once each. All new checkpoints are
        written in one transaction: if one fails, none is catalogued. Their rows wait in memory for that
        transaction, ~2 KB per block (~0.2 % of the bytes ingested, with 1 MiB blocks): split a family of
        terabytes over several calls."""
        from mergepipe_db.pipeline.ingest import ingest_many

        paths = list(paths)
        if names is None:
            names = [_default_name(p) for p in paths]
        elif len(names) != len(paths):
            raise SpecError(f"{len(names)} name(s) for {len(paths)} checkpoint(s): give one name per path, in order")
        return ingest_many(self.db, list(zip(paths, names)), base=base, block_bytes=block_bytes, kind=kind,
                           progress=progress)

    def export_delta(self, expert: str, out: str | Path, *, dtype: str = "float32") -> dict[str, Any]:
        """Write Δ = expert − base (LoRA: B@A·s; delta: as stored) of every tensor the expert covers as an HF
        directory at `out` (must not exist or be empty), in `dtype` (float32: exact for BF16/F16 inputs)."""
        from mergepipe_db.admin.export_delta import export_delta

        return export_delta(self.db, expert, out, dtype=dtype)

    def pack(self, expert: str, *, store: str | Path | None = None) -> Any:
        """Store the candidate blocks of a full expert zstd-compressed (XOR base) in the content-addressed block
        store `store` (default: beside a DuckDB catalog, else ./mergepipe-store); plans then cost those blocks
        their compressed length and merges read them from the store. Idempotent. Returns a PackResult."""
        from mergepipe_db.admin.pack import pack

        return pack(self.db, expert, store=store)

    def checkpoint_id(self, ref: str) -> str:
        """Id of a checkpoint by name, or of the snapshot a ref points to. UnknownCheckpointError otherwise."""
        with self.db.connect() as conn:
            found = _lookup(conn, ref)
        if found is None:
            raise UnknownCheckpointError(f"unknown checkpoint or ref {ref!r}")
        return found

    def _resolve_models(self, refs: list[str], *, base: str | None, progress: bool) -> list[tuple[str, str]]:
        """(id, name) of each spec model reference: a catalog name/ref, or a path. The new paths among them are
        ingested together (experts of `base`), so their base is read once for all of them."""
        with self.db.connect() as conn:
            found = _find_models(conn, refs)
        new = list(dict.fromkeys(ref for ref, f in zip(refs, found) if f is None))  # a path given twice: once
        for ref in new:
            if not Path(ref).exists():
                raise UnknownCheckpointError(
                    f"unknown model {ref!r}: not a catalogued checkpoint or ref, and no such path")
        ingested: dict[str, tuple[str, str]] = {}
        if new:
            try:
                results = self.ingest_many(new, base=base, progress=progress)
            except DuplicateNameError as e:
                raise SpecError(f"model path(s) {', '.join(new)} not catalogued, and a default name is taken "
                                f"({e}): ingest it first with `mergepipe ingest PATH --name NAME`") from e
            ingested = {ref: (res.checkpoint_id, res.name) for ref, res in zip(new, results)}
        return [f if f is not None else ingested[ref] for ref, f in zip(refs, found)]

    # -- plan and merge -------------------------------------------------------------------------------

    def _spec(self, spec: str | Path | dict[str, Any] | MergeSpec, budget: Any, seed: int | None
              ) -> tuple[MergeSpec, Budget]:
        s = spec if isinstance(spec, MergeSpec) else load_spec(spec)
        if seed is not None:
            if not 0 <= seed < 2**63:
                raise SpecError(f"seed must be an integer in [0, 2^63), got {seed}")
            s = MergeSpec(s.method, s.base, s.models, s.normalize, s.lam, s.t, s.dtype, s.budget, seed, s.source)
        b = parse_budget(budget) if budget is not None else (s.budget or Budget(fraction=1.0))
        return s, b

    def plan(self, spec: str | Path | dict[str, Any] | MergeSpec, *, budget: Any = None, seed: int | None = None,
             progress: bool = False) -> Plan:
        """Dry run: the access set chosen for `spec` within the budget (bytes or a fraction of full read)."""
        return self._plan(spec, budget=budget, seed=seed, progress=progress)[0]

    def _plan(self, spec: str | Path | dict[str, Any] | MergeSpec, *, budget: Any, seed: int | None,
              progress: bool, ref: str | None = None) -> tuple[Plan, int | None]:
        """The plan, and the current version of `ref` if given. One catalog connection when every model is
        already catalogued (names resolved, family checked, planned and the ref read together); a model
        given by a new path is ingested first, with no connection held."""
        from mergepipe_db.io.local import check_fresh
        from mergepipe_db.pipeline import commit as cm
        from mergepipe_db.pipeline.plan.build import build_plan

        s, b = self._spec(spec, budget, seed)
        refs = [s.base, *(m.ref for m in s.models)]
        plan: Plan | None = None
        version: int | None = None
        with self.db.connect() as conn:
            found = _find_models(conn, refs)
            if all(f is not None for f in found):
                ids = [f[0] for f in found if f is not None]
                _check_family(conn, ids[0], ids[1:], s)
                plan = build_plan(conn, s, base_id=ids[0], expert_ids=ids[1:], budget_spec=b)
                if ref is not None:
                    version = cm.ref_version(conn, ref)
        if plan is None:
            [(base_id, base_name)] = self._resolve_models([s.base], base=None, progress=progress)
            expert_ids = [cid for cid, _name in self._resolve_models([m.ref for m in s.models], base=base_name,
                                                                       progress=progress)]
            with self.db.connect() as conn:
                _check_family(conn, base_id, expert_ids, s)
                plan = build_plan(conn, s, base_id=base_id, expert_ids=expert_ids, budget_spec=b)
        check_fresh(plan.base.files)
        for e in plan.experts:
            check_fresh(e.checkpoint.files)
        return plan, version

    def merge(self, spec: str | Path | dict[str, Any] | MergeSpec, *, out: str | Path, budget: Any = None,
              seed: int | None = None, ref: str | None = None, shard_bytes: int | None = None,
              progress: bool = False, verify_reads: bool = False) -> MergeResult:
        """Plan, execute and commit a merge; the output appears at `out` only once committed."""
        from mergepipe_db.kernels import warmup

        t_start = time.perf_counter()
        warmup.start()  # the kernels load while the merge is planned
        out_path, ref_name = self._check_outputs(out, ref, shard_bytes)
        t0 = time.perf_counter()
        plan, expected = self._plan(spec, budget=budget, seed=seed, progress=progress, ref=ref_name)
        return self._run_plan(plan, out_path, ref_name, t_start=t_start, t_plan=time.perf_counter() - t0,
                              shard_bytes=shard_bytes, progress=progress, verify_reads=verify_reads,
                              expected=expected)

    def replay(self, source: str | Path, *, out: str | Path, ref: str | None = None,
               shard_bytes: int | None = None, verify: bool = False, progress: bool = False) -> MergeResult:
        """Re-execute a recorded merge (snapshot id, ref, checkpoint name or manifest.json path) without
        planning. Refuses (ReplayError) when an input's content no longer matches the manifest; every
        expert range read is checked against the catalog's xxh3. With `verify`, a VerifyError names every
        output tensor whose hash differs from the record."""
        from mergepipe_db.kernels import warmup
        from mergepipe_db.pipeline.plan.from_manifest import plan_from_manifest
        from mergepipe_db.pipeline.replay import load_manifest, verify_outputs

        t_start = time.perf_counter()
        warmup.start()
        out_path, ref_name = self._check_outputs(out, ref, shard_bytes)
        manifest = load_manifest(self.db, source)
        t0 = time.perf_counter()
        with self.db.connect() as conn:
            plan = plan_from_manifest(conn, manifest)
        res = self._run_plan(plan, out_path, ref_name, t_start=t_start, t_plan=time.perf_counter() - t0,
                             shard_bytes=shard_bytes, progress=progress, verify_reads=True)
        if verify:
            verify_outputs(manifest, Path(res.out))
        return res

    def _check_outputs(self, out: str | Path, ref: str | None, shard_bytes: int | None) -> tuple[Path, str]:
        from mergepipe_db.core.names import validate_checkpoint_name
        from mergepipe_db.pipeline.commit import check_out_dir

        out_path = check_out_dir(out)
        ref_name = ref or out_path.name
        validate_checkpoint_name(ref_name)
        if shard_bytes is not None and shard_bytes < 1:
            raise SpecError(f"shard size must be a positive number of bytes, got {shard_bytes}")
        return out_path, ref_name

    def _run_plan(self, plan: Plan, out_path: Path, ref_name: str, *, t_start: float, t_plan: float,
                  shard_bytes: int | None, progress: bool, verify_reads: bool,
                  expected: int | None = None) -> MergeResult:
        """Execute `plan` into a staging directory, commit it to the catalog, then publish it at `out_path`."""
        from mergepipe_db.core import faults
        from mergepipe_db.io.local import check_fresh
        from mergepipe_db.pipeline import commit as cm
        from mergepipe_db.pipeline.execute import DEFAULT_SHARD_BYTES, execute

        check_fresh(plan.base.files)
        for e in plan.experts:
            check_fresh(e.checkpoint.files)
        if expected is None:  # read with the plan when planned here (the commit's compare-and-set checks it)
            expected = cm.read_ref_version(self.db, ref_name)
        faults.point("planned")

        intent, staging = cm.begin_staging(self.db, out_path)
        committed = False
        try:
            t0 = time.perf_counter()
            result = execute(plan, staging, shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES, progress=progress,
                             verify_reads=verify_reads)
            t_exec = time.perf_counter() - t0
            faults.point("shards_written")
            parents = [plan.base.id] + [e.checkpoint.id for e in plan.experts]
            manifest = build_manifest(plan, result, parents=parents)
            timings = {"plan": t_plan, "execute": t_exec, **result.timings}
            t0 = time.perf_counter()
            mhash = cm.finish_staging(plan, result, staging, manifest, timings)
            timings["finalize"] = time.perf_counter() - t0  # index, side files, header re-check, manifest
            commit = cm.commit(self.db, plan, result, manifest=manifest, mhash=mhash, timings=timings,
                               intent=intent, staging=staging, out=out_path, ref=ref_name, expected_version=expected)
            committed = True
            cm.publish(staging, out_path)
            timings["commit"] = time.perf_counter() - t0
        except BaseException:
            if not committed:
                cm.abandon_staging(self.db, intent, staging)
            raise
        return MergeResult(
            snapshot_id=commit.snapshot_id, checkpoint=commit.checkpoint_name, ref=commit.ref,
            version=commit.version, out=str(out_path), plan_hash=plan.plan_hash, manifest_hash=mhash,
            budget_bytes=plan.budget_bytes, full_bytes=plan.full_bytes, planned_bytes=plan.planned_bytes,
            realized_bytes=result.realized_bytes, realized_per_expert=result.realized_per_expert,
            base_bytes=result.base_bytes, output_bytes=result.output_bytes, cached_bytes=result.cached_bytes,
            bound=plan.bound_total,
            seconds=time.perf_counter() - t_start, timings=timings,
        )

    # -- SQL and maintenance ----------------------------------------------------------------------------

    def sql(self, query: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only query over the documented views. Writes and file access are refused."""
        from mergepipe_db.db.readonly import run_readonly

        return run_readonly(self.db, query)

    def gc(self, *, dry_run: bool = True) -> list[str]:
        """List (or, with dry_run=False, remove) leftovers of interrupted merges; roll forward committed ones."""
        from mergepipe_db.admin.maintenance import gc

        return gc(self.db, dry_run=dry_run)

    def fsck(self, *, full: bool = False) -> list[Any]:
        """Cross-check catalog, manifests and files (`mergepipe_db.fsck`): a list of `Finding`s, each of kind
        ok, leftover (gc collects it), missing or corrupt. `full` also rehashes every file."""
        from mergepipe_db.admin.fsck import fsck

        return fsck(self.db, full=full)

    def verify(self, *, full: bool = False, checkpoint: str | None = None) -> list[str]:
        """Check source files against the catalog (size/mtime; sha256 with full=True). Returns problems."""
        from mergepipe_db.admin.maintenance import verify_sources

        return verify_sources(self.db, full=full, checkpoint=checkpoint)

    def verify_snapshot(self, snapshot: str) -> list[str]:
        """Rehash a committed snapshot's output files and tensors against its manifest; returns problems,
        one line each naming the file or tensor. UnknownCheckpointError when `snapshot` is not one."""
        from mergepipe_db.admin.maintenance import verify_snapshot

        return verify_snapshot(self.db, snapshot)

    def verify_all(self, name: str | None = None, *, full: bool = False) -> tuple[list[str], list[str]]:
        """`mergepipe verify [NAME]`: a snapshot/ref → its outputs; another checkpoint → its sources; no
        NAME → every original checkpoint's sources and every committed snapshot. Returns (problems, checked)."""
        from mergepipe_db.admin.maintenance import verify_all

        return verify_all(self.db, name, full=full)

    # -- audit: lineage, reports, sweeps ----------------------------------------------------------------

    def lineage(self, snapshot: str) -> dict[str, Any]:
        """Lineage DAG of a snapshot (checkpoint name, ref or snapshot id) back to original checkpoints;
        see `mergepipe_db.lineage.lineage_graph`. UnknownCheckpointError for an unknown name."""
        from mergepipe_db.audit.lineage import lineage_graph

        return lineage_graph(self.db, snapshot)

    def report(self, snapshot: str, *, out: str | Path) -> Path:
        """Write an audit report of a committed snapshot: HTML (`.html`) or Markdown (`.md`, heatmap PNG
        beside it). Returns the report path."""
        from mergepipe_db.audit.reports import write_report

        return write_report(self.db, snapshot, out)

    def sweep(self, spec: str | Path | dict[str, Any] | MergeSpec, *, budgets: Any, out: str | Path,
              seed: int | None = None, shard_bytes: int | None = None, progress: bool = False,
              bar: bool = False) -> Any:
        """Merge `spec` at each budget into `out/budget-<b>/` (full budget always included) and write
        `out/frontier.{csv,md,png}`; returns a `mergepipe_db.sweep.SweepResult`."""
        from mergepipe_db.audit.sweep import run_sweep

        return run_sweep(self, spec, budgets, out, seed=seed, shard_bytes=shard_bytes, progress=progress, bar=bar)


def _default_name(path: str | Path) -> str:
    p = Path(path).resolve()
    return p.stem if p.is_file() else p.name


def _find_model(conn: sa.Connection, ref: str) -> tuple[str, str] | None:
    """(id, name) of a catalogued model reference: a checkpoint name, a ref, or the root path of a catalogued
    full checkpoint; None if it is none of these."""
    found = _lookup(conn, ref)
    if found is None and Path(ref).exists():
        root = str(Path(ref).resolve() if Path(ref).is_dir() else Path(ref).resolve().parent)
        c = schema.checkpoint
        found = conn.execute(sa.select(c.c.id).where(c.c.root == root, c.c.kind == "full")
                             .order_by(c.c.created_at)).scalar()
    if found is None:
        return None
    name = conn.execute(sa.select(schema.checkpoint.c.name).where(schema.checkpoint.c.id == found)).scalar_one()
    return found, name


def _find_models(conn: sa.Connection, refs: list[str]) -> list[tuple[str, str] | None]:
    """`_find_model` of each of `refs`, names and refs looked up together (three queries, not two per model)."""
    c, r = schema.checkpoint, schema.ref
    by_name = {name: (cid, name) for cid, name in conn.execute(sa.select(c.c.id, c.c.name)
                                                               .where(c.c.name.in_(sorted(set(refs)))))}
    pending = sorted({x for x in refs if x not in by_name})
    by_ref: dict[str, tuple[str, str]] = {}
    if pending:
        snapshots = dict(conn.execute(sa.select(r.c.name, r.c.snapshot_id).where(r.c.name.in_(pending))).all())
        names = dict(conn.execute(sa.select(c.c.id, c.c.name).where(c.c.id.in_(sorted(set(snapshots.values())))))
                     .all()) if snapshots else {}
        by_ref = {ref: (sid, names[sid]) for ref, sid in snapshots.items() if sid in names}
    return [by_name.get(x) or by_ref.get(x) or _find_model(conn, x) for x in refs]


def _lookup(conn: sa.Connection, ref: str) -> str | None:
    c = schema.checkpoint
    found = conn.execute(sa.select(c.c.id).where(c.c.name == ref)).scalar()
    if found is None:
        found = conn.execute(sa.select(schema.ref.c.snapshot_id).where(schema.ref.c.name == ref)).scalar()
    return found


def _check_family(conn: sa.Connection, base_id: str, expert_ids: list[str], spec: MergeSpec) -> None:
    """Every expert must be catalogued against this base (same coordinates, same blocking)."""
    from mergepipe_db.errors import CoordinateMismatchError

    c = schema.checkpoint
    rows = {r.id: r for r in conn.execute(sa.select(c.c.id, c.c.name, c.c.base_id, c.c.kind)
                                          .where(c.c.id.in_(expert_ids)))}
    for eid, m in zip(expert_ids, spec.models):
        r = rows[eid]
        if eid == base_id:
            raise SpecError(f"model {m.ref!r} is the base model itself")
        if r.base_id != base_id:
            t = schema.tensor
            base_sig = conn.execute(sa.select(t.c.name, t.c.dtype, t.c.shape).where(t.c.checkpoint_id == base_id)
                                    .order_by(t.c.name)).all()
            mine = conn.execute(sa.select(t.c.name, t.c.dtype, t.c.shape).where(t.c.checkpoint_id == eid)
                                .order_by(t.c.name)).all()
            if [tuple(x) for x in base_sig] != [tuple(x) for x in mine]:
                raise CoordinateMismatchError(
                    f"model {m.ref!r} does not share the coordinates of base {spec.base!r}")
            if r.kind != "snapshot":
                raise SpecError(f"model {m.ref!r} was ingested against another base; re-ingest it with "
                                f"--base {spec.base}")

