"""The built wheel carries the SQL files and migrations and works installed non-editable."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_installs_and_migrates_outside_the_source_tree(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    wheel = next(dist.glob("mergepipe_db-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "mergepipe_db/_data/sql/plan_rank.sql" in names
    assert "mergepipe_db/_data/migrations/env.py" in names
    assert any(n.startswith("mergepipe_db/_data/migrations/versions/0001_") for n in names)
    assert "mergepipe_db/py.typed" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    # Dependencies come from the test environment; the project itself only from the wheel.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([str(py), "-c", "import mergepipe_db; print(mergepipe_db.__file__)"], cwd=work,
                           check=True, capture_output=True, text=True).stdout.strip()
    assert where.startswith(str(venv)), where
    cli = venv / "bin" / "mergepipe"
    help_out = subprocess.run([str(cli), "--help"], cwd=work, check=True, capture_output=True, text=True).stdout
    assert "merge" in help_out and "ingest" in help_out
    up = subprocess.run([str(cli), "db", "upgrade", "--catalog", str(work / "c.duckdb")], cwd=work,
                        capture_output=True, text=True)
    assert up.returncode == 0, up.stderr
    from mergepipe_db.db.engine import Database

    assert up.stdout.rstrip().endswith(f"-> {Database('duckdb:///:memory:').head_revision()}"), up.stdout
    q = subprocess.run([str(cli), "sql", "SELECT COUNT(*) AS n FROM checkpoints", "--catalog", str(work / "c.duckdb"),
                        "--format", "csv"], cwd=work, capture_output=True, text=True)
    assert q.returncode == 0 and q.stdout.splitlines() == ["n", "0"], q.stderr
