"""Record tests/golden/golden.json: build the golden merges of tests/golden/cases.py and write their hashes.

From the repository root::

    python -m tests.golden.record                  # (re)write tests/golden/golden.json
    python tests/golden/record.py --out /tmp/g.json  # write elsewhere (e.g. to diff two recordings)

Re-record only when a change of merge output is intended; tests/integration/test_golden.py compares against the file.
The families are built in a temporary directory (or --workdir, which must not exist, kept afterwards).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tests.golden` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.golden import cases  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.golden.record", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=cases.GOLDEN_PATH, help=f"default: {cases.GOLDEN_PATH}")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="build the families here (must not exist) and keep them; default: a temporary directory")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True)
        doc = cases.record_all(args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="mergepipe-golden-") as tmp:
            doc = cases.record_all(Path(tmp))
    cases.write_golden(doc, args.out)
    print(f"wrote {args.out}: {len(doc['cases'])} cases of {len(doc['families'])} families "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
