"""Downstream quality of budgeted merges on a real (tiny) task, not only parameter deviation.

Run: ``.venv/bin/python -m benchmarks.quality`` (about two minutes on one CPU core for all 18 methods;
deterministic seeds; ``--methods task_arithmetic,ties,dare_ties`` for the original three only).
Writes ``benchmarks/results/quality.md`` and ``benchmarks/figures/quality_budget.png`` /
``quality_per_task.png``.

Setup
-----
* Data: scikit-learn's 8x8 ``digits`` (1797 images, ships with scikit-learn), one stratified split
  60 % train / 20 % validation / 20 % test, used by every task.
* Model: MLP 64 → 256 → 256 → 10 (``fc1``, ``fc2``, ``head``; float32). One **shared** 10-logit head: the
  10-class tasks read all 10 logits, the binary tasks read logits 0/1 (trained and evaluated with a
  cross-entropy / argmax over the first two logits). Every expert therefore changes every tensor, including
  the head, and the experts really compete for the same coordinates, as LLM experts sharing an LM head do.
  (Per-task heads stored as separate tensors that only one expert changes would make the head merge
  interference-free and the test easier; we chose the harder, LLM-like setting.)
* Base: pre-trained on a generic, label-free task: predict the k-means (k = 10) cluster of an image from
  three views of it (plain, rotated 90°, pixel-permuted). It knows nothing of the downstream labels.
* Experts, each fully fine-tuned from the base (Adam, a few epochs): digit id; digit id on images rotated
  90°; parity; digit ≥ 5; digit id on pixel-permuted images (one fixed permutation).
* Checkpoints are saved as HF-style directories (``model.safetensors`` + ``config.json``), the base ingested
  with ``Catalog.ingest(..., block_bytes=4096)`` (every weight matrix has many 4 KiB row blocks), the experts
  together with ``Catalog.ingest_many`` (exact pairwise products for the geometric methods), merged with
  ``Catalog.merge`` at each budget, every method of ``ALL_METHODS`` (seed 0 for the random drops). slerp,
  nearswap and arcee_fusion merge the base with the first task's expert, nuslerp the first two; each method
  is evaluated on the tasks of the experts it merges (``merged_tasks``).
* λ, density (and slerp's / nearswap's t) are chosen on the validation split at full budget where the method
  has a grid (``method_grid``), MergeKit's defaults otherwise; everything reported is test accuracy.
* Controls with the same bytes as each budgeted plan: the planner's budgeted ``Plan`` with ``plan.access``
  replaced by (i) seeded random read units, (ii) the lowest-scored read units (the tail of the planner's own
  ranking), filled greedily up to the planner's planned bytes, run by mergepipe's executor
  (``mergepipe_db.pipeline.execute.execute``: real byte-range reads, sketch thresholds for partial TIES /
  breadcrumbs tensors, the geometric methods' coefficients from catalog statistics, realized == planned
  checked). A read unit is the planner's (``unit_kind``): one expert's block, a block row of every expert (the
  methods with a joint election) or one expert's whole tensor (slerp, arcee_fusion). An independent in-memory
  task-arithmetic implementation that masks the deltas of unselected blocks to zero is compared byte for byte
  with mergepipe's committed budgeted output and with every task-arithmetic control output; the geometric
  methods' partially read tensors are compared with θ₀·a₀ + Σ_k Δ̃_k·c_k (``geometric_masked``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import random
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent
TASKS_ALL = ("digit", "rot90", "parity", "ge5", "perm")
TASK_INFO = {  # task -> (input view, number of classes, description)
    "digit": ("plain", 10, "digit id (10 classes)"),
    "rot90": ("rot90", 10, "digit id of the image rotated 90° (10 classes)"),
    "parity": ("plain", 2, "digit parity (2 classes, logits 0/1)"),
    "ge5": ("plain", 2, "digit ≥ 5 (2 classes, logits 0/1)"),
    "perm": ("perm", 10, "digit id of a fixed pixel permutation (10 classes)"),
}
METHOD_SHORT = {"task_arithmetic": "TA", "ties": "TIES", "dare_ties": "DARE-TIES", "dare_linear": "DARE-L",
                "breadcrumbs": "BC", "breadcrumbs_ties": "BC-TIES", "della": "DELLA", "della_linear": "DELLA-L",
                "sce": "SCE", "nearswap": "NearSwap", "ram": "RAM", "ramplus_tl": "RAM+TL", "arcee_fusion": "Fusion",
                "model_stock": "ModelStock", "multislerp": "MultiSLERP", "karcher": "Karcher", "nuslerp": "NuSLERP",
                "slerp": "SLERP"}
#: the original three methods (the default run) and every method the benchmark runs (`--methods all`):
#: mergepipe's methods except linear (the base is one more averaged input there, not θ₀) and passthrough
ORIGINAL_METHODS = ("task_arithmetic", "ties", "dare_ties")
ALL_METHODS = ORIGINAL_METHODS + (
    "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear", "sce", "ram", "ramplus_tl",
    "model_stock", "multislerp", "karcher", "nuslerp", "slerp", "nearswap", "arcee_fusion")
#: how each method's validation grid is formed: "ta" (λ), "ties" (ties' densities × λ), "dare" (DARE's
#: densities × λ), "slerp_t" / "nearswap_t" (the method's t), "none" (MergeKit's defaults only: one point)
GRID_KIND = {"task_arithmetic": "ta", "ties": "ties", "dare_ties": "dare", "dare_linear": "dare",
             "breadcrumbs": "ties", "breadcrumbs_ties": "ties", "della": "dare", "della_linear": "dare",
             "slerp": "slerp_t", "nearswap": "nearswap_t"}
#: methods that merge one expert only (exactly two models: the base and the first task's expert) or two
ONE_EXPERT_METHODS = frozenset({"slerp", "nearswap", "arcee_fusion"})
TWO_EXPERT_METHODS = frozenset({"nuslerp"})
TWO_MODEL_METHODS = ONE_EXPERT_METHODS  # (old name)
#: methods whose models carry no weight (MergeKit declares none)
UNWEIGHTED = frozenset({"sce", "ram", "ramplus_tl", "nearswap", "arcee_fusion", "slerp", "model_stock", "karcher"})
#: methods that take no λ (MergeKit declares none; sce takes one and is left at its default 1)
NO_LAMBDA = UNWEIGHTED | {"multislerp", "nuslerp"}
#: nearswap's t when none is given (MergeKit has no default): the update is taken where |Δ| is within about t
NEARSWAP_T = 1e-3


def merged_tasks(method: str, tasks: tuple[str, ...]) -> tuple[str, ...]:
    """The tasks whose experts `method` merges (in spec order): one for slerp / nearswap / arcee_fusion, two for
    nuslerp, all of them otherwise. The merge is evaluated on exactly these tasks."""
    if method in ONE_EXPERT_METHODS:
        return tasks[:1]
    if method in TWO_EXPERT_METHODS:
        return tasks[:2]
    return tasks


def unit_kind(method: str) -> str:
    """The planner's read unit for `method` under a partial budget (docs/SEMANTICS.md), taken from the operator:
    "row" (a block row of every expert together: a joint election), "tensor" (an expert's whole tensor: slerp,
    arcee_fusion), "block" (one expert's block; the geometric methods plan blocks from catalog statistics).
    The controls draw the same units, and `ranking_reproduces_planner` checks this model of the planner."""
    from mergepipe_db.operators import registry

    cls = registry.get(method)
    if cls.joint_election:
        return "row"
    if cls.tensor_granular and getattr(cls, "plans_from_gram", None) is None:
        return "tensor"
    return "block"


@dataclass
class Config:
    tasks: tuple[str, ...] = TASKS_ALL
    hidden: int = 256
    base_epochs: int = 15
    expert_epochs: int = 5
    lr: float = 1e-3
    batch: int = 64
    block_bytes: int = 4096
    budgets: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0)
    methods: tuple[str, ...] = ALL_METHODS
    # validation grids (full budget); chosen by mean validation accuracy over tasks, first best wins
    ta_lambdas: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
    ties_densities: tuple[float, ...] = (0.2, 0.5, 0.8)
    ties_lambdas: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)
    dare_densities: tuple[float, ...] = (0.5, 0.8)
    dare_lambdas: tuple[float, ...] = (0.3, 0.5, 0.7, 1.0)
    slerp_ts: tuple[float, ...] = (0.25, 0.5, 0.75)  # an interpolation (t = 1 is the expert itself)
    nearswap_ts: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 0.1)
    n_random: int = 10
    seed: int = 0
    merge_seed: int = 0
    md_path: Path | None = ROOT / "results" / "quality.md"
    fig_dir: Path | None = ROOT / "figures"
    workdir: Path | None = None  # default: a temporary directory, removed at the end
    verbose: bool = True
    dump_path: Path | None = None  # the run's results (pickle), to render the report again (`--from-dump`)
    extra: dict[str, Any] = field(default_factory=dict)


def log(cfg: Config, msg: str) -> None:
    if cfg.verbose:
        print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# Data and tasks
# ------------------------------------------------------------------------------------------------


@dataclass
class Data:
    X: np.ndarray  # (n, 64) float32 in [0, 1]
    y: np.ndarray  # digit labels
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    perm: np.ndarray

    def view(self, name: str, idx: np.ndarray) -> np.ndarray:
        x = self.X[idx]
        if name == "plain":
            return x
        if name == "rot90":
            return np.ascontiguousarray(np.rot90(x.reshape(-1, 8, 8), k=1, axes=(1, 2)).reshape(-1, 64))
        if name == "perm":
            return np.ascontiguousarray(x[:, self.perm])
        raise ValueError(name)

    def labels(self, task: str, idx: np.ndarray) -> np.ndarray:
        y = self.y[idx]
        if task in ("digit", "rot90", "perm"):
            return y.astype(np.int64)
        if task == "parity":
            return (y % 2).astype(np.int64)
        if task == "ge5":
            return (y >= 5).astype(np.int64)
        raise ValueError(task)


def load_data(seed: int) -> Data:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    X = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    idx = np.arange(len(y))
    train, rest = train_test_split(idx, test_size=0.4, random_state=seed, stratify=y)
    val, test = train_test_split(rest, test_size=0.5, random_state=seed, stratify=y[rest])
    perm = np.random.default_rng(seed + 1).permutation(64)
    return Data(X, y, np.sort(train), np.sort(val), np.sort(test), perm)


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class _Adam:
    """Plain Adam (betas 0.9/0.999, eps 1e-8, no weight decay). torch.optim would import torch._dynamo on
    first use (seconds on a loaded machine), which the smoke test cannot afford."""

    def __init__(self, params: list[nn.Parameter], lr: float, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8) -> None:
        self.params, self.lr, self.b1, self.b2, self.eps, self.t = params, lr, b1, b2, eps, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            m.mul_(self.b1).add_(p.grad, alpha=1 - self.b1)
            v.mul_(self.b2).addcmul_(p.grad, p.grad, value=1 - self.b2)
            p.addcdiv_(m / c1, (v / c2).sqrt_().add_(self.eps), value=-self.lr)


def _train(model: MLP, X: np.ndarray, y: np.ndarray, n_classes: np.ndarray, epochs: int, cfg: Config,
           seed: int) -> None:
    """Adam + cross-entropy over each sample's first n_classes logits (shared head)."""
    g = torch.Generator().manual_seed(seed)
    opt = _Adam(list(model.parameters()), lr=cfg.lr)
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
    valid = torch.arange(10)[None, :] < torch.from_numpy(n_classes)[:, None]
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(yt), generator=g)
        for i in range(0, len(order), cfg.batch):
            b = order[i:i + cfg.batch]
            logits = model(Xt[b]).masked_fill(~valid[b], -1e9)
            loss = nn.functional.cross_entropy(logits, yt[b])
            model.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()


