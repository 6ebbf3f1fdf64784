"""Passthrough reusing source layers reads each source tensor once per merge (issue 34: "a copied range is read
once and written"). Reads are counted at the byte-store boundary (`io.local.RangeReader`, wrapped here), not by
the executor's counters; source tensors' byte ranges come from the safetensors headers, parsed here; outputs
are compared byte for byte with the source tensors and with the merge that re-reads every use."""

from __future__ import annotations

import collections
import json
import struct
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from store_reads import ReadLog

from mergepipe_db.core.plan import TensorInfo
from mergepipe_db.pipeline.base_reuse import Use, reuse_schedule

pytestmark = pytest.mark.catalog

#: base layers 1 and 2 and e0's layer 2 are each copied by two output layers; base 3 and e0 0, 1, 3 by none
CONFIG = """
merge_method: passthrough
slices:
  - sources: [{model: base, layer_range: [0, 3]}]
  - sources: [{model: e0, layer_range: [2, 3]}]
  - sources: [{model: base, layer_range: [1, 3]}]
  - sources: [{model: e0, layer_range: [2, 3]}]
"""
LAYERS = [("base", 0), ("base", 1), ("base", 2), ("e0", 2), ("base", 1), ("base", 2), ("e0", 2)]


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory):
    from conftest import fresh_catalog_url

    from mergepipe_db import Catalog
    from mergepipe_db.demo.family import LlamaShape, make_family

    root = tmp_path_factory.mktemp("ptreuse")
    shape = LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                       num_kv_heads=2)
    family = make_family(root / "fam", n_experts=1, preset=shape, dtype="float32", seed=11)
    with fresh_catalog_url(root, "catalog") as url:
        cat = Catalog.open(url)
        cat.ingest(family.base, name="base", block_bytes=2048)
        cat.ingest(family.experts[0], name="e0", base="base", block_bytes=2048)
        (root / "pt.yml").write_text(CONFIG)
        yield root, family, cat


def _header_ranges(model_dir: Path) -> dict[tuple[str, int, int], str]:
    """(resolved file, absolute offset, nbytes) -> tensor name, from each shard's safetensors header."""
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        raw = f.read_bytes()
        (hlen,) = struct.unpack("<Q", raw[:8])
        for name, meta in json.loads(raw[8:8 + hlen]).items():
            if name == "__metadata__":
                continue
            lo, hi = meta["data_offsets"]
            out[(str(f.resolve()), 8 + hlen + lo, hi - lo)] = name
    return out


def _merge_counting(byte_reads: ReadLog, cat, spec: Path, out: Path) -> tuple[collections.Counter, int]:
    byte_reads.clear()
    r = cat.merge(str(spec), out=out, budget=0.0)
    return collections.Counter(byte_reads.take()), r.realized_bytes


def _expected_sources(family) -> dict[str, tuple[str, str]]:
    """Output tensor -> (model, source tensor): each output layer's source layer; the embedding from the first
    slice's model, the final norm and the LM head from the last slice's (as MergeKit stacks them)."""
    base = load_file(str(next(family.base.glob("*.safetensors"))))
    out: dict[str, tuple[str, str]] = {}
    for name in base:
        if not name.startswith("model.layers."):
            out[name] = (LAYERS[0][0] if "embed_tokens" in name else LAYERS[-1][0], name)
    for out_l, (model, src_l) in enumerate(LAYERS):
        for name in base:
            prefix = f"model.layers.{src_l}."
            if name.startswith(prefix):
                out[f"model.layers.{out_l}.{name[len(prefix):]}"] = (model, name)
    return out


