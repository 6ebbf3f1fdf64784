"""Full checkpoints (θ_k stored whole, Δ = θ_k − θ₀ formed by the executor) and snapshots of merges."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from mergepipe_db.errors import CoordinateMismatchError
from mergepipe_db.sources.base import ExpertSource, too_many


class FullSource(ExpertSource):
    """A full checkpoint: the same tensors, shapes and dtypes as its base; read as θ bytes."""

    kind: ClassVar[str] = "full"
    can_be_base: ClassVar[bool] = True
    packable: ClassVar[bool] = True

    @classmethod
    def detect(cls, path: str | Path) -> bool:
        """A .safetensors file, or a directory holding one (or a shard index) that is not a LoRA adapter."""
        from mergepipe_db.sources.lora import LoraSource

        p = Path(path)
        if p.is_file():
            return p.suffix.lower() == ".safetensors"
        return p.is_dir() and not LoraSource.detect(p) and any(
            n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in _names(p))

    @classmethod
    def check_coordinates(cls, layout: Any, base: dict[str, Any], *, what: str) -> None:
        """Every tensor of the base and no other, each with the base's shape and dtype."""
        mine = {t.name: t for h in layout.files for t in h.tensors}
        problems: list[str] = []
        for name in sorted(set(base) - set(mine)):
            problems.append(f"missing tensor {name!r}")
        for name in sorted(set(mine) - set(base)):
            problems.append(f"extra tensor {name!r}")
        for name in sorted(set(mine) & set(base)):
            a, b = mine[name], base[name]
            if tuple(a.shape) != b.shape:
                problems.append(f"{name!r} shape {list(a.shape)} != base {list(b.shape)}")
            elif a.dtype != b.dtype:
                problems.append(f"{name!r} dtype {a.dtype} != base {b.dtype}")
        if problems:
            raise CoordinateMismatchError(f"{what} does not share the base's coordinates: {too_many(problems)}")


class SnapshotSource(FullSource):
    """A committed merge's output, catalogued by commit with block statistics against its base."""

    kind: ClassVar[str] = "snapshot"
    packable: ClassVar[bool] = False


def _names(p: Path) -> list[str]:
    try:
        return sorted(x.name for x in p.iterdir())
    except OSError:
        return []
