"""`mergepipe report`: self-contained, well-formed HTML (embedded PNG heatmap, every name escaped) and
Markdown (PNG beside it), whose per-expert byte rows equal the catalog's `reads` view."""

from __future__ import annotations

import base64
import math
from html.parser import HTMLParser

import pytest
from conftest import BLOCK

from mergepipe_db.audit.reports import layer_group, report_data
from mergepipe_db.cli import main
from mergepipe_db.errors import UnsupportedOutputFormatError

pytestmark = pytest.mark.catalog

ODD = 'e<b>&"odd"'  # an expert name that must come out escaped


class _Doc(HTMLParser):
    """Collects tables (by id) as lists of cell-text rows, img srcs, every link and script tag."""

    VOID = {"img", "meta", "br", "hr", "link", "input"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: dict[str, list[list[str]]] = {}
        self.imgs: list[str] = []
        self.urls: list[str] = []
        self.stack: list[str] = []
        self.table: str | None = None
        self.row: list[str] | None = None
        self.cell: list[str] | None = None
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("href", "src"):
            if k in a:
                self.urls.append(a[k] or "")
        if tag == "img":
            self.imgs.append(a.get("src") or "")
        if tag in self.VOID:
            return
        self.stack.append(tag)
        if tag == "table":
            self.table = a.get("id") or f"t{len(self.tables)}"
            self.tables[self.table] = []
        elif tag == "tr":
            self.row = []
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        assert self.stack and self.stack[-1] == tag, (self.stack, tag)
        self.stack.pop()
        if tag in ("td", "th") and self.row is not None and self.cell is not None:
            self.row.append("".join(self.cell).strip())
            self.cell = None
        elif tag == "tr" and self.table is not None and self.row is not None:
            self.tables[self.table].append(self.row)
            self.row = None
        elif tag == "table":
            self.table = None

    def handle_data(self, data):
        self.text.append(data)
        if self.cell is not None:
            self.cell.append(data)


def test_layer_groups() -> None:
    assert layer_group("model.layers.11.mlp.up_proj.weight") == "layer 11"
    assert layer_group("model.embed_tokens.weight") == "embed"
    assert layer_group("lm_head.weight") == "head"
    assert layer_group("model.norm.weight") == "other"


def test_report_html_and_markdown(catalog, catalog_url, tiny_family, tmp_path, capsys) -> None:
    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    names = ["e0", "e1"]
    for n, p in zip(names, tiny_family.experts):
        catalog.ingest(p, name=n, base="base")
    catalog.ingest(tiny_family.experts[2], name=ODD, base="base")
    spec = {"merge_method": "ties", "base_model": "base",
            "models": [{"model": names[0], "parameters": {"weight": 1.0, "density": 0.5}},
                       {"model": names[1], "parameters": {"weight": 0.6, "density": 0.5}},
                       {"model": ODD, "parameters": {"weight": 0.8, "density": 0.7}}]}
    res = catalog.merge(spec, out=tmp_path / "merged", budget=0.3, ref="audit")

    out = catalog.report("audit", out=tmp_path / "rep" / "report.html")
    raw = out.read_text(encoding="utf-8")
    assert ODD not in raw and "e&lt;b&gt;&amp;&quot;odd&quot;" in raw
    doc = _Doc()
    doc.feed(raw)
    doc.close()
    assert doc.stack == ["html"] or doc.stack == []  # every element closed (html may end the document)
    assert all(u.startswith("data:image/png;base64,") for u in doc.urls) and "<script" not in raw
    assert len(doc.imgs) == 1
    png = base64.b64decode(doc.imgs[0].split(",", 1)[1], validate=True)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    _, view = catalog.sql(
        "SELECT expert, SUM(blocks_read), SUM(bytes_full), SUM(bytes_planned), SUM(bytes_read) FROM reads "
        f"WHERE snapshot_id = '{res.snapshot_id}' GROUP BY expert, position ORDER BY position")
    rows = doc.tables["reads-per-expert"]
    assert rows[0][:7] == ["position", "expert", "blocks_read", "blocks_total", "bytes_full", "bytes_planned",
                           "bytes_read"]
    got = [(r[1], int(r[2]), int(r[4]), int(r[5]), int(r[6])) for r in rows[1:]]
    assert got == [(e, int(a), int(b), int(c), int(d)) for e, a, b, c, d in view]
    assert [g[0] for g in got] == [names[0], names[1], ODD]
    assert sum(g[4] for g in got) == res.realized_bytes and [g[4] for g in got] == res.realized_per_expert

    budget = {r[0]: int(r[1]) for r in doc.tables["budget"]}
    assert budget["budget (expert bytes)"] == res.budget_bytes and budget["realized expert bytes"] == \
        res.realized_bytes
    _, files = catalog.sql("SELECT checkpoint, relpath, sha256 FROM files WHERE checkpoint IN ('base', 'e0')")
    inputs = {(r[1], r[3], r[4]) for r in doc.tables["inputs"][1:]}
    assert {(c, p, h) for c, p, h in files} <= inputs
    params = dict((r[0], r[1]) for r in doc.tables["parameters"][1:])
    assert params["merge_method"] == "ties"
    phases = [r[0] for r in doc.tables["timings"][1:]]
    assert phases[:2] == ["plan", "execute"] and any(p.startswith("read_wait") for p in phases)
    assert "Omitted-update bound" in raw and "Lineage" in raw

    # Markdown through the CLI: PNG beside the report, linked, same per-expert rows
    md = tmp_path / "rep" / "report.md"
    assert main(["report", "audit@1", "--out", str(md), "--catalog", catalog_url]) == 0
    assert str(md) in capsys.readouterr().out
    text = md.read_text(encoding="utf-8")
    png_path = md.with_name("report.coverage.png")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![coverage heatmap](report.coverage.png)" in text
    assert ODD not in text.split("```")[0]  # escaped everywhere outside the literal lineage code block
    for e, blocks, full, planned, read in view:
        if e != ODD:
            assert f"| {e} | {blocks} | " in text and f"| {full} | {planned} | {read} |" in text

    with pytest.raises(UnsupportedOutputFormatError):
        catalog.report("audit", out=tmp_path / "report.pdf")

    # the heatmap's numbers: per layer group and expert, bytes read / full bytes, from the reads view
    d = report_data(catalog.db, res.snapshot_id)
    cov = d["coverage"]
    assert cov["groups"][0] == "embed" and cov["groups"][-1] == "head" and "layer 0" in cov["groups"]
    assert cov["experts"] == [names[0], names[1], ODD]
    _, per_tensor = catalog.sql(f"SELECT expert, tensor, bytes_read, bytes_full FROM reads "
                                f"WHERE snapshot_id = '{res.snapshot_id}'")
    for gi, group in enumerate(cov["groups"]):
        for ei, expert in enumerate(cov["experts"]):
            sel = [(r, f) for e, t, r, f in per_tensor if e == expert and layer_group(t) == group]
            want = sum(r for r, _ in sel) / sum(f for _, f in sel)
            assert math.isclose(cov["matrix"][gi][ei], want), (group, expert)
    assert 0 < max(v for row in cov["matrix"] for v in row) <= 1.0
