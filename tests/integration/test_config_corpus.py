"""A corpus of MergeKit 0.1.5 configs written for mergepipe (tests/configs/*.yml), one for each shape MergeKit's
documentation and examples show for the methods mergepipe has: every one runs at full budget on a small family
and gives the layer count its slices say, every output tensor in the output dtype, and the spec as given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mergepipe_db.formats.safetensors import read_header

pytestmark = pytest.mark.catalog

CORPUS = sorted((Path(__file__).parents[1] / "configs").glob("*.yml"))
N_LAYERS = 4
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", None: "F32"}


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory):
    from conftest import fresh_catalog_url

    from mergepipe_db import Catalog
    from mergepipe_db.demo.family import LlamaShape, make_family

    root = tmp_path_factory.mktemp("corpus")
    shape = LlamaShape(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=N_LAYERS, num_heads=2,
                       num_kv_heads=1)
    family = make_family(root / "fam", n_experts=2, preset=shape, dtype="float32", seed=11)
    with fresh_catalog_url(root, "catalog") as url:
        cat = Catalog.open(url)
        cat.ingest(family.base, name="base")
        for i, e in enumerate(family.experts):
            cat.ingest(e, name=f"e{i}", base="base")
        yield root, cat


def expected_layers(doc: dict) -> int:
    if "slices" in doc:
        return sum(s["sources"][0]["layer_range"][1] - s["sources"][0]["layer_range"][0] for s in doc["slices"])
    return N_LAYERS


def test_the_corpus_covers_every_method() -> None:
    methods = {yaml.safe_load(p.read_text())["merge_method"] for p in CORPUS}
    assert methods == {"linear", "slerp", "task_arithmetic", "ties", "dare_ties", "dare_linear", "breadcrumbs",
                       "passthrough"}
    assert len(CORPUS) >= 14


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_every_config_of_the_corpus_runs(fam, path: Path) -> None:
    root, cat = fam
    doc = yaml.safe_load(path.read_text())
    out = root / f"out-{path.stem}"
    res = cat.merge(str(path), out=out, budget=1.0)
    assert res.realized_bytes == res.planned_bytes <= res.full_bytes
    conf = json.loads((out / "config.json").read_text())
    assert conf["num_hidden_layers"] == expected_layers(doc)
    want = DTYPES[doc.get("dtype", doc.get("out_dtype"))]
    tensors = [t for f in sorted(out.glob("*.safetensors")) for t in read_header(f).tensors]
    layers = {int(t.name.split(".")[2]) for t in tensors if t.name.startswith("model.layers.")}
    assert layers == set(range(expected_layers(doc)))
    assert all(t.dtype == want for t in tensors)
    assert (out / "mergekit_config.yml").read_text() == path.read_text()
