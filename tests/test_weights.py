"""Canonical weights: the same dict gives the same layer on every backend."""

from __future__ import annotations

import re

import numpy as np
import pytest

from . import reference as ref
from .tolerances import f64, tolerance

RNG = np.random.default_rng(11)
WEIGHTS = {"W_q": RNG.normal(size=(8, 20)), "W_k": RNG.normal(size=(8, 2)), "w_v": RNG.normal(size=(8,))}
Q, K, V = RNG.normal(size=(2, 3, 20)), RNG.normal(size=(2, 10, 2)), RNG.normal(size=(2, 10, 4))
LENS = np.array([[2, 10, 0], [6, 3, 11]])


def run(bk, layer):
    out = bk.call(layer, *(bk.tensor(a, "float64") for a in (Q, K, V)), bk.tensor(LENS))
    return bk.numpy(out)


@pytest.mark.layers
def test_get_weights_is_canonical(bk):
    got = bk.additive(2, 20, 8).get_weights()
    assert set(got) == {"W_q", "W_k", "w_v"}
    assert {k: v.shape for k, v in got.items()} == {"W_q": (8, 20), "W_k": (8, 2), "w_v": (8,)}
    assert all(isinstance(v, np.ndarray) for v in got.values())


@pytest.mark.layers
def test_set_then_get_is_exact(bk):
    layer = bk.additive(2, 20, 8, dtype="float64", weights=WEIGHTS)
    for key, value in layer.get_weights().items():
        np.testing.assert_array_equal(value, WEIGHTS[key])


@pytest.mark.layers
def test_canonical_weights_mean_the_formula(bk):
    layer = bk.additive(2, 20, 8, dtype="float64", weights=WEIGHTS)
    want = ref.additive_attention(Q, K, V, LENS, WEIGHTS["W_q"], WEIGHTS["W_k"], WEIGHTS["w_v"])[0]
    np.testing.assert_allclose(run(bk, layer), want, **f64(bk))


@pytest.mark.layers
def test_round_trip_between_backends(pair):
    a, b = pair
    source = a.additive(2, 20, 8, dtype="float64")
    target = b.additive(2, 20, 8, dtype="float64", weights=source.get_weights())
    tol = max(tolerance(a.name, "float64"), tolerance(b.name, "float64"))
    np.testing.assert_allclose(run(b, target), run(a, source), rtol=tol, atol=tol)
    back = a.additive(2, 20, 8, dtype="float64", weights=target.get_weights())
    for key, value in back.get_weights().items():
        np.testing.assert_array_equal(value, source.get_weights()[key])


@pytest.mark.layers
def test_get_weights_returns_copies(bk):
    layer = bk.additive(2, 20, 8, dtype="float64", weights=WEIGHTS)
    layer.get_weights()["W_q"][:] = 0
    np.testing.assert_array_equal(layer.get_weights()["W_q"], WEIGHTS["W_q"])


@pytest.mark.layers
def test_set_weights_does_not_alias_the_callers_arrays(bk):
    weights = {k: v.copy() for k, v in WEIGHTS.items()}
    layer = bk.additive(2, 20, 8, dtype="float64", weights=weights)
    weights["W_k"][:] = 0
    np.testing.assert_array_equal(layer.get_weights()["W_k"], WEIGHTS["W_k"])


@pytest.mark.layers
@pytest.mark.parametrize("key, shape", [("W_q", (8, 19)), ("W_k", (2, 8)), ("w_v", (8, 1)), ("w_v", (9,))])
def test_set_weights_shape_mismatch_names_key_and_shapes(bk, key, shape):
    layer = bk.additive(2, 20, 8)
    weights = dict(WEIGHTS, **{key: np.zeros(shape)})
    expected = {"W_q": (8, 20), "W_k": (8, 2), "w_v": (8,)}[key]
    with pytest.raises(
        ValueError, match=re.escape(f"weights[{key!r}] must have shape {expected}, got {shape}")
    ):
        layer.set_weights(weights)


@pytest.mark.layers
def test_set_weights_needs_exactly_the_three_keys(bk):
    layer = bk.additive(2, 20, 8)
    with pytest.raises(ValueError, match=r"missing \['w_v'\], unknown \['bias'\]"):
        layer.set_weights({"W_q": WEIGHTS["W_q"], "W_k": WEIGHTS["W_k"], "bias": 1})


MULTI_HEAD = {
    "W_q": RNG.normal(size=(8, 20)), "W_k": RNG.normal(size=(8, 2)), "W_v": RNG.normal(size=(8, 4)),
    "W_o": RNG.normal(size=(8, 8)), **{f"b_{n}": RNG.normal(size=(8,)) for n in "qkvo"},
}  # fmt: skip
SIZES = dict(query_size=20, key_size=2, value_size=4)


@pytest.mark.layers
def test_multi_head_weights_are_canonical_and_mean_the_formula(bk):
    layer = bk.multi_head(8, 2, bias=True, dtype="float64", weights=MULTI_HEAD, **SIZES)
    got = layer.get_weights()
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in MULTI_HEAD.items()}
    for key, value in got.items():
        np.testing.assert_array_equal(value, MULTI_HEAD[key])
    want = ref.multi_head_attention(Q, K, V, LENS, MULTI_HEAD, 2)[0]
    np.testing.assert_allclose(run(bk, layer), want, **f64(bk))
    assert set(bk.multi_head(8, 2, **SIZES).get_weights()) == {"W_q", "W_k", "W_v", "W_o"}  # no bias


@pytest.mark.layers
def test_multi_head_round_trip_between_backends(pair):
    a, b = pair
    source = a.multi_head(8, 4, bias=True, dtype="float64", **SIZES)
    target = b.multi_head(8, 4, bias=True, dtype="float64", weights=source.get_weights(), **SIZES)
    tol = max(tolerance(a.name, "float64"), tolerance(b.name, "float64"))
    np.testing.assert_allclose(run(b, target), run(a, source), rtol=tol, atol=tol)
