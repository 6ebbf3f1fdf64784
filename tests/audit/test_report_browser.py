"""The HTML report in a real browser: Debian's headless Chromium (installed by `.ci/install-chromium.sh`, which
`make test` runs, like PostgreSQL) renders the report of a TIES merge of 8 experts with sharded outputs at
1280 px. No element may be wider than the viewport, the console stays clean, the audit figures are on the page;
the screenshot is kept under the test's tmp dir. The Markdown report, rendered by markdown-it-py, shows the same
figures in the same tables.

Skipped (with the reason) only where Chromium is missing and cannot be installed here (not root, or no apt-get)
and CI is not set; on CI a missing browser fails the test.
"""

from __future__ import annotations

import os
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from mergepipe_db.core.units import fmt_bytes

pytestmark = pytest.mark.catalog

VIEWPORT = 1280
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path:
        return path
    can_install = hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")
    if not (os.environ.get("CI") or can_install):
        pytest.skip("chromium is not installed and cannot be installed here (not root or no apt-get; CI unset): "
                    "run `sudo bash .ci/install-chromium.sh`")
    pytest.fail("Debian's chromium is not installed: run `bash .ci/install-chromium.sh` (make test does)")


class _Tables(HTMLParser):
    """Every table's rows of cell texts, nested tables apart, in document order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: list[list[list[str]]] = []
        self.ctx: list[dict] = []

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
            self.ctx.append({"t": self.tables[-1], "row": None, "cell": None})
        elif self.ctx and tag == "tr":
            self.ctx[-1]["row"] = []
        elif self.ctx and tag in ("td", "th"):
            self.ctx[-1]["cell"] = []

    def handle_endtag(self, tag):
        if not self.ctx:
            return
        c = self.ctx[-1]
        if tag in ("td", "th") and c["cell"] is not None and c["row"] is not None:
            c["row"].append(" ".join("".join(c["cell"]).split()))
            c["cell"] = None
        elif tag == "tr" and c["row"] is not None:
            c["t"].append(c["row"])
            c["row"] = None
        elif tag == "table":
            self.ctx.pop()

    def handle_data(self, data):
        if self.ctx and self.ctx[-1]["cell"] is not None:
            self.ctx[-1]["cell"].append(data)


def _tables(html_text: str) -> dict[str, list[list[str]]]:
    p = _Tables()
    p.feed(html_text)
    return {" | ".join(t[0]): t[1:] for t in p.tables if t}


@pytest.fixture(scope="module")
def eight_expert_report(tmp_path_factory):
    from mergepipe_db import Catalog
    from mergepipe_db.demo.family import make_family

    root = tmp_path_factory.mktemp("browser")
    fam = make_family(root / "family", n_experts=8, preset="tiny", seed=3)
    cat = Catalog.open(str(root / "catalog.duckdb"))
    cat.ingest(fam.base, name="base", block_bytes=4096)
    names = [f"expert {i:02d} with a long, long name to wrap" for i in range(8)]
    cat.ingest_many(fam.experts, names=names, base="base")
    spec = {"merge_method": "ties", "base_model": "base", "parameters": {"normalize": True},
            "models": [{"model": n, "parameters": {"weight": 1.0, "density": 0.5}} for n in names]}
    res = cat.merge(spec, out=root / "merged", budget=0.25, ref="audit-8", shard_bytes=48_000)
    html_path = cat.report("audit-8", out=root / "report.html")
    md_path = cat.report("audit-8", out=root / "report.md")
    # a merge of merges: its lineage tree is wider than the page
    gen2 = {"merge_method": "task_arithmetic", "base_model": "base",
            "models": [{"model": "audit-8", "parameters": {"weight": 0.7}},
                       {"model": names[1], "parameters": {"weight": 0.3}}]}
    cat.merge(gen2, out=root / "gen2", budget=0.5, ref="gen2 of a merge with a long name", shard_bytes=48_000)
    cat.report("gen2 of a merge with a long name", out=root / "gen2.html")
    return root, res, html_path, md_path


def test_report_in_headless_chromium(eight_expert_report, tmp_path) -> None:
    from playwright.sync_api import sync_playwright

    root, res, html_path, _md = eight_expert_report
    shards = sorted((root / "merged").glob("*.safetensors"))
    assert len(shards) >= 3
    exe = _chromium()
    console: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
        try:
            ctx = browser.new_context(viewport={"width": VIEWPORT, "height": 900})
            page = ctx.new_page()
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.on("request", lambda r: console.append(f"network: {r.url}")
                    if not r.url.startswith(("file:", "data:")) else None)
            pages = {}
            for path in (html_path, root / "gen2.html"):
                page.goto(path.as_uri())
                page.wait_for_load_state("load")
                wide = page.evaluate(f"""() => {{
                    const out = [];
                    for (const el of document.querySelectorAll('body *')) {{
                        const r = el.getBoundingClientRect();
                        if (r.width > {VIEWPORT} || r.right > {VIEWPORT} + 0.5)
                            out.push(el.tagName + (el.id ? '#' + el.id : '') + ' ' + Math.round(r.width));
                    }}
                    return out;
                }}""")
                lineage_overflows = page.evaluate(
                    "() => { const p = document.getElementById('lineage'); return p.scrollWidth > p.clientWidth }")
                pages[path.name] = {
                    "wide": wide, "scroll_w": page.evaluate("() => document.documentElement.scrollWidth"),
                    "img_ok": page.evaluate("() => { const i = document.getElementById('coverage'); return i.complete"
                                            " && i.naturalWidth > 0 && i.getBoundingClientRect().width > 0 }"),
                    "lineage_scrolls": lineage_overflows, "text": page.inner_text("body")}
                shot = tmp_path / f"{path.stem}-1280.png"
                page.screenshot(path=str(shot), full_page=True)
                assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        finally:
            browser.close()
    for name, pg in pages.items():
        assert pg["wide"] == [] and pg["scroll_w"] <= VIEWPORT, (name, pg["wide"], pg["scroll_w"])
        assert pg["img_ok"], name
    assert console == []
    assert pages["gen2.html"]["lineage_scrolls"]  # the wide tree scrolls inside its box, not the page
    text = pages["report.html"]["text"]
    # the figures an auditor signs, as a reader sees them
    assert res.manifest_hash in text and res.plan_hash in text and "mergepipe verify audit-8@1" in text
    for s in shards:
        import hashlib

        assert hashlib.sha256(s.read_bytes()).hexdigest() in text
    assert fmt_bytes(res.realized_bytes) in text and fmt_bytes(res.budget_bytes) in text
    assert "total (wall time)" in text and "estimate (absolute L2)" in text


def test_markdown_report_renders_to_the_same_figures(eight_expert_report) -> None:
    from markdown_it import MarkdownIt

    _root, res, html_path, md_path = eight_expert_report
    html_tables = _tables(html_path.read_text(encoding="utf-8"))
    md_html = MarkdownIt("commonmark").enable("table").render(md_path.read_text(encoding="utf-8"))
    md_tables = _tables(md_html)
    shared = ["expert-read quantity | bytes | exact", "output file | size | sha256",
              "position | expert | blocks read | blocks total | candidate bytes | all bytes | planned | read | "
              "% of candidates | % of all | % of budget", "quantity | value", "phase | seconds | share of wall time",
              "input | role | bytes read from it"]
    for head in shared:
        assert head in md_tables and head in html_tables, head
        h, m = html_tables[head], md_tables[head]
        if head == "phase | seconds | share of wall time":  # HTML adds the background threads to this table
            h = h[:len(m)]
        assert h == m, head
    ident_h = {r[0]: r[1] for r in html_tables["field | value"]}
    ident_m = {r[0]: r[1] for r in md_tables["field | value"]}
    assert ident_m["manifest hash (sha256)"] == res.manifest_hash and ident_m["plan hash"] == res.plan_hash
    assert ident_h == ident_m
    assert ident_m["recheck with"] == "mergepipe verify audit-8@1"
    assert len(md_tables["output file | size | sha256"]) == len(list((_root / "merged").glob("*.safetensors"))) + 1
