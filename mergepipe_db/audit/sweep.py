"""`mergepipe sweep`: one merge spec at several budgets, and the frontier of bytes read against error.

Each budget is a real, committed merge (`Catalog.merge`) into ``DIR/budget-<b>/`` under its own ref
``<DIR name>-b<b>``, all against one catalog. The full budget (1) is always included: it is the reference
every other output is compared with, tensor by tensor in float64, as ‖out_b − out_full‖₂ / ‖out_full‖₂.
Writes ``DIR/frontier.csv``, ``DIR/frontier.md`` and ``DIR/frontier.png`` (deviation and time against the
expert bytes read). Progress lines go to stderr.
"""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergepipe_db.core.spec import Budget, MergeSpec, load_spec, parse_budget
from mergepipe_db.core.units import fmt_bytes
from mergepipe_db.errors import BudgetError, IntegrityError, OutputExistsError, StaleSourceError
from mergepipe_db.io import RangeSource, open_store

if TYPE_CHECKING:
    from mergepipe_db.catalog import Catalog

#: frontier columns; bytes are exact integers, deviations and bounds are L2 norms: ``*_rel`` relative to
#: ‖out_full‖₂, ``*_abs`` absolute (the bound is empty where the operator has none)
COLUMNS = ("budget", "budget_bytes", "expert_bytes", "total_bytes", "seconds", "deviation_rel_l2",
           "deviation_abs_l2", "bound_rel_l2", "bound_abs_l2")
FULL = Budget(fraction=1.0)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass
class SweepResult:
    rows: list[dict[str, Any]]  # one per budget, sorted by budget_bytes; keys COLUMNS + out, ref, snapshot_id
    csv: Path
    md: Path
    png: Path

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "csv": str(self.csv), "md": str(self.md), "png": str(self.png)}


def _label(b: Budget, text: str) -> str:
    if b.fraction is not None:
        return f"{b.fraction:g}"
    return "".join(text.split())


def parse_budgets(budgets: str | list[Any] | tuple[Any, ...]) -> list[tuple[str, Budget]]:
    """``"0.05,0.1,1"`` (or a list) → [(label, Budget)], duplicates dropped, the full budget 1 added if missing.

    Labels name the output directories and refs: a fraction as ``%g`` (0.05, 1), bytes as written (3GiB).
    Raises BudgetError for an empty list or a bad budget.
    """
    items = [x for x in (budgets.split(",") if isinstance(budgets, str) else list(budgets))]
    out: list[tuple[str, Budget]] = []
    seen: set[tuple[float | None, int | None]] = set()
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        b = parse_budget(text)
        key = (b.fraction, b.nbytes)
        if key in seen:
            continue
        seen.add(key)
        out.append((_label(b, text), b))
    if not out:
        raise BudgetError("give at least one budget, e.g. --budgets 0.05,0.1,0.25,0.5,1")
    labels = [lab for lab, _ in out]
    if len(set(labels)) != len(labels):
        raise BudgetError(f"budgets give clashing directory names: {', '.join(labels)}")
    if (FULL.fraction, FULL.nbytes) not in seen:
        out.append(("1", FULL))
    return out


def _tensor_index(out_dir: Path) -> dict[str, tuple[Path, int, int, str, tuple[int, ...]]]:
    """name → (file, absolute offset, nbytes, dtype, shape) for every tensor of an output directory."""
    from mergepipe_db.formats.safetensors import read_header

    index: dict[str, tuple[Path, int, int, str, tuple[int, ...]]] = {}
    for path in sorted(out_dir.glob("*.safetensors")):
        h = read_header(path)
        for t in h.tensors:
            index[t.name] = (path, h.absolute_offset(t), t.nbytes, t.dtype, tuple(t.shape))
    return index


def _read(reader: RangeSource, path: Path, offset: int, nbytes: int) -> bytearray:
    """`nbytes` at `offset` of an output file; IntegrityError where the file ends first."""
    try:
        return reader.read(str(path), offset, nbytes)
    except StaleSourceError:
        raise IntegrityError(f"short read of {nbytes} bytes at offset {offset} of {path}") from None


