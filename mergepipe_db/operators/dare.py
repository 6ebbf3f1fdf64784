"""DARE's seeded random masks: one block's uniforms come from a generator keyed by (seed, expert, tensor, block),
so a block's mask does not depend on which other blocks are read (docs/SEMANTICS.md).

torch's results are the definition (`torch.rand` of the keyed generator); `dare_uniforms_packed` draws the same
bits by MT19937 (`mergepipe_db.kernels.torch_rand`) without importing torch. `dare_keep_mask` is the torch reference.
"""

from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from mergepipe_db.errors import SpecError

if TYPE_CHECKING:
    from mergepipe_db.operators.base import MergeOperator

__all__ = ["block_seed", "check_mask_keys", "dare_keep_mask", "dare_uniforms_packed"]


@functools.lru_cache(maxsize=1 << 13)  # dare_ties and della's TIES pass ask for a tensor's seeds twice
def block_seed(seed: int, expert_key: str, tensor_name: str, block_index: int) -> int:
    """The generator seed of one block's DARE uniforms (docs/SEMANTICS.md)."""
    key = hashlib.sha256(f"{seed}\x1f{expert_key}\x1f{tensor_name}\x1f{block_index}".encode()).digest()
    return int.from_bytes(key[:8], "little") & (2**63 - 1)


def _block_generator(seed: int, expert_key: str, tensor_name: str, block_index: int) -> Any:
    """The torch.Generator of one block's DARE uniforms."""
    import torch

    g = torch.Generator(device="cpu")
    g.manual_seed(block_seed(seed, expert_key, tensor_name, block_index))
    return g


def dare_uniforms_packed(seed: int, expert_key: str, tensor_name: str, blocks: list[tuple[int, int]],
                         out: np.ndarray) -> np.ndarray:
    """Several blocks' uniforms, each ``torch.rand(n)`` of its keyed generator, drawn in parallel by MT19937
    (`kernels.torch_rand.torch_rand_blocks_into`: the same bits, ~10× faster than torch's loop), packed one after
    another into the flat float32 `out` in the order of `blocks` ((block index, element count) pairs); returns each
    block's start offset in `out` (int64, one more entry: the end)."""
    from mergepipe_db.kernels.torch_rand import torch_rand_blocks_into

    bounds = np.zeros(len(blocks) + 1, np.int64)
    bounds[1:] = np.cumsum([n for _, n in blocks], dtype=np.int64)
    torch_rand_blocks_into([block_seed(seed, expert_key, tensor_name, b) for b, _ in blocks], bounds, out)
    return bounds


def dare_keep_mask(seed: int, expert_key: str, tensor_name: str, block_index: int,
                   block_shape: tuple[int, ...], density: float) -> Any:
    """The DARE keep mask (a bool torch tensor, ``block_shape``) of one block: ``rand(block_shape) < density``
    from a generator keyed by (seed, expert, tensor, block) — independent of which other blocks are read."""
    import torch

    g = _block_generator(seed, expert_key, tensor_name, block_index)
    u = torch.rand(tuple(block_shape), generator=g, dtype=torch.float32)
    return u < float(density)


def check_mask_keys(op: MergeOperator) -> None:
    """SpecError unless every expert has its checkpoint id, the key of its DARE masks."""
    for k, e in enumerate(op.experts):
        if not isinstance(e.key, str) or not e.key:
            raise SpecError(f"{op.name}: expert {k} needs its checkpoint id as the DARE mask key")
