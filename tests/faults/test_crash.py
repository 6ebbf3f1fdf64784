"""Crash safety: kill -9 a merge or an ingest at random moments; the catalog and the outputs are always either
the old state or the complete new one, fsck finds only what gc collects, and a rerun gives the same hashes.

The seed of the random moments is printed and taken from MERGEPIPE_CRASH_SEED when set (to replay a failure).
`benchmarks/reliability.py` runs the same trials 30+ times.
"""

from __future__ import annotations

import os
import random

import pytest
from conftest import BLOCK, ingest_family
from crashkit import (
    cli,
    ingest_fault_trials,
    ingest_kill_trials,
    merge_kill_trials,
    output_hashes,
    staging_dirs,
    whole_snapshots,
    write_spec,
)

pytestmark = pytest.mark.catalog


def _seed() -> int:
    return int(os.environ.get("MERGEPIPE_CRASH_SEED", random.SystemRandom().randrange(2**31)))


def test_random_kills_during_merge_leave_old_or_complete_new_state(catalog, catalog_url, tiny_family,
                                                                   tmp_path) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = write_spec(tmp_path / "spec.yml", names)
    ref_out = tmp_path / "reference"
    catalog.merge(spec, out=ref_out, ref="reference")
    reference = output_hashes(ref_out)
    seed = _seed()
    print(f"MERGEPIPE_CRASH_SEED={seed}")
    stats = merge_kill_trials(catalog_url, spec, tmp_path, n=8, rng=random.Random(seed), reference=reference,
                              n_tensors=21, seed=seed, log=print)
    print(stats.to_dict())
    assert stats.trials == 8 and stats.killed >= 5, stats.to_dict()
    assert stats.reruns_identical == 8
    assert whole_snapshots(catalog) == []


def test_random_kills_during_ingest_leave_the_catalog_unchanged_or_complete(catalog, catalog_url, tiny_family,
                                                                            tmp_path) -> None:
    from mergepipe_db import Catalog

    # Content ids of the experts, from an undisturbed ingest into a scratch catalog.
    scratch = Catalog.open(str(tmp_path / "scratch.duckdb"))
    ingest_family(scratch, tiny_family)
    reference_ids = {p.name: scratch.checkpoint_id(f"e{i}") for i, p in enumerate(tiny_family.experts)}
    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    seed = _seed()
    print(f"MERGEPIPE_CRASH_SEED={seed}")
    stats = ingest_kill_trials(catalog_url, list(tiny_family.experts), rng=random.Random(seed),
                               reference_ids=reference_ids, seed=seed, log=print)
    print(stats.to_dict())
    assert stats.trials == 3 and stats.reruns_identical == 3
    _c, rows = catalog.sql("SELECT name FROM checkpoints ORDER BY name")
    assert [r[0] for r in rows] == sorted(["base", *reference_ids])


def test_ingest_killed_at_each_fault_point_leaves_no_trace_or_the_complete_checkpoints(tiny_family,
                                                                                       tmp_path) -> None:
    """Deterministic kills inside ingest, at every point of `faults.INGEST_POINTS` (the random kills above may
    all land before or after the catalog transaction): each must kill the process (a point no longer reached
    fails here), before the commit nothing is left, after it everything is, fsck is clean."""
    from conftest import fresh_catalog_url

    from mergepipe_db import Catalog
    from mergepipe_db.core import faults

    scratch = Catalog.open(str(tmp_path / "scratch.duckdb"))
    ingest_family(scratch, tiny_family)
    reference_ids = {p.name: scratch.checkpoint_id(f"e{i}") for i, p in enumerate(tiny_family.experts)}
    stats = ingest_fault_trials(lambda stem: fresh_catalog_url(tmp_path, stem), tiny_family.base,
                                list(tiny_family.experts), block_bytes=BLOCK, reference_ids=reference_ids,
                                log=print)
    print(stats.to_dict())
    n = len(tiny_family.experts)
    assert stats.killed == stats.trials == len(faults.INGEST_POINTS) - 1 + n  # rows_written: once per expert
    assert stats.rolled_back == n + 1 and stats.rolled_forward == 1 and stats.reruns_identical == stats.trials
    assert dict(stats.modes) == {"ingest_scanned": 1, "ingest_rows_written": n, "ingest_committed": 1}


def test_rerun_into_an_out_awaiting_roll_forward_is_refused_until_gc(catalog, catalog_url, tiny_family,
                                                                     tmp_path) -> None:
    """Killed between the catalog commit and the rename, a merge's output waits for gc. A rerun into the same
    --out must not commit a second snapshot there (its rename would fail, or the first would leak)."""
    from mergepipe_db.errors import OutputExistsError

    names = ingest_family(catalog, tiny_family)
    spec = write_spec(tmp_path / "spec.yml", names)
    out = tmp_path / "out"
    r = cli(["merge", str(spec), "--out", str(out), "--catalog", catalog_url, "--quiet"],
            {"MERGEPIPE_FAULT": "catalog_committed"})
    assert r.returncode == -9, r.stderr
    with pytest.raises(OutputExistsError, match="gc --apply"):
        catalog.merge(spec, out=out)
    assert not out.exists() and len(staging_dirs(tmp_path)) == 1  # only the committed output, waiting
    assert [f.kind for f in catalog.fsck() if f.kind != "ok"] == ["leftover"]
    assert len(catalog.gc(dry_run=False)) == 1
    assert all(f.kind == "ok" for f in catalog.fsck()) and (out / "manifest.json").is_file()
    _c, rows = catalog.sql("SELECT checkpoint FROM snapshots")
    assert rows == [("out@1",)]
