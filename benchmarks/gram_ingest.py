"""Ingest's cost of the inner-product statistics (issue 35): `Catalog.ingest_many` of 3 F32 experts of one base,
timed with the statistics (mp_tensor_gram) and with their hooks disabled in this process (`--without`: the block
statistics alone, as ingest was before them; `--both`: the two interleaved, repetition by repetition). Each
repetition catalogues the base (untimed) and the experts (timed) into a fresh DuckDB catalog; warm page cache
unless `--cold` (root: caches dropped before each timed ingest). Prints the wall times, their median and
the median CPU time (all threads).

    python -m benchmarks.gram_ingest [--without | --both] [--cold] [--reps 5] [--bytes 134e6] [--root /tmp/gram_bench]

Not part of `benchmarks.run`: a development measurement, reported in the issue and commit messages."""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _hooks() -> dict[str, object]:
    from mergepipe_db.pipeline import ingest

    return {k: getattr(ingest, k) for k in ("_expert_block_stats", "_cross_products", "_base_block_square")}


def _set_statistics(on: bool, hooks: dict[str, object]) -> None:
    """Ingest with its hooks (`on`) or as before the inner-product statistics: block statistics only, no cross
    products or ‖θ‖²."""
    from mergepipe_db.kernels.block_stats import delta_block_stats
    from mergepipe_db.pipeline import ingest

    if on:
        for k, v in hooks.items():
            setattr(ingest, k, v)
        return
    ingest._expert_block_stats = lambda data, base, dtype, start: delta_block_stats(data, base, dtype)
    ingest._cross_products = lambda changed, base, dtype: []
    ingest._base_block_square = lambda data, dtype: {ingest._GRAM: 0.0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--without", action="store_true", help="disable the inner-product statistics (the baseline)")
    ap.add_argument("--both", action="store_true", help="both, interleaved repetition by repetition")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each timed ingest (root)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    ap.add_argument("--bytes", type=float, default=134e6, help="bytes of each model (default 134e6)")
    ap.add_argument("--root", default=str(Path(tempfile.gettempdir()) / "gram_bench"),
                    help="where the family is written (kept and reused between runs)")
    args = ap.parse_args(argv)

    from benchmarks.common import drop_caches
    from mergepipe_db import Catalog
    from mergepipe_db.demo.family import make_family, shape_for_bytes

    root = Path(args.root) / f"f32_{int(args.bytes)}"
    if not (root / "done").exists():
        shutil.rmtree(root, ignore_errors=True)
        make_family(root, n_experts=3, preset=shape_for_bytes(int(args.bytes), "float32"), dtype="float32", seed=0)
        (root / "done").touch()
    fam_base, experts = root / "base", sorted(root.glob("expert_*"))
    hooks = _hooks()
    modes = [False, True] if args.both else [not args.without]
    times: dict[bool, list[float]] = {m: [] for m in modes}
    cpu: dict[bool, list[float]] = {m: [] for m in modes}  # CPU seconds of all threads: less moved by other load
    for rep in range(args.reps + 1):  # the first, untimed: numba's compiled kernels loaded, files cached
        for on in modes if rep % 2 else modes[::-1]:  # interleaved, order alternating: drift of a shared machine
            _set_statistics(on, hooks)
            with tempfile.TemporaryDirectory() as tmp:
                cat = Catalog.open(str(Path(tmp) / "c.duckdb"))
                cat.ingest(fam_base, name="base")
                if args.cold and not drop_caches():
                    raise SystemExit("--cold needs root (drop_caches)")
                t0, c0 = time.perf_counter(), time.process_time()
                cat.ingest_many(experts, names=[p.name for p in experts], base="base")
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if rep:
                times[on].append(dt)
                cpu[on].append(dc)
    for on in modes:
        label = "with statistics" if on else "without statistics"
        print(f"{label} ({'cold' if args.cold else 'warm'}): " + " ".join(f"{t:.3f}" for t in times[on])
              + f"  median {statistics.median(times[on]):.3f} s; CPU median {statistics.median(cpu[on]):.3f} s")
    if args.both:
        print(f"ratio of medians: wall {statistics.median(times[True]) / statistics.median(times[False]):.3f}, "
              f"CPU {statistics.median(cpu[True]) / statistics.median(cpu[False]):.3f}")


if __name__ == "__main__":
    main()