def make_eval_sets(data: Data, tasks: tuple[str, ...], split: str) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
    idx = getattr(data, split)
    return {t: (torch.from_numpy(data.view(TASK_INFO[t][0], idx)), data.labels(t, idx)) for t in tasks}


@torch.no_grad()
def accuracy(state: dict[str, torch.Tensor], hidden: int, evalset: dict[str, tuple[torch.Tensor, np.ndarray]]
             ) -> dict[str, float]:
    m = MLP(hidden)
    m.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    m.eval()
    out = {}
    for task, (x, y) in evalset.items():
        n = TASK_INFO[task][1]
        pred = m(x)[:, :n].argmax(1).numpy()
        out[task] = float((pred == y).mean())
    return out


def train_family(cfg: Config, data: Data) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The base (generic k-means-cluster pre-training on three views) and one fine-tuned expert per task."""
    from sklearn.cluster import KMeans

    tr = data.train
    clusters = KMeans(n_clusters=10, random_state=cfg.seed, n_init=4).fit(data.X[tr]).labels_.astype(np.int64)
    views = ("plain", "rot90", "perm")
    Xb = np.concatenate([data.view(v, tr) for v in views])
    yb = np.concatenate([clusters] * len(views))
    torch.manual_seed(cfg.seed)
    base = MLP(cfg.hidden)
    _train(base, Xb, yb, np.full(len(yb), 10), cfg.base_epochs, cfg, seed=cfg.seed)
    base_sd = {k: v.detach().clone().contiguous() for k, v in base.state_dict().items()}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for task in cfg.tasks:
        m = copy.deepcopy(base)
        view, n, _ = TASK_INFO[task]
        _train(m, data.view(view, tr), data.labels(task, tr), np.full(len(tr), n), cfg.expert_epochs, cfg,
               seed=cfg.seed + 101 + TASKS_ALL.index(task))
        experts[task] = {k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}
    return base_sd, experts


def save_hf(path: Path, state: dict[str, torch.Tensor], cfg: Config, name: str) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({
        "architectures": ["DigitsMLP"], "model_type": "digits-mlp", "input_dim": 64, "hidden_size": cfg.hidden,
        "num_logits": 10, "torch_dtype": "float32", "task": name,
    }, indent=2) + "\n")
    return path


def load_st(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


# ------------------------------------------------------------------------------------------------
# Specs, plans, controls
# ------------------------------------------------------------------------------------------------


def make_spec(method: str, tasks: tuple[str, ...], lam: float | None, density: float | None, seed: int,
              t: float | None = None) -> dict[str, Any]:
    """The spec of `method` over the experts of `tasks` (cut to `merged_tasks`), weight 1 each where the method
    takes weights; `lam` where it takes λ, `density` per model when given, `t` for slerp / nearswap."""
    models = []
    for task in merged_tasks(method, tasks):
        p: dict[str, Any] = {} if method in UNWEIGHTED else {"weight": 1.0}
        if density is not None:
            p["density"] = density
        models.append({"model": task, "parameters": p})
    params: dict[str, Any] = {} if method in NO_LAMBDA or lam is None else {"lambda": lam}
    if method == "nearswap":
        params["t"] = NEARSWAP_T if t is None else t
    if method == "slerp":
        params["t"] = 0.5 if t is None else t
    return {"merge_method": method, "base_model": "base", "models": models, "parameters": params, "seed": seed}


def method_grid(cfg: Config, method: str) -> list[tuple[float | None, float | None]]:
    """The (λ, density) validation grid of a method (full budget; None: not given). slerp's and nearswap's t
    grid is `t_grid`; the validation grid is the product of the two."""
    kind = GRID_KIND.get(method, "none" if method in ALL_METHODS else None)
    if kind == "ta":
        return [(lam, None) for lam in cfg.ta_lambdas]
    if kind == "ties":
        return [(lam, d) for d in cfg.ties_densities for lam in cfg.ties_lambdas]
    if kind == "dare":
        return [(lam, d) for d in cfg.dare_densities for lam in cfg.dare_lambdas]
    if kind in ("none", "slerp_t", "nearswap_t"):
        return [(None if method in NO_LAMBDA else 1.0, None)]
    raise ValueError(f"the quality benchmark does not know method {method!r}")


def t_grid(cfg: Config, method: str) -> list[float | None]:
    """slerp's / nearswap's t values on the validation grid; [None] for the other methods."""
    kind = GRID_KIND.get(method)
    return list(cfg.slerp_ts) if kind == "slerp_t" else list(cfg.nearswap_ts) if kind == "nearswap_t" else [None]


@dataclass(frozen=True)
class Cand:
    """One candidate (expert, block) of the planner — or (expert, whole tensor) for a tensor-level method
    (`read.block_idx == -1`): position, base tensor idx, the Read, its score, the block indices it covers."""

    pos: int
    tidx: int
    read: Any
    score: float
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Unit:
    """What the planner selects or leaves as a whole: one Cand ("block", "tensor") or a block row of every
    expert's candidates ("row", a joint election). Scored by the sum of its candidates' scores, costs their bytes."""

    cands: tuple[Cand, ...]
    score: float
    nbytes: int
    order: tuple[Any, ...]


def candidates(cat: Any, full_plan: Any, kind: str = "block", zero: set[tuple[int, int, int]] | None = None
               ) -> list[Cand]:
    """Every candidate of a full-budget plan, in the planner's candidate order (score desc, tensor, block, expert).

    score = |c_k| · delta_l2 from the catalog's `blocks` view (`tensors` for tensor-level methods), as in
    sql/plan_candidates.sql; blocks whose delta is exactly zero are not candidates (added to `zero` as
    (position, tensor idx, block): a full read of a geometric method reads whole tensors, those blocks too).
    """
    from mergepipe_db.core.plan import Read

    names = [e.checkpoint.name for e in full_plan.experts]
    quoted = ", ".join("'" + n.replace("'", "''") + "'" for n in names)
    tname = {t.idx: t.name for t in full_plan.base_tensors}
    out = []
    if kind == "tensor":
        _, rows = cat.sql(f"SELECT checkpoint, name, delta_l2 FROM tensors WHERE checkpoint IN ({quoted})")
        tl2 = {(r[0], r[1]): float(r[2]) for r in rows}
        for (pos, tidx), reads in full_plan.access.items():
            e = full_plan.experts[pos]
            assert len(reads) == 1 and reads[0].block_idx == -1, "a tensor-level method reads whole tensors"
            out.append(Cand(pos, tidx, reads[0], abs(e.coef) * tl2[(e.checkpoint.name, tname[tidx])],
                            full_plan.selected_blocks(pos, tidx)))
    else:
        _, rows = cat.sql(f"SELECT checkpoint, tensor, block_idx, delta_l2, \"offset\", nbytes, xxh3 FROM blocks "
                          f"WHERE checkpoint IN ({quoted})")
        blocks = {(r[0], r[1], int(r[2])): (float(r[3]), Read(int(r[2]), int(r[4]), int(r[5]), r[6])) for r in rows}
        for pos, tidx in full_plan.access:
            e = full_plan.experts[pos]
            for b in full_plan.selected_blocks(pos, tidx):  # a tensor read whole: each of its nonzero blocks
                l2, read = blocks[(e.checkpoint.name, tname[tidx], b)]
                if l2 != 0.0:
                    out.append(Cand(pos, tidx, read, abs(e.coef) * l2, (b,)))
                elif zero is not None:
                    zero.add((pos, tidx, b))
    out.sort(key=lambda c: (-c.score, c.tidx, c.read.block_idx, c.pos))
    return out


def make_units(cands: list[Cand], kind: str) -> list[Unit]:
    """The planner's read units over `cands`, in its rank order: score desc, then tensor, block (and expert for
    single candidates) — sql/plan_rank.sql and, for "row", sql/plan_rank_grouped.sql."""
    if kind == "row":
        groups: dict[tuple[int, int], list[Cand]] = defaultdict(list)
        for c in cands:
            groups[(c.tidx, c.read.block_idx)].append(c)
        units = []
        for (tidx, b), cs in groups.items():
            cs.sort(key=lambda c: c.pos)
            score = sum(c.score for c in cs)
            units.append(Unit(tuple(cs), score, sum(c.read.nbytes for c in cs), (-score, tidx, b)))
    else:
        units = [Unit((c,), c.score, c.read.nbytes, (-c.score, c.tidx, c.read.block_idx, c.pos)) for c in cands]
    units.sort(key=lambda u: u.order)
    return units


def _flat(units: list[Unit]) -> list[Cand]:
    return [c for u in units for c in u.cands]


def prefix_selection(ranked: list[Unit], budget_bytes: int) -> list[Cand]:
    """The planner's rule: the prefix of the ranking whose running cost fits the budget."""
    sel, run = [], 0
    for u in ranked:
        run += u.nbytes
        if run > budget_bytes:
            break
        sel.append(u)
    return _flat(sel)


def fill_selection(order: list[Unit], target_bytes: int) -> list[Cand]:
    """Greedy fill in `order`: take a unit when it still fits in target_bytes, skip it otherwise."""
    sel, used = [], 0
    for u in order:
        if used + u.nbytes <= target_bytes:
            sel.append(u)
            used += u.nbytes
            if used == target_bytes:
                break
    return _flat(sel)


def access_key(sel: list[Cand]) -> set[tuple[int, int, int]]:
    return {(c.pos, c.tidx, b) for c in sel for b in c.blocks}


def plan_access_key(plan: Any) -> set[tuple[int, int, int]]:
    return {(pos, tidx, b) for pos, tidx in plan.access for b in plan.selected_blocks(pos, tidx)}


