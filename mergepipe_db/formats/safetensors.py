"""A strict safetensors header parser and a streaming writer, independent of the `safetensors` package.

File layout: 8-byte little-endian unsigned header length N, then N bytes of UTF-8 JSON (optionally padded
with trailing spaces), then the data section. Tensor offsets in the JSON are relative to the data
section, so a tensor's absolute file offset is ``8 + N + begin``. A file is accepted only when the
tensors tile the data section exactly: contiguous from 0, no gaps, no overlaps, no trailing bytes.
Every rejection is a `SafetensorsFormatError` subclass with a one-line message naming the file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from mergepipe_db.core.dtypes import DTYPE_BITS
from mergepipe_db.core.names import show_name, show_path, show_text, validate_tensor_name
from mergepipe_db.errors import (
    BadCheckpointError,
    BadTensorNameError,
    DuplicateKeyError,
    HeaderEncodingError,
    HeaderJsonError,
    HeaderLengthError,
    MetadataError,
    OffsetError,
    SafetensorsWriteError,
    SizeMismatchError,
    TensorEntryError,
    TrailingBytesError,
    TruncatedDataError,
    UnknownDtypeError,
)
from mergepipe_db.io import InputFile, OutputFile, as_path, open_store

#: Largest header (JSON) length accepted, in bytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024

_METADATA_KEY = "__metadata__"
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
_MEMORY = Path("<memory>")
_U64 = 2**64


# --- message helpers ---------------------------------------------------------------------------


# --- parsed form -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; `begin`/`end` are byte offsets relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes (``end - begin``)."""
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated safetensors header.

    Invariants: `tensors` is sorted by `begin` (then `end`, name) and tiles ``[0, file_size - data_start)``
    exactly; each tensor's byte count equals shape x dtype; names pass `validate_tensor_name`.
    """

    path: Path
    file_size: int
    header_len: int
    metadata: dict[str, str] | None
    tensors: tuple[TensorEntry, ...]

    @property
    def data_start(self) -> int:
        """Absolute file offset of the data section (bytes)."""
        return 8 + self.header_len

    @property
    def data_len(self) -> int:
        """Length of the data section in bytes."""
        return self.file_size - self.data_start

    def absolute_offset(self, t: TensorEntry) -> int:
        """Absolute file offset of tensor `t`'s first byte."""
        return self.data_start + t.begin

    def by_name(self) -> dict[str, TensorEntry]:
        """A new dict of tensor name -> entry."""
        return {t.name: t for t in self.tensors}


# --- validation --------------------------------------------------------------------------------


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _pairs_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class _BadConstant(Exception):
    def __init__(self, text: str) -> None:
        self.text = text


def _reject_constant(text: str) -> Any:
    raise _BadConstant(text)


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs_no_duplicates, parse_constant=_reject_constant)


