"""The first hour: budgets that cannot surprise, no silent empty catalogs, errors named for what happened.

Every refusal is checked from outside: the CLI's exit code and one-line stderr, and the file system (no catalog
file, no lock file, no directory created)."""

from __future__ import annotations

import pytest
from conftest import ingest_family

from mergepipe_db.cli import main
from mergepipe_db.core.spec import Budget, parse_budget
from mergepipe_db.errors import BudgetError


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("text", "want"), [
    ("0", Budget(fraction=0.0)), ("0.25", Budget(fraction=0.25)), ("1", Budget(fraction=1.0)),
    ("1.0", Budget(fraction=1.0)), ("2B", Budget(nbytes=2)), ("2 B", Budget(nbytes=2)),
    ("500MB", Budget(nbytes=500 * 10**6)), ("3GiB", Budget(nbytes=3 * 2**30)), ("1.5KiB", Budget(nbytes=1536)),
])
def test_budget_grammar(text: str, want: Budget) -> None:
    assert parse_budget(text) == want


@pytest.mark.parametrize("text", ["2", "123456", "1.5", "1e3", "0.5B", "-0.1", "lots", "2 parsecs", "", "nan"])
def test_budget_refusals(text: str) -> None:
    with pytest.raises(BudgetError) as ei:
        parse_budget(text)
    assert "\n" not in str(ei.value)


def test_bare_number_above_one_names_the_unit() -> None:
    with pytest.raises(BudgetError, match=r"needs a unit \(2B"):
        parse_budget("2")


READERS = [["sql", "SELECT 1"], ["report", "x", "--out", "r.html"], ["lineage", "x"], ["plan", "spec.yml"],
           ["verify"], ["gc"], ["fsck"], ["merge", "spec.yml", "--out", "o"], ["sweep", "spec.yml", "--out", "s"]]


@pytest.mark.parametrize("argv", READERS, ids=[a[0] for a in READERS])
def test_reading_commands_never_create_a_catalog(argv, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MERGEPIPE_CATALOG", raising=False)
    (tmp_path / "spec.yml").write_text("merge_method: linear\nbase_model: b\nmodels: [{model: e}]\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 1  # the default ./mergepipe.duckdb
    err = _err(capsys)
    assert "CatalogNotFoundError" in err and str(tmp_path / "mergepipe.duckdb") in err and "mergepipe init" in err
    missing = tmp_path / "no" / "such" / "dir" / "cat.duckdb"
    assert main([*argv, "--catalog", str(missing)]) == 1
    assert str(missing) in _err(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no catalog, no .lock, no directories


def test_creating_commands_still_create(tmp_path, capsys) -> None:
    url = str(tmp_path / "new" / "c.duckdb")
    assert main(["init", "--catalog", url]) == 0
    assert (tmp_path / "new" / "c.duckdb").is_file()
    assert main(["sql", "SELECT COUNT(*) AS n FROM checkpoints", "--catalog", url]) == 0
    assert "(1 row)" in capsys.readouterr().out


def test_unsupported_url_scheme_lists_the_supported(tmp_path, capsys) -> None:
    assert main(["sql", "SELECT 1", "--catalog", f"sqlite:///{tmp_path}/x.db"]) == 1
    err = _err(capsys)
    assert "UnsupportedCatalogUrlError" in err and "'sqlite'" in err and "postgresql://" in err
    assert list(tmp_path.iterdir()) == []


def test_gitignore_covers_the_lock_file() -> None:
    from pathlib import Path

    ignored = (Path(__file__).resolve().parents[2] / ".gitignore").read_text().split()
    assert "*.duckdb.lock" in ignored or "mergepipe.duckdb.lock" in ignored


@pytest.mark.catalog
def test_errors_named_for_what_happened(catalog, catalog_url, tiny_family, tmp_path, capsys) -> None:
    ingest_family(catalog, tiny_family)
    assert main(["sql", "SELEC name FROM checkpoints", "--catalog", catalog_url]) == 1
    assert "SqlSyntaxError" in _err(capsys)
    assert main(["sql", "DELETE FROM mp_block", "--catalog", catalog_url]) == 1
    assert "ReadOnlySqlError" in _err(capsys)
    assert main(["ingest", str(tiny_family.experts[0]), "--name", "again", "--base", "base",
                 "--catalog", catalog_url]) == 1
    err = _err(capsys)
    assert "AlreadyCataloguedError" in err and "'e0'" in err
    # a usage error is argparse's: exit 2
    with pytest.raises(SystemExit) as ei:
        main(["sql"])
    assert ei.value.code == 2
    capsys.readouterr()


@pytest.mark.catalog
def test_a_budget_of_two_is_refused_not_a_copy_of_the_base(catalog, catalog_url, tiny_family, tmp_path,
                                                           capsys) -> None:
    import yaml

    names = ingest_family(catalog, tiny_family)
    spec = tmp_path / "m.yml"
    spec.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": "base",
                                    "models": [{"model": n, "parameters": {"weight": 0.5}} for n in names]}))
    out = tmp_path / "out"
    assert main(["merge", str(spec), "--out", str(out), "--budget", "2", "--catalog", catalog_url]) == 1
    assert "BudgetError" in _err(capsys) and not out.exists()
    _, rows = catalog.sql("SELECT COUNT(*) FROM snapshots")
    assert rows == [(0,)]


@pytest.mark.catalog
def test_verify_full_says_what_it_checked_beyond_verify(catalog, catalog_url, tiny_family, capsys) -> None:
    ingest_family(catalog, tiny_family)
    assert main(["verify", "--catalog", catalog_url]) == 0
    plain = capsys.readouterr().out
    assert main(["verify", "--full", "--catalog", catalog_url]) == 0
    full = capsys.readouterr().out
    assert plain != full and "sha256" in full and "(--full)" in full


@pytest.mark.catalog
def test_a_budget_that_selects_nothing_is_warned_about(catalog, catalog_url, tiny_family, tmp_path,
                                                      capsys) -> None:
    import json

    import yaml

    from mergepipe_db.core.units import fmt_bytes

    names = ingest_family(catalog, tiny_family)
    spec = tmp_path / "m.yml"
    spec.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": "base",
                                    "models": [{"model": n, "parameters": {"weight": 0.5}} for n in names]}))
    assert main(["plan", str(spec), "--budget", "2B", "--json", "--catalog", catalog_url]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["planned_bytes"] == 0 and doc["candidate_bytes"] > 0 and len(doc["warnings"]) == 1
    assert "selects no expert block" in cap.err
    assert main(["merge", str(spec), "--out", str(tmp_path / "o"), "--budget", "2B", "--json",
                 "--catalog", catalog_url]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["realized_bytes"] == 0 and doc["warnings"] and "selects no expert block" in cap.err
    # a budget that selects something: no warning; plan, merge --json and the report agree on the split
    assert main(["plan", str(spec), "--budget", "0.5", "--catalog", catalog_url]) == 0
    cap = capsys.readouterr()
    assert cap.err == ""
    plan = catalog.plan(str(spec), budget="0.5")
    assert (f"candidates (non-zero delta) {fmt_bytes(plan.candidate_bytes)}, all (full read) "
            f"{fmt_bytes(plan.full_bytes)}") in cap.out
    assert main(["merge", str(spec), "--out", str(tmp_path / "h"), "--budget", "0.5", "--json",
                 "--catalog", catalog_url]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["candidate_bytes"], doc["full_bytes"], doc["warnings"]) == (plan.candidate_bytes, plan.full_bytes,
                                                                            [])
