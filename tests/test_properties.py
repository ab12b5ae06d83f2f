"""Property-based tests (hypothesis) on every backend under test.

Random shapes, lengths and values; the weights are a distribution over the
valid positions and exactly 0 elsewhere, the output equals the float64
reference, inputs are untouched, and permuting key/value pairs together
permutes the weights and leaves the output unchanged.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multiattn

from . import reference as ref
from .tolerances import tolerance

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@st.composite
def problems(draw):
    B, Q, K, d, v = (draw(st.integers(1, n)) for n in (3, 4, 6, 5, 3))
    lens_kind = draw(st.sampled_from(["none", "1d", "2d"]))
    lens_shape = {"none": None, "1d": (B,), "2d": (B, Q)}[lens_kind]
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 10.0]))
    rng = np.random.default_rng(seed)
    arrays = [rng.normal(size=s) * scale for s in ((B, Q, d), (B, K, d), (B, K, v))]
    lens = None if lens_shape is None else rng.integers(-2, K + 3, size=lens_shape)
    return arrays, lens


def _valid(lens, B, Q, K):
    if lens is None:
        return np.full((B, Q), K)
    lens = np.broadcast_to(lens[:, None], (B, Q)) if lens.ndim == 1 else lens
    return np.clip(lens, 0, K)


@SETTINGS
@given(problem=problems())
def test_weights_are_a_distribution_over_valid_positions(bk, problem):
    (q, k, v), lens = problem
    B, Q, K = q.shape[0], q.shape[1], k.shape[1]
    tensors = [bk.tensor(a, "float64") for a in (q, k, v)]
    out, weights = multiattn.dot_product_attention(
        *tensors, None if lens is None else bk.tensor(lens), return_weights=True
    )
    weights = bk.numpy(weights)
    tol = tolerance(bk.name, "float64") * 10
    n_valid = _valid(lens, B, Q, K)
    assert (weights >= 0).all()
    for b in range(B):
        for i in range(Q):
            n = n_valid[b, i]
            assert (weights[b, i, n:] == 0).all()
            assert abs(weights[b, i].sum() - (1.0 if n else 0.0)) <= tol
    want_out, want_weights = ref.dot_product_attention(q, k, v, lens)
    np.testing.assert_allclose(bk.numpy(out), want_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(weights, want_weights, rtol=tol, atol=tol)
    for tensor, array in zip(tensors, (q, k, v)):  # inputs unchanged
        np.testing.assert_array_equal(bk.numpy(tensor), array)


@SETTINGS
@given(problem=problems(), data=st.data())
def test_permuting_key_value_pairs_permutes_the_weights(bk, problem, data):
    (q, k, v), _ = problem
    K = k.shape[1]
    perm = np.array(data.draw(st.permutations(range(K))))
    lens = np.full(q.shape[0], K)  # lengths cover every key, so any order is valid
    run = multiattn.dot_product_attention
    out, weights = run(*(bk.tensor(a, "float64") for a in (q, k, v)), bk.tensor(lens), return_weights=True)
    out_p, weights_p = run(
        *(bk.tensor(a, "float64") for a in (q, k[:, perm], v[:, perm])), bk.tensor(lens), return_weights=True
    )
    tol = tolerance(bk.name, "float64") * 10
    np.testing.assert_allclose(bk.numpy(out_p), bk.numpy(out), rtol=tol, atol=tol)
    np.testing.assert_allclose(bk.numpy(weights_p), bk.numpy(weights)[:, :, perm], rtol=tol, atol=tol)


@SETTINGS
@given(problem=problems())
def test_masked_softmax_matches_the_reference(bk, problem):
    (q, k, _), lens = problem
    X = np.einsum("bqd,bkd->bqk", q, k)
    got = bk.numpy(
        multiattn.masked_softmax(bk.tensor(X, "float64"), None if lens is None else bk.tensor(lens))
    )
    tol = tolerance(bk.name, "float64") * 10
    np.testing.assert_allclose(got, ref.masked_softmax(X, lens), rtol=tol, atol=tol)


@st.composite
def masked_problems(draw):
    """A problem with any of: lengths, a boolean mask of any broadcastable shape, causality."""
    (q, k, v), lens = draw(problems())
    B, Q, K = q.shape[0], q.shape[1], k.shape[1]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mask_shape = draw(st.sampled_from([None, (B, Q, K), (Q, K), (B, 1, K), (K,), (1, Q, 1)]))
    mask = None if mask_shape is None else rng.random(mask_shape) < draw(st.sampled_from([0.2, 0.6, 1.0]))
    return (q, k, v), dict(valid_lens=lens, attention_mask=mask, causal=draw(st.booleans()))


def _visible(masks, B, Q, K):
    """The AND of the masks, spelled out: what the documentation promises."""
    visible = np.ones((B, Q, K), dtype=bool)
    n_valid = _valid(masks["valid_lens"], B, Q, K)
    visible &= np.arange(K)[None, None, :] < n_valid[:, :, None]
    if masks["attention_mask"] is not None:
        visible &= masks["attention_mask"]
    if masks["causal"]:
        visible &= np.arange(K)[None, :] <= np.arange(Q)[:, None]
    return visible


@SETTINGS
@given(problem=masked_problems())
def test_masks_combine_with_and_and_equal_one_boolean_mask(bk, problem):
    """Lengths, mask and causality give the weights of the one mask that is their AND: a
    distribution over the visible keys, exactly 0 elsewhere and in rows with none visible."""
    (q, k, v), masks = problem
    B, Q, K = q.shape[0], q.shape[1], k.shape[1]
    tensors = [bk.tensor(a, "float64") for a in (q, k, v)]
    given_masks = dict(
        attention_mask=None if masks["attention_mask"] is None else bk.tensor(masks["attention_mask"]),
        causal=masks["causal"],
    )
    lens = None if masks["valid_lens"] is None else bk.tensor(masks["valid_lens"])
    out, weights = multiattn.dot_product_attention(*tensors, lens, return_weights=True, **given_masks)
    visible = _visible(masks, B, Q, K)
    one_out, one_weights = multiattn.dot_product_attention(
        *tensors, attention_mask=bk.tensor(visible), return_weights=True
    )
    weights = bk.numpy(weights)
    tol = tolerance(bk.name, "float64") * 10
    assert (weights[~visible] == 0).all() and (weights >= 0).all()
    sums = weights.sum(-1)
    np.testing.assert_allclose(sums, visible.any(-1).astype(float), atol=tol)
    np.testing.assert_allclose(weights, bk.numpy(one_weights), rtol=tol, atol=tol)
    np.testing.assert_allclose(bk.numpy(out), bk.numpy(one_out), rtol=tol, atol=tol)
    assert (bk.numpy(out)[~visible.any(-1)] == 0).all()  # rows with nothing visible: exactly 0
