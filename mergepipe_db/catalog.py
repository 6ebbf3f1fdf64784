"""`Catalog`: the public, programmatic face of mergepipe_db. The CLI is a thin shell over it.

A facade: each method opens what it needs and calls the module that does the work — ingest
(`pipeline.ingest`), the merge and replay jobs (`jobs`: plan → execute → commit), administration (`admin`) and
audit (`audit`). Data flows one way: catalog → plan → execute → commit (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergepipe_db.core.plan import Plan
from mergepipe_db.core.spec import MergeSpec
from mergepipe_db.db.engine import Database, resolve_url
from mergepipe_db.db.lookup import lookup
from mergepipe_db.errors import SpecError, UnknownCheckpointError
from mergepipe_db.jobs import MergeResult, default_name

if TYPE_CHECKING:  # imported when an ingest runs: it loads numba (its block statistics), which a merge's start
    from mergepipe_db.pipeline.ingest import IngestResult  # leaves to the kernels' warm-up thread


class Catalog:
    """A catalog of checkpoints, tensors and blocks, and the merges made from them.

    Holds no database connection between calls (a DuckDB file admits one process at a time).
    """

    def __init__(self, db: Database) -> None:
        self.db = db

    @classmethod
    def open(cls, url: str | None = None, *, create: bool = True,
             storage_options: dict[str, str] | None = None) -> Catalog:
        """Open the catalog at `url` (SQLAlchemy URL or DuckDB file path; default from the environment).

        A new, empty database is initialised; an out-of-date one raises CatalogOutOfDateError. With
        ``create=False`` a missing catalog (no DuckDB file; a PostgreSQL database without the schema) raises
        CatalogNotFoundError naming where it looked, and nothing is created.
        `storage_options`: settings of the ``s3://`` object store over the ``AWS_*`` environment (``endpoint``,
        ``access_key_id``, ``secret_access_key``, ``session_token``, ``region``, ``max_retries``,
        ``retry_timeout``, ``allow_http``), for this process from now on.
        """
        if storage_options is not None:
            from mergepipe_db.io.s3 import set_storage_options

            set_storage_options(storage_options)
        cat = cls(Database(resolve_url(url)))
        if not create:
            cat.db.require_existing()
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
            name = default_name(path)
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
            names = [default_name(p) for p in paths]
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
            found = lookup(conn, ref)
        if found is None:
            raise UnknownCheckpointError(f"unknown checkpoint or ref {ref!r}")
        return found

    # -- plan and merge -------------------------------------------------------------------------------

    def plan(self, spec: str | Path | dict[str, Any] | MergeSpec, *, budget: Any = None, seed: int | None = None,
             progress: bool = False) -> Plan:
        """Dry run: the access set chosen for `spec` within the budget (bytes or a fraction of full read)."""
        from mergepipe_db.jobs import plan_merge

        return plan_merge(self.db, spec, budget=budget, seed=seed, progress=progress)[0]

    def merge(self, spec: str | Path | dict[str, Any] | MergeSpec, *, out: str | Path, budget: Any = None,
              seed: int | None = None, ref: str | None = None, shard_bytes: int | None = None,
              progress: bool = False, verify_reads: bool = False, client: Any = None, workers: int | None = None,
              scheduler: str | None = None) -> MergeResult:
        """Plan, execute and commit a merge; the output appears at `out` only once committed.

        Distributed on Dask with one of `client` (a `distributed.Client`), `workers` (a local cluster of that
        many worker processes) or `scheduler` (an address, tcp://host:8786): planned and committed here, the
        output shards computed on the workers; the same output and manifest (`mergepipe_db.distributed`)."""
        if client is not None or workers is not None or scheduler is not None:
            from mergepipe_db.distributed import merge as dask_merge

            return dask_merge(self.db, spec, out=out, budget=budget, seed=seed, ref=ref, shard_bytes=shard_bytes,
                              progress=progress, verify_reads=verify_reads, client=client, workers=workers,
                              scheduler=scheduler)
        from mergepipe_db.jobs import merge

        return merge(self.db, spec, out=out, budget=budget, seed=seed, ref=ref, shard_bytes=shard_bytes,
                     progress=progress, verify_reads=verify_reads)

    def replay(self, source: str | Path, *, out: str | Path, ref: str | None = None,
               shard_bytes: int | None = None, verify: bool = False, progress: bool = False) -> MergeResult:
        """Re-execute a recorded merge (snapshot id, ref, checkpoint name or manifest.json path) without
        planning. Refuses (ReplayError) when an input's content no longer matches the manifest; every
        expert range read is checked against the catalog's xxh3. With `verify`, a VerifyError names every
        output tensor whose hash differs from the record."""
        from mergepipe_db.jobs import replay

        return replay(self.db, source, out=out, ref=ref, shard_bytes=shard_bytes, verify=verify, progress=progress)

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
