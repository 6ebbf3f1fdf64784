"""The `mergepipe` command: a thin shell over `mergepipe_db.Catalog`.

Every error a user can cause is a MergePipeError: printed as one line on stderr, exit code 1, no traceback
(set MERGEPIPE_DEBUG=1 to see one). Heavy imports happen inside the commands so `--help` is instant.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from mergepipe_db import sources
from mergepipe_db.core.process import exit_now
from mergepipe_db.core.units import fmt_bytes
from mergepipe_db.core.version import __version__
from mergepipe_db.errors import MergePipeError

EPILOG = "Catalog: --catalog URL, else $MERGEPIPE_CATALOG, else ./mergepipe.duckdb (a DuckDB file)."


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, (bytes, bytearray, memoryview)):
        return bytes(o).hex()
    return str(o)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=_json_default))


def _progress(args: argparse.Namespace) -> bool:
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def _catalog(args: argparse.Namespace, *, create: bool = False):
    """The catalog of `args`. Only `init` and `ingest` (and `demo`, `db upgrade`) create one; every other
    command on a missing catalog fails with CatalogNotFoundError naming the path it looked at."""
    from mergepipe_db.catalog import Catalog

    options = getattr(args, "storage_option", None)
    if options:
        from mergepipe_db.io.s3 import parse_options

        return Catalog.open(args.catalog, create=create, storage_options=parse_options(options))
    return Catalog.open(args.catalog, create=create)


def _parse_size(text: str) -> int:
    from mergepipe_db.core.spec import parse_budget
    from mergepipe_db.errors import BudgetError, SpecError

    if text.strip().isdigit():  # a size (unlike a budget) may be a bare number of bytes
        return int(text.strip())
    try:
        b = parse_budget(text)
    except BudgetError:
        b = None
    if b is None or b.nbytes is None:
        raise SpecError(f"expected a size in bytes (e.g. 1MiB, 4GB, 123456), got {text!r}")
    return b.nbytes


# --- commands ------------------------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    cat = _catalog(args, create=True)
    print(f"catalog ready: {cat.db.display()}")
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from mergepipe_db.catalog import Catalog

    cat = Catalog.lazy(args.catalog)
    before, after = cat.upgrade()
    print(f"catalog {cat.db.display()}: schema {before or 'empty'} -> {after}")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    cat = _catalog(args, create=True)
    block_bytes = _parse_size(args.block_bytes) if args.block_bytes else None
    results = cat.ingest_many(args.path, names=args.name, base=args.base, block_bytes=block_bytes,
                              progress=_progress(args), kind=args.kind)
    if args.json:  # one path: its result; several: a list of them, in the order given
        _print_json(results[0].to_dict() if len(results) == 1 else [r.to_dict() for r in results])
        return 0
    for res in results:
        state = "ingested" if res.created else "unchanged"
        print(f"{state} {res.name} ({res.kind}): {res.n_tensors} tensors, {res.n_blocks} blocks, "
              f"{fmt_bytes(res.total_bytes)}, id {res.checkpoint_id}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    cat = _catalog(args)
    plan = cat.plan(args.spec, budget=args.budget, seed=args.seed, progress=_progress(args))
    from mergepipe_db.jobs import budget_warnings

    summary = plan.summary()
    warnings = budget_warnings(plan)
    for w in warnings:
        print(f"mergepipe: warning: {w}", file=sys.stderr)
    if args.json:
        _print_json({**summary, "warnings": warnings})
        return 0
    print(f"plan {plan.plan_hash[:16]}  method {plan.spec.method}  base {plan.base.name}")
    print(f"expert bytes: candidates (non-zero delta) {fmt_bytes(plan.candidate_bytes)}, all (full read) "
          f"{fmt_bytes(plan.full_bytes)}; budget {fmt_bytes(plan.budget_bytes)}")
    print(f"planned expert reads {fmt_bytes(plan.planned_bytes)}")
    for e in summary["experts"]:
        print(f"  {e['name']:<24} {e['blocks_selected']:>7} blocks  {fmt_bytes(e['planned_bytes']):>12}")
    bound = ("n/a (operator is not fixed-coefficient additive)" if plan.bound_total is None
             else f"{plan.bound_total:.6g}")
    print(f"omitted-update bound (L2): {bound}")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from mergepipe_db.kernels import warmup

    distributed = args.workers is not None or args.scheduler is not None
    if not distributed:  # (on Dask the workers load them)
        warmup.start(own_process=True)  # the merge kernels load while the catalog is imported, opened and planned
    cat = _catalog(args)
    shard = _parse_size(args.shard_size) if args.shard_size else None
    res = cat.merge(args.spec, out=args.out, budget=args.budget, seed=args.seed, ref=args.ref, shard_bytes=shard,
                    progress=_progress(args), verify_reads=args.verify_reads, workers=args.workers,
                    scheduler=args.scheduler)
    for w in res.warnings:
        print(f"mergepipe: warning: {w}", file=sys.stderr)
    if args.json:
        _print_json({k: v for k, v in res.to_dict().items()})
        return 0
    print(f"committed snapshot {res.snapshot_id} as {res.checkpoint} -> {res.out}")
    print(f"  plan {res.plan_hash[:16]}  budget {fmt_bytes(res.budget_bytes)}  expert bytes: candidates "
          f"(non-zero delta) {fmt_bytes(res.candidate_bytes)}, all (full read) {fmt_bytes(res.full_bytes)}")
    print(f"  expert reads planned {fmt_bytes(res.planned_bytes)}, realized {fmt_bytes(res.realized_bytes)}"
          f" ({100.0 * res.realized_bytes / max(1, res.full_bytes):.1f}% of full)")
    print(f"  base read {fmt_bytes(res.base_bytes)}, output written {fmt_bytes(res.output_bytes)}, "
          f"bound {res.bound if res.bound is not None else 'n/a'}, {res.seconds:.2f} s")
    if res.cached_bytes:
        print(f"  {fmt_bytes(res.cached_bytes)} of the reads came from the page cache")
    if distributed:
        print(f"  on Dask: {int(res.timings['n_tasks'])} task(s) over {int(res.timings['n_workers'])} worker(s)")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from mergepipe_db.kernels import warmup

    warmup.start(own_process=True)
    cat = _catalog(args)
    shard = _parse_size(args.shard_size) if args.shard_size else None
    res = cat.replay(args.source, out=args.out, ref=args.ref, shard_bytes=shard, verify=args.verify,
                     progress=_progress(args))
    if args.json:
        _print_json(res.to_dict())
        return 0
    print(f"replayed into snapshot {res.snapshot_id} as {res.checkpoint} -> {res.out}")
    print(f"  plan {res.plan_hash[:16]}  manifest {res.manifest_hash[:16]}  "
          f"expert reads {fmt_bytes(res.realized_bytes)}"
          + ("  (outputs verified against the manifest)" if args.verify else ""))
    return 0


def _render(cols: list[str], rows: list[tuple[Any, ...]], fmt: str) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "NULL" if fmt == "table" else ""
        if isinstance(v, (bytes, bytearray, memoryview)):
            return bytes(v).hex()
        return str(v)

    if fmt == "json":
        return json.dumps([dict(zip(cols, r)) for r in rows], indent=2, default=_json_default)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        for r in rows:
            w.writerow([cell(v) for v in r])
        return buf.getvalue().rstrip("\n")
    table = [[cell(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in table]) for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip(), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines)


def cmd_sql(args: argparse.Namespace) -> int:
    cat = _catalog(args)
    cols, rows = cat.sql(args.query)
    print(_render(cols, rows, args.format))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    cat = _catalog(args)
    problems, checked = cat.verify_all(args.checkpoint, full=args.full)
    if args.json:
        _print_json({"ok": not problems, "checked": checked, "problems": problems})
    else:
        for p in problems:
            print(p)
        if not problems:
            what = "; ".join(checked) if len(checked) <= 3 else f"{checked[0]} and {len(checked) - 1} snapshots"
            how = []
            if any("(sources)" in c or c.startswith("sources") for c in checked):
                how.append("source files: present, size and mtime" + (", and sha256 of every byte (--full)"
                                                                        if args.full else " (--full also rehashes "
                                                                        "their contents, sha256)"))
            if any("(outputs)" in c for c in checked):
                how.append("snapshot outputs: sha256 of every file and xxh3_128 of every tensor")
            print(f"ok: {what} match the record ({'; '.join(how)})")
    if problems:
        from mergepipe_db.errors import VerifyError

        raise VerifyError(f"{len(problems)} problem(s): files or tensors differ from the catalog or the "
                          f"manifest (listed above)")
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    from mergepipe_db.audit.lineage import render

    cat = _catalog(args)
    print(render(cat.lineage(args.snapshot), args.format))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    cat = _catalog(args)
    path = cat.report(args.snapshot, out=args.out)
    if args.json:
        _print_json({"report": str(path)})
    else:
        print(f"wrote {path}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from mergepipe_db.kernels import warmup

    warmup.start(own_process=True)
    cat = _catalog(args)
    shard = _parse_size(args.shard_size) if args.shard_size else None
    res = cat.sweep(args.spec, budgets=args.budgets, out=args.out, seed=args.seed, shard_bytes=shard,
                    progress=not args.quiet, bar=_progress(args))
    if args.json:
        _print_json(res.to_dict())
        return 0
    print(f"{'budget':>8} {'budget bytes':>12} {'expert bytes':>12} {'seconds':>8} {'deviation rel.':>14} "
          f"{'bound rel.':>10} {'bound abs.':>10}")
    for r in res.rows:
        brel = "n/a" if r["bound_rel_l2"] is None else f"{r['bound_rel_l2']:.4g}"
        babs = "n/a" if r["bound_abs_l2"] is None else f"{r['bound_abs_l2']:.4g}"
        print(f"{r['budget']:>8} {fmt_bytes(r['budget_bytes']):>12} {fmt_bytes(r['expert_bytes']):>12} "
              f"{r['seconds']:>8.2f} {r['deviation_rel_l2']:>14.4g} {brel:>10} {babs:>10}")
    print(f"wrote {res.csv}, {res.md}, {res.png}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    cat = _catalog(args)
    actions = cat.gc(dry_run=not args.apply)
    for a in actions:
        print(("would " if not args.apply else "") + a)
    if not actions:
        print("nothing to collect")
    elif not args.apply:
        print("dry run: rerun with --apply to do this")
    return 0


def cmd_fsck(args: argparse.Namespace) -> int:
    from mergepipe_db.admin.fsck import problems

    cat = _catalog(args)
    findings = cat.fsck(full=args.full)
    bad = problems(findings)
    if args.json:
        _print_json({"ok": not bad, "findings": [f.to_dict() for f in findings]})
    else:
        for f in findings:
            print(f)
        n_left = sum(f.kind == "leftover" for f in findings)
        print(f"{len(bad)} problem(s), {n_left} leftover(s) `mergepipe gc --apply` collects")
    if bad:
        from mergepipe_db.errors import VerifyError

        raise VerifyError(f"fsck found {len(bad)} missing or corrupt item(s) (listed above)")
    return 0


def cmd_export_delta(args: argparse.Namespace) -> int:
    res = _catalog(args).export_delta(args.expert, args.out, dtype=args.dtype)
    if args.json:
        _print_json(res)
    else:
        print(f"wrote {res['n_tensors']} delta tensors ({res['dtype']}) of {res['expert']} to {res['out']}")
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    res = _catalog(args).pack(args.expert, store=args.store)
    if args.json:
        _print_json(res.to_dict())
    else:
        print(f"packed {res.blocks_packed} blocks of {res.expert} ({res.blocks_deduplicated} deduplicated): "
              f"{fmt_bytes(res.raw_bytes)} -> {fmt_bytes(res.packed_bytes)} (x{res.ratio:.2f}) in {res.store}")
        if res.blocks_left_raw:
            print(f"left {res.blocks_left_raw} blocks unpacked: compressed, they would not be smaller")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from mergepipe_db.demo.run import run_demo

    return run_demo(Path(args.dir), catalog=args.catalog, method=args.method, budget=args.budget,
                    experts=args.experts, preset=args.preset, progress=_progress(args))


# --- parser ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mergepipe",
        description="Merge LLM checkpoints from a SQL catalog of parameter blocks, under an expert-read I/O budget.",
        epilog=EPILOG,
    )
    p.add_argument("--version", action="version", version=f"mergepipe {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--catalog", metavar="URL", help="catalog URL or DuckDB file (default: $MERGEPIPE_CATALOG "
                        "or ./mergepipe.duckdb)")
    common.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    common.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                        help="setting of the s3:// object store, over the AWS_* environment (repeatable): "
                        "endpoint, access_key_id, secret_access_key, session_token, region, max_retries, "
                        "retry_timeout (seconds), allow_http; a distributed merge sends them to its Dask workers")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("init", parents=[common], help="create the catalog (or check it is current)",
                       description="Create an empty catalog at the given URL, or check an existing one.",
                       epilog=EPILOG)
    s.set_defaults(func=cmd_init)

    s = sub.add_parser("db", help="catalog schema maintenance", description="Catalog schema maintenance.")
    dbsub = s.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    u = dbsub.add_parser("upgrade", parents=[common], help="migrate the catalog to this version's schema",
                         description="Run the Alembic migrations up to the newest schema.", epilog=EPILOG)
    u.set_defaults(func=cmd_db_upgrade)

    s = sub.add_parser("ingest", parents=[common], help="catalogue a checkpoint (once)",
                       description="Catalogue a checkpoint: a Hugging Face model directory (model.safetensors or "
                       "shards + model.safetensors.index.json) or one .safetensors file. Reads each file once; "
                       "idempotent. Several experts of one base are read together, the base once for all of them, "
                       "and catalogued in one transaction (all or none).", epilog=EPILOG)
    s.add_argument("path", nargs="+", help="model directory or .safetensors file (one or more)")
    s.add_argument("--name", action="append", help="catalog name (default: the directory or file name); with "
                   "several paths, give it once per path, in order")
    s.add_argument("--base", help="catalogued base model this checkpoint is an expert of (enables delta statistics)")
    s.add_argument("--block-bytes", metavar="N", help="target block size, e.g. 1MiB (default 1MiB; experts use "
                   "their base's)")
    s.add_argument("--kind", choices=sources.kinds(), default=sources.DEFAULT_KIND,
                   help="full checkpoint (default; a directory with adapter_config.json is a LoRA adapter), delta "
                   "(tensors hold expert - base) or lora (PEFT adapter); delta and lora need --base")
    s.add_argument("--json", action="store_true", help="print the result as JSON (with several paths, a list of "
                   "results in their order)")
    s.set_defaults(func=cmd_ingest)

    budget_help = ("expert-read budget: a fraction in [0, 1] of the full read (0.25) or bytes with a unit (3GiB, "
                   "500MB, 2B); default: the spec's budget, else 1 (the full read)")
    s = sub.add_parser("plan", parents=[common], help="dry run: which expert blocks a merge would read",
                       description="Plan a merge without executing it: predicted expert bytes, blocks chosen per "
                       "expert, and the omitted-update bound.", epilog=EPILOG)
    s.add_argument("spec", help="merge spec (MergeKit-compatible YAML plus budget and seed)")
    s.add_argument("--budget", help=budget_help)
    s.add_argument("--seed", type=int, help="seed for random operators (DARE)")
    s.add_argument("--json", action="store_true", help="print the plan summary as JSON")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("merge", parents=[common], help="plan, execute and commit a budgeted merge",
                       description="Run a merge: read only the planned expert byte ranges, write a Hugging Face "
                       "model directory with a manifest, and commit it atomically.", epilog=EPILOG)
    s.add_argument("spec", help="merge spec (MergeKit-compatible YAML plus budget and seed)")
    s.add_argument("--out", required=True, help="output directory (must not exist or be empty), or s3://bucket/prefix "
                   "(nothing stored under it yet)")
    s.add_argument("--budget", help=budget_help)
    s.add_argument("--seed", type=int, help="seed for random operators (DARE)")
    s.add_argument("--ref", help="ref to move to the new snapshot (default: the output directory's name)")
    s.add_argument("--shard-size", metavar="N", help="maximum output shard size (default 4GiB)")
    s.add_argument("--verify-reads", action="store_true", help="check the xxh3 of every expert range read")
    dask = s.add_mutually_exclusive_group()
    dask.add_argument("--workers", type=int, metavar="N",
                      help="execute on a local Dask cluster of N worker processes (planned and committed here; "
                      "the same output)")
    dask.add_argument("--scheduler", metavar="ADDR",
                      help="execute on the workers of an existing Dask scheduler, e.g. tcp://host:8786 (inputs "
                      "and --out on paths every worker sees, or in object storage)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_merge)

    s = sub.add_parser("replay", parents=[common], help="re-execute a recorded merge from its manifest",
                       description="Re-execute the access set a manifest recorded, without planning: same reads, "
                       "same output tensor hashes, same manifest hash. Refuses when an input changed.",
                       epilog=EPILOG)
    s.add_argument("source", help="snapshot id, ref, snapshot checkpoint name, or path to a manifest.json")
    s.add_argument("--out", required=True, help="output directory (must not exist or be empty), or s3://bucket/prefix "
                   "(nothing stored under it yet)")
    s.add_argument("--ref", help="ref to move to the new snapshot (default: the output directory's name)")
    s.add_argument("--shard-size", metavar="N", help="maximum output shard size (default 4GiB)")
    s.add_argument("--verify", action="store_true", help="compare output tensor hashes with the manifest and "
                   "name every tensor that differs")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_replay)

    s = sub.add_parser("sql", parents=[common], help="read-only SQL over the catalog views",
                       description="Run one read-only SELECT over the views checkpoints, files, tensors, blocks, "
                       "snapshots, manifests, lineage, reads, refs. Writes and file access are refused.",
                       epilog=EPILOG)
    s.add_argument("query", help='e.g. "SELECT name, kind, total_bytes FROM checkpoints"')
    s.add_argument("--format", choices=("table", "csv", "json"), default="table", help="output format")
    s.set_defaults(func=cmd_sql)

    s = sub.add_parser("verify", parents=[common], help="check sources and merge outputs against the record",
                       description="Without NAME: check every catalogued source file of the original checkpoints "
                       "(present, same size and mtime; with --full also sha256) and rehash the outputs of every "
                       "committed snapshot against its manifest (file sha256 and per-tensor xxh3_128). With NAME: "
                       "a snapshot (ref@version), ref or snapshot id checks that snapshot's outputs; another "
                       "checkpoint name checks its source files. Prints one line per differing file or tensor "
                       "and exits 1 (VerifyError) when anything differs.", epilog=EPILOG)
    s.add_argument("checkpoint", nargs="?", metavar="NAME",
                   help="only this checkpoint, snapshot (ref@version), ref or snapshot id")
    s.add_argument("--full", action="store_true", help="rehash source file contents (sha256); snapshot outputs "
                   "are always rehashed")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("lineage", parents=[common], help="show what a snapshot was merged from, recursively",
                       description="Walk a snapshot's lineage back to the original checkpoints: every merge on the "
                       "way with its operator, expert-read budget and plan hash, and the bytes read along each edge. "
                       "SNAPSHOT is a snapshot checkpoint "
                       "name (ref@version), a ref (its current version) or a snapshot id.", epilog=EPILOG)
    s.add_argument("snapshot", metavar="SNAPSHOT", help="snapshot name (ref@version), ref or snapshot id")
    s.add_argument("--format", choices=("text", "mermaid", "json"), default="text",
                   help="text: indented tree (default); mermaid: flowchart, merges labelled with operator, budget "
                   "and plan hash prefix, edges with the bytes read from that input; json: nodes and edges")
    s.set_defaults(func=cmd_lineage)

    s = sub.add_parser("report", parents=[common], help="write an audit report (HTML or Markdown) of a snapshot",
                       description="Write an audit report of a committed merge: its identity (manifest hash, plan "
                       "hash, output shards' sha256 and size, the verify command), the distance from the "
                       "full-budget output (bound or estimate, absolute and relative; measured when a full-budget "
                       "merge of the same spec is catalogued), candidate/all/planned/realized expert bytes per "
                       "expert, a time table adding up to the wall time, a byte-weighted per-layer x per-expert "
                       "coverage heatmap, inputs per checkpoint, operator, parameters and lineage. The output files "
                       "are checked first (StaleOutputError when one moved or changed). The format follows the "
                       "extension of --out: .html is self-contained (heatmap embedded); .md writes the heatmap "
                       "PNG beside the report.", epilog=EPILOG)
    s.add_argument("snapshot", metavar="SNAPSHOT", help="snapshot name (ref@version), ref or snapshot id")
    s.add_argument("--out", required=True, help="report file: report.html or report.md (its directory must exist)")
    s.add_argument("--json", action="store_true", help="print the report path as JSON")
    s.set_defaults(func=cmd_report)

    s = sub.add_parser("sweep", parents=[common], help="merge one spec at several budgets; error/time frontier",
                       description="Run the merge in SPEC once per budget into DIR/budget-<b>/ (ref <DIR name>-b<b>"
                       "), always including the full budget 1 as the reference, then write DIR/frontier.csv, "
                       "DIR/frontier.md and DIR/frontier.png: budget, budget bytes, realized expert bytes, total "
                       "bytes (expert + base + output), seconds, the L2 deviation from the full-budget output "
                       "(float64; deviation_rel_l2 relative to its norm, deviation_abs_l2 absolute) and the "
                       "omitted-update bound (bound_rel_l2, bound_abs_l2). The CSV keeps exact integers; the "
                       "table and frontier.md show human units. Progress lines go to stderr.", epilog=EPILOG)
    s.add_argument("spec", help="merge spec (MergeKit-compatible YAML; its own budget is ignored)")
    s.add_argument("--budgets", default="0.05,0.1,0.25,0.5,1",
                   help="comma-separated budgets, fractions or bytes (default 0.05,0.1,0.25,0.5,1)")
    s.add_argument("--out", required=True, metavar="DIR", help="sweep directory (budget-<b>/ must not exist yet)")
    s.add_argument("--seed", type=int, help="seed for random operators (DARE)")
    s.add_argument("--shard-size", metavar="N", help="maximum output shard size (default 4GiB)")
    s.add_argument("--json", action="store_true", help="print the frontier rows as JSON")
    s.set_defaults(func=cmd_sweep)

    s = sub.add_parser("gc", parents=[common], help="list (or remove) leftovers of interrupted merges",
                       description="Find staging directories of interrupted merges and committed snapshots not yet "
                       "published. Dry run unless --apply.", epilog=EPILOG)
    s.add_argument("--apply", action="store_true", help="remove leftovers / publish committed snapshots")
    s.set_defaults(func=cmd_gc)

    s = sub.add_parser("fsck", parents=[common], help="cross-check catalog, snapshots, staging and sources",
                       description="Check that every committed snapshot's files are at its output directory with "
                       "the catalogued sizes and manifest, list leftovers of interrupted merges (collectable by "
                       "`gc --apply`) and check every source file. Exit 1 when anything is missing or corrupt; "
                       "leftovers alone exit 0.", epilog=EPILOG)
    s.add_argument("--full", action="store_true", help="also rehash every file (sha256)")
    s.add_argument("--json", action="store_true", help="print the findings as JSON")
    s.set_defaults(func=cmd_fsck)

    s = sub.add_parser("export-delta", parents=[common], help="write an expert's delta (expert - base) as a model dir",
                       description="Write delta = expert - base (LoRA: B@A*scale; delta checkpoints: as stored) of "
                       "every tensor the expert covers to a new Hugging Face directory (model.safetensors + the "
                       "base's config.json); ingest it back with --kind delta.", epilog=EPILOG)
    s.add_argument("expert", help="catalogued expert name")
    s.add_argument("--out", required=True, help="output directory (must not exist or be empty), or s3://bucket/prefix "
                   "(nothing stored under it yet)")
    s.add_argument("--dtype", default="float32", help="float32 (default, exact for bf16/f16), bfloat16 or float16")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_export_delta)

    s = sub.add_parser("pack", parents=[common], help="store an expert's delta blocks compressed",
                       description="Store the blocks of a full expert whose delta is nonzero as zstd(expert XOR "
                       "base) in a content-addressed, append-only block store; plans then cost those blocks their "
                       "compressed length and merges read them from the store. Idempotent.", epilog=EPILOG)
    s.add_argument("expert", help="catalogued full expert name")
    s.add_argument("--store", help="store directory (default: mergepipe-store beside a DuckDB catalog, else ./)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_pack)

    s = sub.add_parser("demo", parents=[common], help="generate a small model family, ingest it, merge it",
                       description="Generate a small Llama-shaped family (base + experts, sharded safetensors, HF "
                       "layout), ingest it, run a budgeted merge and print what it read.", epilog=EPILOG)
    s.add_argument("--dir", default="mergepipe-demo", help="working directory (default ./mergepipe-demo)")
    s.add_argument("--method", default="ties", help="merge method (default ties)")
    s.add_argument("--budget", default="0.25", help=budget_help + " (default 0.25)")
    s.add_argument("--experts", type=int, default=4, help="number of experts (default 4)")
    s.add_argument("--preset", default="small", help="model size preset: tiny, small (default), bench")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from mergepipe_db.kernels.compile_time import compiled, note

    before = compiled()
    try:
        rc = int(args.func(args) or 0)
        compiling = note(before) if sys.stderr.isatty() else None  # for a person at a terminal, as the bar
        if compiling:
            print(f"mergepipe: {compiling}", file=sys.stderr)
        return rc
    except MergePipeError as e:
        if os.environ.get("MERGEPIPE_DEBUG"):
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"mergepipe: error: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `mergepipe sql ... | head`: not an error
        return 0
    except OSError as e:
        if os.environ.get("MERGEPIPE_DEBUG"):
            raise
        print(f"mergepipe: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mergepipe: interrupted", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The `mergepipe` console script: `main`, then `exit_now` (tests call `main` in process)."""
    exit_now(main())


if __name__ == "__main__":
    run()
