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
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0003'"))
    capsys.readouterr()
    assert run_demo(tmp_path, **args) == 0
    out = capsys.readouterr().out
    assert f"upgraded the demo catalog {url} from schema 0003 to 0005" in out
    assert (tmp_path / "merged-ties-2" / "manifest.json").is_file()
    with Catalog.open(url).db.connect() as conn:
        assert conn.execute(sa.text("SELECT COUNT(*) FROM mp_tensor_sketch")).scalar_one() > 0
