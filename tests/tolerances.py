"""Per-dtype tolerances of the matrix, relative to max(1, largest reference magnitude).

The reference is computed from the inputs as rounded to the dtype under test,
so the tolerance covers only the rounding inside the computation.
"""

from __future__ import annotations

import numpy as np

# float32: about 1e-6 as the spine issue asks; half types: a few units of their epsilon.
TOLERANCE = {"float64": 1e-12, "float32": 2e-6, "float16": 4e-3, "bfloat16": 3e-2}
# Backends whose kernels are less accurate than IEEE in a dtype override here.
# MLX's exp/softmax are float32-accurate even for float64 arrays (documented in the README).
BACKEND_TOLERANCE: dict[tuple[str, str], float] = {("mlx", "float64"): 1e-6}


def tolerance(backend: str, dtype: str) -> float:
    return BACKEND_TOLERANCE.get((backend, dtype), TOLERANCE[dtype])


def dtype_name(tensor) -> str:
    """'float32' for torch.float32, numpy's dtype('float32'), tf's <dtype: 'float32'>, ..."""
    text = str(tensor.dtype).rsplit(".", 1)[-1]
    return text.replace("<dtype: '", "").replace("'>", "").lower()


def assert_close(bk, got, want, dtype: str) -> None:
    assert dtype_name(got) == dtype, f"{bk.name}: output dtype {got.dtype}, expected {dtype}"
    got = np.asarray(bk.numpy(got), dtype=np.float64)
    assert got.shape == want.shape, f"{bk.name}: shape {got.shape}, expected {want.shape}"
    assert not np.isnan(got).any(), f"{bk.name}: NaN in the result"
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    err = float(np.abs(got - want).max(initial=0.0))
    tol = tolerance(bk.name, dtype) * scale
    assert err <= tol, f"{bk.name} {dtype}: max abs error {err:.3g} > {tol:.3g}"


def f64(bk) -> dict:
    """assert_allclose keywords for a float64 comparison on this backend."""
    tol = tolerance(bk.name, "float64")
    return {"rtol": tol, "atol": tol}
