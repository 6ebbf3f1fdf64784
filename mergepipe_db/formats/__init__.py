"""Checkpoint file formats: the safetensors dtype table, header parser/writer and HF directory layout."""

from __future__ import annotations

from mergepipe_db.formats.dtypes import (
    ARITHMETIC_DTYPES,
    DTYPE_BITS,
    from_torch,
    nbytes_for,
    torch_dtype,
)
from mergepipe_db.formats.hf_layout import CheckpointLayout, resolve_checkpoint
from mergepipe_db.formats.safetensors import (
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    SafetensorsWriter,
    TensorEntry,
    build_header,
    parse_header,
    read_header,
    validate_tensor_name,
)

__all__ = [
    "ARITHMETIC_DTYPES",
    "DTYPE_BITS",
    "MAX_HEADER_BYTES",
    "CheckpointLayout",
    "SafetensorsHeader",
    "SafetensorsWriter",
    "TensorEntry",
    "build_header",
    "from_torch",
    "nbytes_for",
    "parse_header",
    "read_header",
    "resolve_checkpoint",
    "torch_dtype",
    "validate_tensor_name",
]
