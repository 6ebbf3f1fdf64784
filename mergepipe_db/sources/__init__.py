"""Expert sources: how each kind of expert (full, delta, LoRA, packed) is detected, checked against its base,
scanned, costed and read (`sources.base.ExpertSource`, one module per kind).

This module is the registry, the one list of kinds: `kinds()` (what ingest takes, the CLI's ``--kind``),
`source_class(kind)` (a catalogued kind's class), `detect_kind` (ingest) and `sources_for` (the planner: one
source per expert, a packed one where the expert has blocks in the packed store). It imports the kinds' modules
only when asked, so ``mergepipe --help`` stays instant.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergepipe_db.errors import BadCheckpointError

if TYPE_CHECKING:
    from mergepipe_db.core.plan import CheckpointInfo
    from mergepipe_db.sources.base import ExpertSource

#: every kind of checkpoint the catalog holds -> (module, class); ingest takes those in `_INGESTED`
_REGISTRY: dict[str, tuple[str, str]] = {
    "full": ("mergepipe_db.sources.full", "FullSource"),
    "delta": ("mergepipe_db.sources.delta", "DeltaSource"),
    "lora": ("mergepipe_db.sources.lora", "LoraSource"),
    "snapshot": ("mergepipe_db.sources.full", "SnapshotSource"),  # a merge's output, catalogued by commit
}
_INGESTED = ("full", "delta", "lora")
DEFAULT_KIND = "full"  # what ingest takes a path for when no other kind detects it


def kinds(*, catalogued: bool = False) -> tuple[str, ...]:
    """The kinds ingest takes (``--kind``); with `catalogued`, every kind a catalog row may have."""
    return tuple(_REGISTRY) if catalogued else _INGESTED


def source_class(kind: str) -> type[ExpertSource]:
    """The source class of a catalogued `kind`; BadCheckpointError for an unknown one."""
    try:
        module, name = _REGISTRY[kind]
    except KeyError:
        raise BadCheckpointError(f"unsupported checkpoint kind {kind!r}; supported: {', '.join(_INGESTED)}") from None
    return getattr(importlib.import_module(module), name)


def detect_kind(path: str | Path, kind: str | None, base: str | None) -> str:
    """The kind to ingest `path` as: `kind`, or the kind whose `detect` recognises the path when `kind` is
    None, ``auto`` or the default (a directory with adapter_config.json is a LoRA adapter). BadCheckpointError
    for an unknown kind, or one that is relative to a base without a base."""
    if kind in (None, "auto", DEFAULT_KIND):
        kind = next((k for k in _INGESTED if k != DEFAULT_KIND and source_class(k).detect(path)), DEFAULT_KIND)
    if kind not in _INGESTED:
        raise BadCheckpointError(f"unsupported checkpoint kind {kind!r}; supported: {', '.join(_INGESTED)}")
    if not source_class(kind).can_be_base and base is None:
        raise BadCheckpointError(f"a {kind} checkpoint is relative to a base: give --base NAME")
    return kind


def source_for(info: CheckpointInfo, packed: Any = None) -> ExpertSource:
    """The source reading expert `info`: a `PackedSource` when `packed` (its `PackedIndex`) holds blocks."""
    if packed:
        from mergepipe_db.sources.packed import PackedSource

        return PackedSource(info, packed)
    return source_class(info.kind)(info)


def sources_for(conn: Any, infos: list[CheckpointInfo], packed_ids: set[str] | None = None
                ) -> tuple[ExpertSource, ...]:
    """One source per checkpoint of `infos`, in order; the packed store's index is loaded for packable experts
    with blocks in it (`packed_ids`: those of `infos` with packed blocks, where the caller has them already;
    else one query), then one query per such expert."""
    from mergepipe_db.sources import packed as store

    packable = [i.id for i in infos if source_class(i.kind).packable]
    with_packed = store.packed_checkpoints(conn, packable) if packed_ids is None else packed_ids & set(packable)
    return tuple(source_for(i, store.load_index(conn, i.id) if i.id in with_packed else None) for i in infos)
