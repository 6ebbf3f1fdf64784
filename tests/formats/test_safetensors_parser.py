"""The strict safetensors parser and writer: each rejection, names, round trips against `safetensors`."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mergepipe_db import errors as E
from mergepipe_db.core import dtypes, names
from mergepipe_db.core.names import validate_tensor_name
from mergepipe_db.formats.safetensors import (
    MAX_HEADER_BYTES,
    SafetensorsWriter,
    build_header,
    parse_header,
    read_header,
)


def raw(header: dict | str | bytes, data: bytes = b"", *, n: int | None = None) -> bytes:
    """A file image: 8-byte length (`n` overrides it), header bytes, data."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode("utf-8")
    length = len(header) if n is None else n
    return length.to_bytes(8, "little") + header + data


def t(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def one_line(e: BaseException) -> bool:
    msg = str(e)
    return bool(msg) and len(msg.splitlines()) == 1 and "\n" not in msg


def check_rejected(tmp_path: Path, blob: bytes, cls: type[Exception]) -> Exception:
    """`blob` must be refused with exactly `cls` by both read_header and parse_header."""
    f = tmp_path / "bad.safetensors"
    f.write_bytes(blob)
    with pytest.raises(E.MergePipeError) as info:
        read_header(f)
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    assert one_line(info.value)
    assert "bad.safetensors" in str(info.value)
    with pytest.raises(E.MergePipeError) as info2:
        parse_header(blob, len(blob), path=f)
    assert type(info2.value) is cls
    assert one_line(info2.value)
    return info.value


F32x2 = t("F32", [2], 0, 8)
D8 = b"\x00" * 8

REJECTED = [
    # --- length prefix
    pytest.param(b"", E.HeaderLengthError, id="empty-file"),
    pytest.param(b"\x02\x00\x00", E.HeaderLengthError, id="shorter-than-8"),
    pytest.param(raw(b"", n=0), E.HeaderLengthError, id="header-len-zero"),
    pytest.param(raw(b"{}", n=100), E.HeaderLengthError, id="header-past-eof"),
    pytest.param(raw(b"{}", n=2**64 - 1), E.HeaderLengthError, id="header-len-overflow-u64max"),
    pytest.param(raw(b"{}", n=2**63), E.HeaderLengthError, id="header-len-overflow-2^63"),
    # --- encoding / JSON
    pytest.param(raw(b'{"a\xff":1}'), E.HeaderEncodingError, id="invalid-utf8"),
    pytest.param(raw(b'{"a":\xed\xa0\x80}'), E.HeaderEncodingError, id="utf8-encoded-surrogate"),
    pytest.param(raw(b'{"a":'), E.HeaderJsonError, id="truncated-json"),
    pytest.param(raw(b"{not json}"), E.HeaderJsonError, id="not-json"),
    pytest.param(raw(b"[]"), E.HeaderJsonError, id="json-array"),
    pytest.param(raw(b'"str"'), E.HeaderJsonError, id="json-string"),
    pytest.param(raw(b" {}"), E.HeaderJsonError, id="leading-space"),
    pytest.param(raw(b"{}x"), E.HeaderJsonError, id="garbage-after-json"),
    pytest.param(raw(b"{}\n"), E.HeaderJsonError, id="newline-padding"),
    pytest.param(raw(b"{}\x00\x00"), E.HeaderJsonError, id="nul-padding"),
    pytest.param(raw(b"{}{}"), E.HeaderJsonError, id="two-objects"),
    pytest.param(raw(b'{"__metadata__":{"a":NaN}}'), E.HeaderJsonError, id="nan-constant"),
    pytest.param(
        raw(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), E.HeaderJsonError, id="deep-nesting"
    ),
    # --- duplicate keys
    pytest.param(
        raw('{"a":' + json.dumps(F32x2) + ',"a":' + json.dumps(F32x2) + "}", D8),
        E.DuplicateKeyError,
        id="duplicate-tensor",
    ),
    pytest.param(
        raw('{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', D8),
        E.DuplicateKeyError,
        id="duplicate-entry-field",
    ),
    pytest.param(raw('{"__metadata__":{"k":"1","k":"2"}}'), E.DuplicateKeyError, id="duplicate-metadata-key"),
    pytest.param(raw('{"__metadata__":{},"__metadata__":{}}'), E.DuplicateKeyError, id="duplicate-metadata"),
    # --- __metadata__
    pytest.param(raw({"__metadata__": None}), E.MetadataError, id="metadata-null"),
    pytest.param(raw({"__metadata__": ["a"]}), E.MetadataError, id="metadata-list"),
    pytest.param(raw({"__metadata__": "a"}), E.MetadataError, id="metadata-string"),
    pytest.param(raw({"__metadata__": {"a": 1}}), E.MetadataError, id="metadata-int-value"),
    pytest.param(raw({"__metadata__": {"a": {"b": "c"}}}), E.MetadataError, id="metadata-nested"),
    pytest.param(raw({"__metadata__": {"a": None}}), E.MetadataError, id="metadata-null-value"),
    pytest.param(raw('{"__metadata__":{"a":"\\ud800"}}'), E.MetadataError, id="metadata-lone-surrogate"),
    # --- entry structure
    pytest.param(raw({"a": [1, 2]}), E.TensorEntryError, id="entry-list"),
    pytest.param(raw({"a": "F32"}), E.TensorEntryError, id="entry-string"),
    pytest.param(raw({"a": None}), E.TensorEntryError, id="entry-null"),
    pytest.param(
        raw({"a": {"shape": [2], "data_offsets": [0, 8]}}, D8), E.TensorEntryError, id="missing-dtype"
    ),
    pytest.param(
        raw({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, D8), E.TensorEntryError, id="missing-shape"
    ),
    pytest.param(raw({"a": {"dtype": "F32", "shape": [2]}}, D8), E.TensorEntryError, id="missing-offsets"),
    pytest.param(raw({"a": {**F32x2, "extra": 1}}, D8), E.TensorEntryError, id="extra-field"),
    pytest.param(raw({"a": {}}), E.TensorEntryError, id="empty-entry"),
    pytest.param(raw({"a": {**F32x2, "dtype": 32}}, D8), E.TensorEntryError, id="dtype-not-string"),
    pytest.param(raw({"a": {**F32x2, "dtype": None}}, D8), E.TensorEntryError, id="dtype-null"),
    pytest.param(raw({"a": {**F32x2, "shape": 2}}, D8), E.TensorEntryError, id="shape-not-list"),
    pytest.param(raw({"a": {**F32x2, "shape": [-2]}}, D8), E.TensorEntryError, id="shape-negative"),
    pytest.param(raw({"a": {**F32x2, "shape": [2.0]}}, D8), E.TensorEntryError, id="shape-float"),
    pytest.param(raw({"a": {**F32x2, "shape": [True, 2]}}, D8), E.TensorEntryError, id="shape-bool"),
    pytest.param(raw({"a": {**F32x2, "shape": ["2"]}}, D8), E.TensorEntryError, id="shape-string"),
    pytest.param(raw({"a": {**F32x2, "shape": [2**64]}}, D8), E.TensorEntryError, id="shape-dim-over-u64"),
    pytest.param(raw({"a": {**F32x2, "shape": [[2]]}}, D8), E.TensorEntryError, id="shape-nested"),
    pytest.param(raw({"a": {**F32x2, "data_offsets": "0,8"}}, D8), E.TensorEntryError, id="offsets-not-list"),
    pytest.param(raw({"a": {**F32x2, "data_offsets": [8]}}, D8), E.TensorEntryError, id="offsets-one"),
    pytest.param(
        raw({"a": {**F32x2, "data_offsets": [0, 8, 8]}}, D8), E.TensorEntryError, id="offsets-three"
    ),
    pytest.param(
        raw({"a": {**F32x2, "data_offsets": [-1, 8]}}, D8), E.TensorEntryError, id="offsets-negative"
    ),
    pytest.param(raw({"a": {**F32x2, "data_offsets": [0.0, 8]}}, D8), E.TensorEntryError, id="offsets-float"),
    pytest.param(
        raw({"a": {**F32x2, "data_offsets": [False, 8]}}, D8), E.TensorEntryError, id="offsets-bool"
    ),
    # --- dtype
    pytest.param(raw({"a": {**F32x2, "dtype": "F128"}}, D8), E.UnknownDtypeError, id="dtype-unknown"),
    pytest.param(raw({"a": {**F32x2, "dtype": "f32"}}, D8), E.UnknownDtypeError, id="dtype-lowercase"),
    pytest.param(raw({"a": {**F32x2, "dtype": ""}}, D8), E.UnknownDtypeError, id="dtype-empty"),
    # --- offsets and sizes
    pytest.param(raw({"a": t("F32", [0], 8, 0)}, D8), E.OffsetError, id="begin-after-end"),
    pytest.param(raw({"a": t("F32", [2], 0, 4)}, D8[:4]), E.SizeMismatchError, id="size-smaller-than-shape"),
    pytest.param(raw({"a": t("F32", [1], 0, 8)}, D8), E.SizeMismatchError, id="size-larger-than-shape"),
    pytest.param(
        raw({"a": t("F4", [3], 0, 2)}, b"\x00\x00"), E.SizeMismatchError, id="subbyte-not-whole-bytes"
    ),
    pytest.param(raw({"a": t("F6_E2M3", [1], 0, 1)}, b"\x00"), E.SizeMismatchError, id="f6-not-whole-bytes"),
    pytest.param(
        raw({"a": t("U8", [2**40, 2**40], 0, 8)}, D8), E.SizeMismatchError, id="shape-over-2^64-elements"
    ),
    pytest.param(raw({"a": t("F32", [1], 4, 8)}, D8), E.OffsetError, id="not-starting-at-zero"),
    pytest.param(
        raw({"a": t("F32", [1], 0, 4), "b": t("F32", [1], 8, 12)}, b"\x00" * 12), E.OffsetError, id="gap"
    ),
    pytest.param(raw({"a": t("F32", [2], 0, 8), "b": t("F32", [1], 4, 8)}, D8), E.OffsetError, id="overlap"),
    pytest.param(
        raw({"a": t("F32", [2], 0, 8), "b": t("F32", [2], 0, 8)}, D8), E.OffsetError, id="same-range"
    ),
    pytest.param(raw({"a": F32x2}, D8 + b"\x00"), E.TrailingBytesError, id="trailing-byte"),
    pytest.param(raw({}, b"\x00"), E.TrailingBytesError, id="trailing-byte-no-tensors"),
    pytest.param(raw({"a": F32x2}, D8[:7]), E.TruncatedDataError, id="missing-byte"),
    pytest.param(
        raw({"a": t("F32", [1 << 20], 0, 4 << 20)}, D8), E.TruncatedDataError, id="missing-many-bytes"
    ),
    # --- names
    pytest.param(raw({"": F32x2}, D8), E.BadTensorNameError, id="name-empty"),
    pytest.param(raw({"a\x00b": F32x2}, D8), E.BadTensorNameError, id="name-nul"),
    pytest.param(raw({"a\nb": F32x2}, D8), E.BadTensorNameError, id="name-newline"),
    pytest.param(raw({"a\x1fb": F32x2}, D8), E.BadTensorNameError, id="name-unit-separator"),
    pytest.param(raw({"a\x7fb": F32x2}, D8), E.BadTensorNameError, id="name-del"),
    pytest.param(raw({"a\x85b": F32x2}, D8), E.BadTensorNameError, id="name-c1-control"),
    pytest.param(raw({"x" * 1025: F32x2}, D8), E.BadTensorNameError, id="name-1025-bytes"),
    pytest.param(raw({"é" * 513: F32x2}, D8), E.BadTensorNameError, id="name-1026-utf8-bytes"),
    pytest.param(raw('{"\\ud800":' + json.dumps(F32x2) + "}", D8), E.BadTensorNameError, id="name-surrogate"),
]


@pytest.mark.parametrize(("blob", "cls"), REJECTED)
def test_rejects(tmp_path: Path, blob: bytes, cls: type[Exception]) -> None:
    err = check_rejected(tmp_path, blob, cls)
    assert isinstance(err, E.SafetensorsFormatError)


def test_header_over_cap_is_refused_without_reading(tmp_path: Path) -> None:
    f = tmp_path / "huge.safetensors"
    with open(f, "wb") as fh:
        fh.write((MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{")
        fh.truncate(MAX_HEADER_BYTES + 64)  # sparse: the header length fits inside the file
    with pytest.raises(E.HeaderLengthError, match="limit") as info:
        read_header(f)
    assert one_line(info.value)


def test_message_escapes_control_characters_in_path(tmp_path: Path) -> None:
    blob = raw({"a": F32x2}, D8 + b"\x00")
    with pytest.raises(E.TrailingBytesError) as info:
        parse_header(blob, len(blob), path=tmp_path / "line\nbreak\u2028.safetensors")
    assert one_line(info.value)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(E.BadCheckpointError, match="no such file") as info:
        read_header(tmp_path / "nope.safetensors")
    assert one_line(info.value)
    with pytest.raises(E.BadCheckpointError, match="not a regular file"):
        read_header(tmp_path)


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(E.BadCheckpointError, match="not a regular file"):
        read_header(fifo)


def test_parse_header_buffer_shorter_than_header() -> None:
    blob = raw({"a": F32x2}, D8)
    with pytest.raises(E.HeaderLengthError):
        parse_header(blob[:12], len(blob))


# --- accepted files ----------------------------------------------------------------------------


def test_zero_tensors() -> None:
    for blob in (raw(b"{}"), raw({"__metadata__": {}}), raw(b"{}      ")):
        h = parse_header(blob, len(blob))
        assert h.tensors == () and h.data_start == len(blob) and h.data_len == 0


def test_space_padding_accepted() -> None:
    blob = raw(json.dumps({"a": F32x2}) + " " * 37, D8)
    h = parse_header(blob, len(blob))
    assert h.header_len == len(blob) - 16
    assert h.absolute_offset(h.tensors[0]) == len(blob) - 8


def test_interior_json_whitespace_accepted() -> None:
    blob = raw('{ "a" : { "dtype" : "F32", "shape" : [ 2 ], "data_offsets" : [ 0 , 8 ] } }', D8)
    assert parse_header(blob, len(blob)).tensors[0].shape == (2,)


def test_zero_size_tensors_share_offsets() -> None:
    hdr = {"z1": t("F32", [0, 3], 0, 0), "a": t("F32", [2], 0, 8), "z2": t("BF16", [4, 0], 8, 8)}
    blob = raw(hdr, D8)
    h = parse_header(blob, len(blob))
    assert [x.name for x in h.tensors] == ["z1", "a", "z2"]
    assert h.by_name()["z2"].nbytes == 0


def test_tensors_sorted_by_offset_and_metadata_kept() -> None:
    hdr = {"b": t("U8", [3], 4, 7), "__metadata__": {"format": "pt", "k": ""}, "a": t("I32", [], 0, 4)}
    blob = raw(hdr, b"\x01" * 7)
    h = parse_header(blob, len(blob))
    assert [(x.name, x.begin, x.end, x.shape) for x in h.tensors] == [("a", 0, 4, ()), ("b", 4, 7, (3,))]
    assert h.metadata == {"format": "pt", "k": ""}


@pytest.mark.parametrize("dtype", sorted(dtypes.DTYPE_BITS))
def test_every_dtype_parses(dtype: str) -> None:
    bits = dtypes.DTYPE_BITS[dtype]
    n = 8 // bits if bits < 8 and 8 % bits == 0 else 4
    size = n * bits // 8
    blob = raw({"x": t(dtype, [n], 0, size)}, b"\x00" * size)
    assert parse_header(blob, len(blob)).tensors[0].nbytes == size


ACCEPTED_NAMES = [
    "model.layers.0.self_attn.q_proj.weight",
    "quote'd\"name",
    "semi;colon; DROP TABLE tensors;--",
    "a/b/../../etc/passwd",
    "..",
    "/absolute",
    "with space ",
    " ",
    "ünïcødé-名前-🙂",
    "back\\slash",
    "__metadata",
    "x" * 1024,
    "é" * 512,
    "\u2028line-sep-is-not-Cc",
]


@pytest.mark.parametrize("name", ACCEPTED_NAMES, ids=range(len(ACCEPTED_NAMES)))
def test_names_accepted_and_returned_exactly(tmp_path: Path, name: str) -> None:
    validate_tensor_name(name)
    f = tmp_path / "n.safetensors"
    with SafetensorsWriter(f, [(name, "F32", (2,)), ("other", "U8", (1,))]) as w:
        w.write(name, np.arange(2, dtype=np.float32).tobytes())
        w.write("other", b"\x07")
    h = read_header(f)
    assert h.tensors[0].name == name and set(h.by_name()) == {name, "other"}
    with safe_open(str(f), "pt") as g:
        assert set(g.keys()) == {name, "other"}


@pytest.mark.parametrize(
    "name",
    ["", "\x00", "a\x00", "\t", "a\rb", "\x1b[31m", "\x9f", "x" * 1025, "é" * 513, "\ud800"],
    ids=["empty", "nul", "trailing-nul", "tab", "cr", "escape", "c1", "1025-bytes", "1026-utf8", "surrogate"],
)
def test_names_rejected(name: str) -> None:
    with pytest.raises(E.BadTensorNameError) as info:
        validate_tensor_name(name)
    assert one_line(info.value)


def test_name_rejected_non_string() -> None:
    with pytest.raises(E.BadTensorNameError):
        validate_tensor_name(b"abc")  # type: ignore[arg-type]


# --- reads only the header ---------------------------------------------------------------------


def test_read_header_reads_only_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "big.safetensors"
    save_file({"w": torch.zeros(256, 1024)}, str(f))
    from mergepipe_db.io import local

    calls: list[tuple[int, int]] = []
    real = local.pread_into

    def spy(fd: int, buf: memoryview, off: int, need: int | None = None) -> int:
        calls.append((len(buf), off))
        return real(fd, buf, off, need)

    monkeypatch.setattr(local, "pread_into", spy)
    h = read_header(f)
    assert len(calls) == 2
    assert calls[0] == (8, 0) and calls[1] == (h.header_len, 8)
    assert h.file_size == f.stat().st_size and h.tensors[0].nbytes == 256 * 1024 * 4


# --- round trips against the safetensors package -----------------------------------------------


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 200, shape, generator=g).to(dtype)


ROUNDTRIP = [
    ("F32", torch.float32),
    ("BF16", torch.bfloat16),
    ("F16", torch.float16),
    ("I64", torch.int64),
    ("U8", torch.uint8),
    ("F8_E4M3", torch.float8_e4m3fn),
]


def _u8(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize(("name", "tdtype"), ROUNDTRIP, ids=[r[0] for r in ROUNDTRIP])
def test_writer_roundtrip_with_safe_open(tmp_path: Path, name: str, tdtype: torch.dtype) -> None:
    tensors = {
        "odd": _sample(torch.uint8, (3,), 0),  # misaligns what follows, on purpose
        "w": _sample(tdtype, (5, 7), 1),
        "empty": _sample(tdtype, (0, 4), 2),
        "scalar": _sample(tdtype, (), 3),
    }
    entries = [(k, dtypes.from_torch(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    assert entries[1][1] == name
    f = tmp_path / "out.safetensors"
    w = SafetensorsWriter(f, entries, {"format": "pt", "note": "ünï"})
    for k, v in tensors.items():
        w.write(k, _u8(v).numpy().tobytes())
    digest = w.close()
    assert digest == hashlib.sha256(f.read_bytes()).hexdigest()
    assert (8 + read_header(f).header_len) % 8 == 0
    with safe_open(str(f), "pt") as g:
        assert g.metadata() == {"format": "pt", "note": "ünï"}
        assert list(g.keys()) == sorted(tensors)
        for k, v in tensors.items():
            got = g.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            assert torch.equal(_u8(got), _u8(v))
    h = read_header(f)
    assert [(e.name, e.dtype, e.shape) for e in h.tensors] == entries
    data = f.read_bytes()
    for e in h.tensors:
        off = h.absolute_offset(e)
        assert data[off : off + e.nbytes] == _u8(tensors[e.name]).numpy().tobytes()


@pytest.mark.parametrize(("name", "tdtype"), ROUNDTRIP, ids=[r[0] for r in ROUNDTRIP])
def test_parser_reads_files_from_safetensors(tmp_path: Path, name: str, tdtype: torch.dtype) -> None:
    tensors = {
        "a.weight": _sample(tdtype, (4, 3), 0),
        "b": _sample(tdtype, (9,), 1),
        "c": _sample(tdtype, (0,), 2),
    }
    f = tmp_path / "lib.safetensors"
    save_file(tensors, str(f), metadata={"format": "pt"})
    h = read_header(f)
    assert h.metadata == {"format": "pt"}
    data = f.read_bytes()
    for e in h.tensors:
        assert e.dtype == name and e.shape == tuple(tensors[e.name].shape)
        assert (
            data[h.absolute_offset(e) : h.absolute_offset(e) + e.nbytes]
            == _u8(tensors[e.name]).numpy().tobytes()
        )


def test_writer_accepts_numpy_and_memoryview(tmp_path: Path) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(6, dtype=np.float16)
    f = tmp_path / "np.safetensors"
    with SafetensorsWriter(f, [("a", "F32", (3, 4)), ("b", "F16", (6,))]) as w:
        w.write("a", memoryview(a))
        w.write("b", memoryview(b.tobytes()))
    assert w.sha256 == hashlib.sha256(f.read_bytes()).hexdigest()
    with safe_open(str(f), "np") as g:
        np.testing.assert_array_equal(g.get_tensor("a"), a)
        np.testing.assert_array_equal(g.get_tensor("b"), b)


def test_writer_zero_tensors(tmp_path: Path) -> None:
    f = tmp_path / "empty.safetensors"
    SafetensorsWriter(f, [], {"a": "b"}).close(fsync=False)
    assert read_header(f).tensors == ()
    with safe_open(str(f), "pt") as g:
        assert list(g.keys()) == [] and g.metadata() == {"a": "b"}


# --- writer misuse -----------------------------------------------------------------------------

ENTRIES = [("a", "F32", (2,)), ("b", "U8", (3,))]


def test_writer_wrong_order(tmp_path: Path) -> None:
    with (
        pytest.raises(E.SafetensorsWriteError, match="expected 'a'") as info,
        SafetensorsWriter(tmp_path / "o.safetensors", ENTRIES) as w,
    ):
        w.write("b", b"abc")
    assert one_line(info.value)


def test_writer_wrong_size(tmp_path: Path) -> None:
    w = SafetensorsWriter(tmp_path / "o.safetensors", ENTRIES)
    with pytest.raises(E.SafetensorsWriteError, match="needs 8 more bytes, got 7"):
        w.write("a", b"\x00" * 7)
    w.write("a", b"\x00" * 8)
    w.write("b", b"abc")
    with pytest.raises(E.SafetensorsWriteError, match="after all tensors"):
        w.write("c", b"")
    w.close(fsync=False)
    with pytest.raises(E.SafetensorsWriteError, match="after close"):
        w.write("a", b"")


def test_writer_close_early(tmp_path: Path) -> None:
    w = SafetensorsWriter(tmp_path / "o.safetensors", ENTRIES)
    w.write("a", b"\x00" * 8)
    with pytest.raises(E.SafetensorsWriteError, match="1 tensors unwritten"):
        w.close()
    with pytest.raises(E.SafetensorsWriteError):
        w.close()


def test_writer_exclusive(tmp_path: Path) -> None:
    f = tmp_path / "o.safetensors"
    f.write_bytes(b"old")
    with pytest.raises(E.SafetensorsWriteError, match="already exists"):
        SafetensorsWriter(f, ENTRIES)
    assert f.read_bytes() == b"old"
    with SafetensorsWriter(f, ENTRIES, exclusive=False) as w:
        w.write("a", b"\x00" * 8)
        w.write("b", b"abc")
    assert read_header(f).file_size == f.stat().st_size


def test_writer_exception_closes_fd_and_keeps_file(tmp_path: Path) -> None:
    f = tmp_path / "o.safetensors"
    with pytest.raises(RuntimeError), SafetensorsWriter(f, ENTRIES) as w:
        w.write("a", b"\x00" * 8)
        raise RuntimeError("boom")
    assert f.exists() and w.sha256 is None
    with pytest.raises(E.SafetensorsWriteError, match="aborted"):  # its file was let go
        w.close()


def test_build_header_layout() -> None:
    prefix, offs = build_header([("b", "F32", (2, 2)), ("a", "BF16", (3,)), ("z", "F4", (2,))], {"k": "v"})
    n = int.from_bytes(prefix[:8], "little")
    assert len(prefix) == 8 + n and len(prefix) % 8 == 0
    body = prefix[8:].rstrip(b" ")
    assert body.startswith(
        b'{"__metadata__":{"k":"v"},"b":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}'
    )
    assert offs == [(0, 16), (16, 22), (22, 23)]
    assert build_header([("b", "F32", (2, 2))], None)[0] == build_header([("b", "F32", (2, 2))], None)[0]


@pytest.mark.parametrize(
    ("entries", "meta", "cls"),
    [
        ([("a", "F32", (1,)), ("a", "F32", (1,))], None, E.DuplicateKeyError),
        ([("__metadata__", "F32", (1,))], None, E.DuplicateKeyError),
        ([("a\x00", "F32", (1,))], None, E.BadTensorNameError),
        ([("a", "F33", (1,))], None, E.UnknownDtypeError),
        ([("a", "F32", (-1,))], None, E.TensorEntryError),
        ([("a", "F4", (3,))], None, E.SizeMismatchError),
        ([], {"a": 1}, E.MetadataError),
    ],
    ids=["dup-name", "reserved-name", "bad-name", "bad-dtype", "bad-shape", "subbyte", "bad-metadata"],
)
def test_build_header_rejects(entries: list, meta: dict | None, cls: type[Exception]) -> None:
    with pytest.raises(cls):
        build_header(entries, meta)


# --- dtype table -------------------------------------------------------------------------------


def test_dtype_table() -> None:
    assert dtypes.nbytes_for("F32", (3, 4)) == 48
    assert dtypes.nbytes_for("BF16", ()) == 2
    assert dtypes.nbytes_for("F4", (2, 3)) == 3
    assert dtypes.nbytes_for("F6_E3M2", (4,)) == 3
    assert dtypes.nbytes_for("U8", (0, 10**30)) == 0
    assert {"F32", "F16", "BF16"} == dtypes.ARITHMETIC_DTYPES
    with pytest.raises(E.SizeMismatchError):
        dtypes.nbytes_for("F4", (3,))
    with pytest.raises(E.UnknownDtypeError):
        dtypes.nbytes_for("Q4", (2,))
    with pytest.raises(E.TensorEntryError):
        dtypes.nbytes_for("F32", (-1,))


def test_torch_mapping() -> None:
    for name in dtypes.DTYPE_BITS:
        try:
            td = dtypes.torch_dtype(name)
        except E.UnsupportedDtypeError:
            assert name in {"F4", "F6_E2M3", "F6_E3M2"}
            continue
        assert dtypes.from_torch(td) == name
        assert torch.empty((), dtype=td).element_size() * 8 == dtypes.DTYPE_BITS[name]
    assert dtypes.torch_dtype("BF16") is torch.bfloat16
    with pytest.raises(E.UnknownDtypeError):
        dtypes.torch_dtype("nope")
    with pytest.raises(E.UnsupportedDtypeError):
        dtypes.from_torch(torch.complex128)


def test_writer_write_part_streams_blocks(tmp_path: Path) -> None:
    a = np.arange(10, dtype=np.float32)
    f = tmp_path / "parts.safetensors"
    with SafetensorsWriter(f, [("a", "F32", (10,)), ("z", "U8", (0,)), ("b", "U8", (2,))]) as w:
        w.write_part("a", a[:3])
        with pytest.raises(E.SafetensorsWriteError, match="needs 28 more bytes, got 40"):
            w.write_part("a", a)
        with pytest.raises(E.SafetensorsWriteError, match="needs 28 more bytes"):
            w.write("a", a)  # write() wants the whole tensor, not the rest
        w.write_part("a", a[3:])
        w.write_part("z", b"")
        w.write("b", b"\x01\x02")
    with safe_open(str(f), "np") as g:
        np.testing.assert_array_equal(g.get_tensor("a"), a)


def test_control_character_set_is_category_cc() -> None:
    import sys
    import unicodedata

    for cp in range(sys.maxunicode + 1):
        ch = chr(cp)
        assert (names.CONTROL_CHARS.match(ch) is not None) == (unicodedata.category(ch) == "Cc"), hex(cp)


@pytest.mark.parametrize("sizes", [(1,), (3, 4093, 5), (2 << 20, 4096, 7), ((8 << 20) + 11,),
                                   (3 * (8 << 20) + 5, 17)])
def test_direct_writer_writes_the_same_file(tmp_path: Path, sizes: tuple[int, ...]) -> None:
    """O_DIRECT output (page-sized writes, a padded tail, then truncation) is byte-identical to a plain write,
    with the same sha256, whatever the sizes; where O_DIRECT is refused it falls back to plain writes."""
    rng = np.random.default_rng(len(sizes))
    entries = [(f"t{i}", "U8", (n,)) for i, n in enumerate(sizes)]
    blobs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    digests = []
    for direct in (False, True):
        w = SafetensorsWriter(tmp_path / f"{direct}.safetensors", entries, {"format": "pt"}, direct=direct)
        for (name, _dt, _shape), blob in zip(entries, blobs):
            w.write(name, blob)
        digests.append(w.close(fsync=True))
    plain, direct_bytes = ((tmp_path / f"{d}.safetensors").read_bytes() for d in (False, True))
    assert plain == direct_bytes
    assert digests[0] == digests[1] == hashlib.sha256(plain).hexdigest()


@pytest.mark.parametrize("fail_at", [0, 2])
def test_direct_writer_reports_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int) -> None:
    """A page write that fails with ENOSPC in the helper thread surfaces as OutOfSpaceError from `write`
    or `close`, never silently, and no digest is given."""
    import errno

    from mergepipe_db.errors import OutOfSpaceError

    calls = []
    real = os.pwritev

    def pwritev(fd, bufs, offset):  # noqa: ANN001, ANN202
        calls.append(offset)
        if len(calls) > fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    n = 4 * (8 << 20) + 3
    w = SafetensorsWriter(tmp_path / "x.safetensors", [("t", "U8", (n,))], {"format": "pt"}, direct=True)
    if not w.direct:
        pytest.skip("O_DIRECT is refused on this file system")
    with pytest.raises(OutOfSpaceError):
        w.write("t", bytes(n))
        w.close(fsync=True)
    assert w.sha256 is None
    w._abort()
