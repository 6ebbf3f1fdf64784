"""The benchmark family (generated once, K=16 experts; smaller K is a prefix) and its catalog."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import DATA, Config, dir_files


def ensure_family(cfg: Config) -> dict[str, Any]:
    from mergepipe_db.demo.family import make_family, shape_for_bytes

    d = cfg.family_dir
    marker = d / "family.json"
    if marker.exists():
        return json.loads(marker.read_text())
    DATA.mkdir(parents=True, exist_ok=True)
    shape = shape_for_bytes(cfg.model_bytes)
    t0 = time.perf_counter()
    print(f"[bench] generating family in {d} ({shape}) ...", flush=True)
    make_family(d, n_experts=cfg.n_experts, preset=shape, dtype="bfloat16", seed=0, shard_bytes=cfg.shard_bytes,
                progress=False)
    info = {"shape": shape.__dict__, "model_bytes": shape.nbytes("bfloat16"), "n_experts": cfg.n_experts,
            "shard_bytes": cfg.shard_bytes, "seconds": time.perf_counter() - t0}
    marker.write_text(json.dumps(info))
    return info


def model_dir(cfg: Config, k: int | None) -> Path:
    if k is None:
        return cfg.family_dir / "base"
    return cfg.family_dir / f"expert_{k:02d}"


def model_files(cfg: Config, k: int | None) -> list[Path]:
    return dir_files(model_dir(cfg, k))


def ensure_catalog(cfg: Config) -> None:
    """Ingest base + all experts into the family's catalog (untimed set-up)."""
    from mergepipe_db import Catalog

    marker = cfg.family_dir / "catalog.done"
    if marker.exists():
        return
    cfg.catalog.unlink(missing_ok=True)
    cat = Catalog.open(str(cfg.catalog))
    t0 = time.perf_counter()
    cat.ingest(model_dir(cfg, None), name="base")
    cat.ingest_many([model_dir(cfg, k) for k in range(cfg.n_experts)],
                    names=[f"expert_{k:02d}" for k in range(cfg.n_experts)], base="base")  # the base read once
    print(f"[bench] catalogued family in {time.perf_counter() - t0:.1f} s", flush=True)
    marker.write_text("ok")


def spec(cfg: Config, method: str, k: int, *, dtype: str = "bfloat16", by_path: bool = False,
         **params: Any) -> dict[str, Any]:
    """MergeKit-compatible spec over base + the first k experts (weight 1/k, density 0.5 where used)."""
    density_methods = {"ties", "dare_ties", "dare_linear", "breadcrumbs"}
    models = []
    for i in range(k):
        p: dict[str, Any] = {"weight": 1.0 / k}
        if method in density_methods:
            p["density"] = 0.5
        models.append({"model": str(model_dir(cfg, i)) if by_path else f"expert_{i:02d}", "parameters": p})
    gp: dict[str, Any] = {}
    if method in ("linear", "ties"):
        gp["normalize"] = True
    gp.update(params)
    return {"merge_method": method, "base_model": str(model_dir(cfg, None)) if by_path else "base",
            "models": models, "parameters": gp, "dtype": dtype, "seed": 0}
