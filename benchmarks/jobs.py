"""Timed jobs, each run as its own subprocess by the suite (so /proc/PID/io and ru_maxrss are its own).

    python -m benchmarks.jobs ingest CATALOG PATH NAME [BASE]
    python -m benchmarks.jobs ingest-many CATALOG BASE PATH... (one call; names: the directories' names)
    python -m benchmarks.jobs merge CATALOG SPEC.json BUDGET OUT SHARD_BYTES
    python -m benchmarks.jobs plan CATALOG SPEC.json BUDGET

Each prints one JSON line on stdout: the library's result plus `startup_s` (interpreter + imports) and
`work_s` (the library call itself), so process wall time can be split into start-up and work. A job imports
what the `mergepipe` command imports and ends as it does (`cli.exit_now`), so its wall time is the command's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

T_START = time.perf_counter()


def main(argv: list[str]) -> None:
    cmd = argv[0]
    if cmd == "merge":  # as `mergepipe merge` does before it imports the catalog
        from mergepipe_db.kernels import warmup

        warmup.start(own_process=True)
    from mergepipe_db import Catalog
    from mergepipe_db.cli import exit_now

    cat = Catalog.open(argv[1])
    t0 = time.perf_counter()
    startup = t0 - T_START
    if cmd == "ingest":
        base = argv[4] if len(argv) > 4 else None
        res = cat.ingest(argv[2], name=argv[3], base=base).to_dict()
    elif cmd == "ingest-many":
        results = cat.ingest_many(argv[3:], base=argv[2])
        res = {"n": len(results), "created": sum(r.created for r in results),
               "total_bytes": sum(r.total_bytes for r in results)}
    elif cmd == "merge":
        spec = json.loads(Path(argv[2]).read_text())
        r = cat.merge(spec, out=argv[4], budget=argv[3], shard_bytes=int(argv[5]))
        res = r.to_dict()
    elif cmd == "plan":
        spec = json.loads(Path(argv[2]).read_text())
        p = cat.plan(spec, budget=argv[3])
        res = p.summary()
    else:
        raise SystemExit(f"unknown job {cmd}")
    res["work_s"] = time.perf_counter() - t0
    res["startup_s"] = startup
    print(json.dumps(res, default=str))
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1:])
