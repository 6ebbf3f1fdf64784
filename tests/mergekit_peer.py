"""MergeKit 0.1.5, the reference peer, in a venv of its own (never a dependency of the package).

The venv is made on first use by the test set-up: `python3 -m venv` + `pip install torch==2.13.0 mergekit==0.1.5`
(the CPU torch wheel this machine holds; the package registry has MergeKit). It lives at `.venv-mergekit/` in the
repository (git-ignored) or where MERGEPIPE_MERGEKIT_VENV points, and is made once even when pytest-xdist
workers ask for it together (a file lock).

    from mergekit_peer import run_mergekit, load_dir
    out = run_mergekit(yaml_text, tmp_path / "mk-out")      # runs `mergekit-yaml CONFIG OUT --random-seed 0`
    tensors = load_dir(out)                                   # {name: torch.Tensor}

Tests that use it are marked `mergekit`; `MERGEPIPE_NO_MERGEKIT=1` skips them on a machine that cannot make the
venv (never set on CI, where an install failure fails the tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERSION = "0.1.5"
VENV = Path(os.environ.get("MERGEPIPE_MERGEKIT_VENV", str(REPO / ".venv-mergekit")))


def _exe(name: str) -> Path:
    return VENV / "bin" / name


def ensure_mergekit() -> Path:
    """The venv's `mergekit-yaml`, installing MergeKit first when the venv lacks it."""
    if os.environ.get("MERGEPIPE_NO_MERGEKIT"):
        pytest.skip("MERGEPIPE_NO_MERGEKIT is set: the MergeKit differential tests are skipped")
    exe = _exe("mergekit-yaml")
    stamp = VENV / ".mergekit-ok"
    if stamp.exists() and exe.exists():
        return exe
    from filelock import FileLock

    VENV.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(VENV) + ".lock", timeout=1800):
        if stamp.exists() and exe.exists():
            return exe
        py = os.environ.get("PYTHON3", "python3" if sys.prefix != sys.base_prefix else sys.executable)
        subprocess.run([py, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(_exe("pip")), "install", "-q", "--disable-pip-version-check",
                        "torch==2.13.0", f"mergekit=={VERSION}"], check=True, timeout=1800)
        got = subprocess.run([str(_exe("python")), "-c",
                              "import importlib.metadata as m; print(m.version('mergekit'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
        if got != VERSION:
            raise RuntimeError(f"MergeKit venv at {VENV} has mergekit {got}, not {VERSION}")
        stamp.write_text(got)
    return exe


def run_mergekit(config: str | dict, out: Path, *args: str, seed: int = 0, timeout: int = 600) -> Path:
    """Run `mergekit-yaml` on a config (YAML text or a dict) into `out`; returns `out`. Raises with MergeKit's
    stderr tail when it fails."""
    import yaml

    exe = ensure_mergekit()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
    cfg = out.parent / f"{out.name}.mergekit.yml"
    cfg.write_text(text)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONHASHSEED": "0"}
    proc = subprocess.run([str(exe), str(cfg), str(out), "--random-seed", str(seed), "--no-copy-tokenizer", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"mergekit-yaml failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return out


def load_dir(out: Path) -> dict:
    """Every tensor of a safetensors output directory (sharded or not), as torch tensors."""
    from safetensors.torch import load_file

    out = Path(out)
    tensors: dict = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def load_config(out: Path) -> dict:
    return json.loads((Path(out) / "config.json").read_text())
