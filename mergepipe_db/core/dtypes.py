"""The safetensors dtype table: element width in bits, exact byte sizes, numpy and torch mappings.

Names are the strings written in a safetensors header (``"F32"``, ``"BF16"``, ...). Sizes are exact
integers in bytes; sub-byte dtypes (F4, F6_*) are packed, so a tensor of them is valid only when
``numel * bits`` is a multiple of 8.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from mergepipe_db.errors import SizeMismatchError, TensorEntryError, UnknownDtypeError, UnsupportedDtypeError

if TYPE_CHECKING:
    import torch

#: Every dtype the safetensors format defines (as of safetensors 0.8), element width in bits.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "U16": 16,
    "I16": 16,
    "U32": 32,
    "I32": 32,
    "U64": 64,
    "I64": 64,
    "F16": 16,
    "BF16": 16,
    "F32": 32,
    "F64": 64,
    "C64": 64,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F4": 4,
}

#: Dtypes the merge operators compute on (upcast to F32 internally).
ARITHMETIC_DTYPES: frozenset[str] = frozenset({"F32", "F16", "BF16"})

# safetensors name -> torch attribute name. F4/F6 have no element-wise torch dtype (torch's
# float4_e2m1fn_x2 packs two values per element, which changes the shape), so they are absent.
_TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


def dtype_bits(dtype: str) -> int:
    """Element width of `dtype` in bits; raises `UnknownDtypeError` for a name not in the table."""
    try:
        return DTYPE_BITS[dtype]
    except (KeyError, TypeError):
        raise UnknownDtypeError(f"unknown safetensors dtype {dtype!r}") from None


def numel(shape: Iterable[int]) -> int:
    """Number of elements of `shape` (1 for a scalar ``()``); dims must be non-negative ints."""
    n = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise TensorEntryError(f"shape dimension {d!r} is not a non-negative integer")
        n *= d
    return n


def nbytes_for(dtype: str, shape: Iterable[int]) -> int:
    """Exact size in bytes of a tensor of `dtype` and `shape`.

    Raises `UnknownDtypeError` for an unknown dtype, `TensorEntryError` for a bad dimension and
    `SizeMismatchError` when a sub-byte dtype's ``numel * bits`` is not a whole number of bytes.
    """
    shape = tuple(shape)
    bits = dtype_bits(dtype) * numel(shape)
    if bits % 8:
        raise SizeMismatchError(
            f"{dtype} tensor of shape {tuple(shape)} does not fill a whole number of bytes"
        )
    return bits // 8


# safetensors name -> the numpy dtype that holds one stored value; BF16 (numpy has none) as its uint16 bits
_NUMPY_NAMES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32", "I32": "int32",
    "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "uint16", "F32": "float32", "F64": "float64",
    "C64": "complex64",
}


def numpy_storage_dtype(name: str) -> Any:
    """The numpy dtype a stored value of safetensors dtype `name` is read as (BF16: its uint16 bit pattern);
    `UnsupportedDtypeError` when numpy has none of the width (FP8, sub-byte)."""
    import numpy as np

    dtype_bits(name)
    attr = _NUMPY_NAMES.get(name)
    if attr is None:
        raise UnsupportedDtypeError(f"dtype {name} has no numpy equivalent")
    return np.dtype(attr)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for safetensors dtype `name`; `UnsupportedDtypeError` when torch has none."""
    import torch

    dtype_bits(name)
    attr = _TORCH_NAMES.get(name)
    dt = getattr(torch, attr, None) if attr is not None else None
    if dt is None:
        raise UnsupportedDtypeError(f"dtype {name} has no torch equivalent in this torch version")
    return dt


def from_torch(dtype: torch.dtype) -> str:
    """The safetensors dtype name for a torch dtype; `UnsupportedDtypeError` when there is none."""
    import torch

    for name, attr in _TORCH_NAMES.items():
        if getattr(torch, attr, None) == dtype:
            return name
    raise UnsupportedDtypeError(f"torch dtype {dtype} has no safetensors equivalent")


def as_float32(raw: np.ndarray) -> np.ndarray:
    """Stored values as float32 (a new array, exact): BF16 bit patterns (uint16) widened, F16/F64 cast."""
    if raw.dtype == np.uint16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)
