"""`mergepipe-yaml CONFIG OUT_DIR [options]`: a drop-in for MergeKit's `mergekit-yaml`.

Takes the same config and the common `mergekit-yaml` options, plus `--budget` and `--catalog`. Model references
may be catalogue names, paths (not yet catalogued ones are ingested first) or Hugging Face ids (`org/name`,
`org/name@revision`), resolved through the local Hugging Face cache (`--download` fetches a missing one).
Errors are one line on stderr and exit code 1, as for `mergepipe`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from mergepipe_db.errors import MergePipeError, SpecError

_NO_EFFECT = ("lazy_unpickle", "cuda")
_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


def parse_kmb(text: str) -> int:
    """MergeKit's counts: `5B` = 5·10⁹, `500M`, `100K`, or a plain integer."""
    t = text.strip()
    mult = {"k": 10**3, "m": 10**6, "b": 10**9}.get(t[-1:].lower(), 1)
    digits = t[:-1] if mult != 1 else t
    if not digits.isdigit() or int(digits) < 1:
        raise SpecError(f"--out-shard-size: expected a positive count such as 5B, 500M or 100000, got {text!r}")
    return int(digits) * mult


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mergepipe-yaml",
        description="Merge models from a MergeKit YAML config, as `mergekit-yaml CONFIG OUT_DIR` does, reading "
                    "expert weights under a byte budget (full read by default: MergeKit's result).",
        epilog="Catalog: --catalog URL, else $MERGEPIPE_CATALOG, else ./mergepipe.duckdb. Hugging Face ids are "
               "looked up in the local cache (HF_HOME / HF_HUB_CACHE).")
    p.add_argument("config", help="MergeKit YAML config")
    p.add_argument("out_dir", help="output directory (must not exist, or be empty)")
    p.add_argument("--budget", default=None,
                   help="expert-read budget: a fraction of the full read (0.25) or bytes (3GiB); default: the "
                        "config's `budget`, else the full read")
    p.add_argument("--catalog", default=None, help="catalog URL or DuckDB file")
    p.add_argument("--out-shard-size", default="5B",
                   help="parameters per output shard, as MergeKit (5B, 500M); converted to bytes with the output "
                        "dtype (4 bytes a parameter when the config names none) [default: 5B]")
    p.add_argument("--copy-tokenizer", action=argparse.BooleanOptionalAction, default=True,
                   help="copy the tokenizer files of the base (or tokenizer_source) [default: on]")
    p.add_argument("--write-model-card", action=argparse.BooleanOptionalAction, default=True,
                   help="write README.md, a model card [default: on]")
    p.add_argument("--random-seed", type=int, default=None, help="seed of the random merges (DARE)")
    p.add_argument("--lazy-unpickle", action="store_true", help="accepted; no effect (mergepipe never unpickles)")
    p.add_argument("--cuda", action="store_true", help="accepted; no effect (mergepipe merges on the CPU)")
    p.add_argument("--allow-crimes", action="store_true",
                   help="refused: mergepipe does not merge models of different architectures")
    p.add_argument("--download", action="store_true",
                   help="download Hugging Face models missing from the local cache (safetensors, config and "
                        "tokenizer files only)")
    p.add_argument("--ref", default=None, help="catalog ref to move to the result (default: the output's name)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _catalogued(cat: Any, ref: str) -> bool:
    from mergepipe_db.errors import UnknownCheckpointError

    try:
        cat.checkpoint_id(ref)
    except UnknownCheckpointError:
        return False
    return True


def load(args: argparse.Namespace, cat: Any) -> Any:
    """The spec of `args.config` with Hugging Face ids replaced by their cache directories (the text kept as
    given, for mergekit_config.yml and the manifest) and the options applied."""
    import yaml

    from mergepipe_db.core.mergekit_config import model_refs, substitute_refs
    from mergepipe_db.core.spec import load_spec
    from mergepipe_db.hf_models import is_hf_ref, resolve_hf

    path = Path(args.config)
    try:
        text = path.read_text(encoding="utf-8")
        raw = yaml.safe_load(text)
    except FileNotFoundError as e:
        raise SpecError(f"config {path} does not exist") from e
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError, TypeError, RecursionError) as e:
        raise SpecError(f"config {path} is not readable YAML: {' '.join(str(e).split())[:200]}") from e
    if not isinstance(raw, dict):
        raise SpecError(f"config {path} must be a YAML mapping")
    aliases = {ref: str(resolve_hf(ref, download=args.download)) for ref in model_refs(raw)
               if is_hf_ref(ref) and not _catalogued(cat, ref)}
    substitute_refs(raw, aliases)
    spec = load_spec(raw)
    seed = args.random_seed if args.random_seed is not None else spec.seed
    spec = replace(spec, text=text, seed=seed, model_card=args.write_model_card,
                   copy_tokenizer=args.copy_tokenizer, source=str(path), aliases=aliases)
    shard_bytes = parse_kmb(args.out_shard_size) * _DTYPE_BYTES.get(spec.dtype or "F32", 4)
    return spec, shard_bytes


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mergepipe_db.kernels.compile_time import compiled, note

    before = compiled()
    try:
        if args.allow_crimes:
            raise SpecError("--allow-crimes is not supported: mergepipe merges only models of one architecture")
        for name in _NO_EFFECT:
            if getattr(args, name):
                print(f"mergepipe-yaml: note: --{name.replace('_', '-')} has no effect", file=sys.stderr)
        from mergepipe_db.kernels import warmup

        warmup.start(own_process=True)  # the merge kernels load while the catalog is imported, opened and planned
        from mergepipe_db.catalog import Catalog

        cat = Catalog.open(args.catalog)
        spec, shard_bytes = load(args, cat)
        res = cat.merge(spec, out=args.out_dir, budget=args.budget, ref=args.ref, shard_bytes=shard_bytes)
    except MergePipeError as e:
        if os.environ.get("MERGEPIPE_DEBUG"):
            raise
        print(f"mergepipe-yaml: error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"mergepipe-yaml: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    compiling = note(before) if sys.stderr.isatty() else None  # for a person at a terminal, as the progress bar
    if compiling:
        print(f"mergepipe-yaml: {compiling}", file=sys.stderr)
    if args.json:
        import json

        print(json.dumps(res.to_dict(), indent=2, default=str))
    else:
        print(f"merged {spec.method} into {res.out} (snapshot {res.snapshot_id}, checkpoint {res.checkpoint}); "
              f"expert bytes read {res.realized_bytes} of {res.full_bytes} (budget {res.budget_bytes})")
    return 0


def run() -> NoReturn:
    """The `mergepipe-yaml` console script: `main`, then `core.process.exit_now` (tests call `main` in
    process)."""
    from mergepipe_db.core.process import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()
