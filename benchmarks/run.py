"""Run the benchmark suite and assemble benchmarks/RESULTS.md.

    .venv/bin/python -m benchmarks.run [--quick] [--only NAME[,NAME...]] [--assemble-only | --ingest-from-raw]

Experiments: ingest, planner, scaling, budget_sweep, operators, io_floor, peers (see benchmarks/README.md).
Each writes benchmarks/results/<name>.md; RESULTS.md is assembled from every file in benchmarks/results/
(other engineers drop their own sections there, e.g. reliability.md, quality.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback

from benchmarks import experiments as ex
from benchmarks.common import DATA, RAW, REPO, RESULTS, config, machine_line, write_section
from benchmarks.family import ensure_catalog, ensure_family
from benchmarks.planner_scale import planner

EXPERIMENTS = {
    "ingest": ex.ingest,
    "planner": planner,
    "scaling": ex.scaling,
    "budget_sweep": ex.budget_sweep,
    "operators": ex.operators,
    "io_floor": ex.floor,
    "peers": ex.peers,
}
ORDER = ["targets", "analysis", "phases", "ingest", "scaling", "budget_sweep", "operators", "io_floor", "peers",
         "planner"]


def _load(name: str):
    p = RAW / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def phases() -> str:
    """Where a merge's wall time goes (medians over the operator runs' own timers)."""
    from statistics import median as med

    from benchmarks.common import md_table

    op = _load("operators")
    if not op:
        return ""
    rows = []
    for key, rec in op["recs"].items():
        runs = rec["runs"]

        def m(f, runs=runs):  # noqa: ANN001, ANN202
            return f"{med([f(r) for r in runs]):.2f}"

        rows.append([key.replace("-", " @"), m(lambda r: r["wall"]), m(lambda r: r["startup_s"]),
                     m(lambda r: r["timings"]["plan"]), m(lambda r: r["timings"]["execute"]),
                     m(lambda r: r["timings"]["read_wait"]), m(lambda r: r["timings"]["compute"]),
                     m(lambda r: r["timings"].get("write_wait", 0.0)), m(lambda r: r["timings"].get("output", 0.0)),
                     m(lambda r: r["timings"].get("output_stats", 0.0)),
                     m(lambda r: r["timings"]["commit"] + r["timings"]["finalize"]),
                     m(lambda r: r["wall"] - r["startup_s"] - r["work_s"])])
    text = ("## Where the time goes (K = 8, from the runs of section 4)\n\n"
            "Seconds, medians of the same cold runs. `startup` = imports (duckdb, sqlalchemy; no "
            "torch) and opening the catalog, before the library call, with numba loading beside them since run I "
            "(`mergepipe_db/warmup.py`); `execute` = the executor, split into what the "
            "compute thread waited for reads (`read wait`), computed (`compute`) and waited to hand a tensor "
            "to the output thread (`write wait`); `output busy` = the output thread's own time (handing bytes "
            "to the O_DIRECT sink, whose helper threads write and sha256 them, and waiting when the statistics "
            "fall behind; overlapped with compute); `stats` = its helper's time for each tensor's xxh3 and block "
            "statistics (0 in runs before it existed); `commit` = manifest, header re-check and the catalog "
            "transaction; "
            "`exit` = process wall not inside the library call or start-up: interpreter start and end (the "
            "job ends as the `mergepipe` command does, without interpreter teardown).\n\n"
            + md_table(["merge", "wall", "startup", "plan", "execute", "read wait", "compute", "write wait",
                        "output busy", "stats", "commit", "exit"], rows))
    write_section("phases", text)
    return text


def targets() -> str:
    """The issue's performance targets, judged from whatever raw results exist."""
    from statistics import median as med

    rows = []

    def add(target: str, value: str, ok: bool | None) -> None:
        rows.append([target, value, "n/a" if ok is None else ("met" if ok else "**missed**")])

    ing = _load("ingest_summary")
    if ing:
        for w in ("base", "expert", "family"):
            r = ing.get(w)
            if r is None:  # a summary from before the family row
                continue
            what = w if w != "family" else "family (8 experts, one call)"
            strict = r.get("ratio_work_direct")
            lo_hi = r.get("ratio_work_direct_range")
            spread = f" [{lo_hi[0]:.0%}–{lo_hi[1]:.0%}]" if lo_hi else ""
            add(f"ingest {what} ≥ 70 % of raw cold read", f"{r['ratio_wall']:.0%} (process wall), "
                f"{r['ratio_work']:.0%} (ingest call)"
                + (f"; against dd iflag=direct {strict:.0%}{spread} (ingest call)" if strict is not None else "")
                + (f"; {r['ratio_work_floor']:.0%} of the I/O floor of the bytes it must read (its files and the "
                   "base blocks it changed, at dd iflag=direct's rate)" if r.get("ratio_work_floor") else ""),
                # met only against both reads: buffered dd (the goal's) and O_DIRECT (no page cache to fill)
                r["ratio_wall"] >= 0.7 and (strict is None or strict >= 0.7))
    fl = _load("io_floor")
    pe = _load("peers")
    if fl:
        for op in ("linear", "ties"):
            x = fl.get(f"{op}-1.0")
            if x:
                ratio = med(x["merge"]["wall"]) / x["floor"]["floor_med"]
                strict = med(x["merge"]["wall"]) / x["floor"]["floor_direct_med"]
                add(f"K=8 {op} full budget ≤ 1.5 × I/O floor", f"{ratio:.2f}× (against the O_DIRECT floor: "
                    f"{strict:.2f}×)", max(ratio, strict) <= 1.5)
    if pe:
        for op in ("linear", "ties"):
            d = pe.get(op)
            if not d:
                continue
            ours = med(d["ours"])
            for peer in ("naive", "mergekit"):
                if d[peer]:
                    theirs = med([m["wall"] for m in d[peer]])
                    add(f"K=8 {op} full budget faster than {peer}", f"ours/{peer} = {ours / theirs:.2f}",
                        ours < theirs)
                else:
                    add(f"K=8 {op} full budget faster than {peer}", "peer not run", None)
    op = _load("operators")
    if op:
        for name in ex.OPS:
            f, p = op["recs"].get(f"{name}-1.0"), op["recs"].get(f"{name}-0.1")
            if not (f and p):
                continue
            # "full" is the full read of every expert tensor (what the naive script and MergeKit read); the
            # full-budget run itself reads less, since blocks whose delta is exactly zero are never read.
            frac = p["realized_bytes"] / p["full_bytes"]
            rb = med(p["read_bytes"]) / med(f["read_bytes"])
            add(f"{name} @0.1 expert bytes ≤ 10 % of full", f"{frac:.1%} of the full read "
                f"({p['realized_bytes'] / f['realized_bytes']:.1%} of the full-budget run's reads; whole-process "
                f"read_bytes ratio {rb:.1%}, incl. base and libraries)", frac <= 0.1)
            speed = f["wall_med"] / p["wall_med"]
            moved = ex.bytes_moved(f) / ex.bytes_moved(p)
            reads = (f["realized_bytes"] + f["base_bytes"]) / (p["realized_bytes"] + p["base_bytes"])
            add(f"{name} @0.1 speed-up ≥ 0.8 × bytes-moved ratio (reads + output write)",
                f"{speed:.2f}× vs 0.8 × {moved:.2f} = {0.8 * moved:.2f}× (reads only: 0.8 × {reads:.2f} = "
                f"{0.8 * reads:.2f}×)", speed >= 0.8 * moved)
    sc = _load("scaling")
    if sc:
        xs = [sc[f"{k}-budget"]["realized_bytes"] for k in (2, 4, 8, 16) if f"{k}-budget" in sc]
        # Flat once the budget binds (the full read exceeds it); below that the merge simply reads everything.
        bound = [sc[f"{k}-budget"]["realized_bytes"] for k in (2, 4, 8, 16)
                 if f"{k}-budget" in sc and sc[f"{k}-budget"]["full_bytes"] > sc[f"{k}-budget"]["budget_bytes"]]
        if xs:
            binds = [k for k in (2, 4, 8, 16) if f"{k}-budget" in sc
                     and sc[f"{k}-budget"]["full_bytes"] > sc[f"{k}-budget"]["budget_bytes"]]
            add("expert bytes flat as K grows (fixed budget)", ", ".join(f"{x / 1e9:.3f}" for x in xs)
                + f" GB (K = 2, 4, 8, 16; the budget binds from K = {binds[0] if binds else '—'})",
                bool(bound) and max(xs) <= sc["2-budget"]["budget_bytes"] and max(bound) / min(bound) < 1.1)
        rss = {k: med(sc[f"{k}-full"]["maxrss"]) for k in (2, 4, 8, 16) if f"{k}-full" in sc}
        if rss:
            add("peak RSS independent of K (full read)",
                ", ".join(f"K={k}: {v / 2**30:.2f} GiB" for k, v in rss.items()),
                max(rss.values()) / min(rss.values()) < 1.25)
    bs = _load("budget_sweep")
    if bs and "ties-0.5" in bs["dev"]:
        d = bs["dev"]["ties-0.5"]["rel_l2"]
        add("TIES @0.5 relative L2 deviation ≤ 1e-3", f"{d:.2e}", d <= 1e-3)
    pl = _load("planner")
    if pl:
        for k, v in pl.items():
            backend, n, *case = k.split("-")  # backend-n (linear @0.1), or backend-n-method-budget
            if n == "1000000":
                t = med(v["catalog_plan"])
                what = f"{backend}, {case[0]} @{case[1]}" if case else f"{backend}, linear @0.1"
                add(f"planning 10^6 blocks < 1 s ({what})", f"{t:.3f} s (build_plan "
                    f"{med(v['build_plan']):.3f} s)", t < 1)
    from benchmarks.common import md_table

    text = "## Targets\n\n" + md_table(["target", "measured (median)", "status"], rows)
    write_section("targets", text)
    return text


