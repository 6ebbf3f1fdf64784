"""Ingest's inner-product statistics (mp_tensor_gram, `kernels/gram_stats.py`): ⟨θ₀, Δ⟩, ‖Δ‖², ‖θ₀‖² and the
count sketch of Δ against the same quantities computed here from the files, with a sign function written
again from its description (seeded table of 2^20 signs × splitmix64 of the index's high bits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergepipe_db.db.gram import tensor_cross, tensor_gram
from mergepipe_db.kernels.gram_stats import GRAM_DIM, gram_block_stats

pytestmark = pytest.mark.catalog

M64 = (1 << 64) - 1


def splitmix_sign(hi: int) -> float:
    z = (hi + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return -1.0 if (z ^ (z >> 31)) >> 63 else 1.0


TABLE = np.where(np.random.default_rng(0x5EED_6A4A).random(1 << 20) < 0.5, -1.0, 1.0)


def plain_sketch(delta: np.ndarray) -> np.ndarray:
    out = np.zeros(GRAM_DIM)
    d = delta.reshape(-1).astype(np.float64)
    for g in range(d.shape[0]):
        out[g % GRAM_DIM] += TABLE[g % (1 << 20)] * splitmix_sign(g >> 20) * d[g]
    return out


def load(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("fixture", ["tiny_family_f32", "tiny_family"])
def test_ingest_stores_the_inner_products(catalog, request, fixture: str) -> None:
    fam = request.getfixturevalue(fixture)
    catalog.ingest(fam.base, name="base", block_bytes=4096)
    catalog.ingest_many(list(fam.experts[:2]), names=["a", "b"], base="base")
    ids = {n: catalog.checkpoint_id(n) for n in ("base", "a", "b")}
    with catalog.db.connect() as conn:
        grams = {n: tensor_gram(conn, i) for n, i in ids.items()}
        crosses = {n: tensor_cross(conn, ids[n]) for n in ("a", "b")}
        names = {n: dict(conn.execute(__import__("sqlalchemy").text(
            "SELECT tensor_idx, name FROM mp_tensor WHERE checkpoint_id = :c"), {"c": i}).all())
            for n, i in ids.items()}
    base = load(fam.base)
    experts = {"a": load(fam.experts[0]), "b": load(fam.experts[1])}
    assert len(grams["base"]) == len(base) and len(grams["a"]) == len(base)
    for tidx, g in grams["base"].items():
        b = base[names["base"][tidx]].double()
        assert g.base_sq == pytest.approx(float((b * b).sum()), rel=1e-12)
    est, true, bound = [], [], []
    for n in ("a", "b"):
        for tidx, g in grams[n].items():
            name = names[n][tidx]
            b32 = base[name].float()
            d = (experts[n][name].float() - b32)
            dd = d.double()
            assert g.base_dot == pytest.approx(float((b32.double() * dd).sum()), rel=1e-9, abs=1e-12)
            assert g.delta_sq == pytest.approx(float((dd * dd).sum()), rel=1e-9, abs=1e-15)
            if d.numel() <= 20000:
                np.testing.assert_allclose(g.proj, plain_sketch(d.numpy()), rtol=1e-5, atol=1e-6 * float(dd.norm()))
    # the sketches of two experts estimate their inner product: exact for tensors of at most GRAM_DIM elements;
    # ingested together (ingest_many), the product itself is stored (where both Δ are nonzero somewhere)
    n_exact = 0
    for tidx, ga in grams["a"].items():
        name = names["a"][tidx]
        tb = next(t for t, nm in names["b"].items() if nm == name)
        da = (experts["a"][name].float() - base[name].float()).double()
        db = (experts["b"][name].float() - base[name].float()).double()
        got, want = float(ga.proj @ grams["b"][tb].proj), float((da * db).sum())
        ex_a, ex_b = crosses["a"].get((tidx, ids["b"])), crosses["b"].get((tb, ids["a"]))
        assert ex_a == ex_b
        if ex_a is not None:
            assert ex_a == pytest.approx(want, rel=1e-5, abs=1e-12 * float(da.norm() * db.norm()) + 1e-30)
            n_exact += 1
        else:  # no block where both changed
            assert want == 0.0 or float(da.norm() * db.norm()) == 0.0 or (da * db != 0).sum() == 0
        if da.numel() <= GRAM_DIM or float(da.norm() * db.norm()) == 0.0:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-9)
        else:
            est.append(got)
            true.append(want)
            bound.append(float(da.norm() * db.norm()) * (2 / GRAM_DIM) ** 0.5)
    assert n_exact >= 3
    z = (np.array(est) - np.array(true)) / np.array(bound)
    assert len(z) >= 3 and np.all(np.abs(z) < 6) and abs(z.mean()) < 1.5


def test_block_sketches_add_up_to_the_tensor_sketch() -> None:
    """Blocks starting anywhere (also across a 2^20 boundary) sum to the whole tensor's sketch."""
    rng = np.random.default_rng(3)
    n = (1 << 20) + 5000
    b = rng.standard_normal(n).astype(np.float32)
    e = (b + rng.standard_normal(n).astype(np.float32) * 0.01).astype(np.float32)
    cuts = [0, 777, (1 << 20) - 3, (1 << 20) + 100, n]
    total = sum(gram_block_stats(e[s:t].tobytes(), b[s:t].tobytes(), "F32", s)[2] for s, t in zip(cuts, cuts[1:]))
    whole = gram_block_stats(e.tobytes(), b.tobytes(), "F32", 0)[2]
    np.testing.assert_allclose(total, whole, rtol=1e-4, atol=1e-6)
    # and the part past 2^20 follows the high-bit sign: the plain formula on a short tail
    tail = gram_block_stats(e[1 << 20:].tobytes(), b[1 << 20:].tobytes(), "F32", 1 << 20)[2]
    d = (e[1 << 20:] - b[1 << 20:]).astype(np.float64)
    want = np.zeros(GRAM_DIM)
    for i in range(d.shape[0]):
        g = (1 << 20) + i
        want[g % GRAM_DIM] += TABLE[g % (1 << 20)] * splitmix_sign(g >> 20) * d[i]
    np.testing.assert_allclose(tail, want, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_fused_pass_gives_the_block_statistics_bit_for_bit_and_the_plain_inner_products(dtype: str) -> None:
    """`block_and_gram_stats` (the one pass ingest runs) returns exactly `delta_block_stats`'s catalog row, and
    inner products equal to the plain formulas, for blocks with zero tiles, a NaN, starts off the 1,024 grid and
    across a 2^20 boundary."""
    from mergepipe_db.kernels.block_stats import delta_block_stats
    from mergepipe_db.kernels.gram_stats import block_and_gram_stats

    rng = np.random.default_rng(5)
    tdt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]
    for n, start, nan in [(9000, 0, False), (9000, 3 * 2048 + 513, True), (5000, (1 << 20) - 1000, False),
                          (100, 7, False), (0, 0, False)]:
        b = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(tdt)
        e = (b.float() + torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * 0.02).to(tdt)
        e[:4500] = b[:4500]  # two whole tiles with Δ = 0 (skipped) and part of a third
        if nan:
            e[-10] = float("nan")
        raw = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[tdt]
        eb, bb = (bytearray(x.view(raw).numpy().tobytes()) for x in (e, b))
        row, (bd, dd, proj) = block_and_gram_stats(eb, bb, dtype, start)
        want = delta_block_stats(eb, bb, dtype)
        assert str(row) == str(want)  # (str: NaN equal to NaN)
        d = (e.float() - b.float()).double()
        ref = np.zeros(GRAM_DIM)
        for i in range(n):
            g = start + i
            ref[g % GRAM_DIM] += TABLE[g % (1 << 20)] * splitmix_sign(g >> 20) * float(d[i])
        if nan:
            assert np.isnan(bd) and np.isnan(dd) and np.isnan(proj).any()
            continue
        assert bd == pytest.approx(float((b.double() * d).sum()), rel=1e-9, abs=1e-12)
        assert dd == pytest.approx(float((d * d).sum()), rel=1e-9, abs=1e-15)
        np.testing.assert_allclose(proj, ref, rtol=1e-5, atol=1e-6 * float(d.norm()) + 1e-30)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_cross_products_are_the_plain_dot_products_of_the_deltas(dtype: str) -> None:
    from mergepipe_db.kernels.gram_stats import cross_products

    rng = np.random.default_rng(6)
    tdt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]
    raw = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[tdt]
    n = 7001
    b = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(tdt)
    es = [(b.float() + torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * 0.02).to(tdt) for _ in range(3)]
    got = cross_products([(k, bytearray(e.view(raw).numpy().tobytes())) for k, e in zip((0, 2, 5), es)],
                         bytearray(b.view(raw).numpy().tobytes()), dtype)
    ds = {k: (e.float() - b.float()).double() for k, e in zip((0, 2, 5), es)}
    assert [(i, j) for i, j, _ in got] == [(0, 2), (0, 5), (2, 5)]
    for i, j, v in got:
        assert v == pytest.approx(float((ds[i] * ds[j]).sum()), rel=1e-9, abs=1e-12)


