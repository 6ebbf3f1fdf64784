"""The merge and replay jobs: plan (or take the plan from a manifest) → execute → commit → publish.

The one place the pipeline stages meet. Each stage takes and returns core objects (`Plan`,
`ExecutionResult`, the manifest); this module passes them along and keeps the catalog's connection discipline:
a DuckDB file admits one writing process at a time, so no catalog connection is held while a merge executes —
the plan's rows are read, the connection closed, the merge runs, and commit opens its own transaction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mergepipe_db.core import faults
from mergepipe_db.core.manifest import build_manifest
from mergepipe_db.core.names import validate_checkpoint_name
from mergepipe_db.core.plan import Plan
from mergepipe_db.core.spec import Budget, MergeSpec, load_spec, parse_budget
from mergepipe_db.db.engine import Database
from mergepipe_db.db.lookup import check_family, find_models
from mergepipe_db.errors import DuplicateNameError, SpecError, UnknownCheckpointError
from mergepipe_db.io import as_path, check_fresh, is_remote
from mergepipe_db.pipeline import commit as cm
from mergepipe_db.pipeline.plan.build import build_plan


@dataclass(frozen=True)
class MergeResult:
    """What a merge or replay produced and what it cost (bytes; seconds)."""

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
    candidate_bytes: int = 0  # expert bytes of blocks with a non-zero delta (what a full-budget merge reads)
    warnings: list[str] = field(default_factory=list)  # e.g. `budget_warnings`; the CLI prints them on stderr

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def budget_warnings(plan: Plan) -> list[str]:
    """Warnings about a plan's budget a user should see: one that selects no expert block while candidates
    exist (the merge is then a copy of the base)."""
    if plan.planned_bytes == 0 and plan.candidate_bytes > 0:
        return [f"the budget ({plan.budget_bytes} bytes) selects no expert block although "
                f"{plan.candidate_bytes} candidate bytes exist: the output is the base unchanged; raise the "
                f"budget (a fraction such as 0.25, or bytes with a unit such as 500MB)"]
    return []


def default_name(path: str | Path) -> str:
    """The name a checkpoint gets when none is given: its file's stem or its directory's name (an object's or
    a prefix's, for an ``s3://`` URI)."""
    if is_remote(path):
        q = as_path(path)
        return q.stem if q.suffix == ".safetensors" else q.name
    p = Path(path).resolve()
    return p.stem if p.is_file() else p.name


def resolve_spec(spec: str | Path | dict[str, Any] | MergeSpec, budget: Any, seed: int | None
                 ) -> tuple[MergeSpec, Budget]:
    """The spec (loaded and validated) with `seed` applied, and the budget: `budget` if given, else the
    spec's, else the full read."""
    s = spec if isinstance(spec, MergeSpec) else load_spec(spec)
    if seed is not None:
        if not 0 <= seed < 2**63:
            raise SpecError(f"seed must be an integer in [0, 2^63), got {seed}")
        s = replace(s, seed=seed)
    b = parse_budget(budget) if budget is not None else (s.budget or Budget(fraction=1.0))
    return s, b


def resolve_models(db: Database, refs: list[str], *, base: str | None, progress: bool) -> list[tuple[str, str]]:
    """(id, name) of each spec model reference: a catalog name/ref, or a path. The new paths among them are
    ingested together (experts of `base`), so their base is read once for all of them."""
    with db.connect() as conn:
        found = find_models(conn, refs)
    new = list(dict.fromkeys(ref for ref, f in zip(refs, found) if f is None))  # a path given twice: once
    for ref in new:
        if not is_remote(ref) and not Path(ref).exists():
            raise UnknownCheckpointError(
                f"unknown model {ref!r}: not a catalogued checkpoint or ref, and no such path")
    ingested: dict[str, tuple[str, str]] = {}
    if new:
        from mergepipe_db.pipeline.ingest import ingest_many  # loads numba: not at a merge's start (`kernels.warmup`)

        try:
            results = ingest_many(db, [(p, default_name(p)) for p in new], base=base, block_bytes=None,
                                  kind="full", progress=progress)
        except DuplicateNameError as e:
            raise SpecError(f"model path(s) {', '.join(new)} not catalogued, and a default name is taken "
                            f"({e}): ingest it first with `mergepipe ingest PATH --name NAME`") from e
        ingested = {ref: (res.checkpoint_id, res.name) for ref, res in zip(new, results)}
    return [f if f is not None else ingested[ref] for ref, f in zip(refs, found)]


def plan_merge(db: Database, spec: str | Path | dict[str, Any] | MergeSpec, *, budget: Any, seed: int | None,
               progress: bool, ref: str | None = None) -> tuple[Plan, int | None]:
    """The plan, and the current version of `ref` if given. One catalog connection when every model is
    already catalogued (names resolved, family checked, planned and the ref read together); a model given by
    a new path is ingested first, with no connection held. StaleSourceError when an input changed on disk."""
    s, b = resolve_spec(spec, budget, seed)
    if s.config is not None:  # a MergeKit config resolved per tensor (pipeline/plan/layout.py)
        return _plan_config(db, s, b, progress=progress, ref=ref)
    refs = [s.base, *(m.ref for m in s.models)]
    plan: Plan | None = None
    version: int | None = None
    with db.connect() as conn:
        found = find_models(conn, refs)
        if all(f is not None for f in found):
            ids = [f[0] for f in found if f is not None]
            check_family(conn, ids[0], ids[1:], s)
            plan = build_plan(conn, s, base_id=ids[0], expert_ids=ids[1:], budget_spec=b)
            if ref is not None:
                version = cm.ref_version(conn, ref)
    if plan is None:
        [(base_id, base_name)] = resolve_models(db, [s.base], base=None, progress=progress)
        expert_ids = [cid for cid, _name in resolve_models(db, [m.ref for m in s.models], base=base_name,
                                                           progress=progress)]
        with db.connect() as conn:
            check_family(conn, base_id, expert_ids, s)
            plan = build_plan(conn, s, base_id=base_id, expert_ids=expert_ids, budget_spec=b)
    check_inputs(plan)
    return plan, version


def _plan_config(db: Database, s: MergeSpec, b: Budget, *, progress: bool, ref: str | None
                 ) -> tuple[Plan, int | None]:
    """`plan_merge` of a config resolved per tensor: its models (paths not yet catalogued are ingested first,
    against the base model when there is one), the base whose tensors are θ₀, then the plan."""
    from mergepipe_db.pipeline.plan.layout import checkpoint_name, plan_base

    refs = [m.ref for m in s.models]
    if s.base:
        [(base_id, base_name)] = resolve_models(db, [s.base], base=None, progress=progress)
        ids = [cid for cid, _n in resolve_models(db, refs, base=base_name, progress=progress)]
        by_ref = dict(zip(refs, ids)) | {s.base: base_id}
    else:  # the first model fixes θ₀ (plan_base); new paths among the others are ingested against it
        first = s.config.slices[0].sources[0].model
        [(first_id, _n)] = resolve_models(db, [first], base=None, progress=progress)
        with db.connect() as conn:
            base_name = checkpoint_name(conn, plan_base(conn, s, {first: first_id}))
        ids = [cid for cid, _n in resolve_models(db, refs, base=None if s.method == "passthrough" else base_name,
                                                 progress=progress)]
        by_ref = dict(zip(refs, ids))
    with db.connect() as conn:
        base_id = plan_base(conn, s, by_ref)
        plan = build_plan(conn, s, base_id=base_id, expert_ids=ids, budget_spec=b)
        version = cm.ref_version(conn, ref) if ref is not None else None
    check_inputs(plan)
    return plan, version


def check_inputs(plan: Plan) -> None:
    """StaleSourceError when an input file of `plan` changed since it was catalogued (size or version)."""
    check_fresh(plan.base.files)
    for e in plan.experts:
        check_fresh(e.checkpoint.files)


def check_outputs(out: str | Path, ref: str | None, shard_bytes: int | None) -> tuple[Path, str]:
    """The output directory (refused when it exists and is not empty) and the ref name (default: its name)."""
    out_path = cm.check_out_dir(out)
    ref_name = ref or out_path.name
    validate_checkpoint_name(ref_name)
    if shard_bytes is not None and shard_bytes < 1:
        raise SpecError(f"shard size must be a positive number of bytes, got {shard_bytes}")
    return out_path, ref_name


def run_plan(db: Database, plan: Plan, out_path: Path, ref_name: str, *, t_start: float, t_plan: float,
             shard_bytes: int | None, progress: bool, verify_reads: bool,
             expected: int | None = None, executor: Any = None) -> MergeResult:
    """Execute `plan` (its input files checked fresh by the caller: `check_inputs`) into a staging directory,
    commit it to the catalog, then publish it at `out_path`.

    Whatever fails before the commit leaves the catalog and `out_path` as they were (the staging directory is
    abandoned); after the commit the output is published (`gc` rolls a crash between the two forward).
    `executor` replaces `pipeline.execute.execute` (same arguments and result: `distributed` runs the plan's
    shards on Dask workers)."""
    from mergepipe_db.pipeline.execute import DEFAULT_SHARD_BYTES, execute

    if expected is None:  # read with the plan when planned here (the commit's compare-and-set checks it)
        expected = cm.read_ref_version(db, ref_name)
    faults.point("planned")

    intent, staging = cm.begin_staging(db, out_path)
    committed = False
    try:
        t0 = time.perf_counter()
        t_start_up = t0 - t_start - t_plan  # before and after planning: outputs checked, ref read, staging made
        result = (executor or execute)(plan, staging, shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES,
                                       progress=progress, verify_reads=verify_reads)
        t_exec = time.perf_counter() - t0
        faults.point("shards_written")
        parents = [plan.base.id] + [e.checkpoint.id for e in plan.experts]
        manifest = build_manifest(plan, result, parents=parents)
        timings = {"start_up": t_start_up, "plan": t_plan, "execute": t_exec, **result.timings}
        t0 = time.perf_counter()
        mhash = cm.finish_staging(plan, result, staging, manifest, timings)
        timings["finalize"] = time.perf_counter() - t0  # index, side files, header re-check, manifest
        t0 = time.perf_counter()
        commit = cm.commit(db, plan, result, manifest=manifest, mhash=mhash, timings=timings,
                           intent=intent, staging=staging, out=out_path, ref=ref_name, expected_version=expected)
        committed = True
        cm.publish(staging, out_path)
        timings["commit"] = time.perf_counter() - t0  # catalog transaction + publish (rename)
    except BaseException:
        if not committed:
            cm.abandon_staging(db, intent, staging)
        raise
    timings["wall"] = time.perf_counter() - t_start
    cm.record_timings(db, commit.snapshot_id, timings)
    return MergeResult(
        snapshot_id=commit.snapshot_id, checkpoint=commit.checkpoint_name, ref=commit.ref,
        version=commit.version, out=str(out_path), plan_hash=plan.plan_hash, manifest_hash=mhash,
        budget_bytes=plan.budget_bytes, full_bytes=plan.full_bytes, planned_bytes=plan.planned_bytes,
        realized_bytes=result.realized_bytes, realized_per_expert=result.realized_per_expert,
        base_bytes=result.base_bytes, output_bytes=result.output_bytes, cached_bytes=result.cached_bytes,
        bound=plan.bound_total,
        seconds=timings["wall"], timings=timings, candidate_bytes=plan.candidate_bytes,
        warnings=budget_warnings(plan),
    )


def merge(db: Database, spec: str | Path | dict[str, Any] | MergeSpec, *, out: str | Path, budget: Any,
          seed: int | None, ref: str | None, shard_bytes: int | None, progress: bool,
          verify_reads: bool) -> MergeResult:
    """Plan, execute and commit a merge; the output appears at `out` only once committed."""
    from mergepipe_db.kernels import warmup

    t_start = time.perf_counter()
    warmup.start()  # the kernels load while the merge is planned
    out_path, ref_name = check_outputs(out, ref, shard_bytes)
    t0 = time.perf_counter()
    plan, expected = plan_merge(db, spec, budget=budget, seed=seed, progress=progress, ref=ref_name)
    return run_plan(db, plan, out_path, ref_name, t_start=t_start, t_plan=time.perf_counter() - t0,
                    shard_bytes=shard_bytes, progress=progress, verify_reads=verify_reads, expected=expected)


def replay(db: Database, source: str | Path, *, out: str | Path, ref: str | None, shard_bytes: int | None,
           verify: bool, progress: bool) -> MergeResult:
    """Re-execute a recorded merge without planning (see `Catalog.replay`)."""
    from mergepipe_db.kernels import warmup
    from mergepipe_db.pipeline.plan.from_manifest import plan_from_manifest
    from mergepipe_db.pipeline.replay import load_manifest, verify_outputs

    t_start = time.perf_counter()
    warmup.start()
    out_path, ref_name = check_outputs(out, ref, shard_bytes)
    manifest = load_manifest(db, source)
    t0 = time.perf_counter()
    with db.connect() as conn:
        plan = plan_from_manifest(conn, manifest)
    check_inputs(plan)
    res = run_plan(db, plan, out_path, ref_name, t_start=t_start, t_plan=time.perf_counter() - t0,
                   shard_bytes=shard_bytes, progress=progress, verify_reads=True)
    if verify:
        verify_outputs(manifest, as_path(res.out))
    return res
