"""Commit: make a merge's output durable, then visible, atomically (Iceberg/Delta style).

1. `begin_staging`: record intent in the catalog, create a private staging directory beside `--out`
   (exclusive create); the executor writes and fsyncs shards there, hashing while writing.
2. `finish_staging`: index json and the base's side files, re-parse every written header, write
   `manifest.json`, fsync files and directory.
3. `commit`: one catalog transaction — snapshot COMMITTED, manifest, output checkpoint rows, lineage, reads,
   and the ref moved by compare-and-set (`UPDATE … WHERE version = :expected`); zero rows → CommitConflictError.
4. `publish`: rename staging to `--out`, fsync the parent. A crash between 3 and 4 is rolled forward by `gc`.
A crash anywhere leaves the old state or the complete new one; leftovers are listed and removed by `gc`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from mergepipe_db.core import faults
from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES
from mergepipe_db.core.hashing import canonical_json, sha256_hex
from mergepipe_db.core.manifest import manifest_hash
from mergepipe_db.core.plan import Plan
from mergepipe_db.core.results import ExecutionResult
from mergepipe_db.core.version import __version__
from mergepipe_db.db import schema
from mergepipe_db.db.bulk import bulk_insert
from mergepipe_db.db.checkpoints import now_iso, write_checkpoint
from mergepipe_db.db.engine import Database
from mergepipe_db.errors import CommitConflictError, IntegrityError, OutOfSpaceError, OutputExistsError
from mergepipe_db.io import is_remote, open_store

STAGING_PREFIX = ".mergepipe-staging-"


def check_out_dir(out: str | Path) -> Path:
    """`--out` must not exist, or be an empty directory. Returns its absolute path. In an object store
    (``s3://bucket/prefix``): nothing may be stored under the prefix (`io.s3.check_output_prefix`)."""
    if is_remote(out):
        open_store(out)  # UnsupportedStorageError for a scheme no store implements
        from mergepipe_db.io.s3 import check_output_prefix

        return check_output_prefix(out)  # type: ignore[return-value]  # an ObjectPath: a path's operations
    path = Path(out).expanduser().absolute()
    if path.exists() or path.is_symlink():
        if not path.is_dir() or path.is_symlink():
            raise OutputExistsError(f"output path {path} exists and is not a directory")
        if any(path.iterdir()):
            raise OutputExistsError(f"output directory {path} is not empty; choose a new --out")
    if not path.parent.is_dir():
        raise OutputExistsError(f"parent directory of --out does not exist: {path.parent}")
    return path


def begin_staging(db: Database, out: Path) -> tuple[str, Path]:
    """Record the intent in the catalog, then create the staging directory. Returns (intent id, path)."""
    sid = uuid.uuid4().hex
    staging = out.parent / f"{STAGING_PREFIX}{out.name}-{sid[:12]}"
    if is_remote(out):  # no directories, no rename: the attempt's own keys under the output prefix
        from mergepipe_db.io.s3 import AttemptPrefix

        staging = AttemptPrefix(out, sid[:12])  # type: ignore[assignment]
    with db.connect() as conn:
        conn.execute(schema.staging.insert().values(
            id=sid, staging_path=str(staging), out_path=str(out), pid=os.getpid(), host=socket.gethostname(),
            created_at=now_iso()))
    try:
        with out_of_space(staging):
            if not is_remote(out):
                staging.mkdir(mode=0o755)  # exclusive: fails if it exists
    except BaseException:
        with db.connect() as conn:  # nothing was created: drop the intent (the directory is not ours)
            conn.execute(schema.staging.delete().where(schema.staging.c.id == sid))
        raise
    return sid, staging


@contextlib.contextmanager
def out_of_space(where: Path) -> Iterator[None]:
    """Turn ENOSPC/EDQUOT raised inside the block into OutOfSpaceError (nothing is published on failure)."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutOfSpaceError(f"out of space while writing the output in {where.parent}: nothing was "
                                  f"published") from e
        raise


def abandon_staging(db: Database, intent: str, staging: Path) -> None:
    """Best-effort cleanup after a failed merge (gc removes anything left)."""
    if is_remote(str(staging)):
        from mergepipe_db.io.s3 import abandon_attempt

        with contextlib.suppress(Exception):
            abandon_attempt(staging)  # type: ignore[arg-type]
    else:
        shutil.rmtree(staging, ignore_errors=True)
    try:
        with db.connect() as conn:
            conn.execute(schema.staging.delete().where(schema.staging.c.id == intent))
    except Exception:  # noqa: BLE001 - the original error matters more; gc cleans up
        pass


def _write_json(path: Path, obj: Any) -> None:
    data = json.dumps(obj, indent=2, sort_keys=False, allow_nan=True).encode("utf-8") + b"\n"
    open_store(path).write_new(path, data)


def finish_staging(plan: Plan, result: ExecutionResult, staging: Path, manifest: dict[str, Any],
                   timings: dict[str, float]) -> str:
    """Write index, side files and manifest.json into staging; re-check headers; fsync. Returns manifest hash."""
    with out_of_space(staging):
        mhash = _finish_staging(plan, result, staging, manifest, timings)
    faults.point("manifest_written")
    return mhash


def _finish_staging(plan: Plan, result: ExecutionResult, staging: Path, manifest: dict[str, Any],
                    timings: dict[str, float]) -> str:
    from mergepipe_db.formats.safetensors import read_header

    for name, t_expected in _by_shard(result).items():
        header = read_header(staging / name)
        got = [(t.name, t.dtype, tuple(t.shape)) for t in header.tensors]
        if got != t_expected:
            raise IntegrityError(f"written shard {name} does not re-parse to the expected tensors")
    remote = is_remote(str(staging))
    if len(result.shard_names) > 1 or remote:  # remote shard names carry the attempt: always an index
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in result.out_tensors)},
            "weight_map": {t.name: _object_name(staging, result.shard_names[t.shard]) for t in result.out_tensors},
        }
        if remote:  # created only if absent: the attempt's claim on the prefix (`io.s3.write_index`)
            from mergepipe_db.io.s3 import write_index

            write_index(staging, json.dumps(index, indent=2, allow_nan=True).encode("utf-8") + b"\n")
        else:
            _write_json(staging / "model.safetensors.index.json", index)
    extras = plan.spec.text is not None  # a spec given as YAML: MergeKit's extras (model card, config, tokenizer)
    if remote and extras:  # the extras edit the side files: made in a local directory, then uploaded
        import tempfile

        from mergepipe_db.pipeline.model_card import write_extras

        with tempfile.TemporaryDirectory(prefix="mergepipe-extras-") as tmp:
            _copy_side_files(plan.base.root, Path(tmp))
            write_extras(plan, Path(tmp), model_card=plan.spec.model_card)
            for f in sorted(Path(tmp).iterdir()):
                dest = staging / f.name
                open_store(dest).write_new(dest, f.read_bytes())
    elif remote or is_remote(plan.base.root):
        _copy_side_files(plan.base.root, staging)
    else:
        root = Path(plan.base.root)
        for side in _side_files(root):
            dest = staging / side.name
            if dest.exists():
                continue
            shutil.copyfile(side, dest)
            open_store(dest).sync(dest)
    if extras and not remote:
        from mergepipe_db.pipeline.model_card import write_extras

        for path in write_extras(plan, staging, model_card=plan.spec.model_card):
            open_store(path).sync(path)
    mhash = manifest_hash(manifest)
    _write_json(staging / "manifest.json", {"manifest_hash": mhash, "manifest": manifest, "timings": timings})
    open_store(staging).sync(staging)
    return mhash


def _object_name(staging: Any, name: str) -> str:
    """The name output file `name` has in `staging` (an object store attempt's shard names carry its id)."""
    return staging.object_name(name) if hasattr(staging, "object_name") else name


def _copy_side_files(root: str, staging: Any) -> None:
    """The base's side files (`SIDE_FILES`) copied into `staging` through the stores (a base or an output in an
    object store)."""
    from mergepipe_db.formats.hf_layout import MAX_JSON_BYTES
    from mergepipe_db.io import as_path

    src = as_path(root)
    for name in SIDE_FILES:
        try:
            data = open_store(src / name).read_small(src / name, MAX_JSON_BYTES)
        except (FileNotFoundError, IsADirectoryError):
            continue
        dest = staging / name
        with contextlib.suppress(FileExistsError):
            open_store(dest).write_new(dest, data)


def _by_shard(result: ExecutionResult) -> dict[str, list[tuple[str, str, tuple[int, ...]]]]:
    out: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
    for t in result.out_tensors:
        out.setdefault(result.shard_names[t.shard], []).append((t.name, t.dtype, tuple(t.shape)))
    return out


SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def _side_files(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    out = []
    for name in SIDE_FILES:
        p = root / name
        if p.is_file() and not p.is_symlink():
            out.append(p)
    return out


@dataclass(frozen=True)
class CommitResult:
    snapshot_id: str
    checkpoint_id: str
    checkpoint_name: str
    ref: str
    version: int
    manifest_hash: str


def ref_version(conn: sa.Connection, ref: str) -> int:
    """Current version of `ref` (0 when it does not exist yet): what a merge's commit expects to replace."""
    v = conn.execute(sa.select(schema.ref.c.version).where(schema.ref.c.name == ref)).scalar()
    return int(v or 0)


def read_ref_version(db: Database, ref: str) -> int:
    """`ref_version` on a connection of its own."""
    with db.connect() as conn:
        return ref_version(conn, ref)


def commit(
    db: Database,
    plan: Plan,
    result: ExecutionResult,
    *,
    manifest: dict[str, Any],
    mhash: str,
    timings: dict[str, float],
    intent: str,
    staging: Path,
    out: Path,
    ref: str,
    expected_version: int,
) -> CommitResult:
    """One catalog transaction making the snapshot visible; compare-and-set on the ref."""
    version = expected_version + 1
    snapshot_id = sha256_hex({"manifest": mhash, "ref": ref, "version": version})[:32]
    cp_name = f"{ref}@{version}"
    with db.connect() as conn:
        _claim_out(conn, out)
        r = schema.ref
        if expected_version == 0:
            exists = conn.execute(sa.select(r.c.version).where(r.c.name == ref)).scalar()
            if exists is not None:
                raise CommitConflictError(
                    f"ref {ref!r} was created by another writer (now version {exists}); rerun the merge")
            conn.execute(r.insert().values(name=ref, snapshot_id=snapshot_id, version=version, updated_at=now_iso()))
        else:
            moved = conn.execute(
                r.update().where(r.c.name == ref, r.c.version == expected_version)
                .values(snapshot_id=snapshot_id, version=version, updated_at=now_iso())
            ).rowcount
            if moved != 1:
                raise CommitConflictError(
                    f"ref {ref!r} was moved by another writer since version {expected_version}; rerun the merge")
        taken = conn.execute(sa.select(schema.checkpoint.c.id).where(schema.checkpoint.c.name == cp_name)).scalar()
        if taken is not None:
            raise CommitConflictError(f"checkpoint name {cp_name!r} already exists; rerun the merge")
        _insert_output_checkpoint(conn, plan, result, snapshot_id, cp_name, out, staging)
        conn.execute(schema.snapshot.insert().values(
            id=snapshot_id, checkpoint_id=snapshot_id, ref=ref, state="COMMITTED", out_path=str(out),
            staging_path=str(staging), method=plan.spec.method, plan_hash=plan.plan_hash,
            budget_bytes=plan.budget_bytes, planned_bytes=plan.planned_bytes,
            realized_bytes=result.realized_bytes, full_bytes=plan.full_bytes, base_bytes=result.base_bytes,
            output_bytes=result.output_bytes, bound=plan.bound_total, seed=plan.spec.seed, created_at=now_iso(),
        ))
        conn.execute(schema.manifest.insert().values(
            snapshot_id=snapshot_id, manifest=canonical_json(manifest).decode("utf-8"),
            timings=json.dumps(timings)))
        lineage = [{"child_id": snapshot_id, "parent_id": plan.base.id, "role": "base", "position": -1,
                    "snapshot_id": snapshot_id}]
        lineage += [{"child_id": snapshot_id, "parent_id": e.checkpoint.id, "role": "expert",
                     "position": e.position, "snapshot_id": snapshot_id} for e in plan.experts]
        bulk_insert(conn, schema.lineage, lineage)
        bulk_insert(conn, schema.read_stat, _read_rows(plan, result, snapshot_id))
        if conn.execute(schema.staging.delete().where(schema.staging.c.id == intent)).rowcount != 1:
            # gc judged this merge dead and removed its staging: committing would publish nothing.
            raise CommitConflictError(f"the staging intent of this merge was collected (gc?) before commit; "
                                      f"rerun the merge (staging {staging})")
    faults.point("catalog_committed")
    return CommitResult(snapshot_id, snapshot_id, cp_name, ref, version, mhash)


def record_timings(db: Database, snapshot_id: str, timings: dict[str, float]) -> None:
    """Store the merge's final timings (with the commit's own time and the wall time, known only after the
    commit) in the catalog's manifest row. Timings are outside the manifest hash; a failure here leaves the
    committed snapshot as it is, with the timings written at commit."""
    from mergepipe_db.errors import MergePipeError

    try:
        with db.connect() as conn:
            conn.execute(schema.manifest.update().where(schema.manifest.c.snapshot_id == snapshot_id)
                         .values(timings=json.dumps(timings)))
    except MergePipeError:
        pass


def _claim_out(conn: sa.Connection, out: Path) -> None:
    """Refuse to commit a second snapshot to `out` while another one waits there to be published (a merge
    killed between commit and rename, not yet rolled forward by gc), or when `out` filled up meanwhile:
    its rename would fail after the commit and leave the snapshot unpublished."""
    if conn.dialect.name == "postgresql":  # DuckDB commits are serialized by the catalog lock already
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:o))"), {"o": str(out)})
    s = schema.snapshot
    for sid, staging in conn.execute(sa.select(s.c.id, s.c.staging_path).where(s.c.out_path == str(out))):
        if is_remote(out):
            raise OutputExistsError(f"snapshot {sid} was already committed to {out}; choose another --out")
        if Path(staging).is_dir():
            raise OutputExistsError(f"snapshot {sid} was committed to {out} but not yet published (interrupted "
                                    f"merge): run `mergepipe gc --apply` to publish it, or choose another --out")
    if not is_remote(out) and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OutputExistsError(f"output directory {out} was filled while this merge ran; choose a new --out")


def _read_rows(plan: Plan, result: ExecutionResult, snapshot_id: str) -> list[dict[str, Any]]:
    rows = []
    for e in plan.experts:
        for t in plan.base_tensors:
            if t.dtype not in ARITHMETIC_DTYPES or t.name not in e.tensors:  # delta/LoRA: a subset
                continue
            et = e.tensors[t.name]
            reads = plan.access.get((e.position, t.idx), ())
            n_sel = t.n_blocks if any(r.block_idx == -1 for r in reads) else sum(r.block_idx >= 0 for r in reads)
            rows.append({
                "snapshot_id": snapshot_id, "expert_id": e.checkpoint.id, "tensor_idx": t.idx,
                "position": e.position, "blocks_total": t.n_blocks, "blocks_read": n_sel,
                "bytes_full": et.nbytes, "bytes_planned": sum(r.nbytes for r in reads),
                "bytes_read": result.reads.get((e.position, t.idx), 0),
            })
    return rows


def _insert_output_checkpoint(conn: sa.Connection, plan: Plan, result: ExecutionResult, cid: str, name: str,
                              out: Path, staging: Path) -> None:
    """Catalogue the output as a checkpoint (kind 'snapshot', with delta statistics against the base when it
    has the base's dtypes) so it can be merged again, ranked block by block (`write_checkpoint`, as ingest).

    Paths are the published ones (`out`); size and mtime come from the staged files, which the rename keeps.
    """
    files, tensors, blocks = [], [], []
    file_ids = []
    for fi, shard in enumerate(result.shard_names):
        fid = sha256_hex([cid, shard])[:32]
        file_ids.append(fid)
        where = staging / shard
        st = open_store(where).stat(where)
        key = _object_name(staging, shard)  # an object store's key names the attempt: stays where written
        files.append({"id": fid, "checkpoint_id": cid, "file_idx": fi, "relpath": key, "path": str(out / key),
                      "size": st.size, "mtime_ns": int(st.version), "sha256": result.shard_sha256[fi],
                      "header_len": result.header_lens[fi]})
    blocks_by_tensor: dict[int, list[dict[str, Any]]] = {}
    for b in result.block_rows:
        blocks_by_tensor.setdefault(b["tensor_idx"], []).append(b)
    has_stats = True
    base_xxh3 = {t.name: (t.dtype, t.xxh3) for t in plan.base_tensors}
    for t, h, off in zip(result.out_tensors, result.tensor_xxh3, result.tensor_offsets):
        bl = blocks_by_tensor.get(t.idx, [])
        with_stats = bool(bl) and all(b["delta_l2"] is not None for b in bl)
        has_stats &= with_stats or t.dtype not in ARITHMETIC_DTYPES
        tensors.append({
            "checkpoint_id": cid, "tensor_idx": t.idx, "name": t.name, "dtype": t.dtype,
            "shape": json.dumps(list(t.shape)), "file_id": file_ids[t.shard], "offset": off,
            "nbytes": t.nbytes, "n_rows": t.shape[0] if t.shape else 1,
            "rows_per_block": bl[0]["rows_per_block"] if bl else 1, "n_blocks": len(bl), "xxh3": h,
            "delta_l2": math.sqrt(math.fsum(b["delta_l2"] ** 2 for b in bl)) if with_stats else None,
            # the base's bytes, as ingest decides it (a tensor that differs in the sign of a zero is not)
            "equal_to_base": base_xxh3.get(t.name) == (t.dtype, h) if with_stats else None,
        })
        for b in bl:
            blocks.append({
                "checkpoint_id": cid, "tensor_idx": t.idx, "block_idx": b["block_idx"], "row_start": b["row_start"],
                "row_stop": b["row_stop"], "offset": off + b["rel"], "nbytes": b["nbytes"], "xxh3": b["xxh3"],
                "delta_l2": b["delta_l2"], "delta_l1": b["delta_l1"], "delta_max": b["delta_max"],
                "pos_frac": b["pos_frac"], "sketch": b["sketch"],
            })
    write_checkpoint(conn, {
        "id": cid, "name": name, "kind": "snapshot", "base_id": plan.base.id, "root": str(out),
        "config": json.dumps(plan.base.config if plan.base.config is None or plan.recipe is None  # slices:
                             else {**plan.base.config, "num_hidden_layers": plan.recipe.num_layers})  # its layers
        if plan.base.config is not None else None,
        "block_bytes": plan.base.block_bytes, "n_tensors": len(tensors),
        "total_bytes": sum(t.nbytes for t in result.out_tensors),
        "has_stats": has_stats, "created_at": now_iso(), "tool_version": __version__,
    }, files, tensors, blocks)


def publish(staging: Path, out: Path) -> None:
    """Make the committed output visible at `out` (atomic rename on the same filesystem; in an object store,
    ``manifest.json`` written last, `io.s3.publish_attempt`)."""
    if is_remote(str(staging)):
        from mergepipe_db.io.s3 import publish_attempt

        publish_attempt(staging)  # type: ignore[arg-type]
        faults.point("published")
        return
    if not staging.is_dir() and (out / "manifest.json").is_file():
        return  # already rolled forward by `gc --apply` (which may run while a merge is between commit and publish)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    try:
        open_store(out).publish(staging, out)  # rename, then fsync the parent
    except FileNotFoundError:
        if not (out / "manifest.json").is_file():
            raise
        return  # gc published it between our look and the rename
    faults.point("published")
