"""Checkpoint directory resolution: single files, sharded indexes, bad indexes, symlinks, pickle refusal."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from mergepipe_db import errors as E
from mergepipe_db.formats.hf_layout import resolve_checkpoint
from mergepipe_db.formats.safetensors import SafetensorsWriter


def one_line(e: BaseException) -> bool:
    return bool(str(e)) and len(str(e).splitlines()) == 1


def write_st(path: Path, names: list[str], size: int = 2) -> Path:
    """A tiny F32 safetensors file holding `names`, each of shape (size,)."""
    with SafetensorsWriter(path, [(n, "F32", (size,)) for n in names]) as w:
        for n in names:
            w.write(n, b"\x00" * 4 * size)
    return path


def write_index(root: Path, weight_map: dict | str | bytes, **extra: object) -> Path:
    p = root / "model.safetensors.index.json"
    if isinstance(weight_map, bytes):
        p.write_bytes(weight_map)
    elif isinstance(weight_map, str):
        p.write_text(weight_map)
    else:
        p.write_text(json.dumps({"metadata": {"total_size": 0}, **extra, "weight_map": weight_map}))
    return p


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    root.mkdir()
    write_st(root / "model-00001-of-00002.safetensors", ["a", "b"])
    write_st(root / "model-00002-of-00002.safetensors", ["c"])
    write_index(
        root,
        {
            "c": "model-00002-of-00002.safetensors",
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors",
        },
    )
    return root


# --- accepted layouts --------------------------------------------------------------------------


def test_single_file(tmp_path: Path) -> None:
    f = write_st(tmp_path / "weights.safetensors", ["x", "y"])
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    lay = resolve_checkpoint(f)
    assert lay.root == tmp_path
    assert len(lay.files) == 1 and lay.files[0].path == f
    assert lay.tensor_file == {"x": 0, "y": 0}
    assert lay.config == {"model_type": "llama"}
    assert lay.side_files == (tmp_path / "config.json",)


def test_directory_with_model_safetensors(tmp_path: Path) -> None:
    write_st(tmp_path / "model.safetensors", ["w"])
    side = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "cl100k.tiktoken",
        "vocab.json",
        "merges.txt",
    ]
    for name in side:
        (tmp_path / name).write_text("{}")
    (tmp_path / "README.md").write_text("not a side file")
    (tmp_path / "tokenizer_dir.json").mkdir()  # a directory is not a side file
    lay = resolve_checkpoint(tmp_path)
    assert lay.root == tmp_path
    assert lay.tensor_file == {"w": 0}
    assert [p.name for p in lay.side_files] == sorted(side)
    assert lay.config == {}


def test_directory_without_config(tmp_path: Path) -> None:
    write_st(tmp_path / "model.safetensors", ["w"])
    lay = resolve_checkpoint(str(tmp_path))
    assert lay.config is None and lay.side_files == ()


def test_sharded_with_index(sharded: Path) -> None:
    write_st(sharded / "unlisted.safetensors", ["zzz"])  # not in the index: ignored
    lay = resolve_checkpoint(sharded)
    assert [h.path.name for h in lay.files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert lay.tensor_file == {"a": 0, "b": 0, "c": 1}
    assert lay.header_for("c").path.name == "model-00002-of-00002.safetensors"


def test_directory_with_one_other_safetensors(tmp_path: Path) -> None:
    write_st(tmp_path / "adapter_model.safetensors", ["w"])
    assert resolve_checkpoint(tmp_path).tensor_file == {"w": 0}


def test_symlink_inside_root_is_fine(tmp_path: Path) -> None:
    write_st(tmp_path / "real.safetensors", ["w"])
    (tmp_path / "model.safetensors").symlink_to("real.safetensors")
    assert resolve_checkpoint(tmp_path).tensor_file == {"w": 0}


def test_odd_tensor_names_pass_through(tmp_path: Path) -> None:
    names = ["q'\";--", "../../etc/passwd", "名前"]
    write_st(tmp_path / "s1.safetensors", names)
    write_index(tmp_path, dict.fromkeys(names, "s1.safetensors"))
    assert set(resolve_checkpoint(tmp_path).tensor_file) == set(names)


# --- refused layouts ---------------------------------------------------------------------------


def test_nonexistent(tmp_path: Path) -> None:
    with pytest.raises(E.BadCheckpointError, match="no such file or directory") as info:
        resolve_checkpoint(tmp_path / "missing")
    assert type(info.value) is E.BadCheckpointError and one_line(info.value)


def test_several_safetensors_without_index(tmp_path: Path) -> None:
    write_st(tmp_path / "a.safetensors", ["a"])
    write_st(tmp_path / "b.safetensors", ["b"])
    with pytest.raises(E.BadCheckpointError, match="index") as info:
        resolve_checkpoint(tmp_path)
    assert one_line(info.value)


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(E.BadCheckpointError, match="no model.safetensors"):
        resolve_checkpoint(tmp_path)


def test_unsupported_single_file(tmp_path: Path) -> None:
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(E.BadCheckpointError, match="not a .safetensors"):
        resolve_checkpoint(f)


def test_bad_safetensors_in_directory(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(E.HeaderLengthError, match="model.safetensors"):
        resolve_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "text", ["[]", "{not json", '"x"', '{"a": 1, "a": 2}'], ids=["array", "invalid", "string", "dup-key"]
)
def test_config_must_be_object(tmp_path: Path, text: str) -> None:
    write_st(tmp_path / "model.safetensors", ["w"])
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(E.BadCheckpointError, match="config.json") as info:
        resolve_checkpoint(tmp_path)
    assert one_line(info.value)


S1 = "model-00001-of-00002.safetensors"
S2 = "model-00002-of-00002.safetensors"

BAD_INDEX = [
    pytest.param("{not json", id="not-json"),
    pytest.param(b'{"weight_map": {"a": "\xff"}}', id="not-utf8"),
    pytest.param("[]", id="not-object"),
    pytest.param('{"metadata": {}}', id="no-weight-map"),
    pytest.param('{"weight_map": []}', id="weight-map-list"),
    pytest.param('{"weight_map": {}}', id="weight-map-empty"),
    pytest.param({"a": 1, "b": S1, "c": S2}, id="shard-not-string"),
    pytest.param(
        f'{{"weight_map": {{"a": "{S1}", "a": "{S1}", "b": "{S1}", "c": "{S2}"}}}}', id="duplicate-key"
    ),
    pytest.param({"a": "sub/" + S1, "b": S1, "c": S2}, id="shard-with-slash"),
    pytest.param({"a": "sub\\" + S1, "b": S1, "c": S2}, id="shard-with-backslash"),
    pytest.param({"a": "../" + S1, "b": S1, "c": S2}, id="shard-dotdot-path"),
    pytest.param({"a": "..", "b": S1, "c": S2}, id="shard-dotdot"),
    pytest.param({"a": ".", "b": S1, "c": S2}, id="shard-dot"),
    pytest.param({"a": "/etc/passwd", "b": S1, "c": S2}, id="shard-absolute"),
    pytest.param({"a": S1 + "\x00", "b": S1, "c": S2}, id="shard-nul"),
    pytest.param({"a": "", "b": S1, "c": S2}, id="shard-empty"),
    pytest.param({"a": "missing.safetensors", "b": S1, "c": S2}, id="shard-missing"),
    pytest.param({"a": S1, "c": S2}, id="tensor-not-in-weight-map"),
    pytest.param({"a": S1, "b": S2, "c": S2}, id="tensor-in-wrong-shard"),
    pytest.param({"a": S1, "b": S1, "c": S2, "ghost": S2}, id="tensor-held-by-no-shard"),
    pytest.param({"a": S1, "b": S1, "c": S2, "": S2}, id="bad-tensor-name"),
    pytest.param({"a": S1, "b": S1, "c": S2, "x\x00": S2}, id="nul-tensor-name"),
]


@pytest.mark.parametrize("weight_map", BAD_INDEX)
def test_bad_index(sharded: Path, weight_map: dict | str | bytes) -> None:
    write_index(sharded, weight_map)
    with pytest.raises(E.ShardIndexError) as info:
        resolve_checkpoint(sharded)
    assert one_line(info.value)
    assert "model.safetensors.index.json" in str(info.value)


def test_index_shard_is_directory(sharded: Path) -> None:
    (sharded / "dir.safetensors").mkdir()
    write_index(sharded, {"a": S1, "b": S1, "c": S2, "d": "dir.safetensors"})
    with pytest.raises(E.ShardIndexError, match="not a regular file"):
        resolve_checkpoint(sharded)


def test_tensor_in_two_shards(sharded: Path) -> None:
    (sharded / S2).unlink()
    write_st(sharded / S2, ["c", "a"])
    with pytest.raises(E.ShardIndexError, match="in both") as info:
        resolve_checkpoint(sharded)
    assert one_line(info.value)


def test_listed_shard_that_does_not_parse(sharded: Path) -> None:
    (sharded / S2).write_bytes(b"garbage!" * 4)
    with pytest.raises(E.SafetensorsFormatError, match=S2):
        resolve_checkpoint(sharded)


def test_shard_symlink_outside_root(sharded: Path, tmp_path: Path) -> None:
    outside = write_st(tmp_path / "outside.safetensors", ["c"])
    (sharded / S2).unlink()
    (sharded / S2).symlink_to(outside)
    with pytest.raises(E.ShardIndexError, match="outside") as info:
        resolve_checkpoint(sharded)
    assert isinstance(info.value, E.SymlinkEscapeError) and one_line(info.value)
    assert resolve_checkpoint(sharded, allow_symlinks_outside=True).tensor_file["c"] == 1


def test_single_file_symlink_outside_root(tmp_path: Path) -> None:
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snap").mkdir()
    blob = write_st(tmp_path / "blobs" / "abc", ["w"])
    (tmp_path / "snap" / "model.safetensors").symlink_to(blob)
    for target in (tmp_path / "snap", tmp_path / "snap" / "model.safetensors"):
        with pytest.raises(E.SymlinkEscapeError, match="outside"):
            resolve_checkpoint(target)
    assert resolve_checkpoint(tmp_path / "snap", allow_symlinks_outside=True).tensor_file == {"w": 0}


def test_side_file_symlink_outside_root(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    write_st(tmp_path / "ck" / "model.safetensors", ["w"])
    (tmp_path / "secret.json").write_text("{}")
    (tmp_path / "ck" / "config.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(E.SymlinkEscapeError):
        resolve_checkpoint(tmp_path / "ck")


def test_index_symlink_outside_root(sharded: Path, tmp_path: Path) -> None:
    idx = sharded / "model.safetensors.index.json"
    moved = tmp_path / "index.json"
    idx.rename(moved)
    idx.symlink_to(moved)
    with pytest.raises(E.SymlinkEscapeError):
        resolve_checkpoint(sharded)


# --- pickle refusal ----------------------------------------------------------------------------


class _Payload:
    """Unpickling this creates `marker` (via builtins.open): proof that something was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def _evil(path: Path, marker: Path) -> Path:
    path.write_bytes(pickle.dumps({"state_dict": _Payload(marker)}))
    return path


