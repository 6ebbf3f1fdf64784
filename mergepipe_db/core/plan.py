"""The plan: immutable facts about checkpoints and tensors, the selected reads, and the plan that carries them
from the planner to the executor, with its canonical form and hash.

`ExpertPlan` and `Plan` are frozen: the planner (`pipeline.plan`) computes every field — read costs, sketches,
the plan hash (`compute_plan_hash`) — before it constructs them, and the mappings they carry are `FrozenDict`s,
so neither a field nor an entry changes once a plan is built."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np

from mergepipe_db.core.hashing import canonical_json
from mergepipe_db.core.spec import MergeSpec
from mergepipe_db.core.version import __version__


class FrozenDict(dict):
    """A dict that refuses every change once built: the mappings a frozen plan carries (reads, selections,
    sketches, an expert's tensors). Equal to the plain dict of the same items; pickles as one."""

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a plan's mappings are read-only: a plan is complete when built (dataclasses.replace "
                        "makes a changed copy)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore

    def __reduce__(self) -> tuple[type[FrozenDict], tuple[dict]]:
        return FrozenDict, (dict(self),)


def _freeze(obj: object, *names: str) -> None:
    """Replace the dict fields `names` of a frozen dataclass instance by `FrozenDict`s (in `__post_init__`)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not isinstance(value, FrozenDict):
            object.__setattr__(obj, name, FrozenDict(value))


@dataclass(frozen=True)
class TensorInfo:
    idx: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    path: str
    offset: int  # absolute byte offset in `path`
    nbytes: int
    rows_per_block: int
    n_blocks: int
    xxh3: str


@dataclass(frozen=True)
class CheckpointInfo:
    id: str
    name: str
    kind: str
    root: str
    has_stats: bool
    block_bytes: int
    files: tuple[FileStamp, ...]
    file_hashes: tuple[tuple[str, str], ...]  # (relpath, sha256)
    config: dict[str, Any] | None
    base_id: str | None = None  # the base its delta statistics are against (None for an original base)


@dataclass(frozen=True, slots=True)
class Read:
    """One selected unit: a block (block_idx ≥ 0) or a whole tensor (block_idx = -1)."""

    block_idx: int
    offset: int
    nbytes: int
    xxh3: str


@dataclass(frozen=True)
class ExpertPlan:
    position: int
    checkpoint: CheckpointInfo
    weight: float
    density: float
    gamma: float
    coef: float
    tensors: dict[str, TensorInfo]  # by name
    planned_bytes: int = 0
    blocks_selected: int = 0
    pruned_bytes: int = 0  # TIES: bytes of nonzero-delta blocks trimmed to zero entirely (not candidates)
    blocks_pruned: int = 0

    def __post_init__(self) -> None:
        _freeze(self, "tensors")


@dataclass(frozen=True)
class Plan:
    spec: MergeSpec
    base: CheckpointInfo
    base_tensors: list[TensorInfo]  # checkpoint order
    experts: list[ExpertPlan]
    out_dtype: str | None
    budget_bytes: int
    full_bytes: int  # what a full read of every expert tensor costs (the naive merge)
    candidate_bytes: int  # bytes of blocks with a non-zero delta
    planned_bytes: int
    access: dict[tuple[int, int], tuple[Read, ...]]  # (position, base tensor_idx) -> reads, block order
    full_selection: dict[tuple[int, int], bool]  # every candidate block of (expert, tensor) selected
    bound_per_tensor: dict[int, float] | None
    bound_total: float | None
    plan_hash: str = ""
    sketches: dict[tuple[int, int], Any] = field(default_factory=dict)
    sources: tuple[Any, ...] = ()  # a `sources.base.ExpertSource` per expert, by position
    pruned_bytes: int = 0  # TIES: read cost of nonzero-delta blocks that trim to zero (never candidates)
    pruned_blocks: int = 0
    #: a MergeKit config resolved per tensor (`core.mergekit_config.Recipe`): base_tensors are then the output
    #: tensors, and `tensor_params` holds by output tensor index (model parameters per expert, global parameters)
    recipe: Any = None
    tensor_params: dict[int, Any] | None = None

    #: geometric methods under a budget: [a₀, [c_k]] by tensor name, from catalog statistics (docs/SEMANTICS.md)
    coefficients: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _freeze(self, "access", "full_selection", "bound_per_tensor", "sketches", "tensor_params", "coefficients")

    def selected_blocks(self, position: int, tensor_idx: int) -> tuple[int, ...]:
        """The block indices expert `position` reads of base tensor `tensor_idx` (all of its blocks for a
        whole-tensor read; a LoRA factor unit is block -2)."""
        reads = self.access.get((position, tensor_idx), ())
        if any(r.block_idx == -1 for r in reads):
            name = next(t.name for t in self.base_tensors if t.idx == tensor_idx)
            return tuple(range(self.experts[position].tensors[name].n_blocks))
        return tuple(r.block_idx for r in reads)

    def access_mask(self) -> list[list[Any]]:
        """Compact access set: [position, tensor name, [[first_block, stop_block], ...]] sorted."""
        out: list[list[Any]] = []
        names = {t.idx: t for t in self.base_tensors}
        for (pos, tidx), reads in sorted(self.access.items()):
            t = names[tidx]
            ranges: list[list[int]] = []
            for r in reads:
                if r.block_idx == -1:
                    ranges.append([0, t.n_blocks])
                elif ranges and ranges[-1][1] == r.block_idx:
                    ranges[-1][1] = r.block_idx + 1
                else:
                    ranges.append([r.block_idx, r.block_idx + 1])
            out.append([pos, t.name, ranges])
        return out

    def canonical(self) -> dict[str, Any]:
        """Deterministic content the plan hash is computed from (`plan_hash`: its canonical JSON, hashed)."""
        return {**self._canonical_head(), "access": self.access_mask()}

    def _canonical_head(self) -> dict[str, Any]:
        return canonical_head(self.spec, self.out_dtype, self.base.id, self.experts, self.budget_bytes,
                              recipe=self.recipe)

    def summary(self) -> dict[str, Any]:
        return {
            "plan_hash": self.plan_hash,
            "method": self.spec.method,
            "base": self.base.name,
            "budget_bytes": self.budget_bytes,
            "full_bytes": self.full_bytes,
            "candidate_bytes": self.candidate_bytes,
            "planned_bytes": self.planned_bytes,
            "pruned_bytes": self.pruned_bytes,
            "pruned_blocks": self.pruned_blocks,
            "bound": self.bound_total,
            "experts": [
                {"name": e.checkpoint.name, "position": e.position, "planned_bytes": e.planned_bytes,
                 "blocks_selected": e.blocks_selected, "pruned_bytes": e.pruned_bytes,
                 "blocks_pruned": e.blocks_pruned, "coef": e.coef}
                for e in self.experts
            ],
        }


def canonical_head(spec: MergeSpec, out_dtype: str | None, base_id: str, experts: list[ExpertPlan],
                   budget_bytes: int, recipe: Any = None) -> dict[str, Any]:
    """The canonical content of a plan other than its access set (`Plan.canonical`); a config resolved per
    tensor adds its recipe (every output tensor's sources and parameters)."""
    head: dict[str, Any] = {
        "method": spec.method,
        "normalize": spec.normalize,
        "lambda": spec.lam,
        "t": spec.t,
        "seed": spec.seed,
        "dtype": out_dtype,
        "base": base_id,
        "experts": [[e.checkpoint.id, e.weight, e.density, e.gamma]
                    + ([] if m.epsilon is None else [m.epsilon]) for e, m in zip(experts, spec.models)],
        "budget_bytes": budget_bytes,
    }
    if recipe is not None:
        head["recipe"] = recipe.to_json()
    if spec.options:  # absent for the methods and options that existed before them: their hashes are unchanged
        head["options"] = dict(spec.options)
    return head


def _access_mask_json(access: dict[tuple[int, int], tuple[Read, ...]], base_tensors: list[TensorInfo]) -> str:
    """``json.dumps(plan.access_mask())`` in canonical form (compact separators, ASCII), built directly as
    text: the same bytes, without a list per range (10^5 selected blocks in a few tens of ms).

    The ranges come out of numpy: read i covers [lo_i, hi_i) ([0, n_blocks) for a whole tensor, block_idx
    -1) and extends the open range, as in `Plan.access_mask`, where it is a block (not -1) of the same key
    starting at the previous read's hi."""
    tensors = {t.idx: t for t in base_tensors}
    keys = sorted(access)
    counts = np.fromiter((len(access[k]) for k in keys), dtype=np.int64, count=len(keys))
    b = np.fromiter(map(_BLOCK_IDX, chain.from_iterable(access[k] for k in keys)), dtype=np.int64,
                    count=int(counts.sum()))
    whole = b == -1
    lo = np.where(whole, 0, b)
    hi = np.where(whole, np.repeat(np.array([tensors[t].n_blocks for _p, t in keys], dtype=np.int64), counts),
                  b + 1)
    first = np.zeros(len(b), dtype=bool)
    first[(np.cumsum(counts) - counts)[counts > 0]] = True
    starts = np.flatnonzero(first | whole | np.r_[True, hi[:-1] != b[1:]])
    ends = np.append(starts[1:], len(b))[:len(starts)] - 1  # each range's last read
    ranges = list(map("[{},{}]".format, lo[starts].tolist(), hi[ends].tolist()))
    # ranges per key: a key's reads are counts[k] consecutive ones, and its first read starts a range
    per_key = np.searchsorted(starts, np.cumsum(counts) - counts).tolist() + [len(ranges)]
    out = [f"[{int(pos)},{json.dumps(tensors[tidx].name)},[{','.join(ranges[per_key[k]:per_key[k + 1]])}]]"
           for k, (pos, tidx) in enumerate(keys)]
    return "[" + ",".join(out) + "]"


_BLOCK_IDX = attrgetter("block_idx")


def plan_hash(plan: Plan) -> str:
    """sha256 of the canonical JSON of ``{"tool": major version, **plan.canonical()}`` (sorted keys, compact)."""
    return compute_plan_hash(plan.spec, plan.out_dtype, plan.base.id, plan.experts, plan.budget_bytes, plan.access,
                             plan.base_tensors, plan.recipe)


def compute_plan_hash(spec: MergeSpec, out_dtype: str | None, base_id: str, experts: list[ExpertPlan],
                      budget_bytes: int, access: dict[tuple[int, int], tuple[Read, ...]],
                      base_tensors: list[TensorInfo], recipe: Any = None) -> str:
    """`plan_hash` of the plan these fields make, computed before it is constructed.

    "access" is the first key in sorted order, so the text is ``{"access":<mask>,`` followed by the canonical
    JSON of the other keys; the mask's text comes from `_access_mask_json`. Equal, byte for byte, to
    ``sha256_hex({"tool": ..., **plan.canonical()})`` (tests/test_planner_paths.py checks both).
    """
    head = canonical_json({"tool": __version__.split(".")[0],
                           **canonical_head(spec, out_dtype, base_id, experts, budget_bytes, recipe)})
    assert head[:1] == b"{"  # every other key sorts after "access"
    h = hashlib.sha256(b'{"access":')
    h.update(_access_mask_json(access, base_tensors).encode("ascii"))
    h.update(b"," if len(head) > 2 else b"")
    h.update(head[1:])
    return h.hexdigest()


@dataclass(frozen=True)
class FileStamp:
    """What ingest recorded about a file, for stale detection."""

    path: str
    size: int
    mtime_ns: int
