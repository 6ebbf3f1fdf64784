"""`mergepipe demo` runs end to end, and again on the demo catalog an earlier version left behind."""

from __future__ import annotations

import sqlalchemy as sa

from mergepipe_db import Catalog
from mergepipe_db.demo.run import run_demo


def test_demo_runs_and_upgrades_its_own_older_catalog(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("MERGEPIPE_CATALOG", raising=False)
    args = {"catalog": None, "method": "ties", "budget": "0.5", "experts": 2, "preset": "tiny", "progress": False}
    assert run_demo(tmp_path, **args) == 0
    assert (tmp_path / "merged-ties-1" / "manifest.json").is_file()
    url = str(tmp_path / "catalog.duckdb")
    with Catalog.open(url).db.connect(check_schema=False) as conn:  # as schema 0003 left it
        conn.execute(sa.text("DROP TABLE mp_tensor_sketch"))
        conn.execute(sa.text("DROP TABLE mp_tensor_gram"))  # (added after 0003: 0006)
        conn.execute(sa.text("DROP TABLE mp_tensor_cross"))
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0003'"))
    capsys.readouterr()
    assert run_demo(tmp_path, **args) == 0
    out = capsys.readouterr().out
    assert f"upgraded the demo catalog {url} from schema 0003 to 0006" in out
    assert (tmp_path / "merged-ties-2" / "manifest.json").is_file()
    with Catalog.open(url).db.connect() as conn:
        assert conn.execute(sa.text("SELECT COUNT(*) FROM mp_tensor_sketch")).scalar_one() > 0


def test_the_demos_next_commands_work_as_printed(tmp_path, monkeypatch, capsys) -> None:
    """`make demo`'s hints, run exactly as printed by bash from the same directory, with `mergepipe` not on
    PATH (as after `make demo`): the activation line puts it there, the exported catalog is the demo's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and p != venv_bin and not Path(p, "mergepipe").exists())
    env = {**{k: v for k, v in os.environ.items() if k != "MERGEPIPE_CATALOG"}, "PATH": path,
           "PYTHONPATH": str(repo)}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", path)  # as after `make demo`: mergepipe is not on PATH
    monkeypatch.delenv("MERGEPIPE_CATALOG", raising=False)
    from mergepipe_db.cli import main

    assert main(["demo", "--dir", "mergepipe-demo", "--preset", "tiny", "--experts", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.split("next (copy and paste; these are the README's next commands):\n", 1)[1].splitlines()
    steps = [ln.strip() for ln in lines if ln.startswith("  ")]
    assert steps[0].startswith("source ") and steps[1].startswith("export MERGEPIPE_CATALOG=")
    script = "set -euo pipefail\n" + "\n".join(steps) + "\n"
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "report.html").is_file() and "merged-ties-1@1 (snapshot" in r.stdout
    assert "expert_00" in r.stdout and "(2 rows)" in r.stdout
    assert not (tmp_path / "mergepipe.duckdb").exists()  # nothing fell back to an empty default catalog
