"""Independent full-read reference merge (the test oracle).

Written directly from ``docs/SEMANTICS.md`` and nothing else: every tensor is read whole, upcast to
float32, merged with plain whole-tensor torch operations and cast to the output dtype at the very end.
The only place blocks appear is the DARE keep mask, which SEMANTICS.md defines per row block.

This module must stay independent of ``mergepipe_db`` (it does not import it) so that agreement between
the executor and this file means something.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "slerp")

# SEMANTICS.md: default of the `normalize` flag per method.
NORMALIZE_DEFAULT = {
    "linear": True,
    "task_arithmetic": False,
    "ties": True,
    "dare_linear": False,
    "dare_ties": False,
    "breadcrumbs": False,
}

DEFAULT_DENSITY = 1.0
DEFAULT_GAMMA = 0.01

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


# --------------------------------------------------------------------------------------------------
# Reading checkpoints
# --------------------------------------------------------------------------------------------------


def _tensor_files(path: Path) -> dict[str, Path]:
    """Map every tensor name of a checkpoint to the .safetensors file that holds it.

    ``path`` is a single .safetensors file, or an HF directory with ``model.safetensors.index.json``
    (+ shards) or with ``model.safetensors``.
    """
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / INDEX_NAME).is_file():
        index = json.loads((path / INDEX_NAME).read_text())
        return {name: path / shard for name, shard in index["weight_map"].items()}
    elif (path / SINGLE_NAME).is_file():
        files = [path / SINGLE_NAME]
    else:
        raise FileNotFoundError(f"no {INDEX_NAME} or {SINGLE_NAME} in {path}")

    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not plain mappings
                if name in where:
                    raise ValueError(f"tensor {name!r} appears twice in {path}")
                where[name] = file
    return where


def _read_tensor(file: Path, name: str) -> torch.Tensor:
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name)


def load_model(path: Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a checkpoint, in its stored dtype."""
    return {name: _read_tensor(file, name) for name, file in _tensor_files(Path(path)).items()}


