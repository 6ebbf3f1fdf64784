"""`mergepipe report`: an audit report of one committed merge snapshot, as self-contained HTML or Markdown.

Contents: the inputs with their file hashes (from the manifest), operator and parameters, the budget against
the realized expert reads per expert (from the catalog's per-tensor read records), a per-layer × per-expert
coverage heatmap (fraction of each layer's expert bytes that were read), the omitted-update bound and the
time breakdown. Every name is escaped; the HTML embeds its PNG (base64) and loads nothing from the network.
For Markdown the PNG is written beside the report and linked.
"""

from __future__ import annotations

import base64
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
from mergepipe_db.errors import UnsupportedOutputFormatError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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


def report_data(db: Database, snapshot_ref: str) -> dict[str, Any]:
    """Everything a report shows, as plain data (bytes are bytes, seconds are seconds).

    Raises UnknownCheckpointError when `snapshot_ref` is not a committed snapshot.
    """
    s, m, rd, c, t = schema.snapshot, schema.manifest, schema.read_stat, schema.checkpoint, schema.tensor
    with db.connect() as conn:
        res = resolve_snapshot(conn, snapshot_ref)
        snap = conn.execute(sa.select(s).where(s.c.id == res.snapshot_id)).mappings().one()
        mrow = conn.execute(sa.select(m.c.manifest, m.c.timings).where(m.c.snapshot_id == res.snapshot_id)).one()
        reads = conn.execute(
            sa.select(rd.c.position, c.c.name.label("expert"), t.c.name.label("tensor"), rd.c.blocks_total,
                      rd.c.blocks_read, rd.c.bytes_full, rd.c.bytes_planned, rd.c.bytes_read)
            .join(c, c.c.id == rd.c.expert_id)
            .join(t, (t.c.checkpoint_id == snap["checkpoint_id"]) & (t.c.tensor_idx == rd.c.tensor_idx))
            .where(rd.c.snapshot_id == res.snapshot_id)
            .order_by(rd.c.position, rd.c.tensor_idx)
        ).all()
    manifest = json.loads(mrow.manifest)
    timings = json.loads(mrow.timings) if mrow.timings else {}

    experts: dict[int, dict[str, Any]] = {}
    for e in manifest.get("inputs", {}).get("experts", []):
        experts[int(e["position"])] = {"position": int(e["position"]), "name": e["name"], "blocks_total": 0,
                                       "blocks_read": 0, "bytes_full": 0, "bytes_planned": 0, "bytes_read": 0}
    cover: dict[tuple[str, int], list[int]] = {}
    for r in reads:
        pos = int(r.position)
        e = experts.setdefault(pos, {"position": pos, "name": r.expert, "blocks_total": 0, "blocks_read": 0,
                                     "bytes_full": 0, "bytes_planned": 0, "bytes_read": 0})
        for k in ("blocks_total", "blocks_read", "bytes_full", "bytes_planned", "bytes_read"):
            e[k] += int(getattr(r, k))
        cell = cover.setdefault((layer_group(r.tensor), pos), [0, 0])
        cell[0] += int(r.bytes_read)
        cell[1] += int(r.bytes_full)
    groups = sorted({g for g, _ in cover}, key=_group_order)
    positions = sorted(experts)
    matrix = [[(cover[(g, p)][0] / cover[(g, p)][1]) if cover.get((g, p), [0, 0])[1] else math.nan
               for p in positions] for g in groups]
    realized = manifest.get("realized", {}).get("per_expert", [])
    for p, e in experts.items():
        e["manifest_bytes_read"] = int(realized[p]) if p < len(realized) else None
    return {
        "snapshot": {k: snap[k] for k in ("id", "ref", "state", "method", "plan_hash", "budget_bytes",
                                          "planned_bytes", "realized_bytes", "full_bytes", "base_bytes",
                                          "output_bytes", "bound", "seed", "out_path", "created_at")},
        "name": res.name,
        "manifest": manifest,
        "timings": {k: float(v) for k, v in timings.items() if isinstance(v, (int, float))},
        "experts": [experts[p] for p in positions],
        "coverage": {"groups": groups, "experts": [experts[p]["name"] for p in positions], "matrix": matrix},
        "lineage": render_text(lineage_graph(db, res.snapshot_id)),
    }


