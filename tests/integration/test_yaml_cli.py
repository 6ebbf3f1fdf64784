"""`mergepipe-yaml`, the drop-in for `mergekit-yaml`: Hugging Face ids through a local cache laid out as the Hub
client keeps it (offline; a missing model is an error naming --download), mergekit-yaml's options, and refusals
that write nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mergepipe_db.yaml_cli import main, parse_kmb

pytestmark = pytest.mark.catalog

CONFIG = """
slices:
  - sources:
      - {model: org/base, layer_range: [0, 2]}
      - {model: org/chat@main, layer_range: [0, 2]}
merge_method: slerp
base_model: org/base
parameters:
  t: [{filter: self_attn, value: [0, 1]}, {value: 0.5}]
dtype: float32
"""


def _cache_model(hub: Path, repo: str, src: Path, commit: str) -> None:
    d = hub / f"models--{repo.replace('/', '--')}"
    snap = d / "snapshots" / commit
    shutil.copytree(src, snap)
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "main").write_text(commit)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    from mergepipe_db.demo.family import make_family

    root = tmp_path_factory.mktemp("yamlcli")
    family = make_family(root / "fam", n_experts=1, preset="tiny", dtype="float32", seed=2)
    hub = root / "hub"
    _cache_model(hub, "org/base", family.base, "a" * 40)
    _cache_model(hub, "org/chat", family.experts[0], "b" * 40)
    (root / "cfg.yml").write_text(CONFIG)
    return root, hub


@pytest.fixture
def env(setup, monkeypatch: pytest.MonkeyPatch, catalog_url: str):
    root, hub = setup
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root, catalog_url


def test_hf_ids_resolve_through_the_cache_and_options_apply(env, tmp_path: Path, capsys) -> None:
    root, url = env
    out = tmp_path / "merged"
    rc = main([str(root / "cfg.yml"), str(out), "--catalog", url, "--no-copy-tokenizer", "--lazy-unpickle",
               "--random-seed", "7", "--out-shard-size", "20K"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "--lazy-unpickle has no effect" in captured.err
    assert (out / "mergekit_config.yml").read_text() == CONFIG
    assert (out / "README.md").read_text().startswith("---\n")
    assert not (out / "tokenizer_config.json").exists()
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert len(list(out.glob("*.safetensors"))) > 1  # 20K parameters (80 kB in F32) a shard
    assert json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"] > 0
    manifest = json.loads((out / "manifest.json").read_text())["manifest"]
    assert manifest["seed"] == 7 and manifest["config"]["text"] == CONFIG
    # replay needs only the manifest (the Hugging Face ids of its text are not looked up again)
    from mergepipe_db import Catalog

    rep = Catalog.open(url).replay(str(out / "manifest.json"), out=tmp_path / "replayed", shard_bytes=80_000)
    assert rep.plan_hash == manifest["plan_hash"]
    for f in sorted(out.glob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "replayed" / f.name).read_bytes()

    out2 = tmp_path / "merged2"
    assert main([str(root / "cfg.yml"), str(out2), "--catalog", url, "--no-write-model-card"]) == 0
    assert not (out2 / "README.md").exists() and (out2 / "tokenizer_config.json").exists()
    for f in sorted(out.glob("*.safetensors")):
        assert f.stat().st_size > 0
    # the same tensors whatever the sharding
    from mergepipe_db.formats.safetensors import read_header

    names = sorted(t.name for f in out.glob("*.safetensors") for t in read_header(f).tensors)
    assert names == sorted(t.name for f in out2.glob("*.safetensors") for t in read_header(f).tensors)


@pytest.mark.parametrize(("args", "message"), [
    (["--allow-crimes"], "--allow-crimes is not supported"),
    ([], "not in the local Hugging Face cache"),
])
def test_refusals_are_one_line_and_write_nothing(env, tmp_path: Path, capsys, args: list[str], message: str) -> None:
    root, url = env
    cfg = tmp_path / "c.yml"
    cfg.write_text(CONFIG.replace("org/chat@main", "org/missing") if not args else CONFIG)
    out = tmp_path / "never"
    assert main([str(cfg), str(out), "--catalog", url, *args]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_parse_kmb_is_mergekits() -> None:
    assert parse_kmb("5B") == 5 * 10**9 and parse_kmb("500M") == 5 * 10**8 and parse_kmb("12") == 12
    with pytest.raises(Exception, match="out-shard-size"):
        parse_kmb("5X")


def test_help_names_every_option(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for opt in ("--out-shard-size", "--copy-tokenizer", "--no-copy-tokenizer", "--write-model-card",
                "--random-seed", "--lazy-unpickle", "--cuda", "--allow-crimes", "--budget", "--catalog",
                "--download"):
        assert opt in text


def test_console_script_exits_at_once_with_its_output_complete(env, tmp_path: Path) -> None:
    """The console script (`run`) ends a successful merge without the interpreter's teardown
    (`core.process.exit_now`): its JSON result on stdout is whole, the output written; a refused config exits 1
    the usual way, one line on stderr."""
    import os
    import subprocess
    import sys

    root, url = env
    script = "import sys; from mergepipe_db import yaml_cli; sys.argv[0] = 'mergepipe-yaml'; yaml_cli.run()"
    # stdout a pipe, buffered: what `exit_now` does not flush is lost
    envs = {k: v for k, v in os.environ.items() if k not in ("MERGEPIPE_DEBUG", "PYTHONUNBUFFERED")}
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", script, str(root / "cfg.yml"), str(out), "--catalog", url, "--json"],
                          capture_output=True, text=True, env=envs, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["snapshot_id"] and (out / "model.safetensors").exists()
    bad = tmp_path / "bad.yml"
    bad.write_text("merge_method: [")
    done = subprocess.run([sys.executable, "-c", script, str(bad), str(tmp_path / "never"), "--catalog", url],
                          capture_output=True, text=True, env=envs, timeout=300)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
    assert "not readable YAML" in done.stderr and not (tmp_path / "never").exists()