def rel_l2_deviation(out_dir: str | Path, ref_dir: str | Path) -> float:
    """‖out − ref‖₂ / ‖ref‖₂ over every floating-point tensor of two output directories, in float64.

    Tensors are read one at a time. Raises IntegrityError when the two hold different tensor sets or shapes.
    """
    import torch

    from mergepipe_db.core.dtypes import torch_dtype

    a_idx, r_idx = _tensor_index(Path(out_dir)), _tensor_index(Path(ref_dir))
    if set(a_idx) != set(r_idx):
        raise IntegrityError(f"outputs {out_dir} and {ref_dir} hold different tensors")
    diff2: list[float] = []
    ref2: list[float] = []
    with (open_store(out_dir).range_reader(random=False) as a_reader,
          open_store(ref_dir).range_reader(random=False) as r_reader):
        for name in sorted(r_idx):
            rp, ro, rn, rdt, rshape = r_idx[name]
            ap, ao, an, adt, ashape = a_idx[name]
            if rdt not in _FLOAT_DTYPES or adt not in _FLOAT_DTYPES:
                continue
            if rshape != ashape:
                raise IntegrityError(f"tensor {name!r} has shape {list(ashape)} in {out_dir}, {list(rshape)} in "
                                     f"{ref_dir}")
            r = torch.frombuffer(_read(r_reader, rp, ro, rn), dtype=torch_dtype(rdt)).to(torch.float64) if rn else None
            a = torch.frombuffer(_read(a_reader, ap, ao, an), dtype=torch_dtype(adt)).to(torch.float64) if an else None
            if r is None or a is None:
                continue
            diff2.append(float(torch.sum((a - r) ** 2)))
            ref2.append(float(torch.sum(r * r)))
    num, den = math.sqrt(math.fsum(diff2)), math.sqrt(math.fsum(ref2))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"sweep: {msg}", file=sys.stderr, flush=True)


def run_sweep(catalog: Catalog, spec: Any, budgets: str | list[Any] | tuple[Any, ...], out: str | Path, *,
              seed: int | None = None, shard_bytes: int | None = None, progress: bool = True,
              bar: bool = False) -> SweepResult:
    """Merge `spec` once per budget into ``out/budget-<b>/`` and write the frontier files into `out`.

    Every output directory must be new (checked before the first merge: OutputExistsError). `progress`
    prints one line per step on stderr; `bar` shows each merge's progress bar.
    """
    plan_budgets = parse_budgets(budgets)
    s = spec if isinstance(spec, MergeSpec) else load_spec(spec)
    root = Path(out).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise OutputExistsError(f"sweep output {root} exists and is not a directory")
    targets = [(label, b, root / f"budget-{label}") for label, b in plan_budgets]
    for *_, target in targets:
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise OutputExistsError(f"sweep output {target} exists and is not empty; choose a new DIR")
    root.mkdir(parents=True, exist_ok=True)

    rows: list[dict[str, Any]] = []
    for i, (label, b, target) in enumerate(targets, 1):
        ref = f"{root.name}-b{label}"
        _say(progress, f"[{i}/{len(targets)}] budget {label} ({b}) -> {target}")
        res = catalog.merge(s, out=target, budget=b, seed=seed, ref=ref, shard_bytes=shard_bytes, progress=bar)
        _say(progress, f"[{i}/{len(targets)}] budget {label}: read {fmt_bytes(res.realized_bytes)} of "
                       f"{fmt_bytes(res.budget_bytes)} ({fmt_bytes(res.full_bytes)} full) in {res.seconds:.2f} s, "
                       f"snapshot {res.checkpoint}")
        rows.append({
            "budget": label, "budget_bytes": res.budget_bytes, "expert_bytes": res.realized_bytes,
            "total_bytes": res.realized_bytes + res.base_bytes + res.output_bytes, "seconds": res.seconds,
            "deviation_rel_l2": None, "deviation_abs_l2": None, "bound_rel_l2": None, "bound_abs_l2": res.bound,
            "out": res.out, "ref": res.ref, "snapshot_id": res.snapshot_id, "checkpoint": res.checkpoint,
            "_full": b == FULL,
        })
    reference = next(r for r in rows if r["_full"])
    ref_norm = l2_norm(reference["out"])
    for r in rows:
        if r is reference:
            r["deviation_rel_l2"] = 0.0
        else:
            _say(progress, f"deviation of budget {r['budget']} from the full-budget output")
            r["deviation_rel_l2"] = rel_l2_deviation(r["out"], reference["out"])
        r["deviation_abs_l2"] = r["deviation_rel_l2"] * ref_norm
        if r["bound_abs_l2"] is not None:
            r["bound_rel_l2"] = r["bound_abs_l2"] / ref_norm if ref_norm else math.inf
        del r["_full"]
    rows.sort(key=lambda r: (r["budget_bytes"], r["expert_bytes"], r["budget"]))

    csv_path, md_path, png_path = root / "frontier.csv", root / "frontier.md", root / "frontier.png"
    named = bool(s.source) and not str(s.source).startswith("<")
    title = f"{s.method}, {len(s.models)} expert(s)" + (f", {Path(str(s.source)).name}" if named else "")
    _write_csv(csv_path, rows)
    _write_md(md_path, rows, title, ref_norm)
    png_path.write_bytes(frontier_png(rows, title))
    return SweepResult(rows, csv_path, md_path, png_path)