# --- heatmap -------------------------------------------------------------------------------------------


def _mpl_text(text: str) -> str:
    """A label matplotlib prints literally (no mathtext from `$`, no control characters)."""
    return "".join(ch if ch.isprintable() else "?" for ch in text).replace("$", r"\$")


def coverage_png(coverage: dict[str, Any], title: str = "") -> bytes:
    """The per-layer × per-expert coverage heatmap as PNG bytes (matplotlib Agg; no global pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups, experts, matrix = coverage["groups"], coverage["experts"], coverage["matrix"]
    n_rows, n_cols = max(1, len(groups)), max(1, len(experts))
    fig = Figure(figsize=(min(14.0, 2.5 + 1.1 * n_cols), min(18.0, 1.6 + 0.35 * n_rows)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    data = matrix if matrix else [[math.nan]]
    im = ax.imshow(data, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(experts)))
    ax.set_xticklabels([_mpl_text(e) for e in experts], rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels([_mpl_text(g) for g in groups], fontsize=8)
    if len(groups) * len(experts) <= 400:
        for i, row in enumerate(matrix):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{100 * v:.0f}%", ha="center", va="center", fontsize=7,
                            color="white" if v < 0.6 else "black")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    if title:
        ax.set_title(_mpl_text(title), fontsize=9)
    fig.colorbar(im, ax=ax, label="fraction of expert bytes read")
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


def _bound_text(bound: float | None) -> str:
    if bound is None:
        return "n/a (the operator is not fixed-coefficient additive, so no bound is computed)"
    if math.isinf(bound):
        return "unbounded (some omitted blocks have no delta statistics)"
    return f"{bound:.6g}"


def _sections(d: dict[str, Any]) -> dict[str, Any]:
    """Rows shared by both renderers (raw values; each renderer escapes)."""
    m, snap = d["manifest"], d["snapshot"]
    spec = m.get("spec", {})
    inputs = []
    base = m.get("inputs", {}).get("base", {})
    for rel, sha in base.get("files", []):
        inputs.append(("base", base.get("name"), base.get("id"), rel, sha))
    for e in m.get("inputs", {}).get("experts", []):
        for rel, sha in e.get("files", []):
            inputs.append((f"expert {e.get('position')}", e.get("name"), e.get("id"), rel, sha))
    params = [("merge_method", spec.get("merge_method")), ("base_model", spec.get("base_model")),
              ("dtype", spec.get("dtype") or "(base dtype)"), ("seed", m.get("seed"))]
    for k, v in (spec.get("parameters") or {}).items():
        params.append((k, "(default)" if v is None else v))
    models = [(i, mm.get("model"), *((mm.get("parameters") or {}).get(k) for k in ("weight", "density", "gamma")))
              for i, mm in enumerate(spec.get("models", []))]
    t = d["timings"]
    top = [k for k in ("plan", "execute", "commit") if k in t]
    total = sum(t[k] for k in top) or sum(t.values())
    times = []
    for k in ("plan", "execute", "read_wait", "compute", "write", "commit"):
        if k in t:
            times.append((k if k in top else f"{k} (in execute)", t[k], _pct(t[k], total)))
    for k in sorted(set(t) - {"plan", "execute", "read_wait", "compute", "write", "commit"}):
        times.append((k, t[k], _pct(t[k], total)))
    budget = [("budget (expert bytes)", snap["budget_bytes"]), ("full read (expert bytes)", snap["full_bytes"]),
              ("planned expert bytes", snap["planned_bytes"]), ("realized expert bytes", snap["realized_bytes"]),
              ("base bytes read", snap["base_bytes"]), ("output bytes written", snap["output_bytes"])]
    return {"inputs": inputs, "params": params, "models": models, "times": times, "total_time": total,
            "budget": budget}


_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}
th{background:#f2f2f2;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}
code,pre{font-size:12px}pre{background:#f7f7f7;padding:.6em;overflow-x:auto}h1{font-size:22px}h2{font-size:17px}"""


