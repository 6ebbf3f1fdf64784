"""Resolve a Hugging Face style checkpoint (file or directory) into validated safetensors shards.

Accepted: a single ``.safetensors`` file; a directory with ``model.safetensors``; a directory with
``model.safetensors.index.json`` plus its shards; a directory holding exactly one ``*.safetensors``.
Pickle weights (.bin/.pt/.pth/.ckpt/.pkl) are refused by name and never opened. Every file used must
be a regular file inside the checkpoint directory once symlinks are resolved.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergepipe_db.core.names import show_name, show_path, validate_tensor_name
from mergepipe_db.errors import (
    BadCheckpointError,
    BadTensorNameError,
    PickleRefusedError,
    ShardIndexError,
    ShardSymlinkEscapeError,
    SymlinkEscapeError,
)
from mergepipe_db.formats.safetensors import SafetensorsHeader, loads_strict, read_header
from mergepipe_db.io import as_path, is_remote, open_store

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: File suffixes of pickle-based weights; such files are refused and never opened.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})
#: Largest index/config JSON read, in bytes.
MAX_JSON_BYTES = 64 * 1024 * 1024

_SIDE_EXACT = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.json",
        "chat_template.jinja",
    }
)


@dataclass(frozen=True)
class CheckpointLayout:
    """A resolved checkpoint: validated shard headers and where each tensor lives.

    `files` are in a deterministic order (sorted file names); `tensor_file` maps every tensor name to an
    index into `files`; `side_files` are the config/tokenizer files next to the weights, sorted by name.
    """

    root: Path
    files: tuple[SafetensorsHeader, ...]
    tensor_file: dict[str, int]
    side_files: tuple[Path, ...]
    config: dict[str, Any] | None

    def header_for(self, name: str) -> SafetensorsHeader:
        """The header of the shard holding tensor `name` (KeyError if absent)."""
        return self.files[self.tensor_file[name]]


def is_side_file(name: str) -> bool:
    """True for config/tokenizer/vocabulary file names copied along with a checkpoint."""
    if name in _SIDE_EXACT:
        return True
    if name.startswith("tokenizer") and name.endswith(".json"):
        return True
    if name.endswith(".tiktoken"):
        return True
    stem = name.split(".", 1)[0]
    return stem in ("vocab", "merges")


def _is_pickle_name(name: str) -> bool:
    return Path(name).suffix.lower() in PICKLE_SUFFIXES


def _refuse_pickle(path: Path) -> PickleRefusedError:
    return PickleRefusedError(
        f"{show_path(path)}: pickle checkpoints are refused (never unpickled); convert to safetensors first"
    )


def _check_inside(path: Path, root_real: Path, *, allow_outside: bool) -> Path:
    """Resolve `path`, require a regular file inside `root_real` (unless allowed); return the real path."""
    try:
        real = path.resolve(strict=True)
        st = os.stat(real)
    except FileNotFoundError:
        raise BadCheckpointError(f"{show_path(path)}: no such file or directory") from None
    except (OSError, RuntimeError) as e:  # RuntimeError: symlink loop on older Pythons
        raise BadCheckpointError(f"{show_path(path)}: cannot resolve: {e}") from None
    if not allow_outside and real != root_real and not real.is_relative_to(root_real):
        raise SymlinkEscapeError(
            f"{show_path(path)}: symlink resolves to {show_path(real)}, outside {show_path(root_real)}"
        )
    if not stat.S_ISREG(st.st_mode):
        raise BadCheckpointError(f"{show_path(path)}: not a regular file")
    return real


def _read_json(path: Path, error: type[BadCheckpointError], what: str) -> Any:
    where = show_path(path)
    try:
        raw = open_store(path).read_small(path, MAX_JSON_BYTES + 1)
    except OSError as e:
        raise error(f"{where}: cannot read {what}: {e.strerror}") from None
    if len(raw) > MAX_JSON_BYTES:
        raise error(f"{where}: {what} is larger than {MAX_JSON_BYTES} bytes")
    try:
        return loads_strict(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise error(f"{where}: {what} is not valid UTF-8") from None
    except ValueError as e:
        raise error(f"{where}: {what} is not valid JSON: {e}") from None


def _validate_shard_name(index: Path, name: object) -> str:
    where = show_path(index)
    if not isinstance(name, str):
        raise ShardIndexError(f"{where}: weight_map value {name!r} is not a string")
    bad = (
        not name
        or "/" in name
        or "\\" in name
        or ".." in name
        or name == "."
        or "\x00" in name
        or os.path.isabs(name)
        or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name)
    )
    if bad:
        raise ShardIndexError(
            f"{where}: shard file name {show_name(name)} is not a plain name inside the directory"
        )
    return name


def _load_index(index: Path) -> dict[str, str]:
    where = show_path(index)
    doc = _read_json(index, ShardIndexError, "shard index")
    if not isinstance(doc, dict):
        raise ShardIndexError(f"{where}: shard index is not a JSON object")
    wm = doc.get("weight_map")
    if not isinstance(wm, dict):
        raise ShardIndexError(f"{where}: shard index has no weight_map object")
    if not wm:
        raise ShardIndexError(f"{where}: weight_map is empty")
    for tensor, shard in wm.items():
        try:
            validate_tensor_name(tensor)
        except BadTensorNameError as e:
            raise ShardIndexError(f"{where}: weight_map: {e}") from None
        _validate_shard_name(index, shard)
    return wm


def _side_files(root: Path, root_real: Path, *, allow_outside: bool) -> tuple[Path, ...]:
    out = []
    try:
        names = sorted(os.listdir(root))
    except OSError as e:
        raise BadCheckpointError(f"{show_path(root)}: cannot list directory: {e.strerror}") from None
    for name in names:
        if not is_side_file(name):
            continue
        p = root / name
        try:
            st = os.stat(p)
        except OSError:
            continue  # a dangling symlink is not a side file
        if not stat.S_ISREG(st.st_mode):
            continue
        _check_inside(p, root_real, allow_outside=allow_outside)
        out.append(p)
    return tuple(out)


def _load_config(side: tuple[Path, ...]) -> dict[str, Any] | None:
    for p in side:
        if p.name == "config.json":
            doc = _read_json(p, BadCheckpointError, "config.json")
            if not isinstance(doc, dict):
                raise BadCheckpointError(f"{show_path(p)}: config.json is not a JSON object")
            return doc
    return None


def _layout(
    root: Path, root_real: Path, files: list[SafetensorsHeader], tensor_file: dict[str, int], allow: bool
) -> CheckpointLayout:
    side = _side_files(root, root_real, allow_outside=allow)
    return CheckpointLayout(
        root=root, files=tuple(files), tensor_file=tensor_file, side_files=side, config=_load_config(side)
    )


def _single(path: Path, root: Path, root_real: Path, allow: bool) -> CheckpointLayout:
    _check_inside(path, root_real, allow_outside=allow)
    header = read_header(path)
    return _layout(root, root_real, [header], dict.fromkeys(header.by_name(), 0), allow)


def _sharded(root: Path, root_real: Path, index: Path, allow: bool, names: set[str] | None = None
             ) -> CheckpointLayout:
    if names is None:
        _check_inside(index, root_real, allow_outside=allow)
    wm = _load_index(index)
    where = show_path(index)
    headers: list[SafetensorsHeader] = []
    tensor_file: dict[str, int] = {}
    for i, shard in enumerate(sorted(set(wm.values()))):
        p = root / shard
        if _is_pickle_name(shard):
            raise _refuse_pickle(p)
        if (shard not in names) if names is not None else not os.path.lexists(p):
            raise ShardIndexError(f"{where}: shard {show_name(shard)} listed in weight_map does not exist")
        try:
            if names is None:
                _check_inside(p, root_real, allow_outside=allow)
        except SymlinkEscapeError as e:
            raise ShardSymlinkEscapeError(f"{where}: shard {show_name(shard)}: {e}") from None
        except BadCheckpointError as e:
            raise ShardIndexError(f"{where}: shard {show_name(shard)}: {e}") from None
        header = read_header(p)
        for t in header.tensors:
            mapped = wm.get(t.name)
            if mapped is None:
                raise ShardIndexError(
                    f"{where}: tensor {show_name(t.name)} in shard {show_name(shard)} "
                    "is missing from weight_map"
                )
            if t.name in tensor_file:
                other = headers[tensor_file[t.name]].path.name
                raise ShardIndexError(
                    f"{where}: tensor {show_name(t.name)} is in both "
                    f"{show_name(other)} and {show_name(shard)}"
                )
            if mapped != shard:
                raise ShardIndexError(
                    f"{where}: weight_map puts tensor {show_name(t.name)} in {show_name(mapped)} "
                    f"but it is in {show_name(shard)}"
                )
            tensor_file[t.name] = i
        headers.append(header)
    for tensor, shard in wm.items():
        if tensor not in tensor_file:
            raise ShardIndexError(
                f"{where}: weight_map puts tensor {show_name(tensor)} in {show_name(shard)} "
                "but no shard holds it"
            )
    if names is not None:
        return _remote_layout(root, names, headers, tensor_file)
    return _layout(root, root_real, headers, tensor_file, allow)


def _remote_layout(root: Any, names: set[str], files: list[SafetensorsHeader], tensor_file: dict[str, int]
                   ) -> CheckpointLayout:
    side = tuple(root / n for n in sorted(names) if is_side_file(n))
    return CheckpointLayout(root=root, files=tuple(files), tensor_file=tensor_file, side_files=side,
                            config=_load_config(side))


def _resolve_remote(path: str | Path) -> CheckpointLayout:
    """`resolve_checkpoint` of an object-store location: one ``.safetensors`` object, or a prefix holding the
    same layouts as a directory (objects directly under it; nothing deeper is looked at)."""
    p = as_path(path)  # StorageConfigError for a malformed URI
    store = open_store(p)
    if _is_pickle_name(p.name):
        raise _refuse_pickle(p)

    def listing(prefix: Any) -> set[str]:
        base = str(prefix).rstrip("/") + "/"
        return {o["path"][len(base):] for o in store.list(prefix) if "/" not in o["path"][len(base):]}

    if p.suffix.lower() == ".safetensors" and store.exists(p):
        root = p.parent
        header = read_header(p)
        return _remote_layout(root, listing(root), [header], dict.fromkeys(header.by_name(), 0))
    names = listing(p) if p.key else set()
    if not names:
        if p.key and store.exists(p):
            raise BadCheckpointError(f"{show_path(p)}: not a .safetensors object or checkpoint prefix")
        raise BadCheckpointError(f"{show_path(p)}: no such object or prefix")
    if SINGLE_FILE in names:
        header = read_header(p / SINGLE_FILE)
        return _remote_layout(p, names, [header], dict.fromkeys(header.by_name(), 0))
    if INDEX_FILE in names:
        return _sharded(p, p, p / INDEX_FILE, False, names)
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    if len(weights) == 1:
        header = read_header(p / weights[0])
        return _remote_layout(p, names, [header], dict.fromkeys(header.by_name(), 0))
    if len(weights) > 1:
        raise BadCheckpointError(
            f"{show_path(p)}: {len(weights)} .safetensors objects but no {SINGLE_FILE} or {INDEX_FILE}; "
            f"add a {INDEX_FILE} that maps tensors to shards")
    if any(_is_pickle_name(n) or n == "pytorch_model.bin.index.json" for n in names):
        raise _refuse_pickle(p)
    raise BadCheckpointError(f"{show_path(p)}: no {SINGLE_FILE}, {INDEX_FILE} or .safetensors object found")


def resolve_checkpoint(path: str | Path, *, allow_symlinks_outside: bool = False) -> CheckpointLayout:
    """Resolve and validate the checkpoint at `path` (a .safetensors file or a checkpoint directory).

    Reads only headers, the index and config.json, never tensor data. Raises `PickleRefusedError` for
    pickle weights, `ShardIndexError` for a bad index, `SymlinkEscapeError` for a file that resolves
    outside the directory (unless `allow_symlinks_outside`, e.g. for a Hugging Face cache snapshot whose
    files link into ``../../blobs``), `SafetensorsFormatError` for a bad file, `BadCheckpointError` else.
    """
    if is_remote(path):
        return _resolve_remote(path)
    p = Path(path).absolute()
    allow = allow_symlinks_outside
    if _is_pickle_name(p.name):
        raise _refuse_pickle(p)
    if not os.path.exists(p):
        raise BadCheckpointError(f"{show_path(p)}: no such file or directory")
    if not p.is_dir():
        if p.suffix.lower() != ".safetensors":
            raise BadCheckpointError(f"{show_path(p)}: not a .safetensors file or checkpoint directory")
        root = p.parent
        return _single(p, root, root.resolve(), allow)
    root, root_real = p, p.resolve()
    if os.path.lexists(root / SINGLE_FILE):
        return _single(root / SINGLE_FILE, root, root_real, allow)
    if os.path.lexists(root / INDEX_FILE):
        return _sharded(root, root_real, root / INDEX_FILE, allow)
    try:
        names = sorted(os.listdir(root))
    except OSError as e:
        raise BadCheckpointError(f"{show_path(root)}: cannot list directory: {e.strerror}") from None
    weights = [n for n in names if n.endswith(".safetensors")]
    if len(weights) == 1:
        return _single(root / weights[0], root, root_real, allow)
    if len(weights) > 1:
        raise BadCheckpointError(
            f"{show_path(root)}: {len(weights)} .safetensors files but no {SINGLE_FILE} or {INDEX_FILE}; "
            f"add a {INDEX_FILE} that maps tensors to shards"
        )
    if any(_is_pickle_name(n) or n == "pytorch_model.bin.index.json" for n in names):
        raise _refuse_pickle(root)
    raise BadCheckpointError(f"{show_path(root)}: no {SINGLE_FILE}, {INDEX_FILE} or .safetensors file found")


__all__ = [
    "CheckpointLayout",
    "INDEX_FILE",
    "PICKLE_SUFFIXES",
    "SINGLE_FILE",
    "is_side_file",
    "resolve_checkpoint",
]