def loads_strict(text: str) -> Any:
    """Parse one JSON value, refusing duplicate keys and NaN/Infinity; surrounding whitespace allowed.

    Raises `ValueError` (with a one-line reason) on any problem; callers wrap it in their own error.
    """
    try:
        return _DECODER.decode(text)
    except _DuplicateKey as e:
        raise ValueError(f"duplicate key {show_name(e.key)}") from None
    except _BadConstant as e:
        raise ValueError(f"non-standard constant {e.text}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, int digit limits
        raise ValueError(show_text(str(e).splitlines()[0] if str(e) else type(e).__name__)) from None


def _is_uint(x: object) -> bool:
    return type(x) is int and 0 <= x < _U64


def _parse_json(where: str, raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderEncodingError(f"{where}: header is not valid UTF-8 (byte offset {8 + e.start})") from None
    if not text.startswith("{"):
        raise HeaderJsonError(f"{where}: header does not start with '{{'")
    body = text.rstrip(" ")
    try:
        obj, end = _DECODER.raw_decode(body)
    except _DuplicateKey as e:
        raise DuplicateKeyError(f"{where}: header repeats key {show_name(e.key)}") from None
    except _BadConstant as e:
        raise HeaderJsonError(f"{where}: header JSON holds non-standard constant {e.text}") from None
    except RecursionError:
        raise HeaderJsonError(f"{where}: header JSON is nested too deeply") from None
    except ValueError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HeaderJsonError(f"{where}: header is not valid JSON: {show_text(first)}") from None
    if end != len(body):
        raise HeaderJsonError(f"{where}: header has bytes after the JSON object other than space padding")
    if not isinstance(obj, dict):
        raise HeaderJsonError(f"{where}: header JSON is not an object")
    return obj


def _parse_metadata(where: str, value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise MetadataError(f"{where}: __metadata__ is {type(value).__name__}, not an object of strings")
    for k, v in value.items():
        if not isinstance(v, str):
            raise MetadataError(
                f"{where}: __metadata__ value for {show_name(k)} is {type(v).__name__}, not a string"
            )
        for s in (k, v):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise MetadataError(f"{where}: __metadata__ holds text that is not valid Unicode") from None
    return dict(value)


def _parse_entry(where: str, name: str, value: object) -> TensorEntry:
    label = f"{where}: tensor {show_name(name)}"
    if not isinstance(value, dict):
        raise TensorEntryError(f"{label}: entry is {type(value).__name__}, not an object")
    keys = set(value)
    if keys != _ENTRY_FIELDS:
        missing = sorted(_ENTRY_FIELDS - keys)
        extra = sorted(keys - _ENTRY_FIELDS)
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unexpected {', '.join(show_name(k) for k in extra[:5])}"] if extra else []
        )
        raise TensorEntryError(
            f"{label}: entry fields must be exactly dtype, shape, data_offsets ({'; '.join(parts)})"
        )
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str):
        raise TensorEntryError(f"{label}: dtype is {type(dtype).__name__}, not a string")
    if dtype not in DTYPE_BITS:
        raise UnknownDtypeError(f"{label}: unknown dtype {show_name(dtype)}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise TensorEntryError(f"{label}: shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise TensorEntryError(f"{label}: data_offsets must be a list of two non-negative integers")
    begin, end = offsets
    if begin > end:
        raise OffsetError(f"{label}: data_offsets begin {begin} > end {end}")
    n = 0 if 0 in shape else 1
    if n:
        for d in shape:
            n *= d
            if n >= _U64:
                raise SizeMismatchError(f"{label}: shape {show_text(str(shape), 80)} has 2**64 or more elements")
    bits = n * DTYPE_BITS[dtype]
    if bits % 8:
        raise SizeMismatchError(f"{label}: {n} {dtype} elements are not a whole number of bytes")
    if end - begin != bits // 8:
        raise SizeMismatchError(
            f"{label}: data_offsets span {end - begin} bytes but {dtype} shape {show_text(str(shape), 80)} "
            f"needs {bits // 8}"
        )
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_length(where: str, n: int, file_size: int) -> None:
    if n == 0:
        raise HeaderLengthError(f"{where}: header length is 0")
    if n >= 2**63:
        raise HeaderLengthError(f"{where}: header length {n} overflows (>= 2**63)")
    if n > MAX_HEADER_BYTES:
        raise HeaderLengthError(f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > file_size:
        raise HeaderLengthError(f"{where}: header length {n} runs past the end of the {file_size}-byte file")


def _parse_body(raw: bytes, header_len: int, file_size: int, path: Path) -> SafetensorsHeader:
    where = show_path(path)
    obj = _parse_json(where, raw)
    metadata: dict[str, str] | None = None
    entries: list[TensorEntry] = []
    for key, value in obj.items():
        if key == _METADATA_KEY:
            metadata = _parse_metadata(where, value)
            continue
        try:
            validate_tensor_name(key)
        except BadTensorNameError as e:
            raise BadTensorNameError(f"{where}: {e}") from None
        entries.append(_parse_entry(where, key, value))
    entries.sort(key=lambda t: (t.begin, t.end, t.name))
    cursor = 0
    for t in entries:
        if t.begin > cursor:
            raise OffsetError(
                f"{where}: gap of {t.begin - cursor} bytes before tensor {show_name(t.name)} "
                f"at offset {t.begin}"
            )
        if t.begin < cursor:
            raise OffsetError(
                f"{where}: tensor {show_name(t.name)} at offset {t.begin} overlaps "
                f"the previous tensor (ends {cursor})"
            )
        cursor = t.end
    data_start = 8 + header_len
    if data_start + cursor < file_size:
        raise TrailingBytesError(
            f"{where}: {file_size - data_start - cursor} bytes after the last tensor's data "
            f"(file {file_size} bytes)"
        )
    if data_start + cursor > file_size:
        raise TruncatedDataError(
            f"{where}: file is {file_size} bytes but its tensors need {data_start + cursor} (truncated)"
        )
    return SafetensorsHeader(
        path=path, file_size=file_size, header_len=header_len, metadata=metadata, tensors=tuple(entries)
    )


def parse_header(buf: bytes, file_size: int, *, path: Path | None = None) -> SafetensorsHeader:
    """Validate a safetensors header held in `buf` (at least the file's first ``8 + N`` bytes).

    `file_size` is the whole file's size in bytes (the data section is checked against it, not against
    `buf`). Raises a `SafetensorsFormatError` subclass naming `path` (or ``<memory>``) on any violation.
    """
    p = _MEMORY if path is None else as_path(path)
    where = show_path(p)
    if file_size < 8:
        raise HeaderLengthError(f"{where}: file is {file_size} bytes, shorter than the 8-byte length prefix")
    view = memoryview(buf)
    if len(view) < 8:
        raise HeaderLengthError(
            f"{where}: buffer holds {len(view)} bytes, fewer than the 8-byte length prefix"
        )
    n = int.from_bytes(view[:8], "little")
    _check_length(where, n, file_size)
    if len(view) < 8 + n:
        raise HeaderLengthError(
            f"{where}: buffer holds {len(view)} bytes, fewer than the {8 + n}-byte header"
        )
    return _parse_body(bytes(view[8 : 8 + n]), n, file_size, p)


def _read_exact(f: InputFile, n: int, offset: int, where: str) -> bytes:
    data = f.read(offset, n)
    if len(data) < n:
        raise TruncatedDataError(f"{where}: file ended at byte {offset + len(data)} while reading its header")
    return data


def read_header(path: str | Path) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at `path`.

    Reads 8 bytes, then exactly N header bytes (through its byte store, `io.open_store`); never touches the
    data section. Raises `BadCheckpointError` if the path is missing or not a regular file, else as
    `parse_header`.
    """
    p = as_path(path)
    where = show_path(p)
    try:
        f = open_store(p).open_input(p)
    except FileNotFoundError:
        raise BadCheckpointError(f"{where}: no such file or directory") from None
    except OSError as e:
        raise BadCheckpointError(f"{where}: cannot open: {e.strerror}") from None
    try:
        if not f.regular:
            raise BadCheckpointError(f"{where}: not a regular file")
        size = f.size
        if size < 8:
            raise HeaderLengthError(f"{where}: file is {size} bytes, shorter than the 8-byte length prefix")
        n = int.from_bytes(_read_exact(f, 8, 0, where), "little")
        _check_length(where, n, size)
        raw = _read_exact(f, n, 8, where)
    except OSError as e:
        raise BadCheckpointError(f"{where}: cannot read: {e.strerror}") from None
    finally:
        f.close()
    return _parse_body(raw, n, size, p)


# --- writer ------------------------------------------------------------------------------------


def build_header(
    entries: Sequence[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None
) -> tuple[bytes, list[tuple[int, int]]]:
    """Build a file prefix for `entries` (name, dtype, shape), data laid out in the given order.

    Returns the full prefix (8-byte little-endian length + compact JSON padded with spaces so the data
    section starts at a multiple of 8) and the (begin, end) data-section offsets of each entry.
    Raises a `SafetensorsFormatError` subclass for a bad name, dtype, shape, metadata or duplicate name.
    """
    doc: dict[str, Any] = {}
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
            raise MetadataError("metadata must be a dict with string keys")
        _parse_metadata("metadata", metadata)
        doc[_METADATA_KEY] = dict(metadata)
    offsets: list[tuple[int, int]] = []
    cursor = 0
    for name, dtype, shape in entries:
        validate_tensor_name(name)
        if name == _METADATA_KEY or name in doc:
            raise DuplicateKeyError(f"tensor name {show_name(name)} is reserved or repeated")
        if dtype not in DTYPE_BITS:
            raise UnknownDtypeError(f"tensor {show_name(name)}: unknown dtype {dtype!r}")
        shape = tuple(shape)
        if not all(_is_uint(d) for d in shape):
            raise TensorEntryError(
                f"tensor {show_name(name)}: shape {shape!r} must hold non-negative integers"
            )
        n = 1
        for d in shape:
            n *= d
        bits = n * DTYPE_BITS[dtype]
        if bits % 8:
            raise SizeMismatchError(
                f"tensor {show_name(name)}: {n} {dtype} elements are not a whole number of bytes"
            )
        begin, cursor = cursor, cursor + bits // 8
        offsets.append((begin, cursor))
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, cursor]}
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body, offsets


class SafetensorsWriter:
    """Streams one file: header first, then each tensor's bytes in entry order; sha256 of the whole file
    computed while writing. The bytes go through the file's byte store (`io.open_store(path).writer`: with
    `direct`, O_DIRECT where the file system allows it); this class does the format.

    Use as a context manager; on an exception the file is let go and the partial file left in place (the
    caller's staging directory removes it).
    """

    def __init__(
        self,
        path: Path,
        entries: Sequence[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        *,
        exclusive: bool = True,
        direct: bool = False,
    ) -> None:
        self.path = as_path(path)
        self._entries = list(entries)
        prefix, self._offsets = build_header(self._entries, metadata)
        self._hash = hashlib.sha256()
        self._next = 0
        self._filled = 0  # bytes of entry `_next` written so far by write_part
        self._digest: str | None = None
        self.bytes_written = 0
        try:  # the file's bytes go through its byte store; with `direct` its helper hashes what it writes
            self._out: OutputFile | None = open_store(self.path).writer(
                self.path, exclusive=exclusive, direct=direct, hasher=self._hash)
        except FileExistsError:
            raise SafetensorsWriteError(f"{show_path(self.path)}: already exists") from None
        try:
            self._write_all(memoryview(prefix))
        except BaseException:
            self._abort()
            raise

    @property
    def direct(self) -> bool:
        """Whether the file is being written with O_DIRECT (asked for with `direct` and allowed)."""
        return self._out is not None and self._out.direct

    @property
    def sha256(self) -> str | None:
        """Hex sha256 of the file once closed successfully, else None."""
        return self._digest

    def _write_all(self, mv: memoryview) -> None:
        assert self._out is not None
        self._out.write(mv)
        self.bytes_written += len(mv)

    def _bytes_for(self, name: str, data: memoryview | bytes) -> memoryview:
        """Check that `name` is the tensor due next; return `data` as a flat byte view."""
        where = show_path(self.path)
        if self._out is None:
            raise SafetensorsWriteError(f"{where}: write after close")
        if self._next >= len(self._entries):
            raise SafetensorsWriteError(f"{where}: write of {show_name(name)} after all tensors were written")
        expected = self._entries[self._next][0]
        if name != expected:
            raise SafetensorsWriteError(
                f"{where}: got tensor {show_name(name)}, expected {show_name(expected)}"
            )
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise SafetensorsWriteError(f"{where}: data for {show_name(name)} is not C-contiguous")
        if mv.ndim != 1 or mv.format != "B":
            try:
                mv = mv.cast("B")
            except TypeError:  # a non-native format (e.g. '<e'): copy once
                mv = memoryview(mv.tobytes())
        return mv

    def write(self, name: str, data: memoryview | bytes) -> None:
        """Write all of tensor `name`'s bytes; it must be the next entry and `data` exactly its size."""
        mv = self._bytes_for(name, data)
        begin, end = self._offsets[self._next]
        if self._filled or mv.nbytes != end - begin:
            raise SafetensorsWriteError(
                f"{show_path(self.path)}: tensor {show_name(name)} needs {end - begin - self._filled} "
                f"more bytes, got {mv.nbytes}"
            )
        self._write_all(mv)
        self._next += 1

    def write_part(self, name: str, data: memoryview | bytes) -> None:
        """Append `data` to tensor `name` (the next entry); it is done once it holds exactly its size.

        For streaming a tensor in blocks; raises `SafetensorsWriteError` if `data` would overrun it.
        """
        mv = self._bytes_for(name, data)
        begin, end = self._offsets[self._next]
        if self._filled + mv.nbytes > end - begin:
            raise SafetensorsWriteError(
                f"{show_path(self.path)}: tensor {show_name(name)} needs {end - begin - self._filled} "
                f"more bytes, got {mv.nbytes}"
            )
        self._write_all(mv)
        self._filled += mv.nbytes
        if self._filled == end - begin:
            self._next += 1
            self._filled = 0

    def close(self, *, fsync: bool = True) -> str:
        """Finish the file (fsync unless told not to) and return its hex sha256.

        Raises `SafetensorsWriteError` (after closing the descriptor) if some tensor was not written.
        """
        if self._digest is not None:
            return self._digest
        where = show_path(self.path)
        if self._out is None:
            raise SafetensorsWriteError(f"{where}: writer was aborted")
        if self._next != len(self._entries):
            missing = self._entries[self._next][0]
            self._abort()
            raise SafetensorsWriteError(
                f"{where}: closed with {len(self._entries) - self._next} tensors unwritten "
                f"(next {show_name(missing)})"
            )
        out, self._out = self._out, None
        out.finish(fsync=fsync)
        self._digest = self._hash.hexdigest()
        return self._digest

    def _abort(self) -> None:
        if self._out is not None:
            out, self._out = self._out, None
            out.abort()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort()


__all__ = [
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "SafetensorsWriter",
    "TensorEntry",
    "build_header",
    "loads_strict",
    "parse_header",
    "read_header",
]
