"""Dask benchmark (issue 36, part 5): 1 against 2 Dask workers, and the coordinator's overhead (plan + gather +
commit) at K = 8, beside the single-process merge of the same spec, budget and shard size.

    python -m benchmarks.dask_workers                      # the benchmark family (BENCH_MODEL_BYTES, ~1 GB default)
    BENCH_MODEL_BYTES=2e9 python -m benchmarks.dask_workers --budgets 0.1,1.0
    python -m benchmarks.dask_workers --quick --reps 1     # tiny family, a smoke run (writes no section)
    python -m benchmarks.dask_workers --catalog URL --spec merge.yml   # a family already catalogued, e.g. in S3
                                                           # (AWS_* in the environment, for the workers too)

Per budget: the single-process merge (`Catalog.merge`), then per worker count a `LocalCluster` of that many
worker processes (one thread each; its start-up timed apart, then one untimed merge loads the kernels in the
workers), then `--reps` timed merges, each after `drop_caches` (root) into a fresh output. Every merge's
manifest hash must equal the single-process one (checked; a difference aborts the run). Coordinator overhead
= plan + dispatch (cutting the plan, submitting tasks) + gather (combining the per-shard results, the realized
== planned check, moving the shards to their names) + commit (index, side files, manifest — the "finalize"
part of it —, catalog transaction, publish): everything but the tasks themselves. Writes
`benchmarks/results/dask.md` (a section of RESULTS.md) and `results/raw/dask.json`, except with --quick.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import MiB, config, drop_caches, machine_line, md_table, save_raw, write_section

#: the coordinator's phases (`MergeResult.timings`; "commit" counts from the start of "finalize" to the publish)
COORDINATOR = ("plan", "dispatch", "gather", "commit")


def _merge(cat: Any, spec: Any, out: Path, budget: str, shard: int, client: Any = None) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    cold = drop_caches()
    t0 = time.perf_counter()
    res = cat.merge(spec, out=out, budget=budget, shard_bytes=shard, client=client,
                    ref=f"bench-dask-{os.getpid()}-{time.time_ns()}")
    wall = time.perf_counter() - t0
    t = res.timings
    row = {"wall_s": wall, "cold": cold, "manifest_hash": res.manifest_hash, "realized": res.realized_bytes,
           "planned": res.planned_bytes, "output": res.output_bytes, "timings": t}
    if client is not None:
        row["coordinator_s"] = sum(t.get(k, 0.0) for k in COORDINATOR)
    shutil.rmtree(out, ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny family; writes no results section")
    ap.add_argument("--k", type=int, default=8, help="experts (default 8)")
    ap.add_argument("--method", default="ties")
    ap.add_argument("--budgets", default="0.1,1.0")
    ap.add_argument("--workers", default="1,2", help="worker counts (default 1,2)")
    ap.add_argument("--reps", type=int, default=int(os.environ.get("BENCH_REPS", 3)))
    ap.add_argument("--shard-bytes", type=int, default=None, help="output shard size (default 256 MiB; quick 4 MiB)")
    ap.add_argument("--catalog", help="an existing catalog (with --spec) instead of the benchmark family")
    ap.add_argument("--spec", help="merge spec over the catalog's checkpoints (with --catalog)")
    ap.add_argument("--out-dir", help="where outputs go (default: a temporary directory beside the family)")
    args = ap.parse_args(argv)

    from distributed import Client, LocalCluster

    from mergepipe_db import Catalog

    cfg = config(args.quick)
    if args.catalog:
        if not args.spec:
            ap.error("--catalog needs --spec")
        cat, spec, where = Catalog.open(args.catalog), args.spec, Path(args.out_dir or tempfile.gettempdir())
        family = f"catalog {args.catalog}, spec {args.spec}"
    else:
        from benchmarks.family import ensure_catalog, ensure_family
        from benchmarks.family import spec as family_spec

        info = ensure_family(cfg)
        ensure_catalog(cfg)
        cat, spec = Catalog.open(str(cfg.catalog)), family_spec(cfg, args.method, args.k)
        where = Path(args.out_dir or cfg.family_dir)
        family = f"{args.method}, K={args.k}, models of {info['model_bytes'] / 1e6:,.0f} MB (BF16)"
    shard = args.shard_bytes or (4 * MiB if args.quick else 256 * MiB)
    work = Path(tempfile.mkdtemp(prefix="dask-bench-", dir=where))
    counts = [int(x) for x in args.workers.split(",")]
    raw: dict[str, Any] = {"family": family, "shard_bytes": shard, "machine": machine_line(), "budgets": {}}
    rows = []
    try:
        for budget in args.budgets.split(","):
            one = [_merge(cat, spec, work / "one", budget, shard) for _ in range(args.reps)]
            expected = one[0]["manifest_hash"]
            per: dict[str, Any] = {"single": one}
            rows.append([budget, "single process", f"{statistics.median(r['wall_s'] for r in one):.2f}", "—", "—",
                         "—", "—"])
            for n in counts:
                t0 = time.perf_counter()
                with LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster, Client(cluster) as client:
                    start_s = time.perf_counter() - t0
                    _merge(cat, spec, work / "warm", budget, shard, client)  # kernels load in the workers
                    runs = [_merge(cat, spec, work / f"w{n}", budget, shard, client) for _ in range(args.reps)]
                bad = [r["manifest_hash"] for r in runs if r["manifest_hash"] != expected]
                if bad:
                    raise SystemExit(f"manifest hash with {n} worker(s) {bad[0]} != single process {expected}")
                per[f"workers_{n}"] = {"cluster_start_s": start_s, "runs": runs}
                med = statistics.median(r["wall_s"] for r in runs)
                coord = statistics.median(r["coordinator_s"] for r in runs)
                t = runs[0]["timings"]
                parts = ", ".join(f"{k} {statistics.median(r['timings'].get(k, 0.0) for r in runs):.3f}"
                                  for k in COORDINATOR)
                rows.append([budget, f"{n} Dask worker(s)", f"{med:.2f}", f"{coord:.3f}", parts,
                             f"{int(t['n_tasks'])}", f"{start_s:.1f}"])
                print(f"[bench] budget {budget}, {n} worker(s): wall {med:.2f} s, coordinator {coord:.3f} s "
                      f"({parts})", flush=True)
            raw["budgets"][budget] = per
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cold = all(r["cold"] for b in raw["budgets"].values() for r in b["single"])
    text = (f"## Dask workers\n\n{family}; output shards of {shard / MiB:g} MiB; median of {args.reps} run(s), "
            f"{'cold cache (drop_caches before each)' if cold else 'WARM cache (not root)'}; {machine_line()}.\n"
            f"Every distributed merge's manifest hash equals the single-process one (checked by the script).\n\n"
            + md_table(["budget", "execution", "wall s", "coordinator s",
                        "plan, dispatch, gather, commit (s)", "tasks", "cluster start s"], rows)
            + "\n\nCoordinator overhead is everything but the tasks: target < 1 s at K = 8. Cluster start-up "
              "(worker processes, imports) is outside the merge's wall time; one untimed merge per cluster loads "
              "the kernels in its workers first.\n")
    print(text)
    if not args.quick:
        save_raw("dask", raw)
        write_section("dask", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
