"""Gradients on every backend with autodiff, against central finite differences in float64.

The loss is sum(output * G) for a fixed random G; the finite differences are
taken on the independent reference in tests/reference.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from . import reference as ref
from .tolerances import tolerance

MASKS = {"none": None, "1d": np.array([0, 7]), "2d": np.array([[2, 0, 9], [5, -1, 3]])}
SHAPE = dict(B=2, Q=3, K=5, d=4, k=3, v=4, h=4)  # v == d: jax's fused kernel runs too


def _inputs(function):
    rng = np.random.default_rng(21)
    B, Q, K, d, k, v, h = SHAPE.values()
    if function == "masked_softmax":
        return {"X": rng.normal(size=(B, Q, K))}, rng.normal(size=(B, Q, K))
    inputs = {
        "queries": rng.normal(size=(B, Q, d)),
        "keys": rng.normal(size=(B, K, k if function == "additive" else d)),
    }
    inputs["values"] = rng.normal(size=(B, K, v))
    if function == "additive":
        inputs.update(
            W_q=rng.normal(size=(h, d)) * 0.5, W_k=rng.normal(size=(h, k)) * 0.5, w_v=rng.normal(size=(h,))
        )
    return inputs, rng.normal(size=(B, Q, v))


def _reference_fn(function, lens):
    if function == "masked_softmax":
        return lambda X: ref.masked_softmax(X, lens)
    if function == "dot_product":
        return lambda queries, keys, values: ref.dot_product_attention(queries, keys, values, lens)[0]
    return lambda queries, keys, values, W_q, W_k, w_v: ref.additive_attention(
        queries, keys, values, lens, W_q, W_k, w_v
    )[0]


@functools.lru_cache(maxsize=None)
def finite_differences(function, mask):
    inputs, cotangent = _inputs(function)
    fn = _reference_fn(function, MASKS[mask])
    step = 1e-6
    grads = {}
    for name, array in inputs.items():
        grad = np.zeros_like(array)
        for idx in np.ndindex(array.shape):
            for sign in (1, -1):
                shifted = dict(inputs)
                shifted[name] = array.copy()
                shifted[name][idx] += sign * step
                grad[idx] += sign * float(np.sum(fn(**shifted) * cotangent))
        grads[name] = grad / (2 * step)
    return grads


def backend_grads(bk, function, mask, dtype):
    inputs, cotangent = _inputs(function)
    lens = None if MASKS[mask] is None else bk.tensor(MASKS[mask])
    names = list(inputs)
    tensors = [bk.tensor(inputs[n], dtype) for n in names]
    module = bk.module
    if function == "masked_softmax":

        def fn(X):
            return module.masked_softmax(X, lens)

    elif function == "dot_product":

        def fn(q, k, v):
            return module.dot_product_attention(q, k, v, lens)

    else:

        def fn(q, k, v, W_q, W_k, w_v):
            return module.additive_attention(q, k, v, lens, W_q=W_q, W_k=W_k, w_v=w_v)

    _, grads = module.vjp(fn, tensors, bk.tensor(cotangent, dtype))
    return {n: np.asarray(bk.numpy(g), dtype=np.float64) for n, g in zip(names, grads)}


def needs_autodiff(bk):
    if bk.module.vjp is None:
        pytest.xfail(f"{bk.name} has no autodiff")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("function", ["masked_softmax", "dot_product", "additive"])
def test_gradients_match_finite_differences(bk, function, mask, dtype, monkeypatch):
    needs_autodiff(bk)
    if hasattr(bk.module, "FUSED_ON_CPU"):  # the fused kernel's gradients, also on CPU
        monkeypatch.setattr(bk.module, "FUSED_ON_CPU", True)
    monkeypatch.setattr(bk.module.ops, "fused_min_scores", 0)
    got = backend_grads(bk, function, mask, dtype)
    want = finite_differences(function, mask)
    # finite differences are good to ~1e-8; float32 kernels to a few 1e-6
    tol = max(tolerance(bk.name, dtype) * 10, 1e-7)
    for name in want:
        scale = max(1.0, float(np.abs(want[name]).max()))
        err = float(np.abs(got[name] - want[name]).max())
        assert not np.isnan(got[name]).any(), f"NaN in the gradient of {name}"
        assert err <= tol * scale, f"gradient of {name}: max abs error {err:.3g} > {tol * scale:.3g}"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_masked_and_fully_masked_rows_get_exactly_zero_gradient(bk, dtype):
    needs_autodiff(bk)
    if dtype not in bk.dtypes:
        pytest.xfail(f"{bk.name} has no {dtype}")
    rng = np.random.default_rng(8)
    X = bk.tensor(rng.normal(size=(2, 2, 4)) * 100, dtype)
    lens = bk.tensor(np.array([[0, 2], [4, 1]]))
    _, (grad,) = bk.module.vjp(
        lambda x: bk.module.masked_softmax(x, lens), [X], bk.tensor(rng.normal(size=(2, 2, 4)), dtype)
    )
    grad = np.asarray(bk.numpy(grad), dtype=np.float64)
    assert not np.isnan(grad).any()
    assert (grad[0, 0] == 0).all() and (grad[0, 1, 2:] == 0).all() and (grad[1, 1, 1:] == 0).all()
    q = bk.tensor(rng.normal(size=(2, 1, 3)), dtype)
    kv = bk.tensor(rng.normal(size=(2, 4, 3)), dtype)
    fn = lambda q, k, v: bk.module.dot_product_attention(q, k, v, bk.tensor(np.array([0, 4])))  # noqa: E731
    _, grads = bk.module.vjp(fn, [q, kv, kv], bk.tensor(np.ones((2, 1, 3)), dtype))
    for g in grads:
        g = np.asarray(bk.numpy(g), dtype=np.float64)
        assert not np.isnan(g).any()
        assert (g[0] == 0).all(), "a fully masked batch element must get zero gradients"
