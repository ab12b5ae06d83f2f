"""One test per row of the semantics table in the README, on every backend."""

from __future__ import annotations

import numpy as np
import pytest

import multiattn

from . import reference as ref
from .tolerances import assert_close, dtype_name, f64

X_NP = np.random.default_rng(0).normal(size=(2, 3, 5)) * 4


def test_no_lengths_is_plain_softmax(bk):
    got = bk.numpy(multiattn.masked_softmax(bk.tensor(X_NP, "float64")))
    e = np.exp(X_NP - X_NP.max(-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), **f64(bk))


def test_1d_lengths_apply_to_every_query_row(bk):
    got = bk.numpy(multiattn.masked_softmax(bk.tensor(X_NP, "float64"), bk.tensor(np.array([2, 4]))))
    for b, n in enumerate([2, 4]):
        for i in range(3):
            assert np.count_nonzero(got[b, i]) == n
            np.testing.assert_allclose(got[b, i, :n], ref.softmax_row(X_NP[b, i, :n]), **f64(bk))


def test_2d_lengths_apply_per_query_row(bk):
    lens = np.array([[1, 3, 5], [2, 0, 4]])
    got = bk.numpy(multiattn.masked_softmax(bk.tensor(X_NP, "float64"), bk.tensor(lens)))
    for b in range(2):
        for i in range(3):
            n = lens[b, i]
            assert np.count_nonzero(got[b, i]) == n
            assert np.all(got[b, i, n:] == 0.0)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_masked_positions_exactly_zero_and_empty_rows_zero_not_nan(bk, dtype):
    if dtype not in bk.dtypes:
        pytest.xfail(f"{bk.name} has no {dtype}")
    # large scores: a -1e6 fill would overflow float16; ours must not
    X = bk.tensor(X_NP * 1000, dtype)
    got = np.asarray(
        bk.numpy(multiattn.masked_softmax(X, bk.tensor(np.array([[0, 2, 5], [1, 0, 3]])))), float
    )
    assert not np.isnan(got).any()
    assert np.all(got[0, 0] == 0) and np.all(got[1, 1] == 0)
    assert np.all(got[0, 1, 2:] == 0) and np.all(got[1, 0, 1:] == 0) and np.all(got[1, 2, 3:] == 0)
    np.testing.assert_allclose(got[0, 2].sum(), 1.0, rtol=1e-2)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_fully_masked_rows_give_zero_output(bk, dtype):
    if dtype not in bk.dtypes:
        pytest.xfail(f"{bk.name} has no {dtype}")
    rng = np.random.default_rng(5)
    q, k, v = (bk.tensor(rng.normal(size=s), dtype) for s in [(2, 2, 4), (2, 3, 4), (2, 3, 2)])
    out = bk.call(bk.dot(), q, k, v, bk.tensor(np.array([0, 3])))
    out = np.asarray(bk.numpy(out), float)
    assert np.all(out[0] == 0) and not np.isnan(out).any()
    assert np.abs(out[1]).sum() > 0


def test_lengths_are_clipped(bk):
    X = bk.tensor(X_NP, "float64")
    over = bk.numpy(multiattn.masked_softmax(X, bk.tensor(np.array([50, 5]))))
    plain = bk.numpy(multiattn.masked_softmax(X))
    np.testing.assert_allclose(over, plain, **f64(bk))
    under = bk.numpy(multiattn.masked_softmax(X, bk.tensor(np.array([[-1, -7, 0], [-2, 0, -100]]))))
    assert np.all(under == 0)


@pytest.mark.parametrize("lens_dtype", ["int32", "int64", "uint8", "float32", "float64"])
def test_any_integer_or_float_length_dtype(bk, lens_dtype):
    lens = np.array([[1, 3, 5], [2, 0, 4]])
    got = bk.numpy(multiattn.masked_softmax(bk.tensor(X_NP, "float64"), bk.tensor(lens.astype(lens_dtype))))
    np.testing.assert_allclose(got, ref.masked_softmax(X_NP, lens), **f64(bk))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("lens", [[2.5, 0.5], [-0.5, 9.1], [[2.5, 0.5, 7.2], [-0.5, 4.0, 1.0]]])
