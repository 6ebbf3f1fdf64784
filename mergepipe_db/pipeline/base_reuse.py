"""Which θ₀ reads the executor keeps for a later output tensor that copies the same source tensor.

A config resolved per tensor can take one source tensor as θ₀ of several output tensors: passthrough's
frankenmerges (``[0, 24]`` of a model followed by ``[8, 32]`` of it reuse layers 8–23), or a slice repeated.
The plan lists one output tensor per use, each pointing at the same bytes. The executor's base reader reads
such a tensor once, keeps a copy of its bytes until its last use, and fills the later uses from the copy
(`reuse_schedule` says which); memory kept is bounded (`keep_bytes`): a use beyond the bound is read again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mergepipe_db.core.plan import TensorInfo
from mergepipe_db.errors import EnvironmentSettingError

#: the most bytes of source tensors kept at once for later uses (`MERGEPIPE_REUSE_BYTES` overrides; 0 turns
#: the reuse off: every use is read)
DEFAULT_KEEP_BYTES = 1 << 30


def keep_bytes() -> int:
    """The bound on bytes kept: `MERGEPIPE_REUSE_BYTES`, else `DEFAULT_KEEP_BYTES`."""
    env = os.environ.get("MERGEPIPE_REUSE_BYTES", "").strip()
    if not env:
        return DEFAULT_KEEP_BYTES
    try:
        n = int(env)
    except ValueError:
        n = -1
    if n < 0:
        raise EnvironmentSettingError(f"MERGEPIPE_REUSE_BYTES={env!r} is not a whole number of bytes >= 0")
    return n


def source_key(t: TensorInfo) -> tuple[str, int, int]:
    """The bytes a tensor of the plan is read from."""
    return (t.path, t.offset, t.nbytes)


@dataclass(frozen=True)
class Use:
    """What the base reader does for one tensor: read it (`keep`: and keep a copy for a later use), or copy it
    from the kept bytes (`from_kept`; `last`: then drop them)."""

    keep: bool = False
    from_kept: bool = False
    last: bool = False


READ = Use()


def reuse_schedule(tensors: list[TensorInfo], limit: int) -> list[Use]:
    """Per tensor (in read order), a `Use`. Greedy in read order: a tensor read with a later use of the same
    bytes is kept when the bytes kept at that moment plus its own stay within `limit`; kept bytes are dropped
    at their last use. Tensors whose bytes no other tensor shares are plain reads (the ordinary merge)."""
    last: dict[tuple[str, int, int], int] = {}
    for i, t in enumerate(tensors):
        last[source_key(t)] = i
    uses: list[Use] = []
    kept: set[tuple[str, int, int]] = set()
    held = 0
    for i, t in enumerate(tensors):
        k = source_key(t)
        if k in kept:
            done = last[k] == i
            uses.append(Use(from_kept=True, last=done))
            if done:
                kept.discard(k)
                held -= t.nbytes
        elif last[k] > i and t.nbytes and held + t.nbytes <= limit:
            uses.append(Use(keep=True))
            kept.add(k)
            held += t.nbytes
        else:
            uses.append(READ)
    return uses
