"""Gradients on every backend with autodiff, against central finite differences in float64.

The loss is sum(output * G) for a fixed random G; the finite differences are
taken on the independent reference in tests/reference.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from . import reference as ref
from .forcing import force_fused
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


def assert_gradients_close(bk, got, want, dtype):
    # finite differences are good to ~1e-8; float32 kernels to a few 1e-6
    tol = max(tolerance(bk.name, dtype) * 10, 1e-7)
    for name in want:
        scale = max(1.0, float(np.abs(want[name]).max()))
        err = float(np.abs(got[name] - want[name]).max())
        assert not np.isnan(got[name]).any(), f"NaN in the gradient of {name}"
        assert err <= tol * scale, f"gradient of {name}: max abs error {err:.3g} > {tol * scale:.3g}"


def needs_autodiff(bk):
    if bk.module.vjp is None:
        pytest.xfail(f"{bk.name} has no autodiff")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("function", ["masked_softmax", "dot_product", "additive"])
def test_gradients_match_finite_differences(bk, function, mask, dtype, monkeypatch):
    needs_autodiff(bk)
    force_fused(bk, monkeypatch)  # kernels the CPU default skips, and at these sizes
    got = backend_grads(bk, function, mask, dtype)
    want = finite_differences(function, mask)
    assert_gradients_close(bk, got, want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_additive_features_over_the_visible_keys_have_the_gradients(bk, dtype, monkeypatch):
    # lengths [0, 7] of 5 keys: the first sequence makes no features, the second all of them
    from .test_specialisations import READ_ADDITIVE_KEY_LENGTHS, force_additive_visible_keys

    needs_autodiff(bk)
    runs = force_additive_visible_keys(monkeypatch)
    got = backend_grads(bk, "additive", "1d", dtype)
    assert_gradients_close(bk, got, finite_differences("additive", "1d"), dtype)
    if bk.name in READ_ADDITIVE_KEY_LENGTHS:
        assert runs == [[0, 5]], "not run, or the lengths misread"
    else:
        assert runs == []


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


# -- boolean masks, causality and multi-head attention --------------------------------------

_MASK = np.random.default_rng(4).random((2, 3, 5)) < 0.6
_MASK[1, 2] = False  # a fully masked row
MASK_CASES = {
    "bool_mask": dict(attention_mask=_MASK),
    "causal": dict(causal=True),
    "lengths+mask+causal": dict(
        valid_lens=np.array([[2, 0, 9], [5, -1, 3]]), attention_mask=_MASK, causal=True
    ),
}
# and the lengths alone, for the block path's tests
CASES = {"none": {}, "1d": dict(valid_lens=MASKS["1d"]), "2d": dict(valid_lens=MASKS["2d"]), **MASK_CASES}
MULTI_HEAD = dict(heads=2, h=4)


def _masked_inputs(function):
    if function != "multi_head":
        return _inputs(function)
    rng = np.random.default_rng(22)
    B, Q, K, d, k, v, _ = SHAPE.values()
    h = MULTI_HEAD["h"]
    inputs = {
        "queries": rng.normal(size=(B, Q, d)),
        "keys": rng.normal(size=(B, K, k)),
        "values": rng.normal(size=(B, K, v)),
    }
    for name, width in (("W_q", d), ("W_k", k), ("W_v", v), ("W_o", h)):
        inputs[name] = rng.normal(size=(h, width)) * 0.5
    return inputs, rng.normal(size=(B, Q, h))


def _masked_reference(function, masks):
    masks = dict(masks)
    lens = masks.pop("valid_lens", None)
    if function == "masked_softmax":
        return lambda X: ref.masked_softmax(X, lens, **masks)
    if function == "dot_product":
        return lambda queries, keys, values: ref.dot_product_attention(queries, keys, values, lens, **masks)[
            0
        ]
    if function == "additive":
        return lambda queries, keys, values, W_q, W_k, w_v: ref.additive_attention(
            queries, keys, values, lens, W_q, W_k, w_v, **masks
        )[0]
    return lambda queries, keys, values, **weights: ref.multi_head_attention(
        queries, keys, values, lens, weights, MULTI_HEAD["heads"], **masks
    )[0]


def central_differences(fn, inputs: dict, cotangent, step: float = 1e-6) -> dict:
    """The gradients of sum(fn(**inputs) * cotangent) by central differences, per input."""
    grads = {}
    for name, array in inputs.items():
        grad = np.zeros_like(array)
        for idx in np.ndindex(array.shape):
            for sign in (1, -1):
                shifted = dict(inputs, **{name: array.copy()})
                shifted[name][idx] += sign * step
                grad[idx] += sign * float(np.sum(fn(**shifted) * cotangent))
        grads[name] = grad / (2 * step)
    return grads


@functools.lru_cache(maxsize=None)
def masked_finite_differences(function, case):
    inputs, cotangent = _masked_inputs(function)
    return central_differences(_masked_reference(function, CASES[case]), inputs, cotangent)


def masked_backend_grads(bk, function, case, dtype):
    inputs, cotangent = _masked_inputs(function)
    masks = dict(CASES[case])
    lens = masks.pop("valid_lens", None)
    lens = None if lens is None else bk.tensor(lens)
    if "attention_mask" in masks:
        masks["attention_mask"] = bk.tensor(masks["attention_mask"])
    names = list(inputs)
    module = bk.module
    fns = {
        "masked_softmax": lambda X: module.masked_softmax(X, lens, **masks),
        "dot_product": lambda q, k, v: module.dot_product_attention(q, k, v, lens, **masks),
        "additive": lambda q, k, v, W_q, W_k, w_v: module.additive_attention(
            q, k, v, lens, W_q=W_q, W_k=W_k, w_v=w_v, **masks
        ),
        "multi_head": lambda q, k, v, *weights: module.multi_head_attention(
            q, k, v, lens, weights=dict(zip(names[3:], weights)), num_heads=MULTI_HEAD["heads"], **masks
        ),
    }
    tensors = [bk.tensor(inputs[n], dtype) for n in names]
    _, grads = module.vjp(fns[function], tensors, bk.tensor(cotangent, dtype))
    return {n: np.asarray(bk.numpy(g), dtype=np.float64) for n, g in zip(names, grads)}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(MASK_CASES))
@pytest.mark.parametrize("function", ["masked_softmax", "dot_product", "additive", "multi_head"])
def test_gradients_with_masks_match_finite_differences(bk, function, case, dtype, monkeypatch):
    needs_autodiff(bk)
    force_fused(bk, monkeypatch)  # kernels the CPU default skips, and at these sizes
    got = masked_backend_grads(bk, function, case, dtype)
    want = masked_finite_differences(function, case)
    assert_gradients_close(bk, got, want, dtype)


# -- attention in blocks (multiattn.blockwise): its own backward, through each framework ------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("block_size", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("function", ["dot_product", "additive", "multi_head"])
def test_gradients_in_blocks_match_finite_differences(bk, function, case, block_size, dtype, monkeypatch):
    """The block path forced (the core's own, no framework kernel), its gradients against the
    reference's finite differences: masks, fully masked rows, causality."""
    from .forcing import force_blocks

    needs_autodiff(bk)
    calls = force_blocks(monkeypatch, block_size)
    got = masked_backend_grads(bk, function, case, dtype)
    assert calls, "the call did not run in blocks"
    assert_gradients_close(bk, got, masked_finite_differences(function, case), dtype)


def test_dot_product_in_blocks_has_its_own_gradient(bk):
    """Every backend with autodiff registers the blocks' backward through its framework's own
    mechanism (``Ops.custom_gradient``): the framework's differentiation of the loop would keep
    every block of scores alive for the backward pass."""
    from multiattn.protocol import Primitives

    needs_autodiff(bk)
    assert type(bk.module.ops).custom_gradient is not Primitives.custom_gradient


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("path", ["materialised", "blocks"])
def test_rows_whose_visible_scores_are_all_minus_inf_get_zero_gradients(bk, path, dtype, monkeypatch):
    """A score_mod making every score of query row 1 -inf, lengths [0, 7] hiding the first
    sequence: the row rule (weights 0) and its gradients, which are those of the reference
    with row 1 hidden by a mask, finite everywhere (never NaN from -inf scores); eagerly and
    under the framework's compiler (jax.jit, tf.function, mx.compile), where nothing is read
    back to the host."""
    from multiattn import mods

    from .forcing import force_blocks
    from .test_mods import _jitted

    needs_autodiff(bk)
    calls = force_blocks(monkeypatch, 2) if path == "blocks" else None
    inputs, cotangent = _inputs("dot_product")
    lens = MASKS["1d"]
    hidden = np.ones((2, 3, 5), bool)
    hidden[:, 1] = False
    minus_inf = lambda s, b, h, i, j: mods.where(i == 1, -np.inf, s)  # noqa: E731
    hidden_row = lambda **x: ref.dot_product_attention(**x, valid_lens=lens, attention_mask=hidden)[0]  # noqa: E731
    want = central_differences(hidden_row, inputs, cotangent)
    tensors = [bk.tensor(inputs[n], dtype) for n in ("queries", "keys", "values")]

    def gradients(q, k, v, lens_t, cotangent_t):
        attend = lambda q, k, v: bk.module.dot_product_attention(q, k, v, lens_t, score_mod=minus_inf)  # noqa: E731
        return bk.module.vjp(attend, [q, k, v], cotangent_t)

    for run in (gradients, _jitted(bk, gradients)):
        if run is None:
            continue
        out, grads = run(*tensors, bk.tensor(lens), bk.tensor(cotangent, dtype))
        assert calls is None or calls, "the call did not run in blocks"
        out = np.asarray(bk.numpy(out), dtype=np.float64)
        assert (out[:, 1] == 0).all() and np.isfinite(out).all()
        got = {n: np.asarray(bk.numpy(g), dtype=np.float64) for n, g in zip(inputs, grads)}
        assert all(np.isfinite(g).all() for g in got.values()), "NaN or inf in the gradients"
        assert (got["queries"][:, 1] == 0).all()
        assert_gradients_close(bk, got, want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("path", ["materialised", "kernels", "blocks"])
def test_keys_holding_minus_inf_hide_themselves_with_finite_gradients(bk, path, dtype, monkeypatch):
    """Positive queries and keys holding -inf: those keys' scores are -inf, so they are hidden
    (all of the first sequence's, one key of the second's), the output is the reference's with
    them masked, and so are dQ, dK, dV: finite, 0 for the rows and keys hidden (0 * -inf in
    dS K must not make NaN); eagerly and under the framework's compiler; the framework's
    fused kernels offered at every size too (they decline such keys where they would NaN)."""
    from .forcing import force_blocks
    from .test_mods import _jitted

    needs_autodiff(bk)
    if path == "kernels":
        if bk.name in ("jax", "mlx"):  # their kernels are off on the CPU unless forced, as here
            pytest.xfail(f"{bk.name}'s fused kernel gives a row whose keys all hold -inf NaN (issue 49 note)")
        force_fused(bk, monkeypatch)
    calls = force_blocks(monkeypatch, 2) if path == "blocks" else None
    inputs, cotangent = _inputs("dot_product")
    inputs["queries"] = np.abs(inputs["queries"]) + 0.1
    visible = np.ones((2, 3, 5), bool)
    visible[0], visible[1, :, 2] = False, False
    want = central_differences(
        lambda **x: ref.dot_product_attention(**x, attention_mask=visible)[0], inputs, cotangent
    )
    keys = inputs["keys"].copy()
    keys[0, :, 0], keys[1, 2, 0] = -np.inf, -np.inf
    tensors = [bk.tensor(x, dtype) for x in (inputs["queries"], keys, inputs["values"])]

    def gradients(q, k, v, cotangent_t):
        return bk.module.vjp(bk.module.dot_product_attention, [q, k, v], cotangent_t)

    for run in (gradients, _jitted(bk, gradients)):
        if run is None:
            continue
        out, grads = run(*tensors, bk.tensor(cotangent, dtype))
        assert calls is None or calls, "the call did not run in blocks"
        out = np.asarray(bk.numpy(out), dtype=np.float64)
        assert (out[0] == 0).all() and np.isfinite(out).all()
        got = {n: np.asarray(bk.numpy(g), dtype=np.float64) for n, g in zip(inputs, grads)}
        assert all(np.isfinite(g).all() for g in got.values()), "NaN or inf in the gradients"
        # 0, or a denormal where the framework's exp(-inf) gives one (paddle's)
        assert all(np.abs(g[0]).max() < 1e-30 for g in got.values())
        assert_gradients_close(bk, got, want, dtype)