def plan_with_access(plan: Any, sel: list[Cand], all_cands: list[Cand], sketch_plan: Any | None) -> Any:
    """`plan` with its access set replaced by `sel` (full_selection, sketches, the geometric methods'
    coefficients and planned bytes to match). `sketch_plan`: a plan of the same spec that reads nothing
    (budget 0): it carries the sketches of every (expert, tensor) and the coefficients of every tensor."""
    access: dict[tuple[int, int], list[Any]] = defaultdict(list)
    for c in sel:
        access[(c.pos, c.tidx)].append(c.read)
    n_cand: dict[tuple[int, int], int] = defaultdict(int)
    for c in all_cands:
        n_cand[(c.pos, c.tidx)] += 1
    full_selection = {k: len(access.get(k, ())) == n for k, n in n_cand.items()}
    sketches, coefficients = {}, {}
    if sketch_plan is not None:
        for k, full in full_selection.items():
            if not full and k in sketch_plan.sketches:
                sketches[k] = sketch_plan.sketches[k]
        if sketch_plan.coefficients:  # as the planner: for the tensors some expert reads in part
            names = {t.idx: t.name for t in plan.base_tensors}
            partial = {names[tidx] for (_, tidx), full in full_selection.items() if not full}
            coefficients = {n: c for n, c in sketch_plan.coefficients.items() if n in partial}
            assert partial <= set(coefficients), "every partially read tensor has its coefficients"
    return dataclasses.replace(
        plan,
        access={k: tuple(sorted(v, key=lambda r: r.block_idx)) for k, v in access.items()},
        full_selection=full_selection, sketches=sketches, planned_bytes=sum(c.read.nbytes for c in sel),
        bound_per_tensor=None, bound_total=None, plan_hash="control", coefficients=coefficients,
    )


def execute_plan(plan: Any, workdir: Path) -> dict[str, torch.Tensor]:
    """Run a (possibly hand-built) plan with mergepipe's executor into a scratch directory; load the output."""
    from mergepipe_db.pipeline.execute import execute

    staging = Path(tempfile.mkdtemp(prefix="exec-", dir=workdir))
    res = execute(plan, staging)
    assert res.realized_bytes == plan.planned_bytes
    state = load_st(staging / res.shard_names[0])
    for p in staging.iterdir():
        p.unlink()
    staging.rmdir()
    return state


def ta_masked(base: dict[str, torch.Tensor], experts: list[dict[str, torch.Tensor]], weights: list[float],
              lam: float, selected: set[tuple[int, str, int]], rows: dict[tuple[str, int], tuple[int, int]]
              ) -> dict[str, torch.Tensor]:
    """Independent in-memory task arithmetic (docs/SEMANTICS.md) with the deltas of unselected blocks zeroed.

    `selected`: (expert position, tensor name, block_idx); `rows`: (tensor name, block_idx) -> row range.
    """
    blocks_of: dict[str, list[int]] = defaultdict(list)
    for (name, b) in rows:
        blocks_of[name].append(b)
    out = {}
    for name, b0 in base.items():
        b32 = b0.to(torch.float32)
        acc = torch.zeros_like(b32)
        for k, (e, w) in enumerate(zip(experts, weights)):
            delta = e[name].to(torch.float32) - b32
            mask = torch.zeros(b32.shape[0] if b32.dim() else 1, dtype=torch.bool)
            for b in blocks_of[name]:
                if (k, name, b) in selected:
                    r0, r1 = rows[(name, b)]
                    mask[r0:r1] = True
            if b32.dim() >= 1:
                shape = (-1,) + (1,) * (b32.dim() - 1)
                delta = torch.where(mask.view(shape), delta, torch.zeros((), dtype=torch.float32))
            elif not bool(mask[0]):
                delta = torch.zeros_like(delta)
            acc = acc + delta * w
        out[name] = (b32 + acc * lam).to(b0.dtype)
    return out


def geometric_masked(base: dict[str, torch.Tensor], experts: list[dict[str, torch.Tensor]],
                     coefficients: dict[str, Any], selected: set[tuple[int, str, int]],
                     rows: dict[tuple[str, int], tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Independent form of a geometric method's output on the tensors it reads in part (docs/SEMANTICS.md):
    ``θ₀·a₀ + Σ_k Δ̃_k·c_k`` in float32, Δ̃_k = θ_k − θ₀ on the rows of the selected blocks, 0 elsewhere;
    (a₀, c_k) from the plan's coefficients. Only the tensors of `coefficients`."""
    out = {}
    for name, (a0, c) in coefficients.items():
        b32 = base[name].to(torch.float32)
        acc = b32 * torch.tensor(a0, dtype=torch.float32)
        for k, (e, ck) in enumerate(zip(experts, c)):
            mask = torch.zeros(b32.shape[0], dtype=torch.bool)
            for (n, b), (r0, r1) in rows.items():
                if n == name and (k, name, b) in selected:
                    mask[r0:r1] = True
            delta = e[name].to(torch.float32) - b32
            delta = torch.where(mask.view((-1,) + (1,) * (b32.dim() - 1)), delta, torch.zeros((), dtype=torch.float32))
            acc = acc + delta * torch.tensor(ck, dtype=torch.float32)
        out[name] = acc
    return out


def tensors_equal_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if set(a) != set(b):
        return False
    return all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
               and a[k].contiguous().view(torch.uint8).equal(b[k].contiguous().view(torch.uint8)) for k in a)


def l2_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a))


# ------------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------------


def run(cfg: Config) -> dict[str, Any]:
    from mergepipe_db import Catalog

    t_start = time.perf_counter()
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    tmp = None
    if cfg.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="mp-quality-")
        work = Path(tmp.name)
    else:
        work = Path(cfg.workdir)
        work.mkdir(parents=True, exist_ok=True)
    try:
        return _run(cfg, work, t_start, Catalog)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(cfg: Config, work: Path, t_start: float, Catalog: Any) -> dict[str, Any]:
    tasks = cfg.tasks
    R: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v)
                                    for k, v in dataclasses.asdict(cfg).items()}}
    data = load_data(cfg.seed)
    R["split"] = {"train": len(data.train), "val": len(data.val), "test": len(data.test)}
    val_sets = make_eval_sets(data, tasks, "val")
    test_sets = make_eval_sets(data, tasks, "test")

    # 1. train ------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    base_sd, expert_sds = train_family(cfg, data)
    log(cfg, f"[{time.perf_counter() - t_start:6.1f}s] trained base + {len(tasks)} experts "
             f"({time.perf_counter() - t0:.1f}s)")
    R["base_acc"] = accuracy(base_sd, cfg.hidden, test_sets)
    R["expert_acc"] = {t: accuracy(expert_sds[t], cfg.hidden, {t: test_sets[t]})[t] for t in tasks}
    R["expert_cross"] = {t: accuracy(expert_sds[t], cfg.hidden, test_sets) for t in tasks}
    log(cfg, f"          base test acc {fmt_accs(R['base_acc'])}")
    log(cfg, f"          experts on own task {fmt_accs(R['expert_acc'])}")

    # 2. save + ingest ----------------------------------------------------------------------------
    models = work / "models"
    save_hf(models / "base", base_sd, cfg, "base")
    for t in tasks:
        save_hf(models / t, expert_sds[t], cfg, t)
    # the files as written (what mergepipe reads), for the in-memory reference
    base_sd = load_st(models / "base" / "model.safetensors")
    expert_sds = {t: load_st(models / t / "model.safetensors") for t in tasks}
    cat = Catalog.open(str(work / "catalog.duckdb"))
    cat.ingest(models / "base", name="base", block_bytes=cfg.block_bytes)
    # one scan group: the experts' pairwise products ⟨Δ_i, Δ_j⟩ are exact (the geometric methods' coefficients
    # under a budget come from them; docs/SEMANTICS.md, "Inner-product statistics")
    cat.ingest_many([models / t for t in tasks], names=list(tasks), base="base")
    _, rows = cat.sql("SELECT tensor, block_idx, row_start, row_stop FROM blocks WHERE checkpoint = 'base'")
    row_ranges = {(r[0], int(r[1])): (int(r[2]), int(r[3])) for r in rows}
    _, trows = cat.sql("SELECT name, shape, n_blocks, nbytes FROM tensors WHERE checkpoint = 'base' "
                       "ORDER BY tensor_idx")
    R["tensors"] = [(r[0], r[1], int(r[2]), int(r[3])) for r in trows]
    R["n_blocks_per_expert"] = sum(int(r[2]) for r in trows)
    _, drows = cat.sql("SELECT checkpoint, SUM(delta_l2 * delta_l2) FROM tensors WHERE checkpoint <> 'base' "
                       "GROUP BY checkpoint")
    R["expert_delta_l2"] = {r[0]: math.sqrt(float(r[1])) for r in drows}
    log(cfg, f"[{time.perf_counter() - t_start:6.1f}s] ingested base + {len(tasks)} experts, "
             f"{R['n_blocks_per_expert']} blocks per checkpoint (block_bytes={cfg.block_bytes})")

    # 3. choose lambda / density / t on validation at full budget -----------------------------------
    # (each method on the tasks of the experts it merges: `merged_tasks`)
    R["grid"] = {}
    R["chosen"] = {}
    R["failed"] = {}
    for method in cfg.methods:
        mt = merged_tasks(method, tasks)
        grid = [{"lambda": lam, "density": d, "t": t} for lam, d in method_grid(cfg, method)
                for t in t_grid(cfg, method)]
        rows_g = []
        try:
            for g in grid:
                plan = cat.plan(make_spec(method, tasks, g["lambda"], g["density"], cfg.merge_seed, g["t"]),
                                budget="1.0")
                state = execute_plan(plan, work)
                acc = accuracy(state, cfg.hidden, {t: val_sets[t] for t in mt})
                rows_g.append(dict(g, val=acc, val_mean=float(np.mean(list(acc.values())))))
        except Exception as exc:  # noqa: BLE001 — reported (method, spec, error), not fixed here
            R["failed"][method] = f"{type(exc).__name__}: {exc}"
            log(cfg, f"[{time.perf_counter() - t_start:6.1f}s] {method}: FAILED {R['failed'][method]}")
            continue
        best = max(range(len(rows_g)), key=lambda i: (rows_g[i]["val_mean"], -i))
        R["grid"][method] = rows_g
        R["chosen"][method] = {k: rows_g[best][k] for k in ("lambda", "density", "t")}
        log(cfg, f"[{time.perf_counter() - t_start:6.1f}s] {method}: chose {fmt_params(R['chosen'][method])} "
                 f"(val mean {rows_g[best]['val_mean']:.3f}, {len(grid)} grid points)")

    # 4. budgeted merges + controls --------------------------------------------------------------
    R["merges"] = {}
    checks: dict[str, Any] = {"ranking_reproduces_planner": [], "ta_masked_equals_mergepipe": [],
                              "ta_masked_equals_controls": [], "executor_equals_commit": [],
                              "geometric_control_equals_formula": []}
    access_sets: dict[tuple[str, float], frozenset] = {}
    out_root = work / "merged"
    out_root.mkdir()
    for method in cfg.methods:
        if method in R["failed"]:
            continue
        try:
            per_b = _merge_method(cfg, R, method, cat, work, out_root, checks, access_sets, test_sets, base_sd,
                                  expert_sds, row_ranges, t_start)
        except Exception as exc:  # noqa: BLE001 — reported (method, spec, error), not fixed here
            R["failed"][method] = f"{type(exc).__name__}: {exc}"
            log(cfg, f"[{time.perf_counter() - t_start:6.1f}s] {method}: FAILED {R['failed'][method]}")
            continue
        R["merges"][method] = per_b
    R["same_access"] = {m: all(access_sets[(m, b)] == access_sets[("task_arithmetic", b)] for b in cfg.budgets)
                        for m in R["merges"] if ("task_arithmetic", cfg.budgets[0]) in access_sets}
    R["same_access_all_methods"] = all(R["same_access"].get(m, False) for m in ORIGINAL_METHODS
                                       if m in R["merges"])
    R["checks"] = checks
    R["seconds"] = time.perf_counter() - t_start
    if cfg.dump_path is not None:
        import pickle

        cfg.dump_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.dump_path.write_bytes(pickle.dumps(R))
    render(cfg, R)
    return R


