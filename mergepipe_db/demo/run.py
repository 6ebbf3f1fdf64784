"""`mergepipe demo`: generate a small Llama-shaped family, ingest it, run a budgeted merge, show what it read."""

from __future__ import annotations

import os
from pathlib import Path

import yaml


def run_demo(workdir: Path, *, catalog: str | None, method: str, budget: str, experts: int, preset: str,
             progress: bool) -> int:
    from mergepipe_db.catalog import Catalog
    from mergepipe_db.core.spec import METHODS
    from mergepipe_db.core.units import fmt_bytes
    from mergepipe_db.demo.family import PRESETS, make_demo_spec, make_family
    from mergepipe_db.errors import SpecError

    if preset not in PRESETS:
        raise SpecError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    if method not in METHODS:
        raise SpecError(f"unknown merge method {method!r}; known: {', '.join(METHODS)}")
    if experts < 1 or experts > 64:
        raise SpecError(f"--experts must be between 1 and 64, got {experts}")
    workdir.mkdir(parents=True, exist_ok=True)
    family_dir = workdir / f"family-{preset}-{experts}"
    shard = 4 << 20 if preset != "bench" else 512 << 20
    print(f"[1/3] generating a {preset} Llama-shaped family: base + {experts} experts in {family_dir}")
    fam = make_family(family_dir, n_experts=experts, preset=preset, shard_bytes=shard, progress=progress)
    own = str(workdir / "catalog.duckdb")
    url = catalog or os.environ.get("MERGEPIPE_CATALOG") or own
    if url == own and Path(url).is_file():
        # the demo's own catalog, left by an earlier version: brought up to date (a catalog named with
        # --catalog or MERGEPIPE_CATALOG is the user's, and upgraded only by `mergepipe db upgrade`)
        before, after = Catalog.lazy(url).upgrade()
        if before != after:
            print(f"      upgraded the demo catalog {url} from schema {before} to {after}")
    cat = Catalog.open(url)
    print(f"[2/3] ingesting into {cat.db.display()}")
    # 64 KiB blocks: the demo models are small, so finer blocks make the budget's choices visible.
    res = cat.ingest(fam.base, name="base", block_bytes=64 << 10, progress=progress)
    print(f"      base: {res.n_tensors} tensors, {res.n_blocks} blocks ({'new' if res.created else 'unchanged'})")
    names = [f"expert_{i:02d}" for i in range(len(fam.experts))]
    for r in cat.ingest_many(fam.experts, names=names, base="base", progress=progress):  # the base read once
        print(f"      {r.name}: {r.n_blocks} blocks ({'new' if r.created else 'unchanged'})")
    spec = make_demo_spec(fam, method=method, budget=budget)
    spec["base_model"] = "base"
    for i, m in enumerate(spec["models"]):
        m["model"] = f"expert_{i:02d}"
    spec_path = workdir / f"merge-{method}.yml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    n = 1
    while (workdir / f"merged-{method}-{n}").exists():
        n += 1
    out = workdir / f"merged-{method}-{n}"
    print(f"[3/3] merging ({method}, budget {budget}) -> {out}")
    m = cat.merge(spec_path, out=out, progress=progress)
    print(f"      snapshot {m.snapshot_id}  plan {m.plan_hash[:16]}")
    print(f"      expert bytes: candidates (non-zero delta) {fmt_bytes(m.candidate_bytes)}, all (full read) "
          f"{fmt_bytes(m.full_bytes)}; budget {fmt_bytes(m.budget_bytes)}, planned {fmt_bytes(m.planned_bytes)}, "
          f"read {fmt_bytes(m.realized_bytes)} ({100 * m.realized_bytes / max(1, m.full_bytes):.1f}% of all)")
    for i, b in enumerate(m.realized_per_expert):
        print(f"        expert_{i:02d}: {fmt_bytes(b)} read")
    print(f"      base read {fmt_bytes(m.base_bytes)}, output {fmt_bytes(m.output_bytes)}, {m.seconds:.2f} s")
    for w in m.warnings:
        print(f"      warning: {w}")
    print(f"\nspec: {spec_path}\ncatalog: {url}")
    print("\nnext (copy and paste; these are the README's next commands):")
    for line in next_steps(url, out.name):
        print(f"  {line}")
    return 0


def next_steps(catalog: str, snapshot: str) -> list[str]:
    """The commands to run after the demo, exactly as they work from the current directory: the activation
    line when `mergepipe` is not on PATH (make demo installs it into .venv), the demo's catalog as
    $MERGEPIPE_CATALOG (every command finds it there), then a report, the lineage and a query."""
    import shlex
    import shutil
    import sys

    lines = []
    if shutil.which("mergepipe") is None and sys.prefix != sys.base_prefix:
        venv = os.path.relpath(sys.prefix) if not os.path.relpath(sys.prefix).startswith("..") else sys.prefix
        lines.append(f"source {shlex.quote(venv)}/bin/activate   # puts mergepipe on PATH")
    shown = catalog if "://" in catalog or os.path.isabs(catalog) else os.path.normpath(catalog)
    lines += [f"export MERGEPIPE_CATALOG={shlex.quote(shown)}   # the demo's catalog",
              f"mergepipe report {shlex.quote(snapshot)} --out report.html",
              f"mergepipe lineage {shlex.quote(snapshot)}",
              'mergepipe sql "SELECT expert, SUM(bytes_read) AS bytes FROM reads GROUP BY expert ORDER BY expert"']
    return lines
