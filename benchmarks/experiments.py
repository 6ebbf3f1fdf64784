"""The paper's experiments on this machine. Each writes benchmarks/results/<name>.md (+ raw JSON, figures)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.common import (
    DATA,
    FIGURES,
    PY,
    RAW,
    REPO,
    Config,
    GiB,
    family_note,
    fmt_t,
    gb,
    md_table,
    measure,
    med,
    rmtree,
    save_raw,
    spread,
    write_section,
)
from benchmarks.family import model_dir, model_files, spec
from benchmarks.merges import OUT, compare, io_floor, run_merge

HOW = ("Measured: each timed job is a separate process started after `sync; echo 3 > "
       "/proc/sys/vm/drop_caches`; wall time is process wall (interpreter start-up and imports included); "
       "read_bytes/write_bytes from the child's /proc/PID/io; peak RSS = the child's VmHWM, sampled every 10 ms.")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(parents=True, exist_ok=True)
    return plt


def _fig(plt, fig, name: str, caption: str) -> str:
    fig.text(0.01, 0.005, caption, fontsize=6.5, wrap=True, va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(FIGURES / f"{name}.png", dpi=110)
    plt.close(fig)
    return f"![{name}](figures/{name}.png)\n\n*{caption}*\n"


def fixed_budget(cfg: Config) -> int:
    return GiB if not cfg.quick else cfg.model_bytes


# --- (1) ingest ------------------------------------------------------------------------------------------


INGEST_FAMILY_K = 8  # experts ingested in one call (`ingest-many`): the base read once for all of them


def base_bytes_changed(catalog: Path, experts: list[str]) -> int:
    """Bytes of the base's blocks that some of `experts` changed (block xxh3 not the base's): what an ingest of
    them reads of the base besides their own files (a block left as it was is not read from the base)."""
    import duckdb

    con = duckdb.connect(str(catalog), read_only=True)
    try:
        marks = ", ".join("?" for _ in experts)
        return int(con.execute(f"""
            SELECT coalesce(sum(b.nbytes), 0) FROM blocks b
            WHERE b.checkpoint = 'base' AND EXISTS (
                SELECT 1 FROM blocks e WHERE e.checkpoint IN ({marks}) AND e.tensor = b.tensor
                AND e.block_idx = b.block_idx AND e.xxh3 <> b.xxh3 AND e.delta_l2 IS NOT NULL)""",
            experts).fetchone()[0])
    finally:
        con.close()


def ingest(cfg: Config) -> str:
    cat = DATA / "ingest-bench.duckdb"
    family_cat = DATA / "ingest-bench-family.duckdb"
    runs = []
    k = min(INGEST_FAMILY_K, cfg.n_experts)
    files = {"base": model_files(cfg, None), "expert": model_files(cfg, 0),
             "family": [f for i in range(k) for f in model_files(cfg, i)]}
    for _r in range(cfg.reps):
        for p in (cat, Path(str(cat) + ".wal"), family_cat, Path(str(family_cat) + ".wal")):
            p.unlink(missing_ok=True)
        row: dict[str, Any] = {}
        for what, job in (("base", ["ingest", str(cat), str(model_dir(cfg, None)), "base"]),
                          ("expert", ["ingest", str(cat), str(model_dir(cfg, 0)), "expert_00", "base"]),
                          ("family", ["ingest-many", str(family_cat), "base",
                                      *(str(model_dir(cfg, i)) for i in range(k))])):
            if what == "expert":  # the family's catalog: the base only, as the expert's was before its ingest
                shutil.copyfile(cat, family_cat)
            m = measure([PY, "-m", "benchmarks.jobs", *job])
            res = json.loads(m.stdout.strip().splitlines()[-1])
            nbytes = sum(f.stat().st_size for f in files[what])
            d = measure(["bash", "-c", " && ".join(f"dd if={f} of=/dev/null bs=16M status=none"
                                                   for f in files[what])])
            # the same read with O_DIRECT: no page cache to fill (on these VMs a cache pushed into reclaim
            # slows buffered reads of more than ~8 GB down ~3x, dd's as much as anyone's)
            dd_direct = measure(["bash", "-c", " && ".join(f"dd if={f} of=/dev/null bs=16M iflag=direct status=none"
                                                           for f in files[what])])
            row[what] = {"wall": m.wall, "work_s": res["work_s"], "startup_s": res["startup_s"],
                         "read_bytes": m.read_bytes, "maxrss": m.maxrss, "bytes": nbytes, "dd_wall": d.wall,
                         "dd_read_bytes": d.read_bytes, "dd_direct_wall": dd_direct.wall}
        row["expert"]["base_bytes_needed"] = base_bytes_changed(cat, ["expert_00"])
        row["family"]["base_bytes_needed"] = base_bytes_changed(family_cat, [f"expert_{i:02d}" for i in range(k)])
        runs.append(row)
    save_raw("ingest", runs)
    return ingest_section(cfg, runs)


def ingest_section(cfg: Config, runs: list[dict[str, Any]]) -> str:
    """Section 1 from the runs `ingest` measured (or saved in results/raw/ingest.json:
    `python -m benchmarks.run --ingest-from-raw` rebuilds it without measuring again)."""
    k = min(INGEST_FAMILY_K, cfg.n_experts)
    rows = []
    summary = {}
    for what in ("base", "expert", "family"):
        xs = [r[what] for r in runs]
        n = xs[0]["bytes"]
        ing = [n / x["wall"] / 1e9 for x in xs]
        work = [n / x["work_s"] / 1e9 for x in xs]
        raw = [n / x["dd_wall"] / 1e9 for x in xs]
        ratio = [x["dd_wall"] / x["wall"] for x in xs]
        ratio_w = [x["dd_wall"] / x["work_s"] for x in xs]
        direct = [x["dd_direct_wall"] for x in xs if "dd_direct_wall" in x]
        ratio_d = [x["dd_direct_wall"] / x["work_s"] for x in xs if "dd_direct_wall" in x]
        summary[what] = {"ratio_wall": med(ratio), "ratio_work": med(ratio_w),
                         "ratio_work_direct": med(ratio_d) if ratio_d else None,
                         "ratio_work_direct_range": [min(ratio_d), max(ratio_d)] if ratio_d else None}
        label = what if what != "family" else f"{k} experts, one call"
        rows.append([label, gb(n), fmt_t([x["wall"] for x in xs]), f"{med(ing):.2f}",
                     fmt_t([x["work_s"] for x in xs]), f"{med(work):.2f}", fmt_t([x["dd_wall"] for x in xs]),
                     f"{med(raw):.2f}", f"{med(ratio):.0%} [{min(ratio):.0%}–{max(ratio):.0%}]",
                     f"{med(ratio_w):.0%} [{min(ratio_w):.0%}–{max(ratio_w):.0%}]",
                     fmt_t(direct) if direct else "—",
                     f"{med(ratio_d):.0%} [{min(ratio_d):.0%}–{max(ratio_d):.0%}]" if ratio_d else "—",
                     gb(med([x["read_bytes"] for x in xs])), f"{med([x['maxrss'] for x in xs]) / 2**20:.0f} MiB"])
    floor_note = ""
    for what in ("expert", "family"):
        xs = [r[what] for r in runs if "base_bytes_needed" in r[what] and "dd_direct_wall" in r[what]]
        if not xs:
            continue
        need = xs[0]["base_bytes_needed"]
        # the bytes this ingest must read (its files and the base blocks they changed) at dd iflag=direct's rate
        floors = [x["dd_direct_wall"] * (x["bytes"] + need) / x["bytes"] for x in xs]
        of_floor = [f / x["work_s"] for f, x in zip(floors, xs)]
        summary[what]["ratio_work_floor"] = med(of_floor)
        label = "One expert" if what == "expert" else f"The {k} experts in one call"
        changed = "it changed" if what == "expert" else "some of them changed"
        floor_note += (f"{label} must also read the base blocks {changed}, {gb(need)} (a block equal to the "
                       "base's, known from its xxh3, is not read from the base): "
                       f"{gb(xs[0]['bytes'] + need)} in all, {fmt_t(floors)} at `dd iflag=direct`'s rate; the "
                       f"ingest call runs at {med(of_floor):.0%} [{min(of_floor):.0%}–{max(of_floor):.0%}] of "
                       "that I/O floor. ")
    save_raw("ingest_summary", summary)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels, vals = [], []
    for what in ("base", "expert", "family"):
        xs = [r[what] for r in runs]
        n = xs[0]["bytes"]
        for lab, key in (("ingest (process)", "wall"), ("ingest (work)", "work_s"), ("raw dd", "dd_wall")):
            labels.append(f"{what}\n{lab}")
            vals.append(med([n / x[key] / 1e9 for x in xs]))
    ax.bar(range(len(vals)), vals, color=["C0", "C1", "C7"] * 3)
    ax.set_xticks(range(len(vals)), labels, fontsize=7)
    ax.set_ylabel("GB/s (median)")
    ax.set_title("Ingest throughput vs cold raw read")
    fig_md = _fig(plt, fig, "ingest", f"Cold cache before every run; median of {cfg.reps}. 'process' = wall of a "
                  "fresh `benchmarks.jobs ingest` process (the CLI's code path, interpreter start-up and torch "
                  "import included); 'work' = the Catalog.ingest call alone; raw dd = `dd bs=16M` of the same files.")
    text = f"""## 1. Ingest speed