def render(cfg: Config, R: dict[str, Any]) -> None:
    """Write the report and the figures of a run's results."""
    if cfg.md_path is not None:
        write_md(cfg, R)
        log(cfg, f"wrote {cfg.md_path}")
    if cfg.fig_dir is not None:
        for p in write_figures(cfg, R):
            log(cfg, f"wrote {p}")


def _merge_method(cfg: Config, R: dict[str, Any], method: str, cat: Any, work: Path, out_root: Path,
                  checks: dict[str, Any], access_sets: dict[tuple[str, float], frozenset],
                  test_sets_all: dict[str, Any], base_sd: dict[str, torch.Tensor],
                  expert_sds: dict[str, dict[str, torch.Tensor]], row_ranges: dict[tuple[str, int], tuple[int, int]],
                  t_start: float) -> dict[float, Any]:
    """One method at every budget: the planner's merge (committed), the random and lowest-scored controls at
    equal bytes (its read units), the checks. Returns {budget: entry}."""
    tasks = cfg.tasks
    mt = merged_tasks(method, tasks)
    test_sets = {t: test_sets_all[t] for t in mt}
    ch = R["chosen"][method]
    spec = make_spec(method, tasks, ch["lambda"], ch["density"], cfg.merge_seed, ch["t"])
    full_plan = cat.plan(spec, budget="1.0")
    tname = {t.idx: t.name for t in full_plan.base_tensors}

    def by_tensor(c: Cand, tname: dict[int, str] = tname) -> str:
        return tname[c.tidx]

    def by_expert(c: Cand) -> str:
        return mt[c.pos]
    kind_u = unit_kind(method)
    zero: set[tuple[int, int, int]] = set()
    ranked = candidates(cat, full_plan, kind_u, zero)
    units = make_units(ranked, kind_u)
    # a plan that reads nothing: the sketches of every (expert, tensor) (TIES / breadcrumbs thresholds of
    # partially read tensors) and the geometric methods' coefficients of every tensor
    sketch_plan = cat.plan(spec, budget="0")
    weights = [e.weight for e in full_plan.experts]
    full_state = None
    per_b: dict[float, Any] = {}
    for budget in sorted(cfg.budgets, reverse=True):
        tag = f"{method}-b{budget:g}".replace(".", "p")
        res = cat.merge(spec, out=out_root / tag, budget=str(budget))
        state = load_st(Path(res.out) / "model.safetensors")
        plan = cat.plan(spec, budget=str(budget))
        assert plan.plan_hash == res.plan_hash
        if full_state is None:
            assert budget == 1.0, "the full budget must be among the budgets (reference for deviation)"
            full_state = state
        # the ranking we rebuilt from the catalog must reproduce the planner's access set
        mine = prefix_selection(units, plan.budget_bytes)
        ok_rank = access_key(mine) == plan_access_key(plan) - zero
        checks["ranking_reproduces_planner"].append((method, budget, ok_rank))
        access_sets[(method, budget)] = frozenset(access_key(mine))
        # mergepipe executor on the planner's plan == the committed output
        if budget < 1.0 and budget == min(cfg.budgets):
            checks["executor_equals_commit"].append(
                (method, budget, tensors_equal_bytes(execute_plan(plan, work), state)))
        entry: dict[str, Any] = {
            "budget_bytes": res.budget_bytes, "full_bytes": res.full_bytes,
            "planned_bytes": res.planned_bytes, "realized_bytes": res.realized_bytes,
            "n_blocks": len(mine), "n_candidates": len(ranked), "n_units": len(units), "unit": kind_u,
            "bound": res.bound,
            "planner": {"test": accuracy(state, cfg.hidden, test_sets), "dev": l2_dev(state, full_state),
                        "bytes": res.realized_bytes, "n_blocks": len(mine),
                        "bound": omitted_bound(ranked, mine) if method == "task_arithmetic" else None,
                        "per_tensor": bytes_by(mine, by_tensor),
                        "per_expert": bytes_by(mine, by_expert)},
        }
        if method == "task_arithmetic":
            sel = {(c.pos, full_plan.base_tensors[c.tidx].name, c.read.block_idx) for c in mine}
            ref = ta_masked(base_sd, [expert_sds[t] for t in tasks], weights, ch["lambda"], sel, row_ranges)
            checks["ta_masked_equals_mergepipe"].append((method, budget, tensors_equal_bytes(ref, state)))
        if plan.coefficients:  # a geometric method under a budget: the committed output against the formula
            sel = {(c.pos, full_plan.base_tensors[c.tidx].name, b) for c in mine for b in c.blocks}
            ref = geometric_masked(base_sd, [expert_sds[t] for t in mt], plan.coefficients, sel, row_ranges)
            ok = all(torch.allclose(state[n].to(torch.float32), ref[n], rtol=1e-5, atol=1e-6) for n in ref)
            checks["geometric_control_equals_formula"].append((method, budget, "planner", ok))
        # controls at equal bytes
        target = res.realized_bytes
        ctrl_sels: dict[str, list[list[Cand]]] = {"random": [], "lowest": []}
        if budget < 1.0:
            for s in range(cfg.n_random):
                order = list(units)
                random.Random(1000 * cfg.seed + s).shuffle(order)
                ctrl_sels["random"].append(fill_selection(order, target))
            ctrl_sels["lowest"].append(fill_selection(list(reversed(units)), target))
        for kind, sels in ctrl_sels.items():
            runs = []
            for sel_c in sels:
                cplan = plan_with_access(plan, sel_c, ranked, sketch_plan)
                cstate = execute_plan(cplan, work)
                if cplan.coefficients:  # a geometric method: the partially read tensors against the formula
                    sel = {(c.pos, full_plan.base_tensors[c.tidx].name, b) for c in sel_c for b in c.blocks}
                    ref = geometric_masked(base_sd, [expert_sds[t] for t in mt], cplan.coefficients, sel, row_ranges)
                    ok = all(torch.allclose(cstate[n].to(torch.float32), ref[n], rtol=1e-5, atol=1e-6) for n in ref)
                    checks["geometric_control_equals_formula"].append((method, budget, kind, ok))
                if method == "task_arithmetic":
                    sel = {(c.pos, full_plan.base_tensors[c.tidx].name, c.read.block_idx) for c in sel_c}
                    ref = ta_masked(base_sd, [expert_sds[t] for t in tasks], weights, ch["lambda"], sel,
                                    row_ranges)
                    checks["ta_masked_equals_controls"].append(
                        (method, budget, kind, tensors_equal_bytes(ref, cstate)))
                runs.append({"test": accuracy(cstate, cfg.hidden, test_sets), "dev": l2_dev(cstate, full_state),
                             "bytes": cplan.planned_bytes, "n_blocks": len(sel_c),
                             "bound": omitted_bound(ranked, sel_c) if method == "task_arithmetic" else None,
                             "per_tensor": bytes_by(sel_c, by_tensor),
                             "per_expert": bytes_by(sel_c, by_expert)})
            entry[kind] = runs
        per_b[budget] = entry
        pm = mean_acc(entry["planner"]["test"])
        msg = f"planner {pm:.3f}"
        if entry.get("random"):
            msg += (f"  random {np.mean([mean_acc(r['test']) for r in entry['random']]):.3f}"
                    f"  lowest {mean_acc(entry['lowest'][0]['test']):.3f}")
        log(cfg, f"[{time.perf_counter() - t_start:6.1f}s] {method} budget {budget:g}: "
                 f"{res.realized_bytes}/{res.full_bytes} B, mean test acc {msg}")
    R.setdefault("cand_per_tensor_by_method", {})[method] = bytes_by(ranked, by_tensor)
    if method == "task_arithmetic":
        R["cand_per_tensor"] = bytes_by(ranked, by_tensor)
        R["cand_per_expert"] = bytes_by(ranked, by_expert)
        # diagnostics (not equal-bytes controls): the full access set without the head / the head alone
        R["diag"] = {}
        for label, keep in (("all blocks except `head.*`", lambda n: not n.startswith("head.")),
                            ("`head.*` blocks only", lambda n: n.startswith("head."))):
            sel_d = [c for c in ranked if keep(full_plan.base_tensors[c.tidx].name)]
            dstate = execute_plan(plan_with_access(full_plan, sel_d, ranked, None), work)
            R["diag"][label] = {"bytes": sum(c.read.nbytes for c in sel_d),
                                "test": accuracy(dstate, cfg.hidden, test_sets)}
    return dict(sorted(per_b.items()))


def bytes_by(sel: list[Cand], key: Any) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for c in sel:
        out[key(c)] += c.read.nbytes
    return dict(out)


def chance(tasks: tuple[str, ...]) -> float:
    return float(np.mean([1.0 / TASK_INFO[t][1] for t in tasks]))


def omitted_bound(ranked: list[Cand], sel: list[Cand]) -> float:
    """Σ |c_k|·‖Δ_k,b‖₂ over omitted candidates (the task-arithmetic omitted-update bound)."""
    chosen = access_key(sel)
    return math.fsum(c.score for c in ranked if (c.pos, c.tidx, c.read.block_idx) not in chosen)


def mean_acc(acc: dict[str, float]) -> float:
    return float(np.mean(list(acc.values())))


def fmt_accs(acc: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in acc.items()) + f" | mean={mean_acc(acc):.3f}"


