"""(7) Planner scale: planning time for 10^4, 10^5, 10^6 candidate blocks on DuckDB and PostgreSQL.

Catalog rows are synthesized directly (fake checkpoints, files, tensors and blocks with random delta_l2), then
`planner.build_plan` (inside one catalog connection) and `Catalog.plan` (end to end: name resolution, family
check, SQL ranking, freshness check of the (tiny, real) fake files) are timed in-process, warm, median of 3.
PostgreSQL uses its own database `mergepipe_bench` on the test server (dropped and recreated per size) so it
never touches `mergepipe_test`, which the test suite uses concurrently.

Standalone (prints the table, writes nothing under benchmarks/results unless --write):

    python -m benchmarks.planner_scale --sizes 10000,100000,1000000 --backends duckdb
"""

from __future__ import annotations

import argparse
import io
import os
import random
import subprocess
import time
from typing import Any

import sqlalchemy as sa

from benchmarks.common import DATA, Config, md_table, med, save_raw, write_section

PG_ADMIN = "postgresql://mergepipe:mergepipe@127.0.0.1:5432/postgres"
PG_URL = "postgresql+psycopg://mergepipe:mergepipe@127.0.0.1:5432/mergepipe_bench"
K = 8
T = 200  # tensors per checkpoint
BACKENDS = ("duckdb", "postgresql")


