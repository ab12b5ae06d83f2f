"""Bad shapes and dtypes: a ValueError naming the argument, the expected and the actual value."""

from __future__ import annotations

import re

import numpy as np
import pytest

import multiattn


def t(bk, *shape, dtype="float32"):
    return bk.tensor(np.ones(shape), dtype)


def raises(match):
    return pytest.raises(ValueError, match=re.escape(match))


def test_wrong_rank(bk):
    with raises("queries must be 3-D (batch, queries, features), got shape (2, 20)"):
        bk.call(bk.dot(), t(bk, 2, 20), t(bk, 2, 10, 20), t(bk, 2, 10, 4))
    with raises("keys must be 3-D (batch, keys, features), got shape (1, 2, 10, 2)"):
        bk.call(bk.additive(2, 20, 8), t(bk, 2, 1, 20), t(bk, 1, 2, 10, 2), t(bk, 2, 10, 4))


def test_batch_mismatch(bk):
    with raises("keys must have batch size 2 like queries, got shape (3, 10, 2)"):
        bk.call(bk.dot(), t(bk, 2, 1, 2), t(bk, 3, 10, 2), t(bk, 2, 10, 4))
    with raises("values must have batch size 2 like queries, got shape (1, 10, 4)"):
        bk.call(bk.additive(2, 20, 8), t(bk, 2, 1, 20), t(bk, 2, 10, 2), t(bk, 1, 10, 4))


def test_keys_and_values_differ_in_length(bk):
    with raises("values must have 10 rows like keys (one value per key), got shape (2, 9, 4)"):
        bk.call(bk.dot(), t(bk, 2, 1, 2), t(bk, 2, 10, 2), t(bk, 2, 9, 4))


def test_dot_product_widths(bk):
    with raises("keys must have width 3 like queries (dot-product attention), got shape (2, 10, 2)"):
        multiattn.dot_product_attention(t(bk, 2, 1, 3), t(bk, 2, 10, 2), t(bk, 2, 10, 4))


def test_additive_widths_must_match_layer(bk):
    layer = bk.additive(2, 20, 8)
    with raises("queries must have width query_size=20, got shape (2, 1, 19)"):
        bk.call(layer, t(bk, 2, 1, 19), t(bk, 2, 10, 2), t(bk, 2, 10, 4))
    with raises("keys must have width key_size=2, got shape (2, 10, 3)"):
        bk.call(layer, t(bk, 2, 1, 20), t(bk, 2, 10, 3), t(bk, 2, 10, 4))


@pytest.mark.parametrize(
    "lens_shape, shown",
    [((3,), "(3,)"), ((2, 4), "(2, 4)"), ((2, 3, 1), "(2, 3, 1)"), ((), "()")],
)
def test_valid_lens_of_the_wrong_shape(bk, lens_shape, shown):
    lens = bk.tensor(np.ones(lens_shape, dtype="int64"))
    msg = f"valid_lens must have shape (2,) (batch,) or (2, 3) (batch, queries), got {shown}"
    with raises(msg):
        multiattn.masked_softmax(t(bk, 2, 3, 5), lens)
    with raises(msg):
        bk.call(bk.dot(), t(bk, 2, 3, 4), t(bk, 2, 5, 4), t(bk, 2, 5, 1), lens)


def test_valid_lens_must_be_numbers(bk):
    with pytest.raises(ValueError, match="valid_lens must have an integer or float dtype, got .*bool"):
        multiattn.masked_softmax(t(bk, 2, 3, 5), bk.tensor(np.array([True, False])))


def test_masked_softmax_needs_3d_with_lengths(bk):
    with raises("X must be 3-D (batch, queries, keys) or 4-D (batch, heads, queries, keys) when valid_lens is given, got shape (2, 5)"):
        multiattn.masked_softmax(t(bk, 2, 5), bk.tensor(np.array([1, 2])))


def test_scores_must_be_floats(bk):
    with pytest.raises(TypeError, match="X must have a floating dtype"):
        multiattn.masked_softmax(bk.tensor(np.ones((2, 3, 4), dtype="int32")))


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 1.5, "0.1", None])
@pytest.mark.layers
def test_dropout_must_be_a_probability(bk, dropout):
    with raises(f"dropout must be a probability in [0, 1), got {dropout!r}"):
        bk.module.DotProductAttention(dropout)
    with raises(f"dropout must be a probability in [0, 1), got {dropout!r}"):
        bk.module.AdditiveAttention(2, 3, 4, dropout)