def all_checks_pass(R: dict[str, Any]) -> bool:
    """Every check passed and no method failed."""
    return not R.get("failed") and all(bool(x[-1]) for v in R["checks"].values() for x in v)


def fmt_params(ch: dict[str, Any]) -> str:
    """The chosen parameters, e.g. ``λ = 0.6, density = 0.8`` (``defaults`` when none is set)."""
    parts = [f"{sym} = {ch[k]:g}" for k, sym in (("lambda", "λ"), ("density", "density"), ("t", "t"))
             if ch.get(k) is not None]
    return ", ".join(parts) or "defaults"


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def _fmt_d(d: float | None) -> str:
    return "—" if d is None else f"{d:g}"


def done_methods(cfg: Config, R: dict[str, Any]) -> list[str]:
    """The methods of the run that produced results (in run order)."""
    return [m for m in cfg.methods if m in R["merges"]]


def base_mean(cfg: Config, R: dict[str, Any], method: str) -> float:
    """The base's mean test accuracy on the tasks `method` merges (its baseline below)."""
    return float(np.mean([R["base_acc"][t] for t in merged_tasks(method, cfg.tasks)]))


def expert_mean(cfg: Config, R: dict[str, Any], method: str) -> float:
    """The merged experts' mean test accuracy, each on its own task (the ceiling of `method`'s merge)."""
    return float(np.mean([R["expert_acc"][t] for t in merged_tasks(method, cfg.tasks)]))


def experts_label(cfg: Config, method: str) -> str:
    mt = merged_tasks(method, cfg.tasks)
    return "all " + str(len(mt)) if mt == cfg.tasks else ", ".join(mt)


def how_chosen(method: str) -> str:
    kind = GRID_KIND.get(method, "none")
    return {"ta": "val: λ", "ties": "val: density × λ", "dare": "val: density × λ", "slerp_t": "val: t",
            "nearswap_t": "val: t"}.get(kind, "MergeKit defaults")