def l2_norm(out_dir: str | Path) -> float:
    """‖out‖₂ over the floating-point tensors (for plotting the bound relative to the output)."""
    import torch

    from mergepipe_db.core.dtypes import torch_dtype

    acc = []
    with open_store(out_dir).range_reader(random=False) as reader:
        for _name, (p, off, n, dt, _shape) in sorted(_tensor_index(Path(out_dir)).items()):
            if dt not in _FLOAT_DTYPES or not n:
                continue
            x = torch.frombuffer(_read(reader, p, off, n), dtype=torch_dtype(dt)).to(torch.float64)
            acc.append(float(torch.sum(x * x)))
    return math.sqrt(math.fsum(acc))


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else str(v)
    return str(v)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow([_cell(r[c]) for c in COLUMNS])


def _write_md(path: Path, rows: list[dict[str, Any]], title: str, ref_norm: float) -> None:
    lines = [f"# Budget sweep: {title}", "",
             "Bytes in human units (exact integers in frontier.csv); `expert` is the realized expert read, `total` "
             "adds base reads and output writes. Deviation: ‖out_b − out_full‖₂ (float64), relative to "
             f"‖out_full‖₂ = {ref_norm:.6g} and absolute; bound: the omitted-update bound (an upper bound on the "
             "absolute deviation), relative and absolute, empty where the operator has none.", "",
             "| budget | budget bytes | expert | total | seconds | deviation (rel.) | deviation (abs.) | "
             "bound (rel.) | bound (abs.) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [r["budget"], fmt_bytes(r["budget_bytes"]), fmt_bytes(r["expert_bytes"]), fmt_bytes(r["total_bytes"]),
                 f"{r['seconds']:.3f}", f"{r['deviation_rel_l2']:.4g}", f"{r['deviation_abs_l2']:.4g}",
                 _g(r["bound_rel_l2"]), _g(r["bound_abs_l2"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "![frontier](frontier.png)", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def _g(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def frontier_png(rows: list[dict[str, Any]], title: str = "") -> bytes:
    """Two panels against expert bytes read: the relative L2 deviation (and the relative bound, where there is
    one) on a log axis, and seconds. The full-budget point (deviation 0) has no place on a log axis."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    mib = float(1 << 20)
    fig = Figure(figsize=(11, 4.4), dpi=100)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    pts = [(r["expert_bytes"] / mib, r["deviation_rel_l2"], r["budget"]) for r in rows if r["deviation_rel_l2"] > 0]
    if pts:
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="measured ‖out−full‖/‖full‖")
        for xi, yi, lab in pts:
            ax1.annotate(str(lab).replace("$", r"\$"), (xi, yi), fontsize=7, textcoords="offset points",
                         xytext=(3, 3))
    bnd = [(r["expert_bytes"] / mib, r["bound_rel_l2"]) for r in rows
           if r["bound_rel_l2"] is not None and math.isfinite(r["bound_rel_l2"]) and r["bound_rel_l2"] > 0]
    if bnd:
        ax1.plot([p[0] for p in bnd], [p[1] for p in bnd], "s--", alpha=0.7, label="bound / ‖full‖")
    if pts or bnd:
        ax1.set_yscale("log")
        ax1.legend(fontsize=8)
    else:
        ax1.text(0.5, 0.5, "every budget read the full output (deviation 0)", ha="center", va="center",
                 transform=ax1.transAxes, fontsize=8)
    ax1.set_xlabel("expert bytes read (MiB)")
    ax1.set_ylabel("relative L2 deviation from full budget (log)")
    ax1.set_title("error vs bytes read (full budget: 0, not drawn)", fontsize=10)
    ax1.grid(True, which="both", alpha=0.3)
    x = [r["expert_bytes"] / mib for r in rows]
    ax2.plot(x, [r["seconds"] for r in rows], "o-", color="tab:orange")
    ax2.set_xlabel("expert bytes read (MiB)")
    ax2.set_ylabel("merge wall time (s)")
    ax2.set_title("time vs bytes read", fontsize=10)
    ax2.grid(True, alpha=0.3)
    ax2.set_ylim(bottom=0)
    if title:
        fig.suptitle(f"Budget sweep: {title}".replace("$", r"\$"), fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