def render_html(d: dict[str, Any], png: bytes) -> str:
    snap, sec = d["snapshot"], _sections(d)
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>mergepipe report: {_h(d['name'])}</title>", f"<style>{_CSS}</style></head><body>",
           f"<h1>Merge report: {_h(d['name'])}</h1>",
           '<table id="snapshot">']
    for k in ("id", "ref", "method", "plan_hash", "seed", "out_path", "created_at"):
        out.append(f"<tr><th>{_h(k)}</th><td><code>{_h(snap[k])}</code></td></tr>")
    out.append("</table>")

    out.append('<h2>Inputs</h2><table id="inputs"><tr><th>role</th><th>checkpoint</th><th>id</th><th>file</th>'
               "<th>sha256</th></tr>")
    for role, name, cid, rel, sha in sec["inputs"]:
        out.append(f"<tr><td>{_h(role)}</td><td>{_h(name)}</td><td><code>{_h(cid)}</code></td><td>{_h(rel)}</td>"
                   f"<td><code>{_h(sha)}</code></td></tr>")
    out.append("</table>")

    out.append('<h2>Operator and parameters</h2><table id="parameters"><tr><th>parameter</th><th>value</th></tr>')
    for k, v in sec["params"]:
        out.append(f"<tr><td>{_h(k)}</td><td>{_h(v)}</td></tr>")
    out.append('</table><table id="models"><tr><th>position</th><th>model</th><th>weight</th><th>density</th>'
               "<th>gamma</th></tr>")
    for row in sec["models"]:
        out.append("<tr>" + "".join(f"<td>{_h(v)}</td>" for v in row) + "</tr>")
    out.append("</table>")

    out.append('<h2>Budget and realized expert reads</h2><table id="budget">')
    for k, v in sec["budget"]:
        out.append(f'<tr><th>{_h(k)}</th><td class="num">{int(v)}</td><td>{_h(fmt_bytes(v))}</td></tr>')
    out.append('</table><table id="reads-per-expert"><tr><th>position</th><th>expert</th><th>blocks_read</th>'
               "<th>blocks_total</th><th>bytes_full</th><th>bytes_planned</th><th>bytes_read</th>"
               "<th>% of full</th><th>% of budget</th></tr>")
    for e in d["experts"]:
        out.append(
            f'<tr><td class="num">{e["position"]}</td><td>{_h(e["name"])}</td>'
            f'<td class="num">{e["blocks_read"]}</td><td class="num">{e["blocks_total"]}</td>'
            f'<td class="num">{e["bytes_full"]}</td><td class="num">{e["bytes_planned"]}</td>'
            f'<td class="num">{e["bytes_read"]}</td><td class="num">{_pct(e["bytes_read"], e["bytes_full"])}</td>'
            f'<td class="num">{_pct(e["bytes_read"], snap["budget_bytes"])}</td></tr>')
    out.append("</table>")

    out.append("<h2>Coverage: fraction of each layer's expert bytes read</h2>")
    out.append(f'<img id="coverage" alt="coverage heatmap" src="data:image/png;base64,'
               f'{base64.b64encode(png).decode("ascii")}">')

    out.append("<h2>Omitted-update bound</h2>")
    out.append(f'<p id="bound">Σ |c<sub>k</sub>|·‖Δ<sub>k,b</sub>‖<sub>2</sub> over omitted blocks (an upper '
               f"bound on the L2 deviation from the full-budget output): <b>{_h(_bound_text(snap['bound']))}</b></p>")

    out.append('<h2>Time breakdown</h2><table id="timings"><tr><th>phase</th><th>seconds</th><th>share</th></tr>')
    for k, v, p in sec["times"]:
        out.append(f'<tr><td>{_h(k)}</td><td class="num">{v:.4f}</td><td class="num">{_h(p)}</td></tr>')
    out.append("</table>")
    out.append(f'<h2>Lineage</h2><pre id="lineage">{_h(d["lineage"])}</pre>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def render_markdown(d: dict[str, Any], png_name: str) -> str:
    snap, sec = d["snapshot"], _sections(d)
    out = [f"# Merge report: {_md(d['name'])}", "", "| field | value |", "|---|---|"]
    for k in ("id", "ref", "method", "plan_hash", "seed", "out_path", "created_at"):
        out.append(f"| {k} | {_md(snap[k])} |")
    out += ["", "## Inputs", "", "| role | checkpoint | id | file | sha256 |", "|---|---|---|---|---|"]
    for row in sec["inputs"]:
        out.append("| " + " | ".join(_md(v) for v in row) + " |")
    out += ["", "## Operator and parameters", "", "| parameter | value |", "|---|---|"]
    for k, v in sec["params"]:
        out.append(f"| {_md(k)} | {_md(v)} |")
    out += ["", "| position | model | weight | density | gamma |", "|---:|---|---:|---:|---:|"]
    for row in sec["models"]:
        out.append("| " + " | ".join(_md(v) for v in row) + " |")
    out += ["", "## Budget and realized expert reads", "", "| quantity | bytes | |", "|---|---:|---|"]
    for k, v in sec["budget"]:
        out.append(f"| {k} | {int(v)} | {fmt_bytes(v)} |")
    out += ["", "| position | expert | blocks_read | blocks_total | bytes_full | bytes_planned | bytes_read | "
            "% of full | % of budget |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for e in d["experts"]:
        out.append(f"| {e['position']} | {_md(e['name'])} | {e['blocks_read']} | {e['blocks_total']} | "
                   f"{e['bytes_full']} | {e['bytes_planned']} | {e['bytes_read']} | "
                   f"{_pct(e['bytes_read'], e['bytes_full'])} | {_pct(e['bytes_read'], snap['budget_bytes'])} |")
    out += ["", "## Coverage: fraction of each layer's expert bytes read", "",
            f"![coverage heatmap]({quote(png_name)})", "",
            "## Omitted-update bound", "",
            "Σ |c_k|·‖Δ_k,b‖₂ over omitted blocks (an upper bound on the L2 deviation from the full-budget "
            f"output): **{_md(_bound_text(snap['bound']))}**", "",
            "## Time breakdown", "", "| phase | seconds | share |", "|---|---:|---:|"]
    for k, v, p in sec["times"]:
        out.append(f"| {_md(k)} | {v:.4f} | {p} |")
    out += ["", "## Lineage", "", "```", d["lineage"].replace("```", "'''"), "```", ""]
    return "\n".join(out)


def write_report(db: Database, snapshot_ref: str, out: str | Path) -> Path:
    """Write the report of `snapshot_ref` to `out`: HTML for ``.html``/``.htm``, Markdown for ``.md`` (the
    heatmap PNG then goes beside it as ``<stem>.coverage.png``). Returns the report path.

    Raises UnknownCheckpointError (not a committed snapshot) or UnsupportedOutputFormatError (other extension).
    """
    path = Path(out).expanduser()
    ext = path.suffix.lower()
    if ext not in (".html", ".htm", ".md", ".markdown"):
        raise UnsupportedOutputFormatError(f"report output must end in .html or .md, got {str(path)!r}")
    d = report_data(db, snapshot_ref)
    png = coverage_png(d["coverage"], title=f"{d['name']}: expert bytes read per layer")
    path.parent.mkdir(parents=True, exist_ok=True)
    if ext in (".html", ".htm"):
        path.write_text(render_html(d, png), encoding="utf-8")
    else:
        png_path = path.with_name(f"{path.stem}.coverage.png")
        png_path.write_bytes(png)
        path.write_text(render_markdown(d, png_path.name), encoding="utf-8")
    return path