def test_ingesting_again_adds_the_statistics_of_a_checkpoint_catalogued_before_them(catalog, tiny_family_f32) -> None:
    """A checkpoint catalogued before mp_tensor_gram (its rows deleted here) gets them by ingesting the same,
    unchanged files again (docs/SEMANTICS.md), the cross products of experts ingested together included; a
    checkpoint that has them is not read again."""
    import sqlalchemy as sa

    fam = tiny_family_f32
    catalog.ingest(fam.base, name="base", block_bytes=4096)
    catalog.ingest_many(list(fam.experts[:2]), names=["a", "b"], base="base")
    ids = {n: catalog.checkpoint_id(n) for n in ("base", "a", "b")}
    with catalog.db.connect() as conn:
        before = {n: tensor_gram(conn, i) for n, i in ids.items()}
        crosses = {n: tensor_cross(conn, ids[n]) for n in ("a", "b")}
    assert all(before.values()) and all(crosses.values())
    with catalog.db.connect() as conn:
        conn.execute(sa.text("DELETE FROM mp_tensor_cross"))
        conn.execute(sa.text("DELETE FROM mp_tensor_gram"))
        conn.commit()
    assert catalog.ingest(fam.base, name="base", block_bytes=4096).bytes_read > 0
    again = catalog.ingest_many(list(fam.experts[:2]), names=["a", "b"], base="base")
    assert [r.created for r in again] == [False, False] and all(r.bytes_read > 0 for r in again)
    with catalog.db.connect() as conn:
        for n, i in ids.items():
            got = tensor_gram(conn, i)
            assert got.keys() == before[n].keys()
            for t, g in got.items():
                assert (g.base_dot, g.delta_sq, g.base_sq) == (before[n][t].base_dot, before[n][t].delta_sq,
                                                               before[n][t].base_sq)
                np.testing.assert_array_equal(g.proj, before[n][t].proj)
        assert {n: tensor_cross(conn, ids[n]) for n in ("a", "b")} == crosses
    assert catalog.ingest(fam.base, name="base", block_bytes=4096).bytes_read == 0  # has them now: unchanged, not read
