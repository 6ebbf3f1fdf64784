"""The expert source interface (`mergepipe_db.sources`): the registry is the one list of kinds, each kind detects
its own files, checks its own coordinates and states the form of what it reads; a packed source costs its
compressed lengths; a plan is complete and frozen when built."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import BLOCK
from safetensors.torch import save_file

from mergepipe_db import sources
from mergepipe_db.cli import build_parser
from mergepipe_db.core.plan import CheckpointInfo, Read, TensorInfo
from mergepipe_db.errors import BadCheckpointError, CoordinateMismatchError
from mergepipe_db.io.buffers import BufferPool
from mergepipe_db.io.local import RangeReader
from mergepipe_db.sources.base import DELTA, THETA, ExpertSource
from mergepipe_db.sources.delta import DeltaSource
from mergepipe_db.sources.full import FullSource, SnapshotSource
from mergepipe_db.sources.lora import FACTOR_BLOCK, LoraSource
from mergepipe_db.sources.packed import PackedBlock, PackedIndex, PackedSource

P = "base_model.model."


def _info(kind: str = "full", config: dict | None = None) -> CheckpointInfo:
    return CheckpointInfo(id="x" * 32, name="x", kind=kind, root="/", has_stats=True, block_bytes=BLOCK, files=(),
                          file_hashes=(), config=config, base_id="b" * 32)


def _tensor(n_blocks: int = 4, nbytes: int = 64) -> TensorInfo:
    return TensorInfo(idx=3, name="w.weight", dtype="F32", shape=(n_blocks, nbytes // 4 // n_blocks), path="/f",
                      offset=1000, nbytes=nbytes, rows_per_block=1, n_blocks=n_blocks, xxh3="t")


def _reads(et: TensorInfo, blocks: list[int]) -> tuple[Read, ...]:
    size = et.nbytes // et.n_blocks
    return tuple(Read(b, et.offset + b * size, size, f"h{b}") for b in blocks)


def _adapter(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    save_file({f"{P}model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64),
               f"{P}model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2)},
              str(path / "adapter_model.safetensors"))
    return path


# --------------------------------------------------------------------------------------------------
# the registry
# --------------------------------------------------------------------------------------------------


def test_registry_is_the_one_list_of_kinds() -> None:
    assert sources.kinds() == ("full", "delta", "lora")
    assert set(sources.kinds(catalogued=True)) == {"full", "delta", "lora", "snapshot"}
    for kind in sources.kinds(catalogued=True):
        cls = sources.source_class(kind)
        assert issubclass(cls, ExpertSource) and cls.kind == kind
    ingest = build_parser()._subparsers._group_actions[0].choices["ingest"]  # noqa: SLF001
    kind = next(a for a in ingest._actions if a.dest == "kind")  # noqa: SLF001
    assert tuple(kind.choices) == sources.kinds() and kind.default == sources.DEFAULT_KIND
    with pytest.raises(BadCheckpointError, match="unsupported checkpoint kind 'packed'"):
        sources.source_class("packed")  # a packed expert is a full one with blocks in the store


def test_properties_answer_what_kind_strings_did() -> None:
    """Ranked block by block, prunable by TIES, needs torch, plain θ blocks, can be a base, packable."""
    table = {cls.kind: (cls.ranked_by_block, cls.ties_prunable, cls.needs_torch, cls.plain_blocks, cls.can_be_base,
                        cls.packable)
             for cls in (FullSource, SnapshotSource, DeltaSource, LoraSource)}
    assert table == {
        "full": (True, True, False, True, True, True),
        "snapshot": (True, True, False, True, True, False),
        "delta": (True, True, False, False, False, False),
        "lora": (False, False, True, False, False, False),
    }
    assert PackedSource.plain_blocks and PackedSource.adjusts_reads and issubclass(PackedSource, FullSource)


def test_each_kind_detects_its_own_fixture_and_not_the_others(tiny_family, tmp_path) -> None:
    full, adapter = Path(tiny_family.base), _adapter(tmp_path / "adapter")
    assert FullSource.detect(full) and not FullSource.detect(adapter)
    assert LoraSource.detect(adapter) and not LoraSource.detect(full)
    assert not DeltaSource.detect(full) and not DeltaSource.detect(adapter)  # files like a full one's: named
    assert not FullSource.detect(tmp_path / "nothing") and not LoraSource.detect(tmp_path / "nothing")
    assert sources.detect_kind(full, None, None) == "full"
    assert sources.detect_kind(adapter, "full", "base") == sources.detect_kind(adapter, "auto", "base") == "lora"
    assert sources.detect_kind(full, "delta", "base") == "delta"
    with pytest.raises(BadCheckpointError, match="--base"):
        sources.detect_kind(adapter, None, None)
    with pytest.raises(BadCheckpointError, match="unsupported checkpoint kind 'snapshot'"):
        sources.detect_kind(full, "snapshot", "base")


def test_one_coordinate_check_per_kind(tiny_family, tmp_path) -> None:
    """Full: every base tensor, same shapes and dtypes. Delta: a subset, same shapes, any arithmetic dtype."""
    layout = FullSource.open_layout(tiny_family.base)
    base = {t.name: SimpleNamespace(shape=tuple(t.shape), dtype=t.dtype) for h in layout.files for t in h.tensors}
    FullSource.check_coordinates(layout, base, what="e")
    name = next(iter(base))
    fewer = {k: v for k, v in base.items() if k != name}
    with pytest.raises(CoordinateMismatchError, match=f"e does not share the base's coordinates: extra tensor '{name}"):
        FullSource.check_coordinates(layout, fewer, what="e")
    (tmp_path / "d").mkdir()
    save_file({"nope": torch.zeros(3)}, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CoordinateMismatchError, match="'nope' is not in the base"):
        DeltaSource.check_coordinates(DeltaSource.open_layout(tmp_path / "d"), base, what="d")


# --------------------------------------------------------------------------------------------------
# planning: read costs and the reads a source plans
# --------------------------------------------------------------------------------------------------


def test_packed_source_costs_its_compressed_lengths() -> None:
    et = _tensor()
    index = PackedIndex({(et.idx, 1): PackedBlock("/store", 0, 5, 16, "b"),
                         (et.idx, 3): PackedBlock("/store", 5, 7, 16, "b")})
    src = sources.source_for(_info(), index)
    assert isinstance(src, PackedSource)
    reads = _reads(et, [0, 1, 2, 3])
    planned = src.planned(et, reads)
    assert [r.nbytes for r in planned] == [16, 5, 16, 7] and src.cost(et, reads) == 44
    assert [(r.block_idx, r.offset, r.xxh3) for r in planned] == [(r.block_idx, r.offset, r.xxh3) for r in reads]
    whole = (Read(-1, et.offset, et.nbytes, "t"),)
    assert src.planned(et, whole) is whole  # a whole-tensor read is read from the expert's file
    unpacked = _reads(et, [0, 2])
    assert src.planned(et, unpacked) is unpacked
    assert isinstance(sources.source_for(_info(), PackedIndex({})), FullSource)  # nothing packed: a plain read


def test_lora_source_plans_a_tensor_level_selection_as_one_whole_read() -> None:
    et = _tensor()
    src = LoraSource(_info("lora", {"lora": {et.name: {}}}))
    every = _reads(et, [0, 1, 2, 3])
    assert src.planned(et, every) == (Read(-1, et.offset, et.nbytes, et.xxh3),)
    with_factor = (Read(FACTOR_BLOCK, 0, 8, "f"), *every)
    assert src.planned(et, with_factor) is with_factor and src.planned(et, every[:2]) == every[:2]
    saved = dataclasses.replace(et, name="modules_to_save.weight")  # a full replacement tensor: blocks as they are
    assert src.planned(saved, every) is every
    assert FullSource(_info()).planned(et, every) is every and FullSource(_info()).cost(et, every) == 64


# --------------------------------------------------------------------------------------------------
# reading: the form is stated
# --------------------------------------------------------------------------------------------------


def test_sources_state_the_form_they_read(tmp_path) -> None:
    """A full source delivers θ bytes (uint8), a delta source Δ in float32, whatever the stored dtype: an F32
    full expert's θ is no Δ although both are float32 values."""
    from mergepipe_db.formats.safetensors import read_header

    w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    save_file({"w.weight": w}, str(tmp_path / "m.safetensors"))
    header = read_header(tmp_path / "m.safetensors")
    entry = header.by_name()["w.weight"]
    et = TensorInfo(idx=0, name="w.weight", dtype="F32", shape=(4, 4), path=str(tmp_path / "m.safetensors"),
                    offset=header.absolute_offset(entry), nbytes=64, rows_per_block=1, n_blocks=4, xxh3="t")
    reads = _reads(et, [1, 2])
    base = np.zeros(64, np.uint8)
    with RangeReader(random=True) as reader:
        theta = FullSource(_info()).read(et, et, reads, base, reader, False, BufferPool())
        delta = DeltaSource(_info("delta")).read(et, et, reads, base, reader, False, BufferPool())
        assert reader.bytes_read == 2 * 32
    assert theta.form == THETA and not theta.is_delta and theta.data.dtype == np.uint8
    assert np.array_equal(theta.data.view(np.float32).reshape(4, 4)[1:3], w.numpy()[1:3])
    assert delta.form == DELTA and delta.is_delta and delta.data.dtype == np.float32
    assert np.array_equal(delta.data, np.where(np.isin(np.arange(4), [1, 2])[:, None], w.numpy(), 0))
    for got in (theta, delta):
        assert got.blocks == (1, 2) and got.rows == [(1, 3)] and got.nbytes_read == 32