def test_payload_really_has_a_side_effect(tmp_path: Path) -> None:
    marker = tmp_path / "control-marker"
    pickle.loads(_evil(tmp_path / "control.bin", marker).read_bytes()).get("state_dict").close()
    assert marker.exists()


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".ckpt", ".pkl", ".BIN"])
def test_pickle_file_refused_unopened(tmp_path: Path, suffix: str) -> None:
    marker = tmp_path / "marker"
    f = _evil(tmp_path / f"pytorch_model{suffix}", marker)
    with pytest.raises(E.PickleRefusedError) as info:
        resolve_checkpoint(f)
    assert one_line(info.value)
    assert not marker.exists()


def test_pickle_only_directory_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    ck = tmp_path / "ck"
    ck.mkdir()
    _evil(ck / "pytorch_model.bin", marker)
    (ck / "config.json").write_text("{}")
    with pytest.raises(E.PickleRefusedError) as info:
        resolve_checkpoint(ck)
    assert one_line(info.value)
    assert not marker.exists()


def test_pickle_disguised_as_safetensors_is_not_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    ck = tmp_path / "ck"
    ck.mkdir()
    _evil(ck / "model.safetensors", marker)
    with pytest.raises(E.SafetensorsFormatError):
        resolve_checkpoint(ck)
    assert not marker.exists()


def test_index_pointing_at_pickle_shard(sharded: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    _evil(sharded / "pytorch_model-00003.bin", marker)
    write_index(sharded, {"a": S1, "b": S1, "c": S2, "d": "pytorch_model-00003.bin"})
    with pytest.raises(E.PickleRefusedError):
        resolve_checkpoint(sharded)
    assert not marker.exists()


def test_safetensors_preferred_over_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    ck = tmp_path / "ck"
    ck.mkdir()
    _evil(ck / "pytorch_model.bin", marker)
    write_st(ck / "model.safetensors", ["w"])
    assert resolve_checkpoint(ck).tensor_file == {"w": 0}
    assert not marker.exists()