{family_note(cfg)}
{HOW} Fresh DuckDB catalog per repetition; the base is ingested (hashes + per-block sketches), then expert_00
against it (hashes + delta statistics, reading the base again); then, into a copy of the catalog holding the
base only, experts 00–{k - 1:02d} in one call (`Catalog.ingest_many`: read in lockstep, the base once for all of
them). Goal: ≥ 70 % of a raw cold `dd` read.

{md_table(["model", "bytes", "ingest wall (process)", "GB/s", "ingest (work only)", "GB/s", "dd wall", "dd GB/s",
           "ours/raw (process)", "ours/raw (work)", "dd iflag=direct wall", "ours/raw O_DIRECT (work)", "read_bytes",
           "peak RSS"], rows)}
The expert ingest reads the expert *and* the base (delta statistics), so its read_bytes are ~2× the file size;
the ratio compares against dd of the expert's files only (the bytes the user asked to ingest). The family row's
read_bytes are the {k} experts' plus the base's once ((k + 1)/k of its dd bytes); its ratio too is against dd of
the experts' files only. Since run Y ingest reads with O_DIRECT (pieces whole in the page cache copied from there)
and reads a base block only where some expert changed it; from run X to Y it dropped what it read from the page
cache behind the reader unless it was cached before (`storage.DropBehind`, still used where O_DIRECT is refused),
before run X only reads of more than half of what the cache could still take. Plain `dd` fills the cache: on these
VMs filling it costs more than the read itself, and a cache pushed into reclaim makes buffered reads ~3× slower,
so the O_DIRECT columns are the stricter reference.
{floor_note}

