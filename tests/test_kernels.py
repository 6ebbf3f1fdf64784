"""The fused ingest kernel agrees with the plain torch/sketch computation, edge values included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergepipe_db import kernels, sketch


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BF16"), (torch.float32, "F32"), (torch.float16, "F16")])
def test_delta_stats_match_torch_and_sketch(dtype: torch.dtype, name: str) -> None:
    g = torch.Generator().manual_seed(5)
    n = 1 << 15
    b = torch.randn(n, generator=g).to(dtype)
    e = (b.float() + torch.randn(n, generator=g) * torch.logspace(-30, 4, n)).to(dtype)
    e[:500] = b[:500]  # exact zeros
    e[600], b[600] = float("nan"), float("nan")  # NaN - NaN
    e[601], b[601] = float("inf"), float("inf")  # inf - inf = NaN
    b[602] = float("-inf")
    e[603], b[603] = -0.0, 0.0
    l2, l1, mx, pos, hist = kernels.delta_stats(e.view(torch.uint8).numpy().tobytes(),
                                                b.view(torch.uint8).numpy().tobytes(), name)
    d = e.float() - b.float()
    assert np.array_equal(hist, sketch.histogram(d.abs()))
    finite = torch.isfinite(d)
    assert pos == pytest.approx(float((d > 0).double().mean()), abs=0)
    assert np.isnan(l2) and np.isnan(mx)  # NaN propagates, as torch's norm and max do
    d_f = d[finite]
    l2f, l1f, mxf, _pos, _h = kernels.delta_stats(e[finite].view(torch.uint8).numpy().tobytes(),
                                                  b[finite].view(torch.uint8).numpy().tobytes(), name)
    assert l2f == pytest.approx(float(torch.linalg.vector_norm(d_f, dtype=torch.float64)), rel=1e-12)
    assert l1f == pytest.approx(float(d_f.abs().double().sum()), rel=1e-12)
    assert mxf == float(d_f.abs().max())
