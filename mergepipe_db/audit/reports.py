"""`mergepipe report`: an audit report of one committed merge snapshot, as self-contained HTML or Markdown.

It answers what an audit asks, in this order:

- **Identity**: the manifest hash, the plan hash, every output shard's sha256 and size, and the command that
  rechecks them (`mergepipe verify <snapshot>`); the output files are checked before anything is rendered
  (a moved or changed output is a StaleOutputError naming the file and the hash, never stale figures).
- **Error**: the distance from the full-budget output. Additive methods: the omitted-update bound, absolute and
  relative to ‖output‖₂; other methods (TIES, DARE, ...): an estimate from the catalog's delta statistics of the
  omitted blocks (Σ |c_k|·‖Δ_k,b‖₂, said to be an estimate); and, when the catalog holds a full-budget merge of
  the same spec and inputs, the measured relative L2 deviation from it.
- **Reads**: budget, candidate bytes (blocks with a non-zero delta), all expert bytes, planned and realized, per
  expert, in human units (exact integers where a table holds them, and in `data-bytes` attributes).
- **Time**: top-level phases (start-up, planning, reads, compute, writes, other, finalize, commit) that add up to
  the wall time, with the background threads (which overlap them) shown apart.
- **Coverage**: a per-layer × per-expert heatmap weighted by bytes (a tiny tensor's cell is faint).
- **Inputs** summarized per checkpoint, shards folded in `<details>`; operator and parameters; lineage with the
  bytes read along each edge.

Every name is escaped; the HTML embeds its PNG (base64) and loads nothing from the network. For Markdown the
PNG is written beside the report and linked.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import math
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa

from mergepipe_db.audit.lineage import lineage_graph, render_text
from mergepipe_db.core.units import fmt_bytes
from mergepipe_db.db import schema
from mergepipe_db.db.checkpoints import resolve_snapshot
from mergepipe_db.db.engine import Database
from mergepipe_db.errors import StaleOutputError, UnsupportedOutputFormatError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

#: ‖output‖₂ (for relative errors) is computed by reading the output only up to this size.
NORM_MAX_BYTES = 8 << 30

ADDITIVE_METHODS = ("linear", "task_arithmetic")


def layer_group(tensor_name: str) -> str:
    """Heatmap row of a tensor: ``layer <i>`` for ``….layers.<i>.…``, else ``embed``, ``head`` or ``other``."""
    m = _LAYER.search(tensor_name)
    if m:
        return f"layer {int(m.group(1))}"
    low = tensor_name.lower()
    if "embed" in low or "wte" in low or "wpe" in low:
        return "embed"
    if "lm_head" in low or low.startswith("head") or ".head." in low or low.endswith(".head.weight"):
        return "head"
    return "other"


def _group_order(group: str) -> tuple[int, int]:
    if group == "embed":
        return (0, 0)
    if group.startswith("layer "):
        return (1, int(group.split()[1]))
    return (2, 0) if group == "other" else (3, 0)


# --- data ----------------------------------------------------------------------------------------------


def check_outputs(name: str, out_path: str, files: list[dict[str, Any]]) -> None:
    """StaleOutputError (naming the file, and the hash when it differs) unless every output file is at
    `out_path` with its catalogued size and mtime, or, where size or mtime changed, with its catalogued
    sha256 (a touched but unchanged file passes)."""
    out = Path(out_path)
    hint = f"run `mergepipe verify {name}` for every difference"
    if not out.is_dir():
        raise StaleOutputError(f"snapshot {name}: output directory {out} is missing (moved or deleted); the report "
                               f"would show figures of files that are gone; {hint}")
    for f in files:
        p = out / f["relpath"]
        try:
            st = p.stat()
        except OSError:
            raise StaleOutputError(f"snapshot {name}: output file {p} is missing (sha256 {f['sha256']} expected); "
                                   f"{hint}") from None
        if st.st_size == int(f["size"]) and st.st_mtime_ns == int(f["mtime_ns"]):
            continue
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        if h.hexdigest() != f["sha256"]:
            raise StaleOutputError(f"snapshot {name}: output file {p} changed since the commit: sha256 "
                                   f"{h.hexdigest()} != {f['sha256']} in the manifest; {hint}")


def _coefficients(spec: dict[str, Any]) -> list[float]:
    """|c_k| per expert for the error estimate: weight × λ, divided by Σ weights when ``normalize``."""
    params = spec.get("parameters") or {}
    weights = [float((m.get("parameters") or {}).get("weight", 1.0) or 0.0) for m in spec.get("models", [])]
    lam = params.get("lambda")
    lam = 1.0 if lam is None else float(lam)
    total = sum(weights)
    norm = bool(params.get("normalize")) and total != 0.0
    return [abs(lam * (w / total if norm else w)) for w in weights]


def _omitted_estimate(conn: sa.Connection, manifest: dict[str, Any], expert_ids: dict[int, str],
                      tensors: set[str]) -> float:
    """Σ over candidate expert blocks the merge did not read of |c_k|·delta_l2 (catalog statistics; inf when an
    omitted candidate has no statistics). For additive operators this is the omitted-update bound."""
    coef = _coefficients(manifest.get("spec") or {})
    read: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for pos, tname, ranges in manifest.get("access", []):
        read.setdefault((int(pos), str(tname)), []).extend((int(a), int(b)) for a, b in ranges)
    b, t = schema.block, schema.tensor
    terms: list[float] = []
    for pos, cid in sorted(expert_ids.items()):
        c = coef[pos] if pos < len(coef) else 1.0
        rows = conn.execute(
            sa.select(t.c.name, b.c.block_idx, b.c.delta_l2)
            .join(t, (t.c.checkpoint_id == b.c.checkpoint_id) & (t.c.tensor_idx == b.c.tensor_idx))
            .where(b.c.checkpoint_id == cid, sa.or_(b.c.delta_l2.is_(None), b.c.delta_l2 > 0)))
        for name, idx, l2 in rows:
            if name not in tensors:
                continue
            if any(a <= int(idx) < z for a, z in read.get((pos, name), ())):
                continue
            if l2 is None:
                return math.inf
            terms.append(c * float(l2))
    return math.fsum(terms)


def _full_budget_twin(conn: sa.Connection, snap: Any, manifest: dict[str, Any]) -> Any:
    """A committed snapshot of the same spec, inputs and seed at the full budget (or None)."""
    s, m = schema.snapshot, schema.manifest
    rows = conn.execute(
        sa.select(s.c.id, s.c.out_path, s.c.checkpoint_id, m.c.manifest).join(m, m.c.snapshot_id == s.c.id)
        .where(s.c.state == "COMMITTED", s.c.method == snap["method"], s.c.id != snap["id"],
               s.c.full_bytes == snap["full_bytes"], s.c.budget_bytes >= s.c.full_bytes)
        .order_by(s.c.created_at.desc()))
    key = (manifest.get("spec"), manifest.get("inputs"), manifest.get("seed"))
    for row in rows:
        other = json.loads(row.manifest)
        if (other.get("spec"), other.get("inputs"), other.get("seed")) == key:
            return row
    return None


def report_data(db: Database, snapshot_ref: str, *, check: bool = True) -> dict[str, Any]:
    """Everything a report shows, as plain data (bytes are bytes, seconds are seconds).

    Raises UnknownCheckpointError when `snapshot_ref` is not a committed snapshot (listing the known ones),
    StaleOutputError when `check` and an output file moved or changed since the commit.
    """
    s, m, rd, c, t = schema.snapshot, schema.manifest, schema.read_stat, schema.checkpoint, schema.tensor
    sf, rt = schema.source_file, schema.rank_tensor
    te = t.alias("te")
    with db.connect() as conn:
        res = resolve_snapshot(conn, snapshot_ref)
        snap = conn.execute(sa.select(s).where(s.c.id == res.snapshot_id)).mappings().one()
        mrow = conn.execute(sa.select(m.c.manifest, m.c.timings).where(m.c.snapshot_id == res.snapshot_id)).one()
        reads = conn.execute(
            sa.select(rd.c.position, rd.c.expert_id, c.c.name.label("expert"), t.c.name.label("tensor"),
                      rd.c.blocks_total, rd.c.blocks_read, rd.c.bytes_full, rd.c.bytes_planned, rd.c.bytes_read,
                      sa.func.coalesce(rt.c.candidate_bytes, 0).label("candidate_bytes"))
            .join(c, c.c.id == rd.c.expert_id)
            .join(t, (t.c.checkpoint_id == snap["checkpoint_id"]) & (t.c.tensor_idx == rd.c.tensor_idx))
            .outerjoin(te, (te.c.checkpoint_id == rd.c.expert_id) & (te.c.name == t.c.name))
            .outerjoin(rt, (rt.c.checkpoint_id == rd.c.expert_id) & (rt.c.tensor_idx == te.c.tensor_idx))
            .where(rd.c.snapshot_id == res.snapshot_id)
            .order_by(rd.c.position, rd.c.tensor_idx)
        ).all()
        out_files = [dict(r) for r in conn.execute(
            sa.select(sf.c.relpath, sf.c.size, sf.c.mtime_ns, sf.c.sha256).where(sf.c.checkpoint_id == snap["id"])
            .order_by(sf.c.file_idx)).mappings()]
        manifest = json.loads(mrow.manifest)
        input_ids = [manifest.get("inputs", {}).get("base", {}).get("id")]
        input_ids += [e.get("id") for e in manifest.get("inputs", {}).get("experts", [])]
        sizes = {(r.checkpoint_id, r.relpath): int(r.size) for r in conn.execute(
            sa.select(sf.c.checkpoint_id, sf.c.relpath, sf.c.size).where(sf.c.checkpoint_id.in_(
                [i for i in input_ids if i])))}
        expert_ids = {int(e["position"]): e["id"] for e in manifest.get("inputs", {}).get("experts", [])}
        tensors = {r.tensor for r in reads}
        estimate = None
        if snap["bound"] is None:
            estimate = _omitted_estimate(conn, manifest, expert_ids, tensors)
        twin = _full_budget_twin(conn, snap, manifest) if snap["budget_bytes"] < snap["full_bytes"] else None
    if check:
        check_outputs(res.name, snap["out_path"], out_files)
    timings = json.loads(mrow.timings) if mrow.timings else {}

    experts: dict[int, dict[str, Any]] = {}
    zero = {"blocks_total": 0, "blocks_read": 0, "bytes_full": 0, "candidate_bytes": 0, "bytes_planned": 0,
            "bytes_read": 0}
    for e in manifest.get("inputs", {}).get("experts", []):
        experts[int(e["position"])] = {"position": int(e["position"]), "name": e["name"], **zero}
    cover: dict[tuple[str, int], list[int]] = {}
    for r in reads:
        pos = int(r.position)
        e = experts.setdefault(pos, {"position": pos, "name": r.expert, **zero})
        for k in zero:
            e[k] += int(getattr(r, k))
        cell = cover.setdefault((layer_group(r.tensor), pos), [0, 0])
        cell[0] += int(r.bytes_read)
        cell[1] += int(r.bytes_full)
    groups = sorted({g for g, _ in cover}, key=_group_order)
    positions = sorted(experts)
    matrix = [[(cover[(g, p)][0] / cover[(g, p)][1]) if cover.get((g, p), [0, 0])[1] else math.nan
               for p in positions] for g in groups]
    cell_bytes = [[cover.get((g, p), [0, 0])[1] for p in positions] for g in groups]
    realized = manifest.get("realized", {}).get("per_expert", [])
    for p, e in experts.items():
        e["manifest_bytes_read"] = int(realized[p]) if p < len(realized) else None

    # error: the bound or estimate, ‖output‖₂, and the measured deviation from a full-budget twin
    out_bytes = sum(int(f["size"]) for f in out_files)
    norm = None
    if check and out_bytes <= NORM_MAX_BYTES:
        from mergepipe_db.audit.sweep import l2_norm

        norm = l2_norm(snap["out_path"])
    measured = None
    if snap["budget_bytes"] >= snap["full_bytes"]:
        measured = {"deviation": 0.0, "reference": res.name, "note": "this merge read the full budget"}
    elif twin is not None and check and Path(twin.out_path).is_dir():
        from mergepipe_db.audit.sweep import rel_l2_deviation

        measured = {"deviation": rel_l2_deviation(snap["out_path"], twin.out_path), "reference": twin.checkpoint_id,
                    "note": None}
        with db.connect() as conn:
            measured["reference"] = conn.execute(sa.select(c.c.name).where(c.c.id == twin.checkpoint_id)).scalar()
    absolute = snap["bound"] if snap["bound"] is not None else estimate
    error = {
        "kind": "bound" if snap["bound"] is not None else "estimate",
        "absolute": None if absolute is None else float(absolute),
        "output_l2": norm,
        "relative": (float(absolute) / norm) if (absolute is not None and norm) else None,
        "measured": measured,
    }

    inputs = []
    base = manifest.get("inputs", {}).get("base", {})
    for role, entry in [("base", base)] + [(f"expert {e.get('position')}", e)
                                           for e in manifest.get("inputs", {}).get("experts", [])]:
        files = [(rel, sha, sizes.get((entry.get("id"), rel))) for rel, sha in entry.get("files", [])]
        inputs.append({"role": role, "name": entry.get("name"), "id": entry.get("id"), "files": files,
                       "size": sum(x[2] or 0 for x in files)})

    graph = lineage_graph(db, res.snapshot_id)
    return {
        "snapshot": {k: snap[k] for k in ("id", "ref", "state", "method", "plan_hash", "budget_bytes",
                                          "planned_bytes", "realized_bytes", "full_bytes", "base_bytes",
                                          "output_bytes", "bound", "seed", "out_path", "created_at")},
        "name": res.name,
        "manifest": manifest,
        "manifest_hash": hashlib.sha256(mrow.manifest.encode("utf-8")).hexdigest(),
        "outputs": [{"file": f["relpath"], "size": int(f["size"]), "sha256": f["sha256"]} for f in out_files],
        "verify_command": f"mergepipe verify {res.name}",
        "timings": {k: float(v) for k, v in timings.items() if isinstance(v, (int, float))},
        "experts": [experts[p] for p in positions],
        "candidate_bytes": sum(e["candidate_bytes"] for e in experts.values()),
        "coverage": {"groups": groups, "experts": [experts[p]["name"] for p in positions], "matrix": matrix,
                     "bytes": cell_bytes},
        "error": error,
        "inputs": inputs,
        "lineage": render_text(graph),
        "lineage_edges": [e for e in graph["edges"] if e["child"] == res.snapshot_id],
    }


# --- time ----------------------------------------------------------------------------------------------

#: (timings key, label) of the top-level phases, in order; they add up to the wall time
PHASES = (
    ("start_up", "start-up (outputs checked, ref read, staging made)"),
    ("plan", "planning (catalog SQL ranking)"),
    ("read_wait", "reads (waiting for input bytes)"),
    ("compute", "compute (merge operator)"),
    ("write_wait", "writes (waiting for the output writer)"),
    ("_other_execute", "other execution (streaming, bookkeeping)"),
    ("finalize", "finalize (index, side files, manifest)"),
    ("commit", "commit (catalog transaction, publish)"),
)
#: background threads: they overlap the phases above, so they are not added; (key, label, parent key, depth),
#: each shown as a share of its parent (``execute``: reads + compute + writes + other execution)
BACKGROUND = (
    ("output", "output writer thread busy", "execute", 1),
    ("output_stats", "block statistics of the output (in the writer thread)", "output", 2),
    ("read_ahead_full", "read-ahead thread stalled on a full queue", "execute", 1),
)
_PARENT_LABEL = {"execute": "execution", "output": "writer busy"}


def time_rows(t: dict[str, float]) -> tuple[list[tuple[str, float, float]], float,
                                            list[tuple[str, float, str, int]], list[str]]:
    """(top-level rows (label, seconds, share of wall), wall seconds, nested background rows (label, seconds,
    share of their parent as text, depth), notes). Top-level rows add up to the wall time: a remainder is its
    own row."""
    t = dict(t)
    notes = []
    if "execute" in t:
        t["_other_execute"] = max(0.0, t["execute"] - sum(t.get(k, 0.0) for k in ("read_wait", "compute",
                                                                                  "write_wait")))
    top = [(label, t[k]) for k, label in PHASES if k in t]
    attributed = math.fsum(v for _, v in top)
    wall = t.get("wall")
    if wall is None:
        wall = attributed
        notes.append("this snapshot recorded no wall time (made by an older version): the total is the sum of "
                     "the phases it recorded" + ("" if "commit" in t else ", without the commit"))
    elif wall - attributed > 1e-9:
        top.append(("manifest building and gaps between phases", wall - attributed))
    rows = [(label, v, v / wall if wall else 0.0) for label, v in top]
    bg = []
    for k, label, parent, depth in BACKGROUND:
        if k in t:
            den = t.get(parent, 0.0)
            share = f"{100 * t[k] / den:.1f}% of {_PARENT_LABEL[parent]}" if den else "-"
            bg.append((label, t[k], share, depth))
    return rows, wall, bg, notes


# --- heatmap -------------------------------------------------------------------------------------------


def _mpl_text(text: str) -> str:
    """A label matplotlib prints literally (no mathtext from `$`, no control characters)."""
    return "".join(ch if ch.isprintable() else "?" for ch in text).replace("$", r"\$")


def coverage_png(coverage: dict[str, Any], title: str = "") -> bytes:
    """The per-layer × per-expert coverage heatmap as PNG bytes (matplotlib Agg; no global pyplot state).

    Colour: the fraction of the cell's expert bytes read; opacity: the cell's share of the largest cell's
    bytes (square root, at least 0.15), so a 512-byte tensor cannot look as loud as a 500 MB one. Cells carry
    the fraction and the bytes; row labels carry the row's bytes."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import to_rgba
    from matplotlib.figure import Figure

    groups, experts, matrix = coverage["groups"], coverage["experts"], coverage["matrix"]
    nbytes = coverage.get("bytes") or [[1 for _ in row] for row in matrix]
    n_rows, n_cols = max(1, len(groups)), max(1, len(experts))
    fig = Figure(figsize=(min(12.0, 3.0 + 1.2 * n_cols), min(18.0, 1.8 + 0.38 * n_rows)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cmap = colormaps["viridis"]
    biggest = max([b for row in nbytes for b in row] or [1]) or 1
    rgba = []
    for row, brow in zip(matrix or [[math.nan]], nbytes or [[0]]):
        line = []
        for v, b in zip(row, brow):
            if math.isnan(v):
                line.append((1.0, 1.0, 1.0, 1.0))
                continue
            r, g, bl, _ = to_rgba(cmap(v))
            a = max(0.15, math.sqrt(b / biggest))
            line.append((1 - a + a * r, 1 - a + a * g, 1 - a + a * bl, 1.0))  # blended over white
        rgba.append(line)
    ax.imshow(rgba, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(experts)))
    ax.set_xticklabels([_mpl_text(e) for e in experts], rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels([f"{_mpl_text(g)} ({fmt_bytes(sum(brow))})" for g, brow in zip(groups, nbytes)], fontsize=8)
    if len(groups) * len(experts) <= 200:
        for i, (row, brow) in enumerate(zip(matrix, nbytes)):
            for j, (v, b) in enumerate(zip(row, brow)):
                if not math.isnan(v):
                    dark = v < 0.6 and math.sqrt(b / biggest) > 0.5
                    ax.text(j, i, f"{100 * v:.0f}%\n{fmt_bytes(b)}", ha="center", va="center", fontsize=6,
                            color="white" if dark else "black")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer (expert bytes in the row)")
    if title:
        ax.set_title(_mpl_text(title), fontsize=9)
    fig.colorbar(ScalarMappable(cmap=cmap), ax=ax, label="fraction of expert bytes read (faint: few bytes)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# --- rendering -----------------------------------------------------------------------------------------


def _h(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _md(x: Any) -> str:
    text = html.escape("" if x is None else str(x), quote=False)
    return re.sub(r"([\\`*_\[\]|#])", r"\\\1", text)


def _pct(num: float, den: float) -> str:
    return f"{100.0 * num / den:.1f}%" if den else "-"


def _g(x: float | None) -> str:
    if x is None:
        return "n/a"
    if math.isinf(x):
        return "unbounded (some omitted blocks have no delta statistics)"
    return f"{x:.4g}"


def error_lines(d: dict[str, Any]) -> list[tuple[str, str]]:
    """(quantity, value) rows of the error section, shared by both renderers."""
    e, snap = d["error"], d["snapshot"]
    rows: list[tuple[str, str]] = []
    if e["kind"] == "bound":
        what = ("bound (absolute L2): Σ |c_k|·‖Δ_k,b‖₂ over omitted blocks, an upper bound on "
                "‖output − full-budget output‖₂")
    else:
        what = (f"estimate (absolute L2): Σ |c_k|·‖Δ_k,b‖₂ over omitted candidate blocks, from the catalog's delta "
                f"statistics, c_k = weight × λ (÷ Σ weights when normalize); not a bound for {snap['method']} "
                f"(trimming, sign election, drop masks and rescaling change what a block contributes)")
    rows.append((what, _g(e["absolute"])))
    rows.append(("‖output‖₂", "n/a (output not read)" if e["output_l2"] is None else f"{e['output_l2']:.6g}"))
    rows.append((f"{e['kind']} relative to ‖output‖₂", "n/a" if e["relative"] is None else f"{e['relative']:.4g}"))
    m = e["measured"]
    if m is None:
        rows.append(("measured relative L2 deviation from the full-budget output",
                     "n/a: no full-budget merge of the same spec and inputs in the catalog (`mergepipe sweep` "
                     "makes one)"))
    else:
        rows.append(("measured relative L2 deviation from the full-budget output",
                     f"{m['deviation']:.4g} (" + (m["note"] or f"against {m['reference']}") + ")"))
    return rows


def _read_rows(d: dict[str, Any]) -> list[tuple[str, int]]:
    snap = d["snapshot"]
    return [("budget", snap["budget_bytes"]),
            ("candidate expert bytes (blocks with a non-zero delta)", d["candidate_bytes"]),
            ("all expert bytes (full read)", snap["full_bytes"]),
            ("planned expert bytes", snap["planned_bytes"]), ("realized expert bytes", snap["realized_bytes"]),
            ("base bytes read (not charged to the budget)", snap["base_bytes"]),
            ("output bytes written", snap["output_bytes"])]


def _params(d: dict[str, Any]) -> list[tuple[str, Any]]:
    m = d["manifest"]
    spec = m.get("spec", {})
    params = [("merge_method", spec.get("merge_method")), ("base_model", spec.get("base_model")),
              ("dtype", spec.get("dtype") or "(base dtype)"), ("seed", m.get("seed"))]
    for k, v in (spec.get("parameters") or {}).items():
        params.append((k, "(default)" if v is None else v))
    return params


def _models(d: dict[str, Any]) -> list[tuple[Any, ...]]:
    spec = d["manifest"].get("spec", {})
    return [(i, mm.get("model"), *((mm.get("parameters") or {}).get(k) for k in ("weight", "density", "gamma")))
            for i, mm in enumerate(spec.get("models", []))]


_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5em auto;max-width:1100px;
padding:0 1em;color:#222;overflow-wrap:anywhere}
table{border-collapse:collapse;margin:.5em 0 1.2em}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;
vertical-align:top}th{background:#f2f2f2;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums;
white-space:nowrap}td.nest{padding-left:2em}tr.total td{font-weight:bold;border-top:2px solid #888}
code{font-size:12px;word-break:break-all}pre{font-size:12px;background:#f7f7f7;padding:.6em;overflow-x:auto;
max-width:100%;box-sizing:border-box}.box{max-width:100%;overflow-x:auto}img{max-width:100%;height:auto}
h1{font-size:22px}h2{font-size:17px;margin-top:1.6em}details summary{cursor:pointer}p.note{color:#555;font-size:13px}"""


def _b(n: int | None) -> str:
    """A byte count for a person: human units, the exact integer in `data-bytes` and the tooltip."""
    if n is None:
        return "<td></td>"
    return f'<td class="num" data-bytes="{int(n)}" title="{int(n)} bytes">{_h(fmt_bytes(int(n)))}</td>'


def render_html(d: dict[str, Any], png: bytes) -> str:
    snap = d["snapshot"]
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>mergepipe report: {_h(d['name'])}</title>", f"<style>{_CSS}</style></head><body>",
           f"<h1>Merge report: {_h(d['name'])}</h1>"]

    out.append('<h2>Identity</h2><div class="box"><table id="identity"><tr><th>field</th><th>value</th></tr>')
    for k, v in (("snapshot", d["name"]), ("snapshot id", snap["id"]), ("method", snap["method"]),
                 ("manifest hash (sha256)", d["manifest_hash"]), ("plan hash", snap["plan_hash"]),
                 ("seed", snap["seed"]), ("output directory", snap["out_path"]), ("created", snap["created_at"]),
                 ("recheck with", d["verify_command"])):
        out.append(f"<tr><th>{_h(k)}</th><td><code>{_h(v)}</code></td></tr>")
    out.append('</table></div><div class="box"><table id="outputs"><tr><th>output file</th><th>size</th>'
               "<th>sha256</th></tr>")
    for f in d["outputs"]:
        out.append(f"<tr><td>{_h(f['file'])}</td>{_b(f['size'])}<td><code>{_h(f['sha256'])}</code></td></tr>")
    total = sum(f["size"] for f in d["outputs"])
    out.append(f'<tr class="total"><td>{len(d["outputs"])} file(s)</td>{_b(total)}<td></td></tr></table></div>')

    out.append('<h2>Distance from the full-budget output</h2><div class="box"><table id="error"><tr><th>quantity</th>'
               "<th>value</th></tr>")
    for k, v in error_lines(d):
        out.append(f"<tr><th>{_h(k)}</th><td>{_h(v)}</td></tr>")
    out.append("</table></div>")

    out.append('<h2>Reads</h2><div class="box"><table id="budget"><tr><th>expert-read quantity</th><th>bytes</th>'
               "<th>exact</th></tr>")
    for k, v in _read_rows(d):
        out.append(f'<tr><th>{_h(k)}</th>{_b(v)}<td class="num">{int(v)}</td></tr>')
    out.append('</table></div><div class="box"><table id="reads-per-expert"><tr><th>position</th><th>expert</th>'
               "<th>blocks read</th><th>blocks total</th><th>candidate bytes</th><th>all bytes</th>"
               "<th>planned</th><th>read</th><th>% of candidates</th><th>% of all</th><th>% of budget</th></tr>")
    for e in d["experts"]:
        out.append(
            f'<tr><td class="num">{e["position"]}</td><td>{_h(e["name"])}</td>'
            f'<td class="num">{e["blocks_read"]}</td><td class="num">{e["blocks_total"]}</td>'
            f'{_b(e["candidate_bytes"])}{_b(e["bytes_full"])}{_b(e["bytes_planned"])}{_b(e["bytes_read"])}'
            f'<td class="num">{_pct(e["bytes_read"], e["candidate_bytes"])}</td>'
            f'<td class="num">{_pct(e["bytes_read"], e["bytes_full"])}</td>'
            f'<td class="num">{_pct(e["bytes_read"], snap["budget_bytes"])}</td></tr>')
    out.append("</table></div>")

    rows, wall, bg, notes = time_rows(d["timings"])
    out.append('<h2>Time</h2><div class="box"><table id="timings"><tr><th>phase</th><th>seconds</th>'
               "<th>share of wall time</th></tr>")
    for label, v, share in rows:
        out.append(f'<tr><td>{_h(label)}</td><td class="num">{v:.4f}</td><td class="num">{100 * share:.1f}%</td>'
                   "</tr>")
    out.append(f'<tr class="total"><td>total (wall time)</td><td class="num">{wall:.4f}</td>'
               f'<td class="num">100.0%</td></tr>')
    if bg:
        out.append('<tr><th colspan="3">background threads (overlap the phases above; not added)</th></tr>')
        for label, v, share, depth in bg:
            out.append(f'<tr><td class="nest" style="padding-left:{1.5 * depth:g}em">{_h(label)}</td>'
                       f'<td class="num">{v:.4f}</td><td class="num">{_h(share)}</td></tr>')
    out.append("</table></div>")
    for n in notes:
        out.append(f'<p class="note">{_h(n)}</p>')

    out.append("<h2>Coverage: fraction of each layer's expert bytes read</h2>")
    out.append(f'<img id="coverage" alt="coverage heatmap" src="data:image/png;base64,'
               f'{base64.b64encode(png).decode("ascii")}">')
    out.append('<p class="note">Colour: fraction read; faint cells hold few bytes (opacity ∝ √bytes).</p>')

    out.append('<h2>Inputs</h2><div class="box"><table id="inputs"><tr><th>role</th><th>checkpoint</th>'
               "<th>id</th><th>size</th><th>files (sha256)</th></tr>")
    for i in d["inputs"]:
        files = "".join(f"<tr><td>{_h(rel)}</td>{_b(size)}<td><code>{_h(sha)}</code></td></tr>"
                        for rel, sha, size in i["files"])
        out.append(f"<tr><td>{_h(i['role'])}</td><td>{_h(i['name'])}</td><td><code>{_h(i['id'])}</code></td>"
                   f"{_b(i['size'])}<td><details><summary>{len(i['files'])} file(s)</summary>"
                   f'<table class="files">{files}</table></details></td></tr>')
    out.append("</table></div>")

    out.append('<h2>Operator and parameters</h2><div class="box"><table id="parameters"><tr><th>parameter</th>'
               "<th>value</th></tr>")
    for k, v in _params(d):
        out.append(f"<tr><td>{_h(k)}</td><td>{_h(v)}</td></tr>")
    out.append('</table><table id="models"><tr><th>position</th><th>model</th><th>weight</th><th>density</th>'
               "<th>gamma</th></tr>")
    for row in _models(d):
        out.append("<tr>" + "".join(f"<td>{_h(v)}</td>" for v in row) + "</tr>")
    out.append("</table></div>")

    out.append('<h2>Lineage</h2><div class="box"><table id="lineage-edges"><tr><th>input</th><th>role</th>'
               "<th>bytes read from it</th></tr>")
    for e in d["lineage_edges"]:
        role = "base" if e["role"] == "base" else f"expert {e['position']}"
        out.append(f"<tr><td>{_h(e['parent_name'])}</td><td>{_h(role)}</td>{_b(e['bytes_read'])}</tr>")
    out.append(f'</table></div><pre id="lineage">{_h(d["lineage"])}</pre>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def render_markdown(d: dict[str, Any], png_name: str) -> str:
    snap = d["snapshot"]
    out = [f"# Merge report: {_md(d['name'])}", "", "## Identity", "", "| field | value |", "|---|---|"]
    for k, v in (("snapshot", d["name"]), ("snapshot id", snap["id"]), ("method", snap["method"]),
                 ("manifest hash (sha256)", d["manifest_hash"]), ("plan hash", snap["plan_hash"]),
                 ("seed", snap["seed"]), ("output directory", snap["out_path"]), ("created", snap["created_at"]),
                 ("recheck with", d["verify_command"])):
        out.append(f"| {_md(k)} | `{_md(v)}` |" if k == "recheck with" else f"| {_md(k)} | {_md(v)} |")
    out += ["", "| output file | size | sha256 |", "|---|---:|---|"]
    for f in d["outputs"]:
        out.append(f"| {_md(f['file'])} | {fmt_bytes(f['size'])} | {_md(f['sha256'])} |")
    out.append(f"| {len(d['outputs'])} file(s) | {fmt_bytes(sum(f['size'] for f in d['outputs']))} | |")
    out += ["", "## Distance from the full-budget output", "", "| quantity | value |", "|---|---|"]
    for k, v in error_lines(d):
        out.append(f"| {_md(k)} | {_md(v)} |")
    out += ["", "## Reads", "", "| expert-read quantity | bytes | exact |", "|---|---:|---:|"]
    for k, v in _read_rows(d):
        out.append(f"| {_md(k)} | {fmt_bytes(v)} | {int(v)} |")
    out += ["", "| position | expert | blocks read | blocks total | candidate bytes | all bytes | planned | read | "
            "% of candidates | % of all | % of budget |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in d["experts"]:
        out.append(f"| {e['position']} | {_md(e['name'])} | {e['blocks_read']} | {e['blocks_total']} | "
                   f"{fmt_bytes(e['candidate_bytes'])} | {fmt_bytes(e['bytes_full'])} | "
                   f"{fmt_bytes(e['bytes_planned'])} | {fmt_bytes(e['bytes_read'])} | "
                   f"{_pct(e['bytes_read'], e['candidate_bytes'])} | {_pct(e['bytes_read'], e['bytes_full'])} | "
                   f"{_pct(e['bytes_read'], snap['budget_bytes'])} |")
    rows, wall, bg, notes = time_rows(d["timings"])
    out += ["", "## Time", "", "| phase | seconds | share of wall time |", "|---|---:|---:|"]
    for label, v, share in rows:
        out.append(f"| {_md(label)} | {v:.4f} | {100 * share:.1f}% |")
    out.append(f"| **total (wall time)** | **{wall:.4f}** | **100.0%** |")
    if bg:
        out += ["", "Background threads (overlap the phases above; not added):", "",
                "| thread | seconds | share of its parent |", "|---|---:|---:|"]
        for label, v, share, depth in bg:
            out.append(f"| {'↳ ' * (depth - 1)}{_md(label)} | {v:.4f} | {share} |")
    for n in notes:
        out += ["", _md(n)]
    out += ["", "## Coverage: fraction of each layer's expert bytes read", "",
            f"![coverage heatmap]({quote(png_name)})", "",
            "Colour: fraction read; faint cells hold few bytes (opacity ∝ √bytes).", "",
            "## Inputs", "", "| role | checkpoint | id | size | files |", "|---|---|---|---:|---:|"]
    for i in d["inputs"]:
        out.append(f"| {_md(i['role'])} | {_md(i['name'])} | {_md(i['id'])} | {fmt_bytes(i['size'])} | "
                   f"{len(i['files'])} |")
    out += ["", "<details><summary>input files and their sha256</summary>", "",
            "| checkpoint | file | size | sha256 |", "|---|---|---:|---|"]
    for i in d["inputs"]:
        for rel, sha, size in i["files"]:
            out.append(f"| {_md(i['name'])} | {_md(rel)} | {'' if size is None else fmt_bytes(size)} | {_md(sha)} |")
    out += ["", "</details>", "", "## Operator and parameters", "", "| parameter | value |", "|---|---|"]
    for k, v in _params(d):
        out.append(f"| {_md(k)} | {_md(v)} |")
    out += ["", "| position | model | weight | density | gamma |", "|---:|---|---:|---:|---:|"]
    for row in _models(d):
        out.append("| " + " | ".join(_md(v) for v in row) + " |")
    out += ["", "## Lineage", "", "| input | role | bytes read from it |", "|---|---|---:|"]
    for e in d["lineage_edges"]:
        role = "base" if e["role"] == "base" else f"expert {e['position']}"
        out.append(f"| {_md(e['parent_name'])} | {role} | "
                   f"{'' if e['bytes_read'] is None else fmt_bytes(e['bytes_read'])} |")
    out += ["", "```", d["lineage"].replace("```", "'''"), "```", ""]
    return "\n".join(out)


def write_report(db: Database, snapshot_ref: str, out: str | Path) -> Path:
    """Write the report of `snapshot_ref` to `out`: HTML for ``.html``/``.htm``, Markdown for ``.md`` (the
    heatmap PNG then goes beside it as ``<stem>.coverage.png``). Returns the report path.

    Raises UnknownCheckpointError (not a committed snapshot), UnsupportedOutputFormatError (other extension),
    ReportPathError (the directory does not exist) or StaleOutputError (the snapshot's outputs moved or
    changed since the commit). An existing report file is replaced.
    """
    path = check_report_path(out)
    d = report_data(db, snapshot_ref)
    png = coverage_png(d["coverage"], title=f"{d['name']}: expert bytes read per layer")
    if path.suffix.lower() in (".html", ".htm"):
        path.write_text(render_html(d, png), encoding="utf-8")
    else:
        png_path = path.with_name(f"{path.stem}.coverage.png")
        png_path.write_bytes(png)
        path.write_text(render_markdown(d, png_path.name), encoding="utf-8")
    return path


def check_report_path(out: str | Path) -> Path:
    """The report path, refused (before any work) when its extension is not .html/.htm/.md/.markdown
    (UnsupportedOutputFormatError) or its directory does not exist (ReportPathError)."""
    from mergepipe_db.errors import ReportPathError

    path = Path(out).expanduser()
    if path.suffix.lower() not in (".html", ".htm", ".md", ".markdown"):
        raise UnsupportedOutputFormatError(f"report output must end in .html or .md, got {str(path)!r}")
    if not path.parent.is_dir():
        raise ReportPathError(f"directory {str(path.parent)!r} of the report does not exist; create it first")
    return path
