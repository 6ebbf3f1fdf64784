"""Measured merges (memoized across experiments), the I/O floor, and output comparisons."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.common import DATA, PY, Config, measure, med, rmtree
from benchmarks.family import model_files, spec

_MEMO: dict[tuple, dict[str, Any]] = {}
OUT = DATA / "out"


def merge_key(method: str, k: int, budget: str, dtype: str = "bfloat16") -> str:
    return f"{method}-k{k}-b{budget}-{dtype}"


def run_merge(cfg: Config, method: str, k: int, budget: str, *, reps: int | None = None, keep: bool = False,
              dtype: str = "bfloat16", **params: Any) -> dict[str, Any]:
    """Run one merge config `reps` times cold; returns runs + medians. Keeps the last output when `keep`."""
    reps = reps or cfg.reps
    key = (cfg.family_dir, method, k, budget, dtype, tuple(sorted(params.items())))
    memo = _MEMO.get(key)
    if memo is not None and len(memo["runs"]) >= reps and (not keep or memo.get("out")):
        return memo
    name = merge_key(method, k, budget, dtype)
    OUT.mkdir(parents=True, exist_ok=True)
    spec_path = OUT / f"{name}.json"
    spec_path.write_text(json.dumps(spec(cfg, method, k, dtype=dtype, **params)))
    runs = []
    out_dir = None
    for r in range(reps):
        out = OUT / f"{name}-r{r}"
        rmtree(out)
        m = measure([PY, "-m", "benchmarks.jobs", "merge", str(cfg.catalog), str(spec_path), budget, str(out),
                     str(cfg.shard_bytes)])
        res = json.loads(m.stdout.strip().splitlines()[-1])
        runs.append({"wall": m.wall, "read_bytes": m.read_bytes, "write_bytes": m.write_bytes,
                     "maxrss": m.maxrss, "cold": m.cold, **res})
        if keep and r == reps - 1:
            out_dir = out
        else:
            rmtree(out)
    rec = {"method": method, "k": k, "budget": budget, "dtype": dtype, "runs": runs, "out": str(out_dir or ""),
           "wall": [x["wall"] for x in runs]}
    for f in ("realized_bytes", "planned_bytes", "full_bytes", "base_bytes", "output_bytes", "budget_bytes",
              "bound"):
        rec[f] = runs[-1][f]
    rec["read_bytes"] = [x["read_bytes"] for x in runs]
    rec["maxrss"] = [x["maxrss"] for x in runs]
    rec["wall_med"] = med(rec["wall"])
    _MEMO[key] = rec
    return rec


def _dd_read_cmd(cfg: Config, k: int, expert_bytes: int, direct: bool) -> list[str]:
    """`dd bs=16M` of the base files and the first `expert_bytes` of the experts' files, one after another;
    with `direct`, O_DIRECT (no page-cache copy; a partial file's byte count rounded up to 4 KiB for it)."""

    def dd(f: Path, count: int | None = None) -> str:
        flags = (["direct"] if direct else []) + ([] if count is None else ["count_bytes"])
        return " ".join([f"dd if={f} of=/dev/null bs=16M", *([f"iflag={','.join(flags)}"] if flags else []),
                         *([] if count is None else [f"count={count}"]), "status=none"])

    parts = [dd(f) for f in model_files(cfg, None)]
    left = expert_bytes
    for e in range(k):
        for f in model_files(cfg, e):
            if left <= 0:
                break
            n = f.stat().st_size
            parts.append(dd(f) if n <= left else dd(f, -(-left // 4096) * 4096 if direct else left))
            left -= min(n, left)
    return ["bash", "-c", " && ".join(parts)]


def io_floor(cfg: Config, k: int, expert_bytes: int, output_bytes: int, reps: int | None = None
             ) -> dict[str, Any]:
    """Cold `dd` read of base + `expert_bytes` of the experts' files, and `dd` write+fsync of the output size.

    The issue's floor reads through the page cache (plain `dd`); the same read with O_DIRECT (as the merge
    reads) is timed beside it as `floor_direct`: on some machines it is the faster of the two."""
    reps = reps or cfg.reps
    read_cmd = _dd_read_cmd(cfg, k, expert_bytes, direct=False)
    direct_cmd = _dd_read_cmd(cfg, k, expert_bytes, direct=True)
    tmp = DATA / "floor.out"
    count = max(1, math.ceil(output_bytes / (16 << 20)))
    write_cmd = ["bash", "-c", f"dd if=/dev/zero of={tmp} bs=16M count={count} conv=fsync status=none"]
    reads, directs, writes, rb = [], [], [], []
    for _ in range(reps):
        m = measure(read_cmd)
        reads.append(m.wall)
        rb.append(m.read_bytes)
        directs.append(measure(direct_cmd).wall)
        tmp.unlink(missing_ok=True)
        m = measure(write_cmd)
        writes.append(m.wall)
        tmp.unlink(missing_ok=True)
    floors = [a + b for a, b in zip(reads, writes)]
    floors_direct = [a + b for a, b in zip(directs, writes)]
    return {"read": reads, "read_direct": directs, "write": writes, "floor": floors, "floor_med": med(floors),
            "floor_direct": floors_direct, "floor_direct_med": med(floors_direct), "read_bytes": rb}


# --- output comparison ---------------------------------------------------------------------------------


def _tensor_map(d: str | Path) -> dict[str, Path]:
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for n in h.keys():  # noqa: SIM118 - safe_open handles are not iterable
                out[n] = f
    return out


def compare(a_dir: str | Path, ref_dir: str | Path) -> dict[str, Any]:
    """‖a − ref‖₂ / ‖ref‖₂ over all tensors (float32), max |a − ref|, fraction of differing elements."""
    import torch
    from safetensors import safe_open

    am, rm = _tensor_map(a_dir), _tensor_map(ref_dir)
    if set(am) != set(rm):
        raise ValueError(f"tensor names differ: {sorted(set(am) ^ set(rm))[:5]}")
    num = den = 0.0
    max_abs = 0.0
    diff_elems = total = 0
    ref_norm_sq = 0.0
    handles: dict[Path, Any] = {}
    try:
        for n in sorted(am):
            for p in (am[n], rm[n]):
                if p not in handles:
                    handles[p] = safe_open(str(p), "pt")
            a = handles[am[n]].get_tensor(n).to(torch.float64)
            r = handles[rm[n]].get_tensor(n).to(torch.float64)
            d = a - r
            num += float((d * d).sum())
            den += float((r * r).sum())
            if d.numel():
                max_abs = max(max_abs, float(d.abs().max()))
            diff_elems += int((d != 0).sum())
            total += d.numel()
        ref_norm_sq = den
    finally:
        handles.clear()
    return {"abs_l2": math.sqrt(num), "ref_l2": math.sqrt(ref_norm_sq),
            "rel_l2": math.sqrt(num) / math.sqrt(den) if den else 0.0, "max_abs": max_abs,
            "frac_diff": diff_elems / total if total else 0.0, "elements": total}