{fig_md}"""
    write_section("ingest", text)
    return text


# --- (2) scaling ------------------------------------------------------------------------------------------


def scaling(cfg: Config) -> str:
    b = fixed_budget(cfg)
    ks = [2, 4, 8, 16]
    recs = {}
    for k in ks:
        recs[(k, "full")] = run_merge(cfg, "linear", k, "1.0")
        recs[(k, "budget")] = run_merge(cfg, "linear", k, str(b))
    raw = {f"{k}-{m}": v for (k, m), v in recs.items()}
    save_raw("scaling", raw)
    rows = []
    for k in ks:
        for m in ("full", "budget"):
            r = recs[(k, m)]
            total = r["realized_bytes"] + r["base_bytes"]
            rows.append([k, "full read" if m == "full" else f"budget {gb(b)}", gb(r["realized_bytes"]),
                         f"{r['realized_bytes'] / r['full_bytes']:.1%}", gb(total),
                         gb(med(r["read_bytes"])), fmt_t(r["wall"]),
                         f"{med(r['maxrss']) / 2**30:.2f} GiB"])
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.2))
    for m, st in (("full", "o-"), ("budget", "s-")):
        a1.plot(ks, [recs[(k, m)]["realized_bytes"] / 1e9 for k in ks], st, label=f"{m}: expert bytes")
        a1.plot(ks, [med(recs[(k, m)]["read_bytes"]) / 1e9 for k in ks], st.replace("-", "--"),
                label=f"{m}: /proc read_bytes")
        a2.errorbar(ks, [med(recs[(k, m)]["wall"]) for k in ks],
                    yerr=[[med(recs[(k, m)]["wall"]) - min(recs[(k, m)]["wall"]) for k in ks],
                          [max(recs[(k, m)]["wall"]) - med(recs[(k, m)]["wall"]) for k in ks]], fmt=st, label=m)
    a1.set_xlabel("experts K")
    a1.set_ylabel("GB")
    a1.legend(fontsize=6)
    a1.set_title("bytes read")
    a2.set_xlabel("experts K")
    a2.set_ylabel("wall s (median, min–max)")
    a2.legend(fontsize=7)
    a2.set_title("wall time")
    fig_md = _fig(plt, fig, "scaling", f"Linear merge of base + K experts, full read vs fixed budget {gb(b)}; cold "
                  f"cache, median of {cfg.reps} (bars: min–max). Expert bytes = executor's counted reads "
                  "(== plan); read_bytes = whole process from /proc (base, catalog and Python included).")
    flat = [recs[(k, "budget")]["realized_bytes"] for k in ks]
    text = f"""## 2. Scaling with the number of experts (fixed absolute budget)

