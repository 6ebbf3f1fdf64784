"""Property tests: whatever bytes `parse_header` is fed, only `MergePipeError`s escape; valid files parse."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save as np_save

from mergepipe_db.core.dtypes import DTYPE_BITS
from mergepipe_db.errors import MergePipeError
from mergepipe_db.formats.safetensors import SafetensorsHeader, build_header, parse_header

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = sorted(DTYPE_BITS)


def parse_or_refuse(blob: bytes, file_size: int | None = None) -> SafetensorsHeader | None:
    """Parse; a refusal must be a MergePipeError with a one-line message (anything else fails the test)."""
    try:
        return parse_header(
            blob, len(blob) if file_size is None else file_size, path=Path("fuzz.safetensors")
        )
    except MergePipeError as e:
        assert len(str(e).splitlines()) == 1, repr(str(e))
        return None


def assert_invariants(h: SafetensorsHeader, size: int) -> None:
    cursor = 0
    for t in h.tensors:
        assert t.begin == cursor and t.end >= t.begin
        cursor = t.end
    assert h.data_start + cursor == size == h.file_size


def prefixed(body: bytes, data: bytes = b"") -> bytes:
    return len(body).to_bytes(8, "little") + body + data


# --- raw noise ---------------------------------------------------------------------------------


@FAST
@given(st.binary(max_size=300))
def test_random_bytes(blob: bytes) -> None:
    parse_or_refuse(blob)


@FAST
@given(st.integers(0, 2**64 - 1), st.binary(max_size=200), st.integers(0, 2**64))
def test_random_length_prefix_and_size(n: int, rest: bytes, size: int) -> None:
    parse_or_refuse(n.to_bytes(8, "little") + rest)
    parse_or_refuse(n.to_bytes(8, "little") + rest, size)


@FAST
@given(st.binary(max_size=200), st.binary(max_size=64))
def test_consistent_prefix_random_body(body: bytes, data: bytes) -> None:
    parse_or_refuse(prefixed(b"{" + body, data))


# --- structured-but-wrong JSON -----------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)

small_uint = st.integers(0, 40) | st.sampled_from([2**63, 2**64 - 1, 2**64])
entry_like = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(DTYPES) | json_values,
        "shape": st.lists(small_uint, max_size=3) | json_values,
        "data_offsets": st.lists(small_uint, min_size=0, max_size=3) | json_values,
    },
    optional={"extra": json_values},
)
names = st.text(max_size=12) | st.sampled_from(["__metadata__", "", "a\x00", "é" * 600])


@FAST
@given(st.dictionaries(names, json_values, max_size=5), st.binary(max_size=64))
def test_random_json_objects(obj: dict, data: bytes) -> None:
    body = json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")
    parse_or_refuse(prefixed(body, data))


@FAST
@given(st.dictionaries(names, entry_like | json_values, max_size=5), st.integers(0, 200), st.integers(0, 9))
def test_entry_like_objects(obj: dict, data_len: int, pad: int) -> None:
    body = json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass") + b" " * pad
    h = parse_or_refuse(prefixed(body, b"\x00" * data_len))
    if h is not None:
        assert_invariants(h, 8 + len(body) + data_len)


# --- valid files and their mutations -----------------------------------------------------------

tensor_names = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=20
).filter(lambda s: s != "__metadata__")


@st.composite
def valid_files(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, str, tuple[int, ...]]]]:
    names_ = draw(st.lists(tensor_names, max_size=6, unique=True))
    entries = []
    for name in names_:
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        n = int(np.prod(shape)) if shape else 1
        if n * DTYPE_BITS[dtype] % 8:
            shape = (*shape, 8)
        entries.append((name, dtype, shape))
    meta = draw(st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
    meta = None if meta is None else {k.encode("utf-8", "replace").decode(): v for k, v in meta.items()}
    try:
        prefix, offsets = build_header(entries, meta)
    except MergePipeError:
        # only the metadata can be refused here (lone surrogates); regenerate without it
        prefix, offsets = build_header(entries, None)
    data = draw(st.binary(min_size=offsets[-1][1], max_size=offsets[-1][1])) if offsets else b""
    return prefix + data, entries


@FAST
@given(valid_files())
def test_valid_files_always_parse(case: tuple[bytes, list]) -> None:
    blob, entries = case
    h = parse_header(blob, len(blob))
    assert_invariants(h, len(blob))
    assert [(t.name, t.dtype, t.shape) for t in h.tensors if t.nbytes] == [e for e in entries if _nbytes(e)]
    assert set(h.by_name()) == {e[0] for e in entries}


def _nbytes(e: tuple[str, str, tuple[int, ...]]) -> int:
    n = int(np.prod(e[2])) if e[2] else 1
    return n * DTYPE_BITS[e[1]] // 8


@FAST
@given(valid_files(), st.data())
def test_mutated_valid_files(case: tuple[bytes, list], data: st.DataObject) -> None:
    blob = bytearray(case[0])
    kind = data.draw(st.sampled_from(["flip", "set", "truncate", "append", "delete", "insert"]))
    i = data.draw(st.integers(0, len(blob) - 1))
    if kind == "flip":
        blob[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "set":
        blob[i] = data.draw(st.sampled_from(b'{}[]",:0123456789- \x00\xff\\e.'))
    elif kind == "truncate":
        del blob[i:]
    elif kind == "append":
        blob += data.draw(st.binary(min_size=1, max_size=16))
    elif kind == "delete":
        del blob[i]
    else:
        blob.insert(i, data.draw(st.integers(0, 255)))
    h = parse_or_refuse(bytes(blob))
    if h is not None:
        assert_invariants(h, len(blob))


NP_DTYPES = [np.float32, np.float16, np.float64, np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_]


@FAST
@given(
    st.dictionaries(
        tensor_names,
        st.tuples(st.sampled_from(NP_DTYPES), st.lists(st.integers(0, 4), max_size=3)),
        max_size=5,
    )
)
def test_files_written_by_safetensors_parse(spec: dict) -> None:
    arrays = {k: np.zeros(shape, dtype=dt) for k, (dt, shape) in spec.items()}
    blob = np_save(arrays)
    h = parse_header(blob, len(blob))
    assert_invariants(h, len(blob))
    got = h.by_name()
    for k, a in arrays.items():
        assert got[k].shape == a.shape and got[k].nbytes == a.nbytes