def glance_lines(cfg: Config, R: dict[str, Any], methods: list[str]) -> list[str]:
    """One row per method: experts merged, read unit, parameters, baselines, full read and, per partial budget,
    planner / random mean [min, max] / lowest (mean test accuracy over the merged experts' tasks, %)."""
    partial = sorted(b for b in cfg.budgets if b < 1.0)
    L = ["| method | experts merged | read unit | parameters (how chosen) | base / experts | full read | "
         + " | ".join(f"{b:g}: planner / random [min, max] / lowest" for b in partial) + " | planner best at |",
         "|---|---|---|---|---|---:|" + "---|" * len(partial) + "---|"]
    for method in methods:
        m = R["merges"][method]
        cells, wins = [], []
        for b in partial:
            e = m[b]
            p = mean_acc(e["planner"]["test"])
            rs = [mean_acc(r["test"]) for r in e["random"]]
            lo = mean_acc(e["lowest"][0]["test"])
            won = p > max(rs) and p > lo
            if won:
                wins.append(f"{b:g}")
            pv = f"**{_pct(p)}**" if won else _pct(p)
            cells.append(f"{pv} / {_pct(float(np.mean(rs)))} [{_pct(min(rs))}, {_pct(max(rs))}] / {_pct(lo)}"
                         + (" (0 B)" if e["planner"]["bytes"] == 0 else ""))
        ch = R["chosen"][method]
        L.append(f"| {method} | {experts_label(cfg, method)} | {m[min(m)]['unit']} | {fmt_params(ch)} "
                 f"({how_chosen(method)}) | {_pct(base_mean(cfg, R, method))} / {_pct(expert_mean(cfg, R, method))} | "
                 f"{_pct(mean_acc(m[1.0]['planner']['test']))} | " + " | ".join(cells)
                 + f" | {', '.join(wins) if wins else '—'} |")
    return L


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def write_md(cfg: Config, R: dict[str, Any]) -> None:
    tasks = cfg.tasks
    L: list[str] = []
    a = L.append
    a("# Downstream quality of budgeted merges (8x8 digits, tiny MLP)")
    a("")
    a("Generated by `.venv/bin/python -m benchmarks.quality` (deterministic seeds; "
      f"{R['seconds']:.0f} s wall on a shared 2-core CPU machine, torch on one thread). All numbers below are "
      "from that run. Accuracies are percentages on the held-out **test** split unless marked *val*.")
    a("")
    a("## What this is, and what it is not")
    a("")
    a("A 64→256→256→10 MLP on scikit-learn's 8x8 digits is **not an LLM**. The whole model is "
      f"{sum(t[3] for t in R['tensors']) // 1024} KiB in float32; a merge takes milliseconds, so nothing here "
      "says anything about I/O time or speed-ups. What it can show is whether the *choice of blocks* made by "
      "the planner (rank by |c_k|·‖Δ_k,b‖₂, keep the prefix that fits) preserves downstream accuracy better "
      "than other access sets of the **same byte cost**, on a merge where the experts really interfere, and "
      "how accuracy degrades as the budget shrinks. It does not show that the same holds for billions of "
      "parameters, bf16 deltas, transformer blocks, LLM benchmarks, or for LoRA / low-learning-rate "
      "fine-tunes whose deltas are distributed differently from these. One base, one "
      "set of experts, one data split: the numbers carry seed noise of a few points (the spread of the "
      "random control gives an idea of it).")
    a("")
    a("## Headline")
    a("")
    for line in headline_lines(cfg, R):
        a(f"* {line}")
    a("")
    a("## Setup")
    a("")
    a(f"* Data: `sklearn.datasets.load_digits`, stratified split train/val/test = "
      f"{R['split']['train']}/{R['split']['val']}/{R['split']['test']} images (seed {cfg.seed}), "
      "inputs scaled to [0, 1].")
    a(f"* Model: MLP 64→{cfg.hidden}→{cfg.hidden}→10 (`fc1`, `fc2`, `head`, float32) with one "
      "**shared 10-logit head**. 10-class tasks use all logits; binary tasks use logits 0/1 "
      "(cross-entropy and argmax over the first two logits). Every expert changes every tensor, the head "
      "included, so the experts compete for the same "
      "coordinates (as LLM experts sharing an LM head do). Per-task heads in separate tensors, each changed by one "
      "expert only, would make the head merge interference-free; we chose the harder, LLM-like setting.")
    a(f"* Base: pre-trained {cfg.base_epochs} epochs on a generic, label-free task — predict the k-means (k=10) "
      "cluster of a training image from three views of it (plain, rotated 90°, pixel-permuted). It knows no "
      "downstream label.")
    a(f"* Experts: each fully fine-tuned from the base for {cfg.expert_epochs} epochs (Adam, lr {cfg.lr:g}, batch "
      f"{cfg.batch}) on one task: " + "; ".join(f"`{t}` = {TASK_INFO[t][2]}" for t in tasks) + ".")
    a(f"* Storage: each checkpoint an HF-style directory (`model.safetensors` + `config.json`), ingested with "
      f"`Catalog.ingest(..., block_bytes={cfg.block_bytes})` → {R['n_blocks_per_expert']} row blocks per checkpoint:")
    a("")
    a("  | tensor | shape | blocks | bytes |")
    a("  |---|---|---:|---:|")
    for name, shape, nb, nbytes in R["tensors"]:
        a(f"  | `{name}` | {shape} | {nb} | {nbytes} |")
    a("")
    a(f"* Merges: through `Catalog.merge` (planned, executed, committed) at budgets "
      f"{', '.join(f'{b:g}' for b in cfg.budgets)} of the full expert read, all {len(cfg.tasks)} experts with weight "
      f"1.0 (where the method takes weights), except slerp, nearswap, arcee_fusion (the base and the "
      f"`{cfg.tasks[0]}` expert) and nuslerp (`{'`, `'.join(cfg.tasks[:2])}`); the experts are ingested together "
      f"(`Catalog.ingest_many`: exact pairwise products for the geometric methods). The random drops (DARE, "
      f"DELLA) use seed {cfg.merge_seed}. "
      "Budget fractions are of the full expert read (every expert tensor); blocks whose delta is exactly zero "
      "are never candidates.")
    a("")
    a("## Choice of λ and density (validation split, full budget)")
    a("")
    a("Each grid point is a full-budget merge through mergepipe's planner + executor, evaluated on the "
      "**validation** split; the point with the best mean validation accuracy over the tasks is kept (first in "
      "grid order on ties) and then used unchanged at every budget. The test split is not looked at.")
    a("")
    a("Methods without a grid (sce, ram, ramplus_tl, model_stock, multislerp, karcher, nuslerp, arcee_fusion) run "
      "MergeKit's defaults, weight 1 per expert where the method takes weights; they have one row. slerp's t is "
      f"chosen from {', '.join(f'{t:g}' for t in cfg.slerp_ts)} (an interpolation; t = 1 would be the expert "
      f"itself), nearswap's t (MergeKit has no default) from {', '.join(f'{t:g}' for t in cfg.nearswap_ts)}. "
      "Methods that merge one or two experts are chosen and evaluated on those experts' tasks only.")
    a("")
    for method in done_methods(cfg, R):
        ch = R["chosen"][method]
        mt = merged_tasks(method, tasks)
        a(f"**{method}** ({experts_label(cfg, method)} expert(s)) — chosen: {fmt_params(ch)}")
        a("")
        a("| λ | density | t | " + " | ".join(f"{t} (val)" for t in mt) + " | mean (val) |")
        a("|---:|---:|---:|" + "---:|" * (len(mt) + 1))
        for g in R["grid"][method]:
            mark = "**" if all(g[k] == ch[k] for k in ("lambda", "density", "t")) else ""
            a(f"| {mark}{_fmt_d(g['lambda'])}{mark} | {_fmt_d(g['density'])} | {_fmt_d(g['t'])} | "
              + " | ".join(_pct(g["val"][t]) for t in mt) + f" | {mark}{_pct(g['val_mean'])}{mark} |")
        a("")
    a("## Per-task test accuracy")
    a("")
    a("| model | budget | bytes read | " + " | ".join(tasks) + " | mean |")
    a("|---|---:|---:|" + "---:|" * (len(tasks) + 1))
    a("| base | — | — | " + " | ".join(_pct(R["base_acc"][t]) for t in tasks) + f" | {_pct(mean_acc(R['base_acc']))} |")
    a("| each expert on its own task | — | — | " + " | ".join(_pct(R["expert_acc"][t]) for t in tasks)
      + f" | {_pct(mean_acc(R['expert_acc']))} |")
    for method in done_methods(cfg, R):
        for budget, e in R["merges"][method].items():
            label = f"{method} (full read)" if budget == 1.0 else f"{method}, planner"
            if merged_tasks(method, tasks) != tasks:
                label += f" [{experts_label(cfg, method)}]"
            acc = e["planner"]["test"]
            a(f"| {label} | {budget:g} | {e['realized_bytes']} | "
              + " | ".join(_pct(acc[t]) if t in acc else "—" for t in tasks) + f" | {_pct(mean_acc(acc))} |")
    a("")
    a("Rows marked [expert(s)] merge only those experts (slerp, nearswap, arcee_fusion: the base and one expert; "
      "nuslerp: two) and are evaluated on their tasks only (— elsewhere); their mean is over those tasks and "
      "compares with those experts' own accuracies in the rows above.")
    a("")
    a("Experts on the other tasks (rows: expert, columns: task) — how much a single expert already covers:")
    a("")
    a("| expert | " + " | ".join(tasks) + " | mean |")
    a("|---|" + "---:|" * (len(tasks) + 1))
    for t in tasks:
        acc = R["expert_cross"][t]
        a(f"| {t} | " + " | ".join(_pct(acc[u]) for u in tasks) + f" | {_pct(mean_acc(acc))} |")
    a("")
    a("## Planner vs random vs lowest-scored blocks at equal bytes")
    a("")
    a("For each budget the planner's `Plan` is kept and only `plan.access` is replaced: **random** = candidate "
      f"blocks in a seeded random order ({cfg.n_random} seeds), **lowest** = the tail of the planner's own ranking "
      "(lowest |c_k|·‖Δ‖₂ first); both filled greedily up to the planner's planned bytes, then run by "
      "`mergepipe_db.executor.execute` (real byte-range reads; for TIES the partial tensors' thresholds come "
      "from the catalog sketches, as in a planned merge). Mean test accuracy over the tasks (best of the three "
      "in bold); random as mean [min, max] over seeds. *dev* = ‖θ_B − θ_full‖₂ over all parameters (vs the "
      "full-read merge of the same method); *bound* (task arithmetic) = Σ |c_k|·‖Δ_k,b‖₂ over omitted blocks.")
    a("")
    a("The controls draw the planner's own read units (docs/SEMANTICS.md): single (expert, block) candidates for "
      "the per-block methods (task_arithmetic, dare_linear, breadcrumbs, della_linear, nearswap, and the geometric "
      "methods, planned by blocks with coefficients from catalog statistics — the controls get the same "
      "coefficients for every tensor they read in part), **block rows of all experts together** for the methods "
      "with a joint election (ties, dare_ties, breadcrumbs_ties, della, sce, ram, ramplus_tl), and **whole "
      "tensors** for slerp and arcee_fusion; *blocks* below counts (expert, block) candidates read.")
    a("")
    for method in done_methods(cfg, R):
        a(f"**{method}** ({experts_label(cfg, method)} expert(s), read unit: {R['merges'][method][1.0]['unit']})")
        a("")
        a("| budget | bytes (planner / random / lowest) | blocks | planner | random mean [min, max] | lowest | "
          "dev planner / random / lowest"
          + (" | bound planner / random / lowest" if method == "task_arithmetic" else "") + " |")
        a("|---:|---|---:|---:|---:|---:|---|" + ("---|" if method == "task_arithmetic" else ""))
        for budget, e in R["merges"][method].items():
            p = e["planner"]
            if budget == 1.0:
                a(f"| 1 | {p['bytes']} (all) | {p['n_blocks']} | {_pct(mean_acc(p['test']))} | (same set) | "
                  "(same set) | 0 |"
                  + (" 0 |" if method == "task_arithmetic" else ""))
                continue
            rm = [mean_acc(r["test"]) for r in e["random"]]
            lo = e["lowest"][0]
            rbytes = sorted({r["bytes"] for r in e["random"]})
            rb = str(rbytes[0]) if len(rbytes) == 1 else f"{rbytes[0]}–{rbytes[-1]}"
            vals = [mean_acc(p["test"]), float(np.mean(rm)), mean_acc(lo["test"])]
            pv, rv, lv = (f"**{_pct(v)}**" if v == max(vals) else _pct(v) for v in vals)
            row = (f"| {budget:g} | {p['bytes']} / {rb} / {lo['bytes']} | {p['n_blocks']} | {pv} | "
                   f"{rv} [{_pct(min(rm))}, {_pct(max(rm))}] | {lv} | "
                   f"{p['dev']:.3f} / {np.mean([r['dev'] for r in e['random']]):.3f} / {lo['dev']:.3f} |")
            if method == "task_arithmetic":
                row += (f" {p['bound']:.2f} / {np.mean([r['bound'] for r in e['random']]):.2f} / {lo['bound']:.2f} |")
            a(row)
        a("")
    a("Per-task detail of the controls (test accuracy; random = mean over seeds):")
    a("")
    a("| method | budget | access set | " + " | ".join(tasks) + " | mean |")
    a("|---|---:|---|" + "---:|" * (len(tasks) + 1))
    for method in done_methods(cfg, R):
        mt = merged_tasks(method, tasks)
        for budget, e in R["merges"][method].items():
            if budget == 1.0:
                continue
            rows = [("planner", e["planner"]["test"]),
                    ("random", {t: float(np.mean([r["test"][t] for r in e["random"]])) for t in mt}),
                    ("lowest", e["lowest"][0]["test"])]
            for kind, acc in rows:
                a(f"| {method} | {budget:g} | {kind} | " + " | ".join(_pct(acc[t]) if t in acc else "—" for t in tasks)
                  + f" | {_pct(mean_acc(acc))} |")
    a("")
    if "task_arithmetic" in R["merges"] and "cand_per_tensor" in R:
        m = R["merges"]["task_arithmetic"]
        tnames = [t[0] for t in R["tensors"]]
        a("## Where the bytes go")
        a("")
        same_as = [x for x, v in R["same_access"].items() if v and x != "task_arithmetic"]
        a("All experts have weight 1, so within a method every score |c_k|·‖Δ_k,b‖₂ carries the same coefficient "
          "and the ranking is by ‖Δ_k,b‖₂ alone (by its sum over the experts for the block-row methods). The "
          "planner's access set at every budget is exactly task_arithmetic's for "
          + (", ".join(same_as) if same_as else "no other method")
          + " (checked); the others read other units (block rows, whole tensors), other experts, or skip "
            "pruned blocks."
          + " Share of each tensor's (left) and each expert's (right) candidate bytes that is read, in %, "
          "task_arithmetic run (random = mean over seeds):")
        a("")
        a("| budget | access set | " + " | ".join(f"`{n}`" for n in tnames) + " | "
          + " | ".join(f"{t}" for t in tasks) + " |")
        a("|---:|---|" + "---:|" * (len(tnames) + len(tasks)))
        ct, ce = R["cand_per_tensor"], R["cand_per_expert"]
        for budget, e in m.items():
            if budget == 1.0:
                continue
            rows = [("planner", e["planner"]["per_tensor"], e["planner"]["per_expert"]),
                    ("random", _mean_dict([r["per_tensor"] for r in e["random"]]),
                     _mean_dict([r["per_expert"] for r in e["random"]])),
                    ("lowest", e["lowest"][0]["per_tensor"], e["lowest"][0]["per_expert"])]
            for kind, pt, pe in rows:
                a(f"| {budget:g} | {kind} | " + " | ".join(f"{100 * pt.get(n, 0) / ct[n]:.0f}" if ct.get(n) else "—"
                                                          for n in tnames)
                  + " | " + " | ".join(f"{100 * pe.get(t, 0) / ce[t]:.0f}" for t in tasks) + " |")
        a("")
        a("Candidate bytes per expert (blocks whose delta is exactly zero are not candidates — the binary experts "
          "never train head rows 2–9): " + ", ".join(f"{t} {ce[t]}" for t in tasks) + f"; full read "
          f"{m[min(m)]['full_bytes']} B. Whole-model delta norms ‖θ_k − θ₀‖₂ (catalog `tensors.delta_l2`): "
          + ", ".join(f"{t} {R['expert_delta_l2'][t]:.2f}" for t in tasks) + ".")
        a("")
        a("Diagnostics (task arithmetic, chosen λ; *not* equal-bytes controls): the full access set without the "
          "head, and the head alone.")
        a("")
        a("| access set | bytes | fraction of full | " + " | ".join(tasks) + " | mean |")
        a("|---|---:|---:|" + "---:|" * (len(tasks) + 1))
        full_b = m[min(m)]["full_bytes"]
        for label, d in R["diag"].items():
            a(f"| {label} | {d['bytes']} | {d['bytes'] / full_b:.3f} | " + " | ".join(_pct(d["test"][t]) for t in tasks)
              + f" | {_pct(mean_acc(d['test']))} |")
        a("")
    new = [m for m in done_methods(cfg, R) if m not in ORIGINAL_METHODS]
    a("## All methods at a glance (issue 35's methods included)")
    a("")
    a("Mean test accuracy (%) over the tasks of the experts each method merges; *base / experts* = the base and "
      "the merged experts (each on its own task) on those tasks; planner in bold where it is above every random "
      "seed and above the lowest-scored set; (0 B) = the planner's access set at that budget is empty (the "
      "output is the base; the controls then read nothing either).")
    a("")
    for line in glance_lines(cfg, R, [m for m in done_methods(cfg, R) if m in ORIGINAL_METHODS] + new):
        a(line)
    a("")
    if R.get("failed"):
        a("**Methods that failed inside mergepipe** (not fixed here; the spec is `make_spec` with the parameters "
          "below):")
        a("")
        for method, err in R["failed"].items():
            a(f"* `{method}`: {err}")
        a("")
    a("## Summary")
    a("")
    for line in summary_lines(cfg, R):
        a(f"* {line}")
    a("")
    a("## Reading the results")
    a("")
    for line in interpretation_lines(cfg, R):
        a(f"* {line}")
    a("")
    a("## Checks (all from this run)")
    a("")
    ck = R["checks"]

    def cnt(name: str) -> str:
        v = ck[name]
        return f"{sum(bool(x[-1]) for x in v)}/{len(v)}"

    a(f"* The candidate ranking rebuilt from the catalog (`blocks.delta_l2` × |c_k|, planner tie-breaks, the "
      "method's read unit) "
      f"reproduces the planner's access set at every budget: {cnt('ranking_reproduces_planner')} plans. The "
      "**lowest** control is therefore exactly the tail of the planner's ranking. For the geometric methods the "
      "full read reads whole tensors, the blocks whose Δ is exactly 0 too; those are left out of that comparison "
      "(they are never candidates under a budget).")
    a(f"* Independent in-memory task arithmetic with unselected blocks' deltas zeroed equals mergepipe's committed "
      f"budgeted output byte for byte: {cnt('ta_masked_equals_mergepipe')} budgets; and equals the executor's "
      f"output for every task-arithmetic control access set: {cnt('ta_masked_equals_controls')} runs.")
    if ck.get("geometric_control_equals_formula"):
        a(f"* Geometric methods under a budget (model_stock, multislerp, karcher, nuslerp): every tensor read in part "
          "equals the independent form θ₀·a₀ + Σ_k Δ̃_k·c_k (Δ̃_k masked to the blocks read, (a₀, c_k) the plan's "
          "coefficients from catalog statistics) within rtol 1e-5 / atol 1e-6, for the committed merge and every "
          f"control: {cnt('geometric_control_equals_formula')} runs.")
    a(f"* `executor.execute` on the planner's own plan equals the committed `Catalog.merge` output byte for byte: "
      f"{cnt('executor_equals_commit')} (smallest budget, each method).")
    a("* Realized expert bytes equal planned bytes for every run (asserted by the executor).")
    a("")
    a("Reproduce: `.venv/bin/python -m benchmarks.quality` (add `--help` for options); smoke test: "
      "`tests/integration/test_quality_smoke.py`.")
    a("")
    assert cfg.md_path is not None
    cfg.md_path.parent.mkdir(parents=True, exist_ok=True)
    cfg.md_path.write_text("\n".join(L))


