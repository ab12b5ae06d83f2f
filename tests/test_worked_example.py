"""The worked example of both source documents, on every backend.

All keys are equal, so the weights are uniform over the valid positions and
the outputs are fixed whatever the random queries and weights are.
"""

from __future__ import annotations

import numpy as np

EXPECTED = np.array([[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]])


def example(bk, query_size):
    rng = np.random.default_rng(0)
    queries = bk.tensor(rng.normal(0, 1, (2, 1, query_size)), "float32")
    keys = bk.tensor(np.ones((2, 10, 2)), "float32")
    values = bk.tensor(np.repeat(np.arange(40, dtype=np.float32).reshape(1, 10, 4), 2, axis=0))
    valid_lens = bk.tensor(np.array([2, 6]))
    return queries, keys, values, valid_lens


def check_layer(bk, layer, args):
    out = bk.numpy(bk.call(layer, *args))
    assert out.shape == (2, 1, 4)
    np.testing.assert_allclose(out, EXPECTED, rtol=1e-5)
    weights = bk.numpy(layer.attention_weights)
    assert weights.shape == (2, 1, 10)
    np.testing.assert_allclose(weights[0, 0], [0.5] * 2 + [0] * 8, rtol=1e-6)
    np.testing.assert_allclose(weights[1, 0], [1 / 6] * 6 + [0] * 4, rtol=1e-6)
    # reshaped for d2l.show_heatmaps as in the books
    assert weights.reshape(1, 1, 2, 10).shape == (1, 1, 2, 10)


def test_additive_attention_example(bk):
    layer = bk.additive(key_size=2, query_size=20, num_hiddens=8, dropout=0.1)
    check_layer(bk, layer, example(bk, 20))


def test_dot_product_attention_example(bk):
    check_layer(bk, bk.dot(dropout=0.5), example(bk, 2))


def test_masked_softmax_examples_of_the_mlx_seed(bk):
    import multiattn

    rng = np.random.default_rng(0)
    got = bk.numpy(
        multiattn.masked_softmax(
            bk.tensor(rng.uniform(size=(2, 2, 4)), "float32"), bk.tensor(np.array([2, 3]))
        )
    )
    assert got.shape == (2, 2, 4)
    assert (got[0, :, 2:] == 0).all() and (got[1, :, 3:] == 0).all()
    np.testing.assert_allclose(got.sum(-1), np.ones((2, 2)), rtol=1e-6)
    got = bk.numpy(
        multiattn.masked_softmax(
            bk.tensor(rng.uniform(size=(2, 2, 4)), "float32"), bk.tensor(np.array([[1, 3], [2, 4]]))
        )
    )
    np.testing.assert_array_equal(got[0, 0], [1, 0, 0, 0])
    assert [np.count_nonzero(r) for r in got.reshape(4, 4)] == [1, 3, 2, 4]
