"""What execution returns: the output tensors' layout and the per-shard and per-expert results commit records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OutTensor:
    idx: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shard: int


@dataclass
class ExecutionResult:
    shard_names: list[str]
    shard_sha256: list[str]
    shard_sizes: list[int]
    out_tensors: list[OutTensor]
    tensor_xxh3: list[str]
    block_rows: list[dict[str, Any]]  # output blocks (for cataloguing the snapshot), tensor_idx-major
    realized_per_expert: list[int]
    reads: dict[tuple[int, int], int]  # (position, tensor_idx) -> bytes read
    base_bytes: int
    output_bytes: int
    cached_bytes: int  # of the base and expert bytes read, those copied from the page cache (io/local.py)
    tensor_offsets: list[int]  # absolute offset of each output tensor in its shard
    header_lens: list[int]
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def realized_bytes(self) -> int:
        return sum(self.realized_per_expert)
