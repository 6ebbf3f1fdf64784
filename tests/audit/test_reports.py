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
    """Collects tables (by id; nested tables apart) as lists of cell-text rows and of the cells' `data-bytes`,
    img srcs, every link and script tag."""

    VOID = {"img", "meta", "br", "hr", "link", "input"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: dict[str, list[list[str]]] = {}
        self.bytes: dict[str, list[list[int]]] = {}
        self.imgs: list[str] = []
        self.urls: list[str] = []
        self.stack: list[str] = []
        self.ctx: list[dict] = []  # one per open table: name, row, brow, cell
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
            name = a.get("id") or f"t{len(self.tables)}"
            self.tables[name], self.bytes[name] = [], []
            self.ctx.append({"name": name, "row": None, "brow": None, "cell": None})
        elif self.ctx and tag == "tr":
            self.ctx[-1]["row"], self.ctx[-1]["brow"] = [], []
        elif self.ctx and tag in ("td", "th"):
            self.ctx[-1]["cell"] = []
            if "data-bytes" in a:
                self.ctx[-1]["brow"].append(int(a["data-bytes"]))

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        assert self.stack and self.stack[-1] == tag, (self.stack, tag)
        self.stack.pop()
        c = self.ctx[-1] if self.ctx else None
        if c is None:
            return
        if tag in ("td", "th") and c["row"] is not None and c["cell"] is not None:
            c["row"].append("".join(c["cell"]).strip())
            c["cell"] = None
        elif tag == "tr" and c["row"] is not None:
            self.tables[c["name"]].append(c["row"])
            self.bytes[c["name"]].append(c["brow"])
            c["row"] = None
        elif tag == "table":
            self.ctx.pop()

    def handle_data(self, data):
        self.text.append(data)
        if self.ctx and self.ctx[-1]["cell"] is not None:
            self.ctx[-1]["cell"].append(data)


def test_layer_groups() -> None:
    assert layer_group("model.layers.11.mlp.up_proj.weight") == "layer 11"
    assert layer_group("model.embed_tokens.weight") == "embed"
    assert layer_group("lm_head.weight") == "head"
    assert layer_group("model.norm.weight") == "other"


def _naive_norms(out_dir, ref_dir=None) -> tuple[float, float]:
    """(‖out‖₂, ‖out − ref‖₂) over the float tensors, in float64, read with safetensors (not mergepipe)."""
    import torch
    from safetensors.torch import load_file

    def load(d):
        t = {}
        for f in sorted(d.glob("*.safetensors")):
            t.update(load_file(str(f)))
        return t

    a = load(out_dir)
    b = load(ref_dir) if ref_dir is not None else None
    n2 = d2 = 0.0
    for k, v in a.items():
        if v.is_floating_point():
            n2 += float(torch.sum(v.double() ** 2))
            if b is not None:
                d2 += float(torch.sum((v.double() - b[k].double()) ** 2))
    return math.sqrt(n2), math.sqrt(d2)


def test_report_html_and_markdown(catalog, catalog_url, tiny_family, tmp_path, capsys) -> None:
    import hashlib

    from mergepipe_db.core.units import fmt_bytes

    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    names = ["e0", "e1"]
    for n, p in zip(names, tiny_family.experts):
        catalog.ingest(p, name=n, base="base")
    catalog.ingest(tiny_family.experts[2], name=ODD, base="base")
    spec = {"merge_method": "ties", "base_model": "base",
            "models": [{"model": names[0], "parameters": {"weight": 1.0, "density": 0.5}},
                       {"model": names[1], "parameters": {"weight": 0.6, "density": 0.5}},
                       {"model": ODD, "parameters": {"weight": 0.8, "density": 0.7}}]}
    res = catalog.merge(spec, out=tmp_path / "merged", budget=0.3, ref="audit", shard_bytes=40_000)
    (tmp_path / "rep").mkdir()

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

    # identity: manifest hash, plan hash, every output shard's sha256 and size (checked against the files)
    ident = {r[0]: r[1] for r in doc.tables["identity"]}
    assert ident["manifest hash (sha256)"] == res.manifest_hash and ident["plan hash"] == res.plan_hash
    assert ident["recheck with"] == "mergepipe verify audit@1"
    shards = sorted((tmp_path / "merged").glob("*.safetensors"))
    assert len(shards) > 1
    got_out = [(r[0], r[2]) for r in doc.tables["outputs"][1:-1]]
    assert got_out == [(p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in shards]
    assert doc.bytes["outputs"][1:-1] == [[p.stat().st_size] for p in shards]
    assert [r[1] for r in doc.tables["outputs"][1:-1]] == [fmt_bytes(p.stat().st_size) for p in shards]
    assert main(["verify", "audit@1", "--catalog", catalog_url]) == 0  # the command the report names works
    capsys.readouterr()

    _, view = catalog.sql(
        "SELECT expert, SUM(blocks_read), SUM(bytes_full), SUM(bytes_planned), SUM(bytes_read) FROM reads "
        f"WHERE snapshot_id = '{res.snapshot_id}' GROUP BY expert, position ORDER BY position")
    rows = doc.tables["reads-per-expert"]
    assert rows[0][:8] == ["position", "expert", "blocks read", "blocks total", "candidate bytes", "all bytes",
                           "planned", "read"]
    got = [(r[1], int(r[2]), *b[1:]) for r, b in zip(rows[1:], doc.bytes["reads-per-expert"][1:])]
    assert got == [(e, int(a), int(b), int(c), int(d)) for e, a, b, c, d in view]
    assert [r[5:8] for r in rows[1:]] == [[fmt_bytes(int(b)), fmt_bytes(int(c)), fmt_bytes(int(d))]
                                          for _e, _a, b, c, d in view]  # human units for a person
    assert sum(g[4] for g in got) == res.realized_bytes and [g[4] for g in got] == res.realized_per_expert
    # candidate bytes (non-zero delta): the same figure `plan` gives
    plan = catalog.plan(spec, budget=0.3)
    assert sum(b[0] for b in doc.bytes["reads-per-expert"][1:]) == plan.candidate_bytes

    budget = {r[0]: int(r[2]) for r in doc.tables["budget"][1:]}
    assert budget["budget"] == res.budget_bytes and budget["realized expert bytes"] == res.realized_bytes
    assert budget["candidate expert bytes (blocks with a non-zero delta)"] == plan.candidate_bytes
    assert budget["all expert bytes (full read)"] == res.full_bytes == plan.full_bytes

    # inputs: one row per checkpoint, files folded; every catalogued sha256 is there
    _, files = catalog.sql("SELECT checkpoint, relpath, sha256 FROM files WHERE checkpoint IN ('base', 'e0')")
    assert len(doc.tables["inputs"]) == 1 + 4 and "<details>" in raw
    assert {h for _c, _p, h in files} <= {r[2] for t, rs in doc.tables.items() if t.startswith("t") for r in rs
                                        if len(r) == 3}
    params = dict((r[0], r[1]) for r in doc.tables["parameters"][1:])
    assert params["merge_method"] == "ties"

    # time: the top-level phases add up to the wall time the merge measured, commit included
    t = doc.tables["timings"]
    total_i = next(i for i, r in enumerate(t) if r[0] == "total (wall time)")
    top = t[1:total_i]
    assert any(r[0].startswith("commit") for r in top) and any(r[0].startswith("planning") for r in top)
    assert math.isclose(sum(float(r[1]) for r in top), float(t[total_i][1]), abs_tol=1e-3 * len(top))
    assert math.isclose(float(t[total_i][1]), res.timings["wall"], abs_tol=1e-4)
    assert math.isclose(sum(float(r[2].rstrip("%")) for r in top), 100.0, abs_tol=0.1 * len(top))
    # nested (background) phases: shares of their parent, not of the wall time
    nested = {r[0]: r[2] for r in t[total_i + 2:]}
    tm = res.timings
    assert nested["block statistics of the output (in the writer thread)"] == \
        f"{100 * tm['output_stats'] / tm['output']:.1f}% of writer busy"
    assert nested["output writer thread busy"] == f"{100 * tm['output'] / tm['execute']:.1f}% of execution"

    # error of a TIES merge: an estimate, absolute and relative to ‖output‖ (computed here independently)
    err = {r[0].split(":")[0]: r[1] for r in doc.tables["error"]}
    norm, _ = _naive_norms(tmp_path / "merged")
    est = float(err["estimate (absolute L2)"])
    assert est > 0 and math.isclose(float(err["‖output‖₂"]), norm, rel_tol=1e-5)
    assert math.isclose(float(err["estimate relative to ‖output‖₂"]), est / norm, rel_tol=1e-3)
    assert err["measured relative L2 deviation from the full-budget output"].startswith("n/a")

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
            assert f"| {e} | {blocks} | " in text and f"| {fmt_bytes(full)} | {fmt_bytes(planned)} | " \
                f"{fmt_bytes(read)} |" in text
    assert res.manifest_hash in text and all(h in text for _n, h in got_out)

    with pytest.raises(UnsupportedOutputFormatError):
        catalog.report("audit", out=tmp_path / "report.pdf")

    # a full-budget merge of the same spec: the report now shows the measured deviation from it
    full = catalog.merge(spec, out=tmp_path / "full", budget=1.0, ref="audit-full")
    d = report_data(catalog.db, "audit")
    _, dev = _naive_norms(tmp_path / "merged", tmp_path / "full")
    full_norm, _ = _naive_norms(tmp_path / "full")
    assert d["error"]["measured"]["reference"] == full.checkpoint
    assert math.isclose(d["error"]["measured"]["deviation"], dev / full_norm, rel_tol=1e-6)

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


def test_report_bound_and_bad_input(catalog, catalog_url, tiny_family, tmp_path, capsys) -> None:
    """Additive merge: the bound, absolute and relative to ‖output‖; a moved or changed output, an unknown
    ref and a missing --out directory are one-line refusals that write nothing."""
    from conftest import ingest_family

    names = ingest_family(catalog, tiny_family)
    spec = {"merge_method": "task_arithmetic", "base_model": "base",
            "models": [{"model": n, "parameters": {"weight": 0.5}} for n in names]}
    res = catalog.merge(spec, out=tmp_path / "ta", budget=0.5, ref="ta")
    assert res.bound is not None and res.bound > 0
    d = report_data(catalog.db, "ta")
    norm, _ = _naive_norms(tmp_path / "ta")
    assert d["error"]["kind"] == "bound" and d["error"]["absolute"] == res.bound
    assert math.isclose(d["error"]["relative"], res.bound / norm, rel_tol=1e-6)
    # the estimate other methods get is the same sum: on an additive merge it equals the planner's bound
    from mergepipe_db.audit.reports import _omitted_estimate

    ids = {int(e["position"]): e["id"] for e in d["manifest"]["inputs"]["experts"]}
    _, tensors = catalog.sql(f"SELECT DISTINCT tensor FROM reads WHERE snapshot_id = '{res.snapshot_id}'")
    with catalog.db.connect() as conn:
        est = _omitted_estimate(conn, d["manifest"], ids, {t for (t,) in tensors})
    assert math.isclose(est, res.bound, rel_tol=1e-9)

    def refused(argv, name):
        assert main([*argv, "--catalog", catalog_url]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and name in err, err
        return err

    err = refused(["report", "nope", "--out", str(tmp_path / "r.html")], "UnknownCheckpointError")
    assert "known snapshots: 'ta@1'" in err
    refused(["report", "ta", "--out", str(tmp_path / "no" / "dir" / "r.html")], "ReportPathError")
    refused(["report", "ta", "--out", str(tmp_path / "r.pdf")], "UnsupportedOutputFormatError")
    shard = sorted((tmp_path / "ta").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size, new mtime, different bytes
    err = refused(["report", "ta", "--out", str(tmp_path / "r.html")], "StaleOutputError")
    assert str(shard) in err and "sha256" in err
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))  # restored (touched): accepted
    assert main(["report", "ta", "--out", str(tmp_path / "r.html"), "--catalog", catalog_url]) == 0
    capsys.readouterr()
    (tmp_path / "ta").rename(tmp_path / "moved")
    err = refused(["report", "ta", "--out", str(tmp_path / "r2.html")], "StaleOutputError")
    assert "missing" in err and str(tmp_path / "ta") in err
    assert not (tmp_path / "r2.html").exists() and not (tmp_path / "no").exists() and \
        not (tmp_path / "r.pdf").exists()
