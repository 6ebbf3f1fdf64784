"""Regenerate (or check) the example outputs in README.md from the documented recipe.

The recipe, as README.md shows it (every file it uses is shown there too):

    mergepipe demo --dir mp-readme --preset tiny
    export MERGEPIPE_CATALOG=mp-readme/catalog.duckdb
    mergepipe merge mp-readme/merge-gen2.yml --out mp-readme/gen2 --budget 0.6

then every example command below. Each README block between ``<!-- readme-example: NAME -->`` and the end
of the code fence that follows it is ``$ <command>`` and what the command prints, exactly.

    python docs/readme_examples.py --write    # rewrite README.md's example blocks
    python docs/readme_examples.py --check    # exit 1 and show the difference when they are stale

tests/demo/test_readme_examples.py runs the check.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import sys
import tempfile
from pathlib import Path

import yaml

README = Path(__file__).resolve().parents[1] / "README.md"

#: merge-gen2.yml: the demo's TIES snapshot and expert_01, merged again by task arithmetic
GEN2_SPEC = {
    "merge_method": "task_arithmetic",
    "base_model": "base",
    "models": [{"model": "merged-ties-1", "parameters": {"weight": 0.7}},
               {"model": "expert_01", "parameters": {"weight": 0.3}}],
}

Q_PER_EXPERT = """SELECT r.expert, SUM(r.bytes_full) AS bytes_full, SUM(r.bytes_read) AS bytes_read,
    ROUND(100.0 * SUM(r.bytes_read) / SUM(r.bytes_full), 1) AS pct_read
  FROM reads r JOIN snapshots s ON s.id = r.snapshot_id
  WHERE s.checkpoint = 'merged-ties-1@1' GROUP BY r.expert, r.position ORDER BY r.position"""
Q_TOP_BLOCKS = """SELECT checkpoint, tensor, block_idx, nbytes, CAST(delta_l2 AS NUMERIC(10, 4)) AS delta_l2
  FROM blocks WHERE delta_l2 > 0 ORDER BY delta_l2 DESC, checkpoint LIMIT 5"""
Q_BUILT_FROM = """WITH RECURSIVE built(name, hops) AS (
    SELECT child, 1 FROM lineage WHERE parent = 'expert_00'
    UNION SELECT l.child, b.hops + 1 FROM lineage l JOIN built b ON l.parent = b.name)
  SELECT name AS snapshot, MIN(hops) AS hops FROM built GROUP BY name ORDER BY hops, name"""
Q_CONTRIBUTED = """SELECT r.expert, r.blocks_read, r.blocks_total, r.bytes_read
  FROM reads r JOIN snapshots s ON s.id = r.snapshot_id
  WHERE s.checkpoint = 'gen2@1' AND r.tensor = 'model.layers.0.input_layernorm.weight' AND r.bytes_read > 0
  ORDER BY r.position"""
Q_BUDGETS = """SELECT checkpoint, method, budget_bytes, planned_bytes, realized_bytes, full_bytes,
    ROUND(100.0 * realized_bytes / full_bytes, 1) AS pct_of_full, CAST(bound AS NUMERIC(12, 6)) AS bound
  FROM snapshots ORDER BY checkpoint"""

#: (block name, argv after `mergepipe`, how the README shows the command)
EXAMPLES: list[tuple[str, list[str], str]] = [
    ("gen2-spec", [], "cat mp-readme/merge-gen2.yml"),
    ("plan-gen2", ["plan", "mp-readme/merge-gen2.yml", "--budget", "0.6"],
     "mergepipe plan mp-readme/merge-gen2.yml --budget 0.6"),
    ("lineage", ["lineage", "gen2"], "mergepipe lineage gen2"),
    ("sql-per-expert", ["sql", Q_PER_EXPERT], f'mergepipe sql "{Q_PER_EXPERT}"'),
    ("sql-top-blocks", ["sql", Q_TOP_BLOCKS], f'mergepipe sql "{Q_TOP_BLOCKS}"'),
    ("sql-built-from", ["sql", Q_BUILT_FROM], f'mergepipe sql "{Q_BUILT_FROM}"'),
    ("sql-contributed", ["sql", Q_CONTRIBUTED], f'mergepipe sql "{Q_CONTRIBUTED}"'),
    ("sql-budgets", ["sql", Q_BUDGETS], f'mergepipe sql "{Q_BUDGETS}"'),
]


def _run(argv: list[str]) -> str:
    from mergepipe_db.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"mergepipe {' '.join(argv)} exited {rc}")
    return buf.getvalue().rstrip("\n")


def generate(workdir: Path) -> dict[str, str]:
    """Run the recipe in `workdir` (as the current directory) and return {block name: block text}."""
    from mergepipe_db.demo.run import run_demo

    old_cwd, old_env = Path.cwd(), os.environ.get("MERGEPIPE_CATALOG")
    os.chdir(workdir)
    try:
        os.environ["MERGEPIPE_CATALOG"] = "mp-readme/catalog.duckdb"
        with contextlib.redirect_stdout(io.StringIO()):
            run_demo(Path("mp-readme"), catalog=None, method="ties", budget="0.25", experts=4, preset="tiny",
                     progress=False)
        spec_text = yaml.safe_dump(GEN2_SPEC, sort_keys=False)
        Path("mp-readme/merge-gen2.yml").write_text(spec_text, encoding="utf-8")
        _run(["merge", "mp-readme/merge-gen2.yml", "--out", "mp-readme/gen2", "--budget", "0.6", "--quiet"])
        blocks = {}
        for name, argv, shown in EXAMPLES:
            output = spec_text.rstrip("\n") if name == "gen2-spec" else _run(argv)
            blocks[name] = f"$ {shown}\n{output}"
        return blocks
    finally:
        os.chdir(old_cwd)
        if old_env is None:
            os.environ.pop("MERGEPIPE_CATALOG", None)
        else:
            os.environ["MERGEPIPE_CATALOG"] = old_env


_BLOCK = re.compile(r"(<!-- readme-example: (?P<name>[\w-]+) -->\n(?P<indent>[ ]*)```[^\n]*)(?P<body>.*?)"
                    r"(\n(?P=indent)```)", re.S)


def render(readme: str, blocks: dict[str, str]) -> str:
    """`readme` with every example block's body replaced by the generated text (indented like its fence)."""
    seen = set()

    def sub(m: re.Match[str]) -> str:
        name, indent = m.group("name"), m.group("indent")
        if name not in blocks:
            raise KeyError(f"README block {name!r} has no generator")
        seen.add(name)
        body = "\n".join((indent + ln) if ln else ln for ln in blocks[name].split("\n"))
        return m.group(1) + "\n" + body + m.group(5)

    out = _BLOCK.sub(sub, readme)
    missing = set(blocks) - seen
    if missing:
        raise KeyError(f"README.md lacks the example block(s) {', '.join(sorted(missing))}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help="rewrite README.md's example blocks")
    g.add_argument("--check", action="store_true", help="exit 1 when README.md's example blocks are stale")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        blocks = generate(Path(tmp))
    current = README.read_text(encoding="utf-8")
    fresh = render(current, blocks)
    if args.write:
        README.write_text(fresh, encoding="utf-8")
        return 0
    if fresh != current:
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), fresh.splitlines(True),
                                                   "README.md", "generated"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
