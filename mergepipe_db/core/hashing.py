"""Content hashes: canonical JSON and its sha256 (plans, manifests), xxh3-128 of stored bytes (blocks, tensors)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode("utf-8")


def sha256_hex(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def xxh3_hex(data: bytes | bytearray | memoryview) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def xxh3_stream() -> Any:
    """An xxh3_128 hasher fed piece by piece (``update``); its ``hexdigest()`` equals `xxh3_hex` of the
    pieces joined."""
    import xxhash

    return xxhash.xxh3_128()
