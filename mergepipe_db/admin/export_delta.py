"""Export Δ = expert − base of one catalogued expert as a Hugging Face directory (full, delta or LoRA sources)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES
from mergepipe_db.errors import BadCheckpointError
from mergepipe_db.sources import kinds, source_for


def export_delta(db: Any, name: str, out: str | Path, *, dtype: str = "float32") -> dict[str, Any]:
    """Write Δ of expert `name` (full: θ − θ₀ in float32; delta: as stored; LoRA: B@A·s) for every tensor
    it covers to a new HF directory `out` (model.safetensors + the base's config.json), cast to `dtype`.
    float32 is exact for BF16/F16 inputs. Raises UnknownCheckpointError, BadCheckpointError, OutputExistsError."""
    import shutil

    import sqlalchemy as sa
    import torch

    from mergepipe_db.core.dtypes import torch_dtype
    from mergepipe_db.db import schema
    from mergepipe_db.db.checkpoints import load_checkpoint_info, load_tensors
    from mergepipe_db.errors import OutputExistsError, UnknownCheckpointError
    from mergepipe_db.formats.safetensors import SafetensorsWriter
    from mergepipe_db.io import check_fresh, open_store

    names = {"float32": "F32", "f32": "F32", "bfloat16": "BF16", "bf16": "BF16", "float16": "F16", "f16": "F16"}
    if dtype.lower() not in names:
        raise BadCheckpointError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    st_dtype = names[dtype.lower()]
    c = schema.checkpoint
    with db.connect() as conn:
        row = conn.execute(sa.select(c).where(c.c.name == name)).mappings().first()
        if row is None:
            raise UnknownCheckpointError(f"unknown checkpoint {name!r}")
        if row["base_id"] is None or row["kind"] not in kinds():  # a snapshot is no ingested expert
            raise BadCheckpointError(f"{name!r} is not an expert of a base (ingest it with --base)")
        info = load_checkpoint_info(conn, row["id"])
        binfo = load_checkpoint_info(conn, row["base_id"])
        mine = {t.name: t for t in load_tensors(conn, row["id"])}
        base = load_tensors(conn, row["base_id"])
    check_fresh(info.files + binfo.files)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OutputExistsError(f"{out} exists and is not an empty directory")
    source = source_for(info)  # Δ per tensor: θ − θ₀ (full), as stored (delta), B@A·s (LoRA)
    todo = [t for t in base if t.name in mine and t.dtype in ARITHMETIC_DTYPES]
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    entries = [(t.name, st_dtype, t.shape) for t in todo]
    try:
        with (open_store(info.root).range_reader(random=False) as reader,
              SafetensorsWriter(tmp / "model.safetensors", entries, {"format": "pt"}) as w):
            for t in todo:
                d = source.delta_tensor(t, mine[t.name], reader)
                stored = d.to(torch_dtype(st_dtype)).contiguous().reshape(-1)  # flat: a 0-d tensor too
                w.write(t.name, memoryview(stored.view(torch.uint8).numpy()))
            w.close(fsync=True)
        if binfo.config is not None:
            (tmp / "config.json").write_text(json.dumps(binfo.config, indent=2), encoding="utf-8")
        open_store(tmp).sync(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left beside `out`
        raise
    if out.exists():
        out.rmdir()
    open_store(out).publish(tmp, out)  # rename, then fsync the parent
    return {"expert": name, "out": str(out), "dtype": st_dtype, "n_tensors": len(todo)}
