"""README.md's example outputs are what the code prints: `docs/readme_examples.py` reruns the documented recipe
(the demo, merge-gen2.yml, the example commands) and the README must equal its rendering, byte for byte.
Regenerate with `python docs/readme_examples.py --write` after an intended change."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("readme_examples", REPO / "docs" / "readme_examples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_examples_are_what_the_code_prints(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MERGEPIPE_CATALOG", raising=False)
    mod = _module()
    blocks = mod.generate(tmp_path)
    current = (REPO / "README.md").read_text(encoding="utf-8")
    fresh = mod.render(current, blocks)
    diff = "".join(difflib.unified_diff(current.splitlines(True), fresh.splitlines(True), "README.md", "generated"))
    assert fresh == current, f"README.md's examples are stale; run `python docs/readme_examples.py --write`:\n{diff}"
    # every block the generator makes is in the README, with its command and some output
    for name, text in blocks.items():
        assert f"<!-- readme-example: {name} -->" in current and text.split("\n", 1)[1].strip(), name


def test_a_stale_example_is_caught(tmp_path) -> None:
    mod = _module()
    readme = "x\n<!-- readme-example: a -->\n```\n$ mergepipe old\nold output\n```\ny\n"
    assert mod.render(readme, {"a": "$ mergepipe old\nold output"}) == readme
    assert mod.render(readme, {"a": "$ mergepipe old\nnew output"}) != readme