def load_output(out_dir: Path) -> dict[str, torch.Tensor]:
    """Read a merged HF output directory (index + shards; a lone model.safetensors is accepted too)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise NotADirectoryError(f"merged output {out_dir} is not a directory")
    return load_model(out_dir)


# --------------------------------------------------------------------------------------------------
# Comparing results
# --------------------------------------------------------------------------------------------------


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor as a (numel, itemsize) uint8 matrix."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), t.element_size())


def row_mask(shape: tuple[int, ...], rows: list[tuple[int, int]]) -> torch.Tensor:
    """A bool tensor broadcastable to `shape`: True on the rows (dim 0) in `rows` (a 0-d tensor has row 0)."""
    if len(shape) == 0:
        return torch.tensor(any(r0 <= 0 < r1 for r0, r1 in rows))
    keep = torch.zeros(shape[0], dtype=torch.bool)
    for r0, r1 in rows:
        keep[r0:r1] = True
    return keep.reshape(shape[0], *[1] * (len(shape) - 1))


def assert_bytes_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                       ignore_rows: dict[str, list[tuple[int, int]]] | None = None) -> None:
    """Same tensor names, dtypes, shapes and identical bytes; otherwise AssertionError naming the first
    differing tensor (in sorted name order) and how many of its elements differ. `ignore_rows[name]`: rows
    (dim 0) of that tensor left out of the comparison."""
    missing = sorted(set(a) - set(b))
    extra = sorted(set(b) - set(a))
    if missing or extra:
        raise AssertionError(
            f"tensor names differ: only in first {missing[:10]}, only in second {extra[:10]}"
        )
    for name in sorted(a):
        x, y = a[name], b[name]
        if x.dtype != y.dtype:
            raise AssertionError(f"tensor {name!r}: dtype {x.dtype} != {y.dtype}")
        if tuple(x.shape) != tuple(y.shape):
            raise AssertionError(f"tensor {name!r}: shape {tuple(x.shape)} != {tuple(y.shape)}")
        differs = (_as_bytes(x) != _as_bytes(y)).any(dim=1)
        if ignore_rows and ignore_rows.get(name):
            compared = ~row_mask(tuple(x.shape), ignore_rows[name]).expand(x.shape).reshape(-1)
            differs &= compared
        n_diff = int(differs.sum())
        if n_diff:
            first = int(differs.nonzero()[0, 0])
            xf, yf = x.reshape(-1)[first].item(), y.reshape(-1)[first].item()
            raise AssertionError(
                f"tensor {name!r}: {n_diff} of {x.numel()} elements differ "
                f"(first at flat index {first}: {xf!r} != {yf!r})"
            )


# --------------------------------------------------------------------------------------------------
# Blocks and DARE masks (SEMANTICS.md "Blocks", "dare_linear and dare_ties")
# --------------------------------------------------------------------------------------------------


def row_blocks(shape: tuple[int, ...], itemsize: int, block_bytes: int) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of the blocks of a tensor with this shape and stored itemsize."""
    if len(shape) == 0:
        return [(0, 1)]
    rows = shape[0]
    if len(shape) == 1:
        return [(0, rows)]
    row_bytes = math.prod(shape[1:]) * itemsize
    rows_per_block = max(1, block_bytes // row_bytes)
    blocks = []
    i = 0
    while i * rows_per_block < rows:
        blocks.append((i * rows_per_block, min(rows, (i + 1) * rows_per_block)))
        i += 1
    return blocks


def theta_from_delta(theta0: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """θ_k of a source that stores Δ_k (delta checkpoint, LoRA): θ₀ + Δ_k, or θ₀ itself, bit for bit, where Δ_k
    is zero throughout the tensor (not stored, or stored as zeros): such a tensor is not read, and θ₀ + 0.0
    would turn θ₀'s -0.0 into +0.0. Only slerp sees the difference: every other sum starts at +0.0."""
    return theta0 + delta if bool(delta.any()) else theta0.clone()


def block_generator(seed: int, expert_key: str, tensor_name: str, block_index: int) -> torch.Generator:
    key = hashlib.sha256(f"{seed}\x1f{expert_key}\x1f{tensor_name}\x1f{block_index}".encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    return g


def dare_keep_mask(
    seed: int,
    expert_key: str,
    tensor_name: str,
    shape: tuple[int, ...],
    stored_itemsize: int,
    density: float,
    block_bytes: int,
) -> torch.Tensor:
    """The whole-tensor DARE keep mask: per-block masks concatenated along dim 0."""
    shape = tuple(shape)
    if len(shape) == 0:
        u = torch.rand((), generator=block_generator(seed, expert_key, tensor_name, 0), dtype=torch.float32)
        return u < density
    if math.prod(shape) == 0:
        # Nothing to draw for an empty tensor (and a zero-byte row has no defined blocking).
        return torch.zeros(shape, dtype=torch.bool)
    pieces = []
    for block_index, (start, stop) in enumerate(row_blocks(shape, stored_itemsize, block_bytes)):
        block_shape = (stop - start, *shape[1:])
        g = block_generator(seed, expert_key, tensor_name, block_index)
        u = torch.rand(block_shape, generator=g, dtype=torch.float32)
        pieces.append(u < density)
    return torch.cat(pieces, dim=0)


def l1_rescale(delta: torch.Tensor, keep: torch.Tensor, stored_itemsize: int, block_bytes: int) -> float:
    """SEMANTICS.md's L1 rescale factor ‖Δ‖₁ / ‖kept Δ‖₁: the exactly rounded sums (`math.fsum` of the float64
    values; NaN when one is NaN, inf when one is inf, as numpy's sum); 1 when either is below 1e-7. Exact sums
    do not depend on the row blocks (`stored_itemsize`, `block_bytes`: kept for the callers)."""
    import math

    import numpy as np

    def exact(v: np.ndarray) -> float:
        if np.isnan(v).any():
            return math.nan
        if np.isinf(v).any():
            return math.inf
        return math.fsum(v.astype(np.float64).tolist())

    a = delta.abs().contiguous().numpy().reshape(-1)
    before = exact(a)
    after = exact(np.where(keep.numpy().reshape(-1), a, np.float32(0.0)))
    return 1.0 if (before < 1e-7 or after < 1e-7) else before / after


# --------------------------------------------------------------------------------------------------
# Per-method pieces, whole tensors, float32
# --------------------------------------------------------------------------------------------------


def _weight_sum(weights: list[float]) -> float:
    """W = sum of weights as a Python float, in order; W = 1 when |W| < 1e-8."""
    total = 0.0
    for w in weights:
        total = total + w
    if abs(total) < 1e-8:
        total = 1.0
    return total


def ties_trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """TIES step 1: keep the entries with |Δ| >= τ, τ the k-th largest |Δ| (k = int(d * n))."""
    if density >= 1:
        return delta
    n = delta.numel()
    k = int(density * n)
    magnitude = delta.abs()
    if k == 0:
        tau = torch.tensor(math.inf, dtype=torch.float32)
    else:
        tau = torch.topk(magnitude.flatten(), k).values.min()
    return torch.where(magnitude >= tau, delta, 0.0)


def breadcrumbs_trim(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Breadcrumbs: drop the n_top largest and the n_bot smallest |Δ| (strict inequalities)."""
    if density >= 1:
        return delta
    n = delta.numel()
    target = int(density * n)
    n_top = int(gamma * n)
    n_bot = n - target - n_top
    if n_bot < 0:
        n_top += n_bot
        n_bot = 0
    a = delta.abs()
    if n_top == 0:
        hi = torch.tensor(math.inf, dtype=torch.float32)
    else:
        hi = torch.topk(a.flatten(), n_top).values.min()  # the n_top-th largest
    if n_bot == 0:
        lo = torch.tensor(-math.inf, dtype=torch.float32)
    else:
        lo = torch.topk(a.flatten(), n_bot, largest=False).values.max()  # the n_bot-th smallest
    return torch.where((a > lo) & (a < hi), delta, 0.0)


def ties_combine(
    base: torch.Tensor, trimmed: list[torch.Tensor], weights: list[float], normalize: bool, lam: float
) -> torch.Tensor:
    """TIES steps 2-6 given the trimmed task vectors T_k."""
    weighted = [t * w for t, w in zip(trimmed, weights, strict=True)]  # D_k = T_k * w_k

    elected_sum = torch.zeros_like(base)  # S
    for d in weighted:
        elected_sum = elected_sum + d
    sign = torch.where(elected_sum >= 0, 1.0, -1.0)  # s

    mixed = torch.zeros_like(base)
    div = torch.zeros_like(base)
    for d, w in zip(weighted, weights, strict=True):
        keep = torch.sign(d) == sign
        mixed = mixed + torch.where(keep, d, 0.0)
        div = div + torch.where(keep, w, 0.0)
    div = torch.where(div == 0, 1.0, div)

    if normalize:
        mixed = mixed / div
    return base + mixed * lam


def task_arithmetic_combine(
    base: torch.Tensor, deltas: list[torch.Tensor], weights: list[float], normalize: bool, lam: float
) -> torch.Tensor:
    mixed = torch.zeros_like(base)
    for delta, w in zip(deltas, weights, strict=True):
        mixed = mixed + delta * w
    if normalize:
        mixed = mixed / _weight_sum(weights)
    return base + mixed * lam


def linear_combine(
    base: torch.Tensor, experts: list[torch.Tensor], weights: list[float], normalize: bool
) -> torch.Tensor:
    acc = torch.zeros_like(base)
    for theta, w in zip(experts, weights, strict=True):
        acc = acc + theta * w
    if normalize:
        return acc / _weight_sum(weights)
    return acc


GRAM_LANES = 64


def ordered_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """Σ a·b in float64 in the order SEMANTICS.md fixes for inner products ("Inner products"): c chunks,
    in each a sum per lane (element index mod 64) in element order, the lanes then the chunks added in order."""
    x, y = a.flatten().double(), b.flatten().double()
    n = x.numel()
    c = max(1, min(16, n // (1 << 17)))
    total = 0.0
    for t in range(c):
        s = (n * t // c) // 4096 * 4096
        e = n if t == c - 1 else (n * (t + 1) // c) // 4096 * 4096
        prod = x[s:e] * y[s:e]
        prod = torch.cat([prod, prod.new_zeros(-prod.numel() % GRAM_LANES)]).reshape(-1, GRAM_LANES)
        lanes = torch.zeros(GRAM_LANES, dtype=torch.float64)
        for row in prod:
            lanes += row
        chunk = 0.0
        for v in lanes.tolist():
            chunk += v
        total += chunk
    return total


def slerp_combine(theta0: torch.Tensor, theta1: torch.Tensor, t: float) -> torch.Tensor:
    n0 = math.sqrt(ordered_dot(theta0, theta0))
    n1 = math.sqrt(ordered_dot(theta1, theta1))
    dot = ordered_dot(theta0, theta1) / ((n0 if n0 > 1e-8 else 1.0) * (n1 if n1 > 1e-8 else 1.0))
    if abs(dot) > 0.9995:
        return theta0 * (1 - t) + theta1 * t
    th0 = math.acos(dot)
    s = math.sin(th0)
    tht = th0 * t
    return theta0 * (math.sin(th0 - tht) / s) + theta1 * (math.sin(tht) / s)


def slerp_planned_combine(theta0: torch.Tensor, delta: torch.Tensor | None, a0: float, c1: float) -> torch.Tensor:
    """slerp of a tensor read in part, with the plan's coefficients (SEMANTICS.md, the geometric methods under a
    budget): ``θ₀·a₀ + Δ̃·c₁`` in float32 (θ₀ itself when a₀ = 1), ``delta`` (Δ̃: Δ on the rows read, exactly 0
    elsewhere) None when no row was read."""
    out = theta0.clone() if a0 == 1.0 else theta0 * torch.tensor(a0, dtype=torch.float32)
    return out if delta is None else out + delta * torch.tensor(c1, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# The reference merge
# --------------------------------------------------------------------------------------------------


def reference_merge(
    method: str,
    base: Path,
    experts: list[Path],
    params: list[dict],
    *,
    normalize: bool | None = None,
    lam: float = 1.0,
    t: float | None = None,
    seed: int = 0,
    expert_keys: list[str] | None = None,
    block_bytes: int = 1 << 20,
    out_dtype: torch.dtype | None = None,
    expert_deltas: list[dict[str, torch.Tensor] | None] | None = None,
    selected_rows: list[dict[str, list[tuple[int, int]]] | None] | None = None,
    rescale: str = "l1",
    coefficients: dict[str, list] | None = None,
) -> dict[str, torch.Tensor]:
    """Full-read merge of ``experts`` onto ``base`` per SEMANTICS.md.

    ``params[k]`` holds expert k's ``weight`` (required except for slerp), ``density`` (default 1.0) and
    ``gamma`` (default 0.01, breadcrumbs). ``expert_keys[k]`` is expert k's catalog id, the DARE mask key.
    ``block_bytes`` only decides how DARE masks are cut into row blocks (using the expert tensor's stored
    itemsize). Returns tensor name -> merged tensor in ``out_dtype`` (default: the base tensor's dtype),
    for every tensor of the base. ``expert_deltas[k]``, when given, is expert k's Δ directly (name -> tensor,
    upcast to float32; a missing name has Δ = 0; θ_k = θ₀ + Δ_k; DARE blocks follow the base's itemsize) and
    ``experts[k]`` is then not read.

    ``selected_rows[k]``, when given (not None), names the rows (dim 0) of expert k's tensors a partial-budget
    merge read (tensor name -> row ranges; a name not in it: nothing read); everywhere else expert k is
    taken as omitted, SEMANTICS.md's Δ_k = 0, θ_k = θ₀ bit for bit (Δ-storing sources: Δ_k zeroed there).

    ``rescale`` (DARE): ``"l1"`` (a spec's default, MergeKit's ``rescale: true``), ``"none"`` or ``"classic"``
    (1/density).

    ``coefficients`` (slerp): a plan's ``[a₀, [c₁]]`` by tensor name (catalog statistics, for the tensors read in
    part): such a tensor is ``θ₀·a₀ + Δ̃·c₁`` (`slerp_planned_combine`) instead of the slerp of the tensors.
    """
    if method not in METHODS:
        raise ValueError(f"unknown merge method {method!r}; expected one of {METHODS}")
    experts = [Path(p) for p in experts]
    if method == "slerp":
        if len(experts) != 1:
            raise ValueError("slerp merges exactly two models: the base and one other")
        if t is None:
            raise ValueError("slerp needs t")
        t = float(t)
    else:
        if len(experts) == 0:
            raise ValueError(f"{method} needs at least one expert")
        if len(params) != len(experts):
            raise ValueError(f"{len(experts)} experts but {len(params)} parameter dicts")
        if normalize is None:
            normalize = NORMALIZE_DEFAULT[method]

    weights: list[float] = []
    densities: list[float] = []
    gammas: list[float] = []
    if method != "slerp":
        for k, p in enumerate(params):
            if "weight" not in p:
                raise ValueError(f"expert {k}: 'weight' is required for {method}")
            weights.append(float(p["weight"]))
            densities.append(float(p.get("density", DEFAULT_DENSITY)))
            gammas.append(float(p.get("gamma", DEFAULT_GAMMA)))
    lam = float(lam)

    needs_keys = method in ("dare_linear", "dare_ties")
    if needs_keys and (expert_keys is None or len(expert_keys) != len(experts)):
        raise ValueError(f"{method} needs one expert key (catalog id) per expert")

    base_files = _tensor_files(Path(base))
    given = list(expert_deltas) if expert_deltas is not None else [None] * len(experts)
    expert_files = [_tensor_files(p) if given[k] is None else {} for k, p in enumerate(experts)]

    out: dict[str, torch.Tensor] = {}
    for name in sorted(base_files):
        base_stored = _read_tensor(base_files[name], name)
        dtype = out_dtype if out_dtype is not None else base_stored.dtype
        theta0 = base_stored.to(torch.float32)

        expert_stored = []
        for k, files in enumerate(expert_files):
            if given[k] is not None:
                expert_stored.append(base_stored)
                continue
            if name not in files:
                raise KeyError(f"expert {k} ({experts[k]}) has no tensor {name!r}")
            stored = _read_tensor(files[name], name)
            if tuple(stored.shape) != tuple(base_stored.shape):
                raise ValueError(
                    f"tensor {name!r}: expert {k} shape {tuple(stored.shape)}"
                    f" != base {tuple(base_stored.shape)}"
                )
            expert_stored.append(stored)
        thetas = [s.to(torch.float32) for s in expert_stored]
        dgiven = [None if g is None else g.get(name, torch.zeros_like(theta0)).to(torch.float32) for g in given]
        for k, sel in enumerate(selected_rows or []):
            if sel is None:
                continue
            keep = row_mask(tuple(theta0.shape), sel.get(name, []))
            if dgiven[k] is None:
                thetas[k] = torch.where(keep, thetas[k], theta0)
            else:
                dgiven[k] = torch.where(keep, dgiven[k], 0.0)
        thetas = [th if d is None else theta_from_delta(theta0, d) for th, d in zip(thetas, dgiven)]

        if method == "slerp" and coefficients and name in coefficients:
            a0, (c1,) = coefficients[name]
            sel = (selected_rows or [None])[0]
            rows = [] if sel is None else sel.get(name, [])
            keep = row_mask(tuple(theta0.shape), rows)
            delta = thetas[0] - theta0 if dgiven[0] is None else dgiven[0]
            merged = slerp_planned_combine(theta0, torch.where(keep, delta, 0.0) if rows else None, a0, c1)
        elif method == "slerp":
            merged = slerp_combine(theta0, thetas[0], t)
        elif method == "linear":
            merged = linear_combine(theta0, thetas, weights, normalize)
        else:
            deltas = [theta - theta0 if d is None else d for theta, d in zip(thetas, dgiven)]
            if method == "task_arithmetic":
                merged = task_arithmetic_combine(theta0, deltas, weights, normalize, lam)
            elif method == "ties":
                trimmed = [ties_trim(delta, d) for delta, d in zip(deltas, densities, strict=True)]
                merged = ties_combine(theta0, trimmed, weights, normalize, lam)
            elif method == "breadcrumbs":
                trimmed = [
                    breadcrumbs_trim(delta, d, g)
                    for delta, d, g in zip(deltas, densities, gammas, strict=True)
                ]
                merged = task_arithmetic_combine(theta0, trimmed, weights, normalize, lam)
            else:  # dare_linear, dare_ties
                trimmed = []
                for k, delta in enumerate(deltas):
                    d = densities[k]
                    if d >= 1:
                        trimmed.append(delta)
                        continue
                    keep = dare_keep_mask(
                        seed,
                        expert_keys[k],
                        name,
                        tuple(delta.shape),
                        expert_stored[k].element_size(),
                        d,
                        block_bytes,
                    )
                    if rescale == "classic":
                        trimmed.append(torch.where(keep, delta / d, 0.0))
                        continue
                    scale = 1.0
                    if rescale == "l1":
                        scale = l1_rescale(delta, keep, expert_stored[k].element_size(), block_bytes)
                    trimmed.append(torch.where(keep, delta * scale, 0.0) if scale != 1.0
                                   else torch.where(keep, delta, 0.0))
                if method == "dare_linear":
                    merged = task_arithmetic_combine(theta0, trimmed, weights, normalize, lam)
                else:
                    merged = ties_combine(theta0, trimmed, weights, normalize, lam)

        out[name] = merged.to(dtype)
    return out