# --------------------------------------------------------------------------------------------------
# a plan is complete and frozen when built
# --------------------------------------------------------------------------------------------------


def test_plan_is_frozen_and_carries_one_source_per_expert(catalog, tiny_family, tmp_path) -> None:
    from builders import make_spec
    from conftest import ingest_family

    names = ingest_family(catalog, tiny_family)
    plan = catalog.plan(make_spec("ties", names), budget=0.3)
    assert isinstance(plan.sources, tuple) and len(plan.sources) == len(plan.experts)
    assert all(type(s) is FullSource and s.info == e.checkpoint for s, e in zip(plan.sources, plan.experts))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.planned_bytes = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.plan_hash = ""  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.experts[0].planned_bytes = 0  # type: ignore[misc]
    key = next(iter(plan.access))
    for change in (lambda: plan.access.__setitem__(key, ()), lambda: plan.access.pop(key),
                   lambda: plan.full_selection.update({key: False}), lambda: plan.sketches.clear(),
                   lambda: plan.experts[0].tensors.popitem()):
        with pytest.raises(TypeError, match="read-only"):
            change()
    import pickle

    again = pickle.loads(pickle.dumps(plan.access))
    assert again == plan.access and type(again) is type(plan.access)
    assert plan.planned_bytes == sum(e.planned_bytes for e in plan.experts) == sum(
        r.nbytes for reads in plan.access.values() for r in reads)
    assert sum(e.blocks_selected for e in plan.experts) == sum(len(reads) for reads in plan.access.values())
    assert plan.sketches  # ties: computed while planning, before construction
    res = catalog.merge(make_spec("ties", names), out=tmp_path / "out", budget=0.3)
    replayed = catalog.replay(tmp_path / "out", out=tmp_path / "again", verify=True)
    assert res.plan_hash == plan.plan_hash == replayed.plan_hash