def assemble(cfg_line: str) -> None:
    parts = []
    names = sorted(p.stem for p in RESULTS.glob("*.md"))
    ordered = [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]
    for n in ordered:
        parts.append((RESULTS / f"{n}.md").read_text().replace("](figures/", "](figures/"))
    head = f"""# Benchmark results

Generated by `.venv/bin/python -m benchmarks.run` on {datetime.date.today().isoformat()}.
Machine: {machine_line()}. {cfg_line}
All timings are cold-cache (`sync; echo 3 > /proc/sys/vm/drop_caches` before every timed process) medians of
the stated number of runs with [min–max] spread, on a shared virtual machine whose disk throughput varies
by up to 2× between runs (hence the I/O floor is measured in the same run as the merges it is compared with).
Sections from other scripts (quality, reliability) say when and on which code they were measured.
Per-experiment sections live in `benchmarks/results/*.md`; raw numbers in `benchmarks/results/raw/*.json`.

"""
    (REPO / "benchmarks" / "RESULTS.md").write_text(head + "\n\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny family (~20 MB models), for development")
    ap.add_argument("--only", help="comma-separated experiment names: " + ", ".join(EXPERIMENTS))
    ap.add_argument("--assemble-only", action="store_true", help="rebuild RESULTS.md from results/*.md")
    ap.add_argument("--ingest-from-raw", action="store_true",
                    help="rebuild the ingest section from results/raw/ingest.json (no measuring), then RESULTS.md")
    a = ap.parse_args(argv)
    cfg = config(a.quick)
    fam = None
    if (cfg.family_dir / "family.json").exists():
        fam = json.loads((cfg.family_dir / "family.json").read_text())
    cfg_line = ""
    if a.ingest_from_raw:
        runs = _load("ingest")
        if not runs:
            print(f"no saved ingest runs in {RAW / 'ingest.json'}; run --only ingest first", file=sys.stderr)
            return 2
        ex.ingest_section(cfg, runs)
    elif not a.assemble_only:
        names = a.only.split(",") if a.only else list(EXPERIMENTS)
        bad = [n for n in names if n not in EXPERIMENTS]
        if bad:
            print(f"unknown experiment(s): {', '.join(bad)}", file=sys.stderr)
            return 2
        DATA.mkdir(parents=True, exist_ok=True)
        if any(n != "planner" for n in names):
            fam = ensure_family(cfg)
            ensure_catalog(cfg)
        for n in names:
            t0 = time.perf_counter()
            print(f"[bench] {n} ...", flush=True)
            try:
                EXPERIMENTS[n](cfg)
            except Exception:  # noqa: BLE001 - keep going; the failure is recorded in the section
                tb = traceback.format_exc()
                print(tb, file=sys.stderr)
                write_section(n, f"## {n}\n\n**FAILED**:\n\n```\n{tb[-3000:]}\n```\n")
            print(f"[bench] {n} done in {time.perf_counter() - t0:.0f} s", flush=True)
        ex.cleanup_outputs()
    if fam:
        cfg_line = ("Families: Llama-shaped BF16 via `mergepipe_db.demo.family.make_family`, "
                    f"{fam['n_experts']} experts (smaller K = prefix); each section names the model size it was "
                    "measured on (the latest run's: "
                    f"{fam['model_bytes'] / 1e9:.2f} GB per model, shape {fam['shape']}).")
    targets()
    phases()
    assemble(cfg_line + (" **Quick mode (tiny sizes; not representative).**" if a.quick else ""))
    print(f"[bench] wrote {REPO / 'benchmarks' / 'RESULTS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