def _populate(url: str, n_blocks: int) -> None:
    from mergepipe_db import Catalog
    from mergepipe_db.db import rank_tables, schema
    from mergepipe_db.db.bulk import bulk_insert

    cat = Catalog.open(url)
    rng = random.Random(0)
    sketches = _sketch_templates(rng)
    bpt = max(1, n_blocks // (K * T))
    fdir = DATA / "planner-files"
    fdir.mkdir(parents=True, exist_ok=True)
    mb = 1 << 20
    ckpts, files, tensors, rows = [], [], [], []
    blocks_cols: dict[str, list[Any]] = {c.name: [] for c in schema.block.columns}
    for c in range(K + 1):
        cid = f"{c:064x}"
        fpath = fdir / f"ckpt{c}.bin"
        fpath.write_bytes(b"x")
        st = os.stat(fpath)
        ckpts.append({"id": cid, "name": "base" if c == 0 else f"e{c - 1}", "kind": "full",
                      "base_id": None if c == 0 else f"{0:064x}", "root": str(fdir), "config": None,
                      "block_bytes": mb, "n_tensors": T, "total_bytes": T * bpt * mb, "has_stats": True,
                      "created_at": "2026-01-01T00:00:00", "tool_version": "bench"})
        fid = f"f{c:063x}"
        files.append({"id": fid, "checkpoint_id": cid, "file_idx": 0, "relpath": fpath.name, "path": str(fpath),
                      "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": "0" * 64, "header_len": 0})
        for t in range(T):
            off = 8 + t * bpt * mb
            tensors.append({"checkpoint_id": cid, "tensor_idx": t, "name": f"model.layers.{t}.weight",
                            "dtype": "BF16", "shape": f"[{bpt * 256}, 2048]", "file_id": fid, "offset": off,
                            "nbytes": bpt * mb, "n_rows": bpt * 256, "rows_per_block": 256, "n_blocks": bpt,
                            "xxh3": "0" * 32, "delta_l2": None if c == 0 else rng.random(),
                            "equal_to_base": False})
            if c == 0:
                continue
            for b in range(bpt):
                blob, delta_max = sketches[rng.randrange(len(sketches))]
                rows.append({"checkpoint_id": cid, "tensor_idx": t, "block_idx": b, "row_start": b * 256,
                             "row_stop": b * 256 + 256, "offset": off + b * mb, "nbytes": mb, "xxh3": "0" * 32,
                             "delta_l2": rng.random() + 1e-9, "delta_l1": 1.0, "delta_max": delta_max,
                             "pos_frac": 0.5, "sketch": blob})
        for r in rank_tables.in_rank_order(rows):  # as ingest inserts them
            for col in blocks_cols:
                blocks_cols[col].append(r[col])
        rows.clear()
    with cat.db.connect() as conn:
        bulk_insert(conn, schema.checkpoint, ckpts)
        bulk_insert(conn, schema.source_file, files)
        bulk_insert(conn, schema.tensor, tensors)
        if conn.dialect.name == "duckdb":
            import pyarrow as pa

            raw = conn.connection.driver_connection
            raw.register("_bench_blocks", pa.table(blocks_cols))
            cols = ", ".join(f'"{c}"' for c in blocks_cols)
            raw.execute(f'INSERT INTO mp_block ({cols}) SELECT {cols} FROM _bench_blocks')
            raw.unregister("_bench_blocks")
        else:
            cur = conn.connection.driver_connection.cursor()
            names = list(blocks_cols)
            buf = io.StringIO()
            cols = [blocks_cols[c] for c in names]
            for row in zip(*cols):
                buf.write("\t".join("\\\\x" + v.hex() if isinstance(v, bytes) else str(v) for v in row) + "\n")
            cols_sql = ", ".join(f'"{c}"' for c in names)
            with cur.copy(f"COPY mp_block ({cols_sql}) FROM STDIN") as cp:
                cp.write(buf.getvalue())
        for ck in ckpts:  # the ranking summaries ingest writes beside the blocks
            rank_tables.write(conn, ck["id"])
    if not url.startswith("postgresql"):
        return
    with sa.create_engine(url).connect() as c:
        c.execute(sa.text("ANALYZE"))
        c.commit()


#: (method, budget) planned at every size, and the further ones planned at the largest: a full budget (every
#: candidate taken) and TIES (block rows ranked together: every candidate ranked)
CASES = (("linear", "0.1"),)
LARGEST_CASES = (("linear", "1.0"), ("ties", "0.1"))


def _sketch_templates(rng: random.Random, n: int = 32) -> list[tuple[bytes, float]]:
    """Block sketches as ingest writes them for a 256 × 2048 BF16 block (524,288 |Δ|: ~40 log-scale bins around
    2^-10, as fine-tuning deltas), with the block's max |Δ| (the upper edge of its top bin), n of them."""
    import numpy as np

    from mergepipe_db.core import sketch

    edges = sketch.bin_edges()
    out = []
    for _ in range(n):
        centre = rng.randrange(100, 130)
        weights = np.exp(-0.5 * ((np.arange(sketch.NBINS) - centre) / 6.0) ** 2)
        weights[:1] = 0.0
        hist = np.random.default_rng(rng.randrange(1 << 30)).multinomial(256 * 2048, weights / weights.sum())
        top = int(np.flatnonzero(hist).max())
        out.append((sketch.encode(hist.astype(np.int64)), float(edges[min(top + 1, sketch.NBINS - 1)])))
    return out


def _spec(method: str = "linear") -> dict[str, Any]:
    params = {"weight": 1.0 / K, **({"density": 0.5} if method == "ties" else {})}
    return {"merge_method": method, "base_model": "base",
            "models": [{"model": f"e{k}", "parameters": dict(params)} for k in range(K)],
            "parameters": {"normalize": True}, "seed": 0}


def _time(url: str, reps: int = 3, method: str = "linear", budget: str = "0.1") -> dict[str, Any]:
    from mergepipe_db import Catalog
    from mergepipe_db.core.spec import load_spec, parse_budget
    from mergepipe_db.pipeline.plan.build import build_plan

    cat = Catalog.open(url)
    spec = load_spec(_spec(method))
    with cat.db.connect() as conn:
        ids = {r[0]: r[1] for r in conn.execute(sa.text("SELECT name, id FROM mp_checkpoint"))}
    bp, cp = [], []
    n_sel = 0
    for _ in range(reps):
        with cat.db.connect() as conn:
            t0 = time.perf_counter()
            plan = build_plan(conn, spec, base_id=ids["base"], expert_ids=[ids[f"e{k}"] for k in range(K)],
                              budget_spec=parse_budget(budget))
            bp.append(time.perf_counter() - t0)
        n_sel = sum(e.blocks_selected for e in plan.experts)  # blocks, also where a tensor is read whole
        t0 = time.perf_counter()
        cat.plan(_spec(method), budget=budget)
        cp.append(time.perf_counter() - t0)
    return {"build_plan": bp, "catalog_plan": cp, "selected": n_sel}


def _pg_available() -> tuple[bool, str]:
    try:
        out = subprocess.run(["bash", ".ci/start-postgres.sh"], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            return False, out.stderr[-300:]
        import psycopg

        with psycopg.connect(PG_ADMIN, autocommit=True) as c:
            c.execute("SELECT 1")
        return True, ""
    except Exception as e:  # noqa: BLE001
        return False, str(e)[-300:]


def _pg_reset() -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as c:
        c.execute("DROP DATABASE IF EXISTS mergepipe_bench WITH (FORCE)")
        c.execute("CREATE DATABASE mergepipe_bench OWNER mergepipe")


def planner(cfg: Config) -> str:
    sizes = [10_000, 100_000] if cfg.quick else [10_000, 100_000, 1_000_000]
    res, rows = _run(sizes, BACKENDS)
    save_raw("planner", res)
    text = _section(rows)
    write_section("planner", text)
    return text


def _run(sizes: list[int], backends: tuple[str, ...], reps: int = 3) -> tuple[dict[str, Any], list[list[Any]]]:
    pg_ok, why = _pg_available() if "postgresql" in backends else (False, "not requested")
    res: dict[str, Any] = {}
    rows = []
    for backend in backends:
        for n in sizes:
            if backend == "postgresql":
                if not pg_ok:
                    rows.append([backend, n, f"skipped: {why}", "", "", ""])
                    continue
                _pg_reset()
                url = PG_URL
            else:
                p = DATA / "planner-bench.duckdb"
                p.unlink(missing_ok=True)
                url = str(p)
            t0 = time.perf_counter()
            _populate(url, n)
            pop = time.perf_counter() - t0
            bpt = max(1, n // (K * T))
            for method, budget in CASES + (LARGEST_CASES if n == max(sizes) else ()):
                r = _time(url, reps, method, budget)
                r["populate_s"] = pop
                key = f"{backend}-{n}" if (method, budget) == CASES[0] else f"{backend}-{n}-{method}-{budget}"
                res[key] = r
                rows.append([backend, f"{K * T * bpt:,}", f"{method} @{budget}",
                             f"{med(r['build_plan']):.3f} s [{min(r['build_plan']):.3f}–{max(r['build_plan']):.3f}]",
                             f"{med(r['catalog_plan']):.3f} s "
                             f"[{min(r['catalog_plan']):.3f}–{max(r['catalog_plan']):.3f}]",
                             f"{r['selected']:,}", "met" if med(r["catalog_plan"]) < 1 else "**missed**"])
    return res, rows


def _section(rows: list[list[Any]]) -> str:
    return f"""## 7. Planner scale

Synthesized catalog rows ({K} experts × {T} tensors × n blocks per tensor, random delta_l2, 1 MiB blocks with
sketches like ingest's of BF16 fine-tuning deltas (~40 non-empty bins), inserted as ingest inserts them, with
their ranking summaries and tensor sketches); linear spec (weights 1/{K}) at budget 0.1 at
every size, and at the largest also at budget 1.0 (every candidate taken: a tensor whose every block is a
candidate is read whole, from the ranking summaries (`ranking.whole_tensors`), the others' blocks come from
`sql/plan_take_all.sql`; here every block is a candidate, so the plan is 1,600 whole-tensor reads and no block
row is fetched; "blocks selected" counts the blocks they cover) and TIES
(density 0.5) at 0.1 (block rows ranked together: every candidate's block row summed, then the 125,000 rows
ranked, `sql/plan_rank_grouped.sql`; linear at 0.1
reads the top of the ranking, `sql/plan_rank_top.sql`). `build_plan` = the planner inside one open catalog
connection (temp tables, ranking query, selection, summary, plan hash); `Catalog.plan` = end-to-end public call
(opens the catalog, checks the schema, resolves names, checks the family, plans, checks source freshness).
Warm, in-process, median of 3 [min–max]. PostgreSQL: local server from `.ci/start-postgres.sh`, separate
database `mergepipe_bench`. Target: < 1 s for 10^6 blocks.

{md_table(["catalog", "candidate blocks", "merge", "build_plan", "Catalog.plan", "blocks selected", "< 1 s"],
          rows)}"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.planner_scale", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="candidate blocks, comma-separated")
    ap.add_argument("--backends", default="duckdb", help="duckdb and/or postgresql, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per size (median reported)")
    ap.add_argument("--write", action="store_true", help="also write benchmarks/results/planner.md and raw JSON")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:  # any other name would be planned on DuckDB under that label
        ap.error(f"unknown backend(s) {', '.join(unknown)}: use duckdb and/or postgresql")
    res, rows = _run(sizes, backends, args.reps)
    text = _section(rows)
    if args.write:
        save_raw("planner", res)
        write_section("planner", text)
    print(text)


if __name__ == "__main__":
    main()