def _mean_dict(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in ds for k in d}
    return {k: float(np.mean([d.get(k, 0) for d in ds])) for k in keys}


def summary_lines(cfg: Config, R: dict[str, Any]) -> list[str]:
    out = []
    base_m, exp_m = mean_acc(R["base_acc"]), mean_acc(R["expert_acc"])
    out.append(f"Base mean {_pct(base_m)} %, chance level (mean of 1/classes) {_pct(chance(cfg.tasks))} %, "
               f"experts on their own tasks mean {_pct(exp_m)} %.")
    for method in done_methods(cfg, R):
        m = R["merges"][method]
        full = mean_acc(m[1.0]["planner"]["test"]) if 1.0 in m else float("nan")
        wins_r = wins_l = n = 0
        parts = []
        for budget, e in m.items():
            if budget == 1.0:
                continue
            n += 1
            p = mean_acc(e["planner"]["test"])
            r = float(np.mean([mean_acc(x["test"]) for x in e["random"]]))
            rmax = max(mean_acc(x["test"]) for x in e["random"])
            lo = mean_acc(e["lowest"][0]["test"])
            wins_r += p > rmax
            wins_l += p > lo
            parts.append(f"{budget:g}: {_pct(p)} vs {_pct(r)} / {_pct(lo)}")
        out.append(f"**{method}** full read {_pct(full)} %. Planner vs random (mean) / lowest at equal bytes — "
                   + "; ".join(parts) + f". Planner above the best random seed at {wins_r}/{n} budgets and above "
                   f"lowest at {wins_l}/{n}.")
    return out


def _dev_losers(R: dict[str, Any]) -> list[tuple[str, float]]:
    """(method, budget) where the planner's deviation from the full read is not the smallest of the access sets."""
    return [(m, b) for m, v in R["merges"].items() for b, e in v.items()
            if b < 1.0 and e["planner"]["dev"] > min([r["dev"] for r in e["random"]] + [e["lowest"][0]["dev"]])]


def headline_lines(cfg: Config, R: dict[str, Any]) -> list[str]:
    """Does the planner's access set beat random / lowest-scored blocks at equal bytes? (computed)"""
    out = []
    allt = [m for m in R["merges"] if merged_tasks(m, cfg.tasks) == cfg.tasks]
    full = {m: mean_acc(R["merges"][m][1.0]["planner"]["test"]) for m in allt if 1.0 in R["merges"][m]}
    if full:
        out.append(f"Full-read merges of all {len(cfg.tasks)} experts reach a mean test accuracy of "
                   + ", ".join(f"{m} {_pct(a)} %" for m, a in full.items())
                   + f" (experts on their own tasks {_pct(mean_acc(R['expert_acc']))} %, base "
                   f"{_pct(mean_acc(R['base_acc']))} %, chance {_pct(chance(cfg.tasks))} %): merging "
                   f"{len(cfg.tasks)} dense, fully fine-tuned experts that share one head loses a lot before any "
                   "budget is applied; the budgeted merges are measured against that. The one- and two-expert "
                   "methods are measured on their experts' tasks (table *All methods at a glance*).")
    wins, below = [], []
    win_budgets: set[float] = set()
    for method, m in R["merges"].items():
        for b, e in m.items():
            if b == 1.0:
                continue
            p = mean_acc(e["planner"]["test"])
            rs = [mean_acc(r["test"]) for r in e["random"]]
            lo = mean_acc(e["lowest"][0]["test"])
            if p > max(rs) and p > lo:
                win_budgets.add(b)
                wins.append(f"{method} at {b:g} ({_pct(p)} vs random {_pct(float(np.mean(rs)))} / lowest {_pct(lo)})")
            elif p < np.mean(rs) and p < lo:
                near = abs(p - base_mean(cfg, R, method)) < 0.05
                below.append((method, b, float(np.mean(rs)) - p, lo - p, near))
    n_partial = sum(1 for m in R["merges"].values() for b in m if b < 1.0)
    out.append(f"**Does the planner's access set beat random and lowest-scored blocks at equal bytes?** Clearly (above "
               f"every random seed and above lowest) in {len(wins)} of {n_partial} (method, budget) cases: "
               + ("; ".join(wins) if wins else "none") + ".")
    if below:
        n_near = sum(x[4] for x in below)
        out.append(f"In {len(below)} cases it is **below both** the random mean (by "
                   f"{100 * min(x[2] for x in below):.1f}–{100 * max(x[2] for x in below):.1f} points) and the "
                   f"lowest-scored set (by {100 * min(x[3] for x in below):.1f}–{100 * max(x[3] for x in below):.1f} "
                   "points), at budgets " + ", ".join(sorted({f'{x[1]:g}' for x in below}, key=float))
                   + f"; in {n_near} of them the planner's merge is within 5 points of the base (nothing transferred)"
                   + ("" if n_near == len(below) else "; the others: " + ", ".join(
                       f"{x[0]} at {x[1]:g}" for x in below if not x[4])) + ".")
    where = (f"at budget(s) {', '.join(f'{b:g}' for b in sorted(win_budgets))}, and not for every method"
             if win_budgets and len(wins) < len(R["merges"]) * len(win_budgets) else
             f"at budget(s) {', '.join(f'{b:g}' for b in sorted(win_budgets))}" if win_budgets else "at no budget")
    losers = _dev_losers(R)
    out.append("In parameter space the planner's access set gives the smallest deviation from the full-read merge "
               + ("in every (method, budget) case" if not losers else
                  f"in {n_partial - len(losers)} of {n_partial} cases (not: "
                  + ", ".join(f"{m} at {b:g}" for m, b in losers) + ")")
               + " (and, for task arithmetic, the smallest omitted-update bound — checked below); downstream that "
               "ordering appears only " + where + " (see *Reading the results* for why).")
    return out


