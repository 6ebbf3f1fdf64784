"""The baseline every user writes: read every tensor of every expert with safetensors, merge in float32
with torch, save_file. No catalog, no budget. MergeKit semantics for linear and TIES (magnitude trim with
k = int(density·numel), sign election by sum, disjoint mean).

    python benchmarks/peers/naive_merge.py METHOD OUT BASE EXPERT... [--density 0.5] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def tensor_files(d: Path) -> dict[str, Path]:
    idx = d / "model.safetensors.index.json"
    if idx.exists():
        return {n: d / f for n, f in json.loads(idx.read_text())["weight_map"].items()}
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({n: f for n in h.keys()})  # noqa: SIM118 - safe_open is not iterable
    return out


class Model:
    def __init__(self, d: Path) -> None:
        self.files = tensor_files(d)
        self.handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        f = self.files[name]
        if f not in self.handles:
            self.handles[f] = safe_open(str(f), "pt")
        return self.handles[f].get_tensor(name)  # type: ignore[attr-defined]


def trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    if density >= 1:
        return delta
    k = int(density * delta.numel())
    flat = delta.reshape(-1)
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[idx] = True
    return (flat * mask).reshape(delta.shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("method", choices=["linear", "ties"])
    ap.add_argument("out")
    ap.add_argument("base")
    ap.add_argument("experts", nargs="+")
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shard-bytes", type=int, default=512 << 20)
    a = ap.parse_args()
    out_dtype = getattr(torch, a.dtype)
    base = Model(Path(a.base))
    experts = [Model(Path(e)) for e in a.experts]
    w = torch.full((len(experts),), 1.0 / len(experts))
    names = list(base.files)
    os.makedirs(a.out, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    used, n_shard, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, used, n_shard
        if shard:
            fname = f"model-{n_shard:05d}.safetensors"
            save_file(shard, os.path.join(a.out, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
            shard, used, n_shard = {}, 0, n_shard + 1

    for name in names:
        if a.method == "linear":
            acc = None
            for k, e in enumerate(experts):
                t = e.get(name).to(torch.float32) * w[k]
                acc = t if acc is None else acc + t
            merged = acc / w.sum()
        else:
            b = base.get(name).to(torch.float32)
            deltas = torch.stack([trim(e.get(name).to(torch.float32) - b, a.density) for e in experts])
            wd = deltas * w.view(-1, *([1] * b.dim()))
            sign = torch.where(wd.sum(0) >= 0, 1.0, -1.0)
            mask = wd.sign() == sign
            mixed = (wd * mask).sum(0)
            div = (w.view(-1, *([1] * b.dim())) * mask).sum(0)
            div[div == 0] = 1
            merged = b + mixed / div
        t = merged.to(out_dtype).contiguous()
        nb = t.numel() * t.element_size()
        if used and used + nb > a.shard_bytes:
            flush()
        shard[name] = t
        used += nb
    flush()
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


if __name__ == "__main__":
    main()