def test_reused_layers_are_read_once(fam, monkeypatch: pytest.MonkeyPatch, byte_reads: ReadLog) -> None:
    root, family, cat = fam
    dirs = {"base": family.base, "e0": family.experts[0]}
    ranges = {m: _header_ranges(d) for m, d in dirs.items()}
    expected = _expected_sources(family)
    uses = collections.Counter(expected.values())
    assert max(uses.values()) == 2  # the config reuses layers

    counts, realized = _merge_counting(byte_reads, cat, root / "pt.yml", root / "once")
    assert realized == 0
    # every byte range read is one source tensor's whole range (nothing else, nothing partial) ...
    names = {k: (m, n) for m, rs in ranges.items() for k, n in rs.items()}
    assert set(counts) <= set(names), set(counts) - set(names)
    # ... each tensor that an output tensor copies read exactly once, and the others not at all
    read = {names[k]: c for k, c in counts.items()}
    assert read == dict.fromkeys(uses, 1)

    # the outputs: the source tensors' bytes
    out = {}
    for f in sorted((root / "once").glob("*.safetensors")):
        out.update(load_file(str(f)))
    src = {m: {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
           for m, d in dirs.items()}
    assert set(out) == set(expected)
    for name, (model, sname) in expected.items():
        assert out[name].dtype == src[model][sname].dtype and out[name].tobytes() == src[model][sname].tobytes()

    # with the reuse off every use is a read of its own (the count above can see a second read), and the
    # output files are byte-identical
    monkeypatch.setenv("MERGEPIPE_REUSE_BYTES", "0")
    counts_off, _ = _merge_counting(byte_reads, cat, root / "pt.yml", root / "every")
    assert {names[k]: c for k, c in counts_off.items()} == dict(uses)
    # a bound of one layer's attention projection: some uses kept, the others read again; same bytes
    q = src["base"]["model.layers.1.self_attn.q_proj.weight"].nbytes
    monkeypatch.setenv("MERGEPIPE_REUSE_BYTES", str(q))
    counts_small, _ = _merge_counting(byte_reads, cat, root / "pt.yml", root / "bounded")
    small = {names[k]: c for k, c in counts_small.items()}
    assert set(small) == set(uses) and any(c == 2 for c in small.values()) and \
        sum(small.values()) < sum(uses.values())
    monkeypatch.delenv("MERGEPIPE_REUSE_BYTES")
    for other in ("every", "bounded"):
        files = sorted(p.name for p in (root / "once").glob("*.safetensors"))
        assert files == sorted(p.name for p in (root / other).glob("*.safetensors"))
        for f in files:
            assert (root / "once" / f).read_bytes() == (root / other / f).read_bytes()


def _t(i: int, offset: int, nbytes: int = 10) -> TensorInfo:
    return TensorInfo(idx=i, name=f"t{i}", dtype="F32", shape=(nbytes // 2, 2), path="/m", offset=offset,
                      nbytes=nbytes, rows_per_block=1, n_blocks=1, xxh3="")


def test_reuse_schedule_keeps_within_the_bound() -> None:
    ts = [_t(0, 0), _t(1, 10), _t(2, 0), _t(3, 10), _t(4, 0), _t(5, 20)]
    keep, copy, last = Use(keep=True), Use(from_kept=True), Use(from_kept=True, last=True)
    read = Use()
    assert reuse_schedule(ts, 100) == [keep, keep, copy, last, last, read]
    # room for one: offset 0 kept to its last use; offset 10 read twice
    assert reuse_schedule(ts, 10) == [keep, read, copy, read, last, read]
    assert reuse_schedule(ts, 0) == [read] * 6
    # no reuse: the ordinary merge reads every tensor
    assert reuse_schedule([_t(0, 0), _t(1, 10)], 100) == [read, read]
    # once dropped, the bytes are read again for a later use (and kept if there is one after it)
    assert reuse_schedule([_t(0, 0), _t(1, 10), _t(2, 0), _t(3, 10), _t(4, 10)], 10) == [
        keep, read, last, keep, last]


@pytest.mark.parametrize("value", ["lots", "-1", "1.5"])
def test_bad_reuse_bound_writes_nothing(fam, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from mergepipe_db.errors import EnvironmentSettingError

    root, _family, cat = fam
    before = cat.sql("SELECT COUNT(*) FROM mp_snapshot")[1]
    monkeypatch.setenv("MERGEPIPE_REUSE_BYTES", value)
    with pytest.raises(EnvironmentSettingError) as ei:
        cat.merge(str(root / "pt.yml"), out=root / "bad-out", budget=0.0)
    assert "MERGEPIPE_REUSE_BYTES" in str(ei.value) and len(str(ei.value).splitlines()) == 1
    assert not (root / "bad-out").exists()
    assert cat.sql("SELECT COUNT(*) FROM mp_snapshot")[1] == before


def test_bad_retain_heap_setting_writes_nothing(fam, monkeypatch: pytest.MonkeyPatch) -> None:
    from mergepipe_db.errors import EnvironmentSettingError

    root, _family, cat = fam
    before = cat.sql("SELECT COUNT(*) FROM mp_snapshot")[1]
    monkeypatch.setenv("MERGEPIPE_RETAIN_HEAP", "on")
    with pytest.raises(EnvironmentSettingError) as ei:
        cat.merge(str(root / "pt.yml"), out=root / "bad-heap-out", budget=0.0)
    assert "MERGEPIPE_RETAIN_HEAP" in str(ei.value) and len(str(ei.value).splitlines()) == 1
    assert not (root / "bad-heap-out").exists()
    assert cat.sql("SELECT COUNT(*) FROM mp_snapshot")[1] == before
