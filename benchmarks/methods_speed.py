"""Every MergeKit method at full budget and at 0.1, K = 8 (fewer where the method takes fewer models), cold cache,
on the benchmark family, beside MergeKit's time for the same YAML (issue 35, point 4).

One YAML per method, with model paths, is given unchanged to `mergepipe-yaml CONFIG OUT --budget B` and to
MergeKit's `mergekit-yaml CONFIG OUT --lazy-unpickle` (its own venv, `tests/mergekit_peer.py`). Each run is its own
process after `sync; echo 3 > /proc/sys/vm/drop_caches`; wall, /proc read_bytes and peak RSS are the child's.

The I/O floor of a run is the time this disk needs to move the run's bytes: (base bytes + planned expert bytes) at
the cold O_DIRECT sequential read rate plus the output at the write+fsync rate, both measured with `dd` in the same
run (median of 3). mergepipe's planned bytes come from its own `--json` result; that they are what it read is
checked outside it, by /proc read_bytes in the table.

    python -m benchmarks.methods_speed [--family DIR] [--methods a,b] [--reps N] [--no-mergekit] [--mk-timeout S]

With ``--reps N`` every method runs N times at full budget (rounds over all methods, so that a drift of the disk
or the VM over the run touches every method alike) and the table gives the median wall (its run's other
columns) with the range; budget 0.1, whose criterion is the bytes read, runs once. `dd` is measured again after
the last run, and the floors use the medians of all six measurements.

Writes benchmarks/results/methods_speed.md and results/raw/methods_speed.json (after every run, so a long run
that is stopped keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import DATA, RAW, REPO, RESULTS, drop_caches, md_table, measure, rmtree

K = 8
BUDGETS = ("1.0", "0.1")
#: method -> (number of experts, per-model parameters, global parameters, base listed among the models)
METHODS: dict[str, tuple[int, dict[str, Any], dict[str, Any], bool]] = {
    "linear": (K, {"weight": 1 / K}, {}, False),
    "task_arithmetic": (K, {"weight": 1 / K}, {}, False),
    "ties": (K, {"weight": 1 / K, "density": 0.5}, {}, False),
    "dare_linear": (K, {"weight": 1 / K, "density": 0.5}, {}, False),
    "dare_ties": (K, {"weight": 1 / K, "density": 0.5}, {}, False),
    "breadcrumbs": (K, {"weight": 1 / K, "density": 0.9, "gamma": 0.01}, {}, False),
    "breadcrumbs_ties": (K, {"weight": 1 / K, "density": 0.9, "gamma": 0.01}, {}, False),
    "della": (K, {"weight": 1 / K, "density": 0.5, "epsilon": 0.1}, {}, False),
    "della_linear": (K, {"weight": 1 / K, "density": 0.5, "epsilon": 0.1}, {}, False),
    "sce": (K, {}, {"select_topk": 0.5}, False),
    "model_stock": (K, {}, {}, False),
    "multislerp": (K, {"weight": 1 / K}, {}, False),
    "karcher": (K, {}, {}, False),
    "ram": (K, {}, {}, False),
    "ramplus_tl": (K, {}, {"r": 0.1, "alpha": 0.2}, False),
    "nuslerp": (2, {"weight": 0.5}, {}, False),
    "slerp": (1, {}, {"t": 0.5}, True),
    "nearswap": (1, {}, {"t": 0.001}, True),
    "arcee_fusion": (1, {}, {}, True),
    "passthrough": (1, {}, {}, False),
}
OUT = DATA / "methods_speed"


def mk_venv() -> Path:
    """MergeKit's venv, made by the tests' peer module on first use (MERGEPIPE_MERGEKIT_VENV overrides)."""
    sys.path.insert(0, str(REPO / "tests"))
    from mergekit_peer import VENV, ensure_mergekit

    ensure_mergekit()
    return VENV


def family_paths(fam: Path) -> tuple[Path, list[Path]]:
    return fam / "base", [fam / f"expert_{i:02d}" for i in range(K)]


def config_yaml(method: str, fam: Path, dtype: str = "bfloat16") -> dict[str, Any]:
    base, experts = family_paths(fam)
    n, mparams, gparams, base_listed = METHODS[method]
    if method == "passthrough":  # a frankenmerge: base layers [0, 2L/3) then expert 0's [L/3, L)
        n_layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
        cut, start = 2 * n_layers // 3, n_layers // 3
        return {"merge_method": "passthrough", "dtype": dtype,
                "slices": [{"sources": [{"model": str(base), "layer_range": [0, cut]}]},
                           {"sources": [{"model": str(experts[0]), "layer_range": [start, n_layers]}]}]}
    models = [{"model": str(p), **({"parameters": dict(mparams)} if mparams else {})} for p in experts[:n]]
    cfg: dict[str, Any] = {"merge_method": method, "models": models, "dtype": dtype}
    if base_listed:
        models.insert(0, {"model": str(base)})
    if method != "linear":  # MergeKit's linear would average the base in too
        cfg["base_model"] = str(base)
    if gparams:
        cfg["parameters"] = dict(gparams)
    return cfg


def dd_rates(fam: Path, reps: int = 3) -> dict[str, float]:
    """Cold O_DIRECT sequential read rate (bytes/s, expert files) and write+fsync rate, medians of `reps`."""
    _base, experts = family_paths(fam)
    files = sorted(p for e in experts[:2] for p in e.glob("*.safetensors"))
    reads, writes = [], []
    for _ in range(reps):
        drop_caches()
        t0 = time.perf_counter()
        n = 0
        for f in files:
            subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True,
                           capture_output=True)
            n += f.stat().st_size
        reads.append(n / (time.perf_counter() - t0))
        out = OUT / "dd.out"
        OUT.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={out}", "bs=16M", "count=64", "conv=fsync"], check=True,
                       capture_output=True)
        writes.append((64 << 24) / (time.perf_counter() - t0))
        out.unlink()
    reads.sort()
    writes.sort()
    return {"read_Bps": reads[len(reads) // 2], "write_Bps": writes[len(writes) // 2], "reads": reads,
            "writes": writes}


def run_ours(method: str, cfg_path: Path, catalog: Path, budget: str) -> dict[str, Any]:
    out = OUT / f"ours-{method}-{budget}"
    rmtree(out)
    m = measure([sys.executable, "-m", "mergepipe_db.yaml_cli", str(cfg_path), str(out), "--catalog", str(catalog),
                 "--budget", budget, "--json", "--no-copy-tokenizer", "--no-write-model-card",
                 "--ref", f"speed-{method}-{budget}"], check=False, timeout=3600, env={"PYTHONPATH": str(REPO)})
    rec: dict[str, Any] = {"wall": m.wall, "read_bytes": m.read_bytes, "maxrss": m.maxrss, "rc": m.rc,
                           "load": os.getloadavg()[0]}
    if m.rc != 0:
        rec["error"] = m.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
    else:
        res = json.loads(m.stdout[m.stdout.index("{"):])
        rec.update({k: res.get(k) for k in ("realized_bytes", "candidate_bytes", "full_bytes", "base_bytes",
                                            "output_bytes", "planned_bytes", "budget_bytes")})
    rmtree(out)
    return rec


def run_mergekit(method: str, cfg_path: Path, timeout: float) -> dict[str, Any]:
    out = OUT / f"mk-{method}"
    rmtree(out)
    m = measure([str(mk_venv() / "bin" / "mergekit-yaml"), str(cfg_path), str(out), "--lazy-unpickle",
                 "--out-shard-size", "1B"], check=False, timeout=timeout,
                env={"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    rec: dict[str, Any] = {"wall": m.wall, "read_bytes": m.read_bytes, "maxrss": m.maxrss, "rc": m.rc,
                           "load": os.getloadavg()[0], "timed_out": m.wall >= timeout}
    if m.rc != 0:
        rec["error"] = m.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
    rmtree(out)
    return rec


def median_run(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median wall among `reps` (the lower middle of an even count; failed runs count as slowest)."""
    ranked = sorted(reps, key=lambda r: (bool(r.get("rc")), r["wall"]))
    return ranked[(len(ranked) - 1) // 2]


def floor_s(rec: dict[str, Any], rates: dict[str, float]) -> float | None:
    if rec.get("realized_bytes") is None or rec.get("base_bytes") is None:
        return None
    return ((rec["realized_bytes"] + rec["base_bytes"]) / rates["read_Bps"]
            + (rec.get("output_bytes") or 0) / rates["write_Bps"])


def disk_rates(raw: dict[str, Any]) -> dict[str, float]:
    """The rates a run's floors use: `dd`'s medians before the runs, or, where `dd` ran again after them
    (``--reps``), the medians of all six measurements (this VM's write rate moves by up to 2× within minutes)."""
    if "dd_end" not in raw:
        return raw["dd"]
    return {"read_Bps": statistics.median(raw["dd"]["reads"] + raw["dd_end"]["reads"]),
            "write_Bps": statistics.median(raw["dd"]["writes"] + raw["dd_end"]["writes"])}


def to_markdown(raw: dict[str, Any]) -> str:
    rates = disk_rates(raw)
    rows = []
    for method in METHODS:
        r = raw["runs"].get(method, {})
        full, tenth, mk = r.get("1.0"), r.get("0.1"), r.get("mergekit")
        if not full:
            continue

        def w(x: dict | None) -> str:
            if not x:
                return "not run"
            if x.get("rc"):
                if x.get("timed_out"):  # MergeKit's progress bar says how far it got
                    done = re.search(r"(\d+)%", " ".join(x.get("error", [])))
                    return f"> {x['wall']:.0f} s (stopped{f' at {done.group(1)} %' if done else ''})"
                return f"failed: {' '.join(x.get('error', []))[:80]}"
            return f"{x['wall']:.1f} s"

        walls = sorted(x["wall"] for x in r.get("1.0_reps", []) if not x.get("rc"))
        spread = f" [{walls[0]:.1f}–{walls[-1]:.1f}]" if len(walls) > 1 else ""
        fl = floor_s(full, rates) if not full.get("rc") else None
        frac = (tenth["realized_bytes"] / tenth["full_bytes"]
                if tenth and not tenth.get("rc") and tenth.get("full_bytes") else None)
        vs_mk = (f"{full['wall'] / mk['wall']:.2f}" if mk and not mk.get("rc") and not full.get("rc") else
                 (f"< {full['wall'] / mk['wall']:.2f}" if mk and mk.get("timed_out") else "–"))
        rows.append([
            method, METHODS[method][0], w(full) + spread, f"{fl:.1f} s" if fl else "–",
            f"{full['wall'] / fl:.2f}×" if fl else "–", f"{full['maxrss'] / 2**30:.2f} GiB",
            w(tenth), f"{frac:.3f}" if frac is not None else "–",
            f"{tenth['read_bytes'] / 1e9:.2f} / {full['read_bytes'] / 1e9:.2f}" if tenth else "–",
            w(mk), f"{mk['maxrss'] / 2**30:.2f} GiB" if mk else "–", vs_mk,
            " / ".join(f"{x['load']:.1f}" for x in (full, tenth, mk) if x)])
    fam = raw.get("family", {})
    shape = fam.get("shape", {})
    head = (f"Family: {fam.get('model_bytes', 0) / 1e9:.2f} GB per model (Llama-shaped BF16, "
            f"{shape.get('num_layers')} layers, hidden {shape.get('hidden_size')}), {K} experts, experts ingested "
            f"together (exact cross products for the geometric methods). Disk (dd, cold, median of 3): "
            f"O_DIRECT read {raw['dd']['read_Bps'] / 1e9:.2f} GB/s, write+fsync {raw['dd']['write_Bps'] / 1e9:.2f} GB/s"
            + (f"; after the last run read {raw['dd_end']['read_Bps'] / 1e9:.2f} GB/s, write "
               f"{raw['dd_end']['write_Bps'] / 1e9:.2f} GB/s; the floors use the medians of all six, "
               f"{rates['read_Bps'] / 1e9:.2f} and {rates['write_Bps'] / 1e9:.2f} GB/s" if "dd_end" in raw else "")
            + ".\n\n")
    earlier = sorted({run for run in raw.get("mergekit_from", {}).values()})
    if earlier:  # MergeKit's times carried over from an earlier run on the same machine (its code did not change)
        head += (f"MergeKit's times of {', '.join(sorted(raw['mergekit_from']))} are those of run "
                 f"{', '.join(earlier)} (same machine, same YAML); the others were measured in this run.\n\n")
    return head + md_table(["method", "experts", "ours @1.0", "I/O floor", "ours / floor", "ours peak RSS",
                     "ours @0.1", "expert bytes read @0.1 / all", "read GB 0.1 / 1.0 (/proc)", "MergeKit",
                     "MergeKit RSS", "ours@1.0 / MergeKit", "load avg (1 min) after 1.0 / 0.1 / MergeKit"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", type=Path, default=DATA / "fam-2g", help="benchmark family directory")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods (default: all 20)")
    ap.add_argument("--no-mergekit", action="store_true", help="time mergepipe only")
    ap.add_argument("--mk-timeout", type=float, default=900, help="seconds before a MergeKit run is stopped")
    ap.add_argument("--reps", type=int, default=1, help="runs of each method at full budget (median reported)")
    ap.add_argument("--raw", type=Path, default=RAW / "methods_speed.json", help="raw results (resumed if present)")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods: {', '.join(sorted(unknown))}")
    catalog = args.family / "catalog.duckdb"
    OUT.mkdir(parents=True, exist_ok=True)
    raw: dict[str, Any] = json.loads(args.raw.read_text()) if args.raw.exists() else {"runs": {}}
    raw["family"] = json.loads((args.family / "family.json").read_text())
    if "dd" not in raw:
        raw["dd"] = dd_rates(args.family)
    print(f"[speed] dd: read {raw['dd']['read_Bps'] / 1e9:.2f} GB/s, write {raw['dd']['write_Bps'] / 1e9:.2f} GB/s",
          flush=True)

    def save() -> None:
        args.raw.parent.mkdir(parents=True, exist_ok=True)
        args.raw.write_text(json.dumps(raw, indent=1))
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "methods_speed.md").write_text(to_markdown(raw))

    cfgs = {}
    for method in methods:
        cfg_path = OUT / f"{args.family.name}-{method}.yml"  # per family: a run on another never rewrites it
        cfg_path.write_text(yaml.safe_dump(config_yaml(method, args.family), sort_keys=False))
        cfgs[method] = cfg_path
    for rep in range(args.reps):  # ours first: both budgets of every method, then the further full-budget rounds
        for method in methods:
            for budget in BUDGETS if rep == 0 else BUDGETS[:1]:
                runs = raw["runs"].setdefault(method, {})
                reps = runs.setdefault(f"{budget}_reps", [runs[budget]] if budget in runs else [])  # an older raw's run
                if len(reps) > rep:
                    continue
                rec = run_ours(method, cfgs[method], catalog, budget)
                reps.append(rec)
                runs[budget] = median_run(reps)
                print(f"[speed] ours {method} @{budget} (run {rep + 1}): {rec['wall']:.1f} s rc={rec['rc']} "
                      f"{rec.get('error', '')}", flush=True)
                save()
    if args.reps > 1 and "dd_end" not in raw:
        raw["dd_end"] = dd_rates(args.family)
        save()
    if not args.no_mergekit:
        mk_venv()
        for method in methods:
            if "mergekit" in raw["runs"].get(method, {}):
                continue
            rec = run_mergekit(method, cfgs[method], args.mk_timeout)
            raw["runs"].setdefault(method, {})["mergekit"] = rec
            print(f"[speed] MergeKit {method}: {rec['wall']:.1f} s rc={rec['rc']} {rec.get('error', '')}", flush=True)
            save()
    save()
    print(to_markdown(raw))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