@pytest.mark.parametrize(
    "arg, sizes", [("num_hiddens", (2, 3, 0)), ("key_size", (-1, 3, 4)), ("query_size", (2, 2.5, 4))]
)
@pytest.mark.layers
def test_sizes_must_be_positive_integers(bk, arg, sizes):
    with raises(f"{arg} must be a positive integer, got"):
        bk.module.AdditiveAttention(*sizes)


def test_mixed_dtypes_name_each_argument(bk):
    q64 = bk.tensor(np.ones((2, 3, 4)), "float64")
    q32, k32, v32 = (bk.tensor(np.ones(shape), "float32") for shape in ((2, 3, 4), (2, 5, 4), (2, 5, 2)))
    with pytest.raises(multiattn.InputDtypeError) as info:
        bk.module.dot_product_attention(q64, k32, v32)
    assert str(info.value) == (
        "queries, keys and values must share one dtype, got queries float64, keys float32, values float32"
    )
    weights = {"W_q": bk.tensor(np.ones((6, 4)), "float64"), "W_k": bk.tensor(np.ones((6, 4)), "float32")}
    weights["w_v"] = bk.tensor(np.ones(6), "float32")
    with pytest.raises(
        multiattn.InputDtypeError, match=r"W_q must have the dtype of queries \(float32\), got float64"
    ):
        bk.module.additive_attention(q32, k32, v32, **weights)


@pytest.mark.layers
def test_a_layer_computes_in_its_inputs_dtype(bk):
    # the parameters are cast to the inputs' dtype, on every backend (a documented rule)
    from . import reference as ref

    rng = np.random.default_rng(3)
    layer = bk.additive(4, 4, 6, dtype="float32")
    q, k, v = (rng.normal(size=shape) for shape in ((2, 3, 4), (2, 5, 4), (2, 5, 2)))
    out = bk.call(layer, *(bk.tensor(x, "float64") for x in (q, k, v)))
    assert "float64" in str(out.dtype)
    stored = layer.get_weights()
    want = ref.additive_attention(q, k, v, None, stored["W_q"], stored["W_k"], stored["w_v"])[0]
    np.testing.assert_allclose(bk.numpy(out), want, rtol=1e-6, atol=1e-6)


def test_tensors_of_another_framework_name_the_way_out(bk):
    # numpy arrays given to any other backend (torch tensors to numpy's layers: the next test);
    # to numpy, a Python list, which is no framework's tensor
    if bk.name == "numpy":
        with pytest.raises(TypeError) as info:
            bk.module.masked_softmax([[[1.0, 2.0]]])
        assert str(info.value).endswith(
            "got builtins.list; convert it first: multiattn.get_backend('numpy').from_numpy(numpy.asarray(x))"
        )
        return
    X = np.ones((1, 2, 3), dtype=np.float32)
    with pytest.raises(TypeError) as info:
        bk.module.masked_softmax(X)
    message = str(info.value)
    assert message.startswith(f"X must be a {bk.name} tensor for the {bk.name} backend, got a numpy tensor")
    assert "MULTIATTN_BACKEND=numpy or multiattn.backends.numpy" in message
    assert (
        f"multiattn.get_backend('{bk.name}').from_numpy(multiattn.get_backend('numpy').to_numpy(x))"
        in message
    )


@pytest.mark.backend("torch")
def test_torch_tensors_given_to_the_default_numpy_layer():
    import torch

    from multiattn.backends import numpy as m

    layer = m.AdditiveAttention(2, 20, 8)
    for args in (
        (torch.ones(2, 1, 20), torch.ones(2, 10, 2), torch.ones(2, 10, 4)),
        (np.ones((2, 1, 20)), np.ones((2, 10, 2)), np.ones((2, 10, 4)), torch.tensor([2, 6])),
    ):
        with pytest.raises(TypeError, match="MULTIATTN_BACKEND=torch or multiattn.backends.torch") as info:
            layer(*args)
        assert "multiattn.get_backend('numpy').from_numpy(multiattn.get_backend('torch').to_numpy(x))" in str(
            info.value
        )