def interpretation_lines(cfg: Config, R: dict[str, Any]) -> list[str]:
    """Statements computed from the run (each with its numbers), so the text cannot drift from the tables."""
    out: list[str] = []
    tasks = cfg.tasks
    base_m = mean_acc(R["base_acc"])
    partial = sorted(b for b in cfg.budgets if b < 1.0)
    if not partial:
        return out
    # 1. parameter deviation / bound order
    losers = _dev_losers(R)
    n_partial = sum(1 for m in R["merges"].values() for b in m if b < 1.0)
    line = ("Parameter space: the planner's access set gives the smallest deviation ‖θ_B − θ_full‖₂ of the three "
            "access sets " + ("at every budget below 1 for every method" if not losers else
                              f"in {n_partial - len(losers)} of {n_partial} (method, budget) cases below budget 1 "
                              "(**not** for " + ", ".join(f"{m} at {b:g}" for m, b in losers) + ")"))
    if "task_arithmetic" in R["merges"]:
        ta = R["merges"]["task_arithmetic"]
        bound_ok = all(e["planner"]["bound"] <= min([r["bound"] for r in e["random"]] + [e["lowest"][0]["bound"]])
                       for b, e in ta.items() if b < 1.0)
        line += ("; for task arithmetic it gives " + ("the smallest" if bound_ok else "not always the smallest")
                 + " omitted-update bound at every budget")
    out.append(line + " — that is what a ‖Δ‖ ranking optimises (exactly so for the additive methods; for those "
               "with a joint election, thresholds or statistics coupling the experts it is a proxy).")
    # 2. downstream accuracy by budget
    near = [b for b in partial
            if all(abs(mean_acc(e[b]["planner"]["test"]) - base_mean(cfg, R, m)) < 0.05
                   for m, e in R["merges"].items())]
    if near:
        gaps = [mean_acc(m[b]["planner"]["test"]) - float(np.mean([mean_acc(r["test"]) for r in m[b]["random"]]))
                for m in R["merges"].values() for b in near]
        out.append(
            f"Downstream accuracy does not follow that order at small budgets. At budget(s) "
            f"{', '.join(f'{b:g}' for b in near)} the planner's merge stays within 5 points of the base "
            f"on that method's tasks (all {len(tasks)} tasks: {_pct(base_m)} %; chance {_pct(chance(tasks))} %) "
            f"for every method, i.e. it has not yet acquired "
            f"any of the experts' skills; planner minus the random control's mean there is between "
            f"{100 * min(gaps):+.1f} and {100 * max(gaps):+.1f} points (the controls are near base level too; these "
            "are differences between failures).")
    for method, m in R["merges"].items():
        if method not in ORIGINAL_METHODS:  # the others: *All methods at a glance*
            continue
        full = mean_acc(m[1.0]["planner"]["test"]) if 1.0 in m else float("nan")
        for b in partial:
            if b in near:
                continue
            e = m[b]
            p = mean_acc(e["planner"]["test"])
            rs = [mean_acc(r["test"]) for r in e["random"]]
            lo = mean_acc(e["lowest"][0]["test"])
            verdict = ("above every random seed" if p > max(rs) else
                       "above the random mean but not every seed" if p > np.mean(rs) else "not above random")
            out.append(f"{method} at budget {b:g}: planner {_pct(p)} % (full read {_pct(full)} %), random "
                       f"{_pct(float(np.mean(rs)))} % [{_pct(min(rs))}, {_pct(max(rs))}], lowest {_pct(lo)} % — "
                       f"planner {verdict}, {'above' if p > lo else 'not above'} lowest.")
    # 2b. where the lowest-scored set beats the planner at the largest partial budget: which tensors each reads
    bmax = max(partial)
    cpt = R.get("cand_per_tensor_by_method", {})
    losing = [m for m, v in R["merges"].items() if m in cpt and v[bmax]["planner"]["bytes"] > 0
              and mean_acc(v[bmax]["lowest"][0]["test"]) > mean_acc(v[bmax]["planner"]["test"])]
    if losing:
        def share(pt: dict[str, int], ct: dict[str, int], pred: Any) -> float:
            tot = sum(b for n, b in ct.items() if pred(n))
            return 100 * sum(b for n, b in pt.items() if pred(n)) / tot if tot else 0.0

        def head(n: str) -> bool:
            return n.startswith("head.")

        def fc1(n: str) -> bool:
            return n.startswith("fc1.")
        starved, other = [], []
        for m in losing:
            e = R["merges"][m][bmax]
            pl, lo = e["planner"]["per_tensor"], e["lowest"][0]["per_tensor"]
            txt = (f"{m} (head {share(pl, cpt[m], head):.0f} % vs {share(lo, cpt[m], head):.0f} %, fc1 "
                   f"{share(pl, cpt[m], fc1):.0f} % vs {share(lo, cpt[m], fc1):.0f} %)")
            (starved if share(pl, cpt[m], head) < share(lo, cpt[m], head) else other).append((m, txt))
        if starved:
            out.append(f"The lowest-scored set beats the planner at budget {bmax:g} for {len(losing)} methods. For "
                       f"{len(starved)} of them the planner spends its bytes on the high-norm `fc2.weight` blocks "
                       "and reads less of the shared head and of `fc1` than the tail of the ranking does — share of "
                       "the candidate bytes of `head.*` and `fc1.*` read, planner vs lowest: "
                       + "; ".join(t for _, t in starved) + ".")
        if other:
            same = [m for m, _ in other if R.get("same_access", {}).get(m)]
            out.append("For " + "; ".join(t for _, t in other) + " the planner reads more of the head than the "
                       "lowest-scored set"
                       + (f"; {', '.join(same)} read exactly task_arithmetic's blocks (where the planner wins at "
                          f"{bmax:g}), so the access set alone does not explain it" if same else "")
                       + ". Their full-read merges are "
                       + ", ".join(f"{m} {_pct(mean_acc(R['merges'][m][1.0]['planner']['test']))} %"
                                   for m, _ in other)
                       + f" (base {_pct(base_mean(cfg, R, other[0][0]))} %).")
    # 3. why: experts starved by the norm ranking
    if "task_arithmetic" in R["merges"] and "cand_per_expert" in R:
        ta = R["merges"]["task_arithmetic"]
        starved = [t for t in tasks if all(ta[b]["planner"]["per_expert"].get(t, 0) == 0 for b in partial)]
        if starved:
            bmax = max(partial)
            e = ta[bmax]
            full_t = ta[1.0]["planner"]["test"] if 1.0 in ta else None
            detail = "; ".join(
                f"{t}: planner {_pct(e['planner']['test'][t])} %, lowest {_pct(e['lowest'][0]['test'][t])} %"
                + (f", full read {_pct(full_t[t])} %" if full_t else "") for t in starved)
            lo_share = sum(e["lowest"][0]["per_expert"].get(t, 0) for t in starved) / max(1, e["planner"]["bytes"])
            beats = all(e["lowest"][0]["test"][t] > e["planner"]["test"][t] for t in starved)
            out.append(
                f"Why: the ranking is by ‖Δ_k,b‖₂ alone and the experts' deltas differ in scale. The planner reads "
                f"**0 %** of the bytes of expert(s) {', '.join(starved)} at every budget ≤ {bmax:g} (delta norms "
                + ", ".join(f"{t} {R['expert_delta_l2'][t]:.2f}" for t in starved) + " vs "
                + ", ".join(f"{t} {R['expert_delta_l2'][t]:.2f}" for t in tasks if t not in starved)
                + f"), so the merge contains nothing of their task vectors; at {bmax:g} (task arithmetic) — {detail}. "
                f"The lowest-scored control spends {100 * lo_share:.0f} % of its bytes on exactly those experts, "
                + ("which is why it beats the planner on them." if beats
                   else "yet does not beat the planner on all of them."))
        bias = [n for n in R["cand_per_tensor"] if n.endswith(".bias")
                and all(ta[b]["planner"]["per_tensor"].get(n, 0) == 0 for b in partial)]
        if bias:
            out.append("The score is per block, not per byte: the small 1-D bias blocks ("
                       + ", ".join(f"`{n}`" for n in bias)
                       + ") are never read below the full budget although they are the cheapest blocks.")
    if R.get("diag"):
        items = list(R["diag"].items())
        fb = R["merges"]["task_arithmetic"][1.0]["full_bytes"]
        out.append("Diagnostic: " + "; ".join(f"{lbl} ({100 * d['bytes'] / fb:.1f} % "
                                              f"of the bytes) → mean {_pct(mean_acc(d['test']))} %" for lbl, d in items)
                   + ". In this network what the experts learned is spread over most of the trunk"
                   + (f"; {100 * max(near):g} % of the bytes, even the highest-norm ones, is not enough to transfer it."
                      if near else "."))
    out.append("What this says about mergepipe: the budget semantics are exact (all checks below pass) and the "
               "planner does what it documents — it minimises the omitted-update norm. That norm is a weak proxy for "
               "downstream quality here: it starves low-norm experts entirely and ignores bytes-per-score. "
               "Per-expert budget floors or a per-byte score are obvious variants to test; they were **not** tested "
               "here."
               + (f" The paper's 'no monotonic degradation' is not reproduced in this toy (every method is back at "
                  f"base level at budget {max(near):g}); that does not contradict LLM results, whose regime differs."
                  if near else ""))
    return out


def write_figures(cfg: Config, R: dict[str, Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert cfg.fig_dir is not None
    cfg.fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    methods = done_methods(cfg, R)
    ncol = min(len(methods), 6)
    nrow = -(-len(methods) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.8 * nrow + 0.6), sharey=True, squeeze=False)
    for ax in axes.flat[len(methods):]:
        ax.set_visible(False)
    for ax, method in zip(axes.flat, methods):
        base_m, exp_m = base_mean(cfg, R, method), expert_mean(cfg, R, method)
        m = R["merges"][method]
        bs = list(m)
        pl = [mean_acc(m[b]["planner"]["test"]) for b in bs]
        ax.plot(bs, pl, "o-", color="C0", label="planner (|c|·‖Δ‖ prefix)")
        cb = [b for b in bs if b < 1.0] + ([1.0] if 1.0 in m else [])

        def ctl(b: float, kind: str, m: dict[float, Any] = m) -> list[float]:
            if b == 1.0:
                return [mean_acc(m[b]["planner"]["test"])]
            return [mean_acc(x["test"]) for x in m[b][kind]]

        rmean = [float(np.mean(ctl(b, "random"))) for b in cb]
        rmin = [min(ctl(b, "random")) for b in cb]
        rmax = [max(ctl(b, "random")) for b in cb]
        ax.plot(cb, rmean, "s--", color="C1", label=f"random blocks (mean of {cfg.n_random})")
        ax.fill_between(cb, rmin, rmax, color="C1", alpha=0.2)
        ax.plot(cb, [ctl(b, "lowest")[0] for b in cb], "v:", color="C3", label="lowest-scored blocks")
        ax.axhline(base_m, color="gray", lw=1, ls="-.", label="base")
        ax.axhline(chance(merged_tasks(method, cfg.tasks)), color="gray", lw=0.8, ls=":", label="chance")
        ax.axhline(exp_m, color="k", lw=1, ls="--", label="experts (own task)")
        ax.set_xscale("log")
        ax.set_xticks(bs)
        ax.set_xticklabels([f"{b:g}" for b in bs])
        ax.set_xlabel("budget (fraction of full expert read)")
        ax.set_title(f"{method} ({fmt_params(R['chosen'][method])}; {experts_label(cfg, method)} expert(s))",
                     fontsize=9)
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("mean test accuracy over merged tasks")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle("Tiny MLP on 8x8 digits (not an LLM): accuracy at equal expert-read bytes", fontsize=10)
    fig.tight_layout(rect=(0, 0.6 / (3.8 * nrow + 0.6), 1, 1))
    p = cfg.fig_dir / "quality_budget.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.8 * nrow), sharey=True, squeeze=False)
    for ax in axes.flat[len(methods):]:
        ax.set_visible(False)
    for ax, method in zip(axes.flat, methods):
        m = R["merges"][method]
        bs = list(m)
        for i, t in enumerate(merged_tasks(method, cfg.tasks)):
            ax.plot(bs, [m[b]["planner"]["test"][t] for b in bs], "o-", color=f"C{i}", label=t)
            ax.axhline(R["expert_acc"][t], color=f"C{i}", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xticks(bs)
        ax.set_xticklabels([f"{b:g}" for b in bs])
        ax.set_xlabel("budget (fraction of full expert read)")
        ax.set_title(f"{method}, planner access set")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("test accuracy (dotted: expert)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    p = cfg.fig_dir / "quality_per_task.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced config (2 tasks, 1 epoch, 2 budgets)")
    ap.add_argument("--n-random", type=int, default=None, help="random-control seeds per budget")
    ap.add_argument("--methods", default=None,
                    help="comma-separated methods, or all (the default: every method of ALL_METHODS); the original "
                         "three are task_arithmetic, ties, dare_ties")
    ap.add_argument("--md", type=Path, default=None, help="markdown output path")
    ap.add_argument("--fig-dir", type=Path, default=None, help="figure output folder")
    ap.add_argument("--dump", type=Path, default=None, help="also write the run's results (pickle) here")
    ap.add_argument("--from-dump", type=Path, default=None,
                    help="render the report and figures from a --dump of an earlier run (no training, no merge)")
    args = ap.parse_args(argv)
    cfg = quick_config() if args.quick else Config()
    if args.n_random is not None:
        cfg.n_random = args.n_random
    if args.methods:
        cfg.methods = ALL_METHODS if args.methods == "all" else tuple(args.methods.split(","))
    if args.md is not None:
        cfg.md_path = args.md
    if args.fig_dir is not None:
        cfg.fig_dir = args.fig_dir
    cfg.dump_path = args.dump
    if args.from_dump is not None:
        import pickle

        R = pickle.loads(args.from_dump.read_bytes())
        cfg.methods = tuple(R["config"]["methods"])
        render(cfg, R)
    else:
        R = run(cfg)
    ok = all_checks_pass(R)
    for line in summary_lines(cfg, R):
        print(line.replace("**", ""))
    for method, err in R.get("failed", {}).items():
        print(f"{method} FAILED: {err}")
    print(f"checks {'all passed' if ok else 'FAILED'}; {R['seconds']:.1f}s")
    return 0 if ok else 1


def quick_config(**kw: Any) -> Config:
    base = dict(tasks=("digit", "parity"), base_epochs=1, expert_epochs=1, budgets=(0.1, 1.0),
                methods=("task_arithmetic",), ta_lambdas=(0.5,), n_random=1, verbose=False)
    base.update(kw)
    return Config(**base)


if __name__ == "__main__":
    sys.exit(main())