{family_note(cfg)}
{HOW} Operator: linear (weights 1/K), BF16 output. Fixed budget {b} bytes of expert reads.

{md_table(["K", "mode", "expert bytes", "of full", "expert+base bytes", "read_bytes (/proc)", "wall",
           "peak RSS"], rows)}
Budgeted expert bytes across K: {', '.join(gb(x) for x in flat)} (max/min = {max(flat) / min(flat):.3f}).

{fig_md}"""
    write_section("scaling", text)
    return text


# --- (3) budget sweep -------------------------------------------------------------------------------------

BUDGETS = ["0.02", "0.05", "0.1", "0.25", "0.5", "1.0"]


def budget_sweep(cfg: Config) -> str:
    k = 8
    lin = {b: run_merge(cfg, "linear", k, b, keep=True) for b in BUDGETS}
    ties_reps = int(os.environ.get("BENCH_TIES_SWEEP_REPS", 1 if not cfg.quick else cfg.reps))
    ties = {b: run_merge(cfg, "ties", k, b, keep=True, reps=ties_reps) for b in BUDGETS}
    dev = {}
    for name, recs in (("linear", lin), ("ties", ties)):
        ref = recs["1.0"]["out"]
        for b in BUDGETS:
            dev[(name, b)] = compare(recs[b]["out"], ref)
    save_raw("budget_sweep", {"linear": lin, "ties": ties,
                              "dev": {f"{n}-{b}": v for (n, b), v in dev.items()}})
    rows = []
    for name, recs in (("linear", lin), ("ties", ties)):
        for b in BUDGETS:
            r = recs[b]
            d = dev[(name, b)]
            bound = r["bound"]
            rel_bound = (bound / d["ref_l2"]) if (bound is not None and d["ref_l2"]) else None
            rows.append([name, b, gb(r["budget_bytes"]), gb(r["realized_bytes"]),
                         "yes" if r["realized_bytes"] <= r["budget_bytes"] else "**NO**",
                         gb(med(r["read_bytes"])),
                         fmt_t(r["wall"]) if len(r["wall"]) > 1 else f"{r['wall'][0]:.2f} s (1 run)",
                         f"{d['rel_l2']:.2e}", f"{rel_bound:.2e}" if rel_bound is not None else "n/a (non-additive)"])
    mono = all(lin[a]["realized_bytes"] <= lin[b]["realized_bytes"] for a, b in zip(BUDGETS, BUDGETS[1:]))
    mono_t = all(ties[a]["realized_bytes"] <= ties[b]["realized_bytes"] for a, b in zip(BUDGETS, BUDGETS[1:]))
    plt = _plt()
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(10, 3.2))
    xs = [float(b) for b in BUDGETS]
    for name, recs, st in (("linear", lin, "o-"), ("ties", ties, "s-")):
        a1.plot(xs, [recs[b]["realized_bytes"] / 1e9 for b in BUDGETS], st, label=f"{name} realized")
        a1.plot(xs, [med(recs[b]["read_bytes"]) / 1e9 for b in BUDGETS], st.replace("-", ":"),
                label=f"{name} /proc read_bytes")
        a2.plot(xs, [med(recs[b]["wall"]) for b in BUDGETS], st, label=name)
        a3.plot(xs, [max(dev[(name, b)]["rel_l2"], 1e-9) for b in BUDGETS], st, label=f"{name} measured")
    a1.plot(xs, [lin[b]["budget_bytes"] / 1e9 for b in BUDGETS], "k--", label="budget")
    a3.plot(xs, [max((lin[b]["bound"] or 0) / dev[("linear", b)]["ref_l2"], 1e-9) for b in BUDGETS], "k--",
            label="linear bound")
    for a in (a1, a2, a3):
        a.set_xscale("log")
        a.set_xlabel("budget (fraction of full read)")
        a.legend(fontsize=6)
    a1.set_ylabel("GB")
    a2.set_ylabel("wall s (median)")
    a3.set_yscale("log")
    a3.set_ylabel("relative L2 deviation")
    fig_md = _fig(plt, fig, "budget_sweep", f"K=8, BF16 output; cold cache; linear median of {cfg.reps}, TIES "
                  f"{ties_reps} run(s). Deviation = ‖θ_B − θ_full‖₂/‖θ_full‖₂ over all output tensors (float64 "
                  "sums of the BF16 outputs); the linear bound is the planner's omitted-update bound / ‖θ_full‖₂.")
    text = f"""## 3. Budget sweep (K = 8)