def test_fractional_negative_and_long_float_lengths(bk, dtype, lens):
    # positions j < length are visible; the dtypes where adapters take their fast paths too
    lens = np.array(lens)
    weights = multiattn.masked_softmax(bk.tensor(X_NP, dtype), bk.tensor(lens.astype("float32")))
    assert_close(bk, weights, ref.masked_softmax(X_NP, lens), dtype)
    got = np.asarray(bk.numpy(weights))
    counts = np.clip(np.ceil(lens), 0, 5).astype(int)
    assert (np.count_nonzero(got, axis=-1) == (counts[:, None] if counts.ndim == 1 else counts)).all()


def test_float_lengths_compare_like_d2l(bk):
    # arange(K) < 2.5 keeps positions 0, 1, 2
    got = bk.numpy(multiattn.masked_softmax(bk.tensor(X_NP, "float64"), bk.tensor(np.array([2.5, 0.5]))))
    assert [np.count_nonzero(got[0, 0]), np.count_nonzero(got[1, 0])] == [3, 1]


# (queries, keys): small, and large enough for every fast path that writes into the core's
# own tensors (slices, softmax into the scores, fused kernels: torch's thresholds)
@pytest.mark.parametrize("n_queries, n_keys", [(3, 5), (200, 200)])
def test_inputs_never_modified(bk, n_queries, n_keys):
    rng = np.random.default_rng(9)
    arrays = [rng.normal(size=s) for s in [(2, n_queries, 4), (2, n_keys, 4), (2, n_keys, 2)]]
    q, k, v = (bk.tensor(a, "float32") for a in arrays)
    scores = rng.normal(size=(2, n_queries, n_keys))
    lens = bk.tensor(np.array([2, 0]))
    X = bk.tensor(scores, "float32")
    multiattn.masked_softmax(X, lens)
    multiattn.masked_softmax(X)
    multiattn.dot_product_attention(q, k, v, lens)  # no weights: the fused kernel if any
    side = max(n_keys // 4, 2)  # blocks: their weights take their scores' memory
    multiattn.dot_product_attention(q, k, v, causal=True, block_size=side)
    multiattn.dot_product_attention(q, k, v, block_size=side, score_mod=lambda s, b, h, i, j: s)
    bk.call(bk.dot(), q, k, v, lens)
    bk.call(bk.additive(4, 4, 3), q, k, v, lens)
    for tensor, array in zip((q, k, v, X), arrays + [scores]):
        np.testing.assert_array_equal(bk.numpy(tensor), array.astype("float32"))
    np.testing.assert_array_equal(bk.numpy(lens), [2, 0])


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_output_dtype_is_input_dtype(bk, dtype):
    if dtype not in bk.dtypes:
        pytest.xfail(f"{bk.name} has no {dtype}")
    rng = np.random.default_rng(2)
    q, k, v = (bk.tensor(rng.normal(size=s), dtype) for s in [(1, 2, 3), (1, 4, 3), (1, 4, 2)])
    lens = bk.tensor(np.array([3]))
    assert dtype_name(multiattn.masked_softmax(q, lens)) == dtype
    assert dtype_name(bk.call(bk.dot(), q, k, v, lens)) == dtype
    assert dtype_name(bk.call(bk.additive(3, 3, 4, dtype=dtype), q, k, v, lens)) == dtype


def test_dot_product_is_scaled_by_sqrt_of_query_width(bk):
    # one query, two keys: weights are softmax([q.k1, q.k2] / sqrt(d))
    q = np.full((1, 1, 9), 1.0)
    k = np.stack([np.zeros(9), np.full(9, 0.5)])[None]
    v = np.eye(2)[None]
    layer = bk.dot()
    bk.call(layer, bk.tensor(q, "float64"), bk.tensor(k, "float64"), bk.tensor(v, "float64"))
    expected = ref.softmax_row(np.array([0.0, 4.5 / 3.0]))
    np.testing.assert_allclose(bk.numpy(layer.attention_weights)[0, 0], expected, **f64(bk))


@pytest.mark.layers
def test_attention_weights_are_before_dropout(bk):
    rng = np.random.default_rng(4)
    q, k, v = (bk.tensor(rng.normal(size=s), "float32") for s in [(2, 3, 4), (2, 6, 4), (2, 6, 2)])
    lens = np.array([4, 6])
    layer = bk.train(bk.module.DotProductAttention(0.5))
    bk.call(layer, q, k, v, bk.tensor(lens))
    want = ref.dot_product_attention(bk.numpy(q), bk.numpy(k), bk.numpy(v), lens)[1]
    assert_close(bk, layer.attention_weights, want, "float32")
