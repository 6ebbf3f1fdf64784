"""nearswap from θ_1's stored values as read (`GatherFold.raw_formula`): the bytes of numpy's formula on θ_1 =
the stored values on the rows read and θ₀ on the others, whatever the rows not read hold."""

from __future__ import annotations

import numpy as np
import pytest
from builders import f32_bits, stored_with_garbage


def _numpy(a: np.ndarray, b: np.ndarray, t: float) -> np.ndarray:
    with np.errstate(all="ignore"):
        w = np.float32(t) / np.maximum(np.abs(a - b), np.float32(1e-6))
        np.clip(w, np.float32(0), np.float32(1), out=w)
        return w * b + (np.float32(1) - w) * a


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize(("shape", "rpb", "blocks"), [
    ((64, 256), 8, (0, 3, 4)), ((300, 24), 1, tuple(range(0, 300, 7))), ((64, 256), 8, ()),
    ((40, 24), 4, tuple(range(10)))])
def test_stored_values_give_numpys_formula(shape, rpb, blocks, dtype, monkeypatch) -> None:
    """Tiles read whole, in part and not at all (garbage there: NaN, ±inf), nothing read, everything read."""
    from mergepipe_db.kernels import gather as gk

    calls = []
    raw = gk.nearswap_raw
    monkeypatch.setattr(gk, "nearswap_raw", lambda *a: (calls.append(1), raw(*a))[1])
    g = np.random.default_rng(len(blocks))
    base = (g.standard_normal(shape) * 0.02).astype(np.float32)
    d = np.zeros(shape, np.float32)
    for b in blocks:
        d[b * rpb:(b + 1) * rpb] = (g.standard_normal((rpb,) + shape[1:]) * 1e-3).astype(np.float32)
    base, stored, deltas = stored_with_garbage(base, [d], [blocks], rpb, dtype, 5)
    got = _fold(base, blocks, stored, rpb)
    assert calls == ([1] if blocks else [])
    assert np.array_equal(f32_bits(got), f32_bits(_numpy(base, base + deltas[0], 0.001)))


def _fold(base, blocks, stored, rpb):
    from mergepipe_db.operators import ExpertInput, ExpertParams, TensorContext, make_operator

    n_blocks = -(-base.shape[0] // rpb)
    ctx = TensorContext(name="w", shape=base.shape, rows_per_block=rpb, n_blocks=n_blocks, seed=0)
    op = make_operator("nearswap", [ExpertParams("e0")], t=0.001)
    op.begin(base, ctx)
    op.add(ExpertInput.from_raw(0, None, blocks, True, base=base, raw=stored[0], ctx=ctx))
    return op.finish().copy()