{family_note(cfg)}
{HOW} Budgets are fractions of the full-read expert bytes. TIES density 0.5, weights 1/8, normalize.

{md_table(["operator", "budget", "budget bytes", "realized expert bytes", "≤ budget", "read_bytes (/proc)", "wall",
           "rel. L2 dev. vs full", "bound (rel.)"], rows)}
Realized bytes monotone in the budget: linear {'yes' if mono else 'NO'}, TIES {'yes' if mono_t else 'NO'}.
Note: measured deviations are between BF16 outputs (the requested dtype); the bound is on the float32 result,
so BF16 rounding can add up to half an ulp per element on top of the bounded part.

{fig_md}"""
    write_section("budget_sweep", text)
    return text


# --- (4) operators ----------------------------------------------------------------------------------------

OPS = ["linear", "task_arithmetic", "ties", "dare_ties"]


def bytes_moved(rec: dict) -> int:
    """Bytes a merge moves: expert reads (the plan's, == realized) + base reads + output written."""
    return rec["realized_bytes"] + rec["base_bytes"] + rec["output_bytes"]


def operators(cfg: Config) -> str:
    k = 8
    recs = {}
    for op in OPS:
        for b in ("1.0", "0.1"):
            recs[(op, b)] = run_merge(cfg, op, k, b, keep=True)
    devs = {op: compare(recs[(op, "0.1")]["out"], recs[(op, "1.0")]["out"]) for op in OPS}
    save_raw("operators", {"recs": {f"{o}-{b}": v for (o, b), v in recs.items()}, "dev": devs})
    rows = []
    for op in OPS:
        f, p = recs[(op, "1.0")], recs[(op, "0.1")]
        tf, tp = bytes_moved(f), bytes_moved(p)
        reads = (f["realized_bytes"] + f["base_bytes"]) / (p["realized_bytes"] + p["base_bytes"])
        speed = f["wall_med"] / p["wall_med"]
        moved = tf / tp
        rows.append([op, fmt_t(f["wall"]), fmt_t(p["wall"]), f"{speed:.2f}×",
                     f"{moved:.2f}× ({gb(tf)} → {gb(tp)})", f"{reads:.2f}×", f"{speed / moved:.2f}",
                     f"{p['realized_bytes'] / f['realized_bytes']:.3f}",
                     f"{med(p['read_bytes']) / med(f['read_bytes']):.3f}", f"{devs[op]['rel_l2']:.2e}",
                     f"{med(f['maxrss']) / 2**30:.2f} / {med(p['maxrss']) / 2**30:.2f} GiB"])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    import numpy as np

    x = np.arange(len(OPS))
    for i, (b, c) in enumerate((("1.0", "C0"), ("0.1", "C1"))):
        meds = [recs[(o, b)]["wall_med"] for o in OPS]
        lo = [m - min(recs[(o, b)]["wall"]) for o, m in zip(OPS, meds)]
        hi = [max(recs[(o, b)]["wall"]) - m for o, m in zip(OPS, meds)]
        ax.bar(x + (i - 0.5) * 0.38, meds, 0.38, yerr=[lo, hi], color=c, label=f"budget {b}")
    ax.set_xticks(x, OPS)
    ax.set_ylabel("wall s (median, min–max)")
    ax.legend()
    fig_md = _fig(plt, fig, "operators", f"K=8, BF16 output, cold cache, median of {cfg.reps}. density 0.5 for "
                  "TIES/DARE-TIES, weights 1/8, seed 0.")
    text = f"""## 4. Operators at full budget and at 0.1 (K = 8)

{family_note(cfg)}
{HOW}

{md_table(["operator", "wall @1.0", "wall @0.1", "speed-up", "total bytes moved ratio (reads + output write)",
           "reads-only ratio (expert + base)", "speed-up / total bytes ratio", "expert bytes 0.1/1.0",
           "read_bytes 0.1/1.0 (/proc)",
           "rel. L2 dev @0.1", "peak RSS 1.0 / 0.1"], rows)}
Target: expert bytes at 0.1 ≤ 10 % of full, and speed-up ≥ 0.8 × the ratio of total bytes moved. Bytes moved
counts every byte the merge must move: expert and base reads plus the output written (the output, a full model,
is the same at every budget); the reads-only ratio is shown beside it.

{fig_md}"""
    write_section("operators", text)
    return text


# --- (5) I/O floor ---------------------------------------------------------------------------------------


def floor(cfg: Config) -> str:
    k = 8
    rows = []
    raw = {}
    for op in ("linear", "ties"):
        for b in ("1.0", "0.1"):
            r = run_merge(cfg, op, k, b)
            fl = io_floor(cfg, k, r["realized_bytes"], r["output_bytes"])
            raw[f"{op}-{b}"] = {"merge": r, "floor": fl}
            ratio = r["wall_med"] / fl["floor_med"]
            strict = r["wall_med"] / fl["floor_direct_med"]
            rows.append([op, b, gb(r["base_bytes"] + r["realized_bytes"]), gb(r["output_bytes"]),
                         fmt_t(fl["read"]), fmt_t(fl["read_direct"]), fmt_t(fl["write"]),
                         f"{fl['floor_med']:.2f} s", f"{fl['floor_direct_med']:.2f} s", fmt_t(r["wall"]),
                         f"{ratio:.2f}×", f"{strict:.2f}×", "met" if max(ratio, strict) <= 1.5 else "**missed**"])
    save_raw("io_floor", raw)
    text = f"""## 5. I/O floor (same run, K = 8)

{family_note(cfg)}
{HOW} Floor = cold `dd bs=16M` read of the base files plus the planned expert bytes (whole expert files at
full budget; at 0.1 the same number of bytes read sequentially from the expert files, which is cheaper than the
scattered ranges the merge needs), plus `dd if=/dev/zero bs=16M conv=fsync` of an output of the same size,
timed separately and summed (no overlap). Target at full budget: merge ≤ 1.5 × floor. The same reads with
`iflag=direct` (O_DIRECT, as the merge reads) are timed beside them: which of the two is faster depends on the
machine, so "≤ 1.5×" holds only when both ratios do.

{md_table(["operator", "budget", "bytes to read", "output bytes", "dd read", "dd read (O_DIRECT)",
           "dd write+fsync", "floor", "floor (O_DIRECT)", "merge wall", "merge / floor",
           "merge / floor (O_DIRECT)", "≤ 1.5×"], rows)}"""
    write_section("io_floor", text)
    return text


# --- (6) peers --------------------------------------------------------------------------------------------

MK_VENV = REPO / "benchmarks" / ".venv-mergekit"


def _mergekit_ok() -> tuple[bool, str]:
    exe = MK_VENV / "bin" / "mergekit-yaml"
    if exe.exists():
        return True, ""
    if os.environ.get("BENCH_NO_MERGEKIT_INSTALL"):
        return False, "MergeKit venv absent (BENCH_NO_MERGEKIT_INSTALL set)"
    try:
        subprocess.run([os.environ.get("PYTHON3", "python3"), "-m", "venv", str(MK_VENV)], check=True)
        subprocess.run([str(MK_VENV / "bin" / "pip"), "install", "-q", "torch==2.13.0", "mergekit"], check=True,
                       timeout=1800)
    except Exception as e:  # noqa: BLE001
        return False, f"MergeKit install failed: {e}"
    return exe.exists(), "" if exe.exists() else "mergekit-yaml not found after install"


def _mergekit_yaml(cfg: Config, method: str, k: int, dtype: str) -> str:
    import yaml

    s = spec(cfg, method, k, dtype=dtype, by_path=True)
    if method == "linear":
        s.pop("base_model")
    s.pop("seed")
    return yaml.safe_dump(s, sort_keys=False)


def run_mergekit(cfg: Config, method: str, k: int, dtype: str, out: Path, cold: bool = True):
    y = OUT / f"mk-{method}-{k}-{dtype}.yml"
    y.write_text(_mergekit_yaml(cfg, method, k, dtype))
    rmtree(out)
    return measure([str(MK_VENV / "bin" / "mergekit-yaml"), str(y), str(out), "--lazy-unpickle",
                    "--out-shard-size", "512M"], cold=cold, timeout=7200)


def peers(cfg: Config) -> str:
    k = 8
    reps = cfg.reps
    ok, why = _mergekit_ok()
    rows = []
    raw: dict[str, Any] = {"mergekit": ok, "why": why}
    for op in ("linear", "ties"):
        ours = run_merge(cfg, op, k, "1.0")
        ours01 = run_merge(cfg, op, k, "0.1")
        nv, mk = [], []
        for _r in range(reps):
            out = OUT / f"naive-{op}"
            rmtree(out)
            m = measure([PY, str(REPO / "benchmarks" / "peers" / "naive_merge.py"), op, str(out),
                         str(model_dir(cfg, None)), *[str(model_dir(cfg, i)) for i in range(k)]])
            nv.append(m)
            rmtree(out)
            if ok:
                out = OUT / f"mk-{op}"
                try:
                    mk.append(run_mergekit(cfg, op, k, "bfloat16", out))
                except RuntimeError as e:
                    ok, why = False, f"MergeKit run failed: {str(e)[-400:]}"
                rmtree(out)
        raw[op] = {"ours": ours["wall"], "ours01": ours01["wall"], "naive": [m.to_dict() for m in nv],
                   "mergekit": [m.to_dict() for m in mk]}
        for name, walls, rb, rss in (
                ("mergepipe_db @1.0", ours["wall"], ours["read_bytes"], ours["maxrss"]),
                ("mergepipe_db @0.1", ours01["wall"], ours01["read_bytes"], ours01["maxrss"]),
                ("naive safetensors+torch", [m.wall for m in nv], [m.read_bytes for m in nv], [m.maxrss for m in nv]),
                ("MergeKit", [m.wall for m in mk], [m.read_bytes for m in mk], [m.maxrss for m in mk])):
            if not walls:
                rows.append([op, name, "skipped: " + why, "", "", "", ""])
                continue
            rows.append([op, name, fmt_t(walls), gb(med(rb)), f"{med(rss) / 2**30:.2f} GiB",
                         f"{ours['wall_med'] / med(walls):.2f}", f"{ours01['wall_med'] / med(walls):.2f}"])
    # full-budget equality with MergeKit (float32 output on both sides)
    eq_rows = []
    eq_k = int(os.environ.get("BENCH_EQ_K", 8 if not cfg.quick else 4))
    if ok and not os.environ.get("BENCH_SKIP_EQ"):
        for op in ("linear", "task_arithmetic", "ties"):
            ours = run_merge(cfg, op, eq_k, "1.0", reps=1, keep=True, dtype="float32")
            out = OUT / f"mk-eq-{op}"
            try:
                m = run_mergekit(cfg, op, eq_k, "float32", out, cold=False)
                c = compare(ours["out"], out)
                raw[f"eq-{op}"] = c
                eq_rows.append([op, eq_k, f"{c['max_abs']:.3e}", f"{c['frac_diff']:.2e}", f"{c['rel_l2']:.2e}",
                                f"{m.wall:.1f} s"])
            except Exception as e:  # noqa: BLE001
                eq_rows.append([op, eq_k, f"failed: {str(e)[-200:]}", "", "", ""])
            rmtree(out)
            rmtree(Path(ours["out"]))
    save_raw("peers", raw)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels, vals, cols = [], [], []
    for op in ("linear", "ties"):
        d = raw[op]
        for name, ws, c in (("ours 1.0", d["ours"], "C0"), ("ours 0.1", d["ours01"], "C1"),
                            ("naive", [m["wall"] for m in d["naive"]], "C7"),
                            ("MergeKit", [m["wall"] for m in d["mergekit"]], "C3")):
            if ws:
                labels.append(f"{op}\n{name}")
                vals.append(med(ws))
                cols.append(c)
    ax.bar(range(len(vals)), vals, color=cols)
    ax.set_xticks(range(len(vals)), labels, fontsize=6.5)
    ax.set_ylabel("wall s (median)")
    fig_md = _fig(plt, fig, "peers", f"K=8 experts, BF16 output, same family, cold cache before each run, median "
                  f"of {reps}. MergeKit: `mergekit-yaml --lazy-unpickle` on the same YAML (CPU).")
    mk_line = "" if ok else f"\n**MergeKit skipped**: {why}\n"
    eq = (md_table(["operator", "K", "max |ours − MergeKit|", "fraction of elements differing", "rel. L2",
                    "MergeKit wall (warm)"], eq_rows) if eq_rows
          else ("(skipped: BENCH_SKIP_EQ set)\n" if ok else "(not run: MergeKit unavailable)\n"))
    text = f"""## 6. Peers: naive full-read script and MergeKit (K = 8)

{family_note(cfg)}
{HOW} The naive peer is `benchmarks/peers/naive_merge.py` (safetensors `get_tensor` of every tensor of every
expert, merge in float32, `save_file`). Ratios are wall(ours)/wall(peer): < 1 means we are faster.
{mk_line}
{md_table(["operator", "tool", "wall", "read_bytes (/proc)", "peak RSS", "ours@1.0 / tool", "ours@0.1 / tool"], rows)}
### Full-budget equality with MergeKit (float32 output, K = {eq_k})

{eq}
{fig_md}"""
    write_section("peers", text)
    return text


def cleanup_outputs() -> None:
    shutil.rmtree(OUT, ignore_errors=True)


__all__ = ["ingest", "ingest_section", "scaling", "budget_sweep", "operators", "floor", "peers", "RAW", "spread"]
