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
    four_d = "or 4-D (batch, heads, queries, features), "
    with raises(f"queries must be 3-D (batch, queries, features) {four_d}got shape (2, 20)"):
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
    with raises(
        "X must be 3-D (batch, queries, keys) or 4-D (batch, heads, queries, keys) when valid_lens is "
        "given, got shape (2, 5)"
    ):
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


# -- masks and multi-head attention ---------------------------------------------------------


def _mh_weights(bk, h=8, widths=(5, 3, 4), dtype="float32", **changes):
    shapes = {"W_q": (h, widths[0]), "W_k": (h, widths[1]), "W_v": (h, widths[2]), "W_o": (h, h)}
    shapes.update(changes)
    return {name: bk.tensor(np.ones(shape) * 0.1, dtype) for name, shape in shapes.items() if shape}


def _mh_inputs(bk, dtype="float32"):
    return t(bk, 2, 3, 5, dtype=dtype), t(bk, 2, 4, 3, dtype=dtype), t(bk, 2, 4, 4, dtype=dtype)


def test_num_heads_must_divide_num_hiddens(bk):
    message = (
        "num_hiddens (8) must be divisible by num_heads (3): each head takes num_hiddens / num_heads columns"
    )
    with raises(message):
        bk.module.multi_head_attention(*_mh_inputs(bk), weights=_mh_weights(bk), num_heads=3)
    with raises("num_heads must be a positive integer, got 0"):
        bk.module.multi_head_attention(*_mh_inputs(bk), weights=_mh_weights(bk), num_heads=0)
    if bk.has_layers:
        with raises(message):
            bk.module.MultiHeadAttention(8, 3)
        with raises("value_size must be a positive integer, got 0"):
            bk.module.MultiHeadAttention(8, 2, value_size=0)


def test_a_float_mask_is_refused(bk):
    q, k, v = t(bk, 2, 3, 4), t(bk, 2, 5, 4), t(bk, 2, 5, 2)
    mask = t(bk, 2, 3, 5)
    message = "attention_mask must be boolean (True: may attend) or integer 0/1, got dtype float32"
    for call in (
        lambda: multiattn.masked_softmax(t(bk, 2, 3, 5), attention_mask=mask),
        lambda: multiattn.dot_product_attention(q, k, v, attention_mask=mask),
        lambda: bk.module.multi_head_attention(
            *_mh_inputs(bk), weights=_mh_weights(bk), num_heads=2, attention_mask=mask
        ),
    ):
        with pytest.raises(multiattn.InputDtypeError, match=re.escape(message)):
            call()


def test_a_mask_that_does_not_broadcast_names_both_shapes(bk):
    q, k, v = t(bk, 2, 3, 4), t(bk, 2, 5, 4), t(bk, 2, 5, 2)
    mask = bk.tensor(np.ones((2, 4), dtype=bool))
    with raises(
        "attention_mask of shape (2, 4) does not broadcast to the scores' shape (2, 3, 5) "
        "(batch, queries, keys)"
    ):
        bk.call(bk.dot(), q, k, v, attention_mask=mask)
    with raises("attention_mask of shape (2, 4) does not broadcast to the scores' shape (2, 3, 5)"):
        multiattn.masked_softmax(t(bk, 2, 3, 5), attention_mask=mask)
    head_mask = bk.tensor(np.ones((2, 3, 3, 4), dtype=bool))  # 3 heads, the layer has 2
    with raises(
        "attention_mask of shape (2, 3, 3, 4) does not broadcast to the scores' shape (2, 2, 3, 4) "
        "(batch, heads, queries, keys)"
    ):
        bk.module.multi_head_attention(
            *_mh_inputs(bk), weights=_mh_weights(bk), num_heads=2, attention_mask=head_mask
        )


def test_causal_must_be_a_bool(bk):
    with pytest.raises(TypeError, match=re.escape("causal must be True or False, got 'yes'")):
        multiattn.masked_softmax(t(bk, 2, 3, 5), causal="yes")


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"W_o": None},
            "weights must have exactly the keys W_q, W_k, W_v, W_o; missing ['W_o'], unknown none",
        ),
        (
            {"W_x": (8, 8)},
            "weights must have exactly the keys W_q, W_k, W_v, W_o; missing none, unknown ['W_x']",
        ),
        ({"b_q": (8,)}, "weights must have exactly the keys W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o; missing"),
        ({"W_k": (8, 4)}, "weights['W_k'] must have shape (8, 3), got (8, 4)"),
        ({"W_o": (8, 4)}, "weights['W_o'] must have shape (8, 8), got (8, 4)"),
    ],
)
def test_multi_head_weights_name_the_bad_key(bk, changes, message):
    with raises(message):
        bk.module.multi_head_attention(*_mh_inputs(bk), weights=_mh_weights(bk, **changes), num_heads=2)


def test_multi_head_weights_in_another_dtype(bk):
    if "float64" not in bk.dtypes:
        pytest.xfail(f"{bk.name} has no float64")
    weights = _mh_weights(bk)
    weights["W_v"] = bk.tensor(np.ones((8, 4)), "float64")
    with pytest.raises(
        multiattn.InputDtypeError,
        match=re.escape("weights['W_v'] must have the dtype of queries (float32), got float64"),
    ):
        bk.module.multi_head_attention(*_mh_inputs(bk), weights=weights, num_heads=2)


@pytest.mark.layers
def test_multi_head_layer_weights_name_the_bad_key(bk):
    layer = bk.module.MultiHeadAttention(8, 2, query_size=5, key_size=3, value_size=4)
    good = {
        name: np.ones(shape)
        for name, shape in {"W_q": (8, 5), "W_k": (8, 3), "W_v": (8, 4), "W_o": (8, 8)}.items()
    }
    with raises("weights['W_v'] must have shape (8, 4), got (4, 8)"):
        layer.set_weights(dict(good, W_v=np.ones((4, 8))))
    with raises("weights must have exactly the keys W_q, W_k, W_v, W_o; missing none, unknown ['b_q']"):
        layer.set_weights(dict(good, b_q=np.ones(8)))
    with raises("queries must have width query_size=5, got shape (2, 3, 4)"):
        bk.call(layer, t(bk, 2, 3, 4), t(bk, 2, 4, 3), t(bk, 2, 4, 4))
    with raises("values must have width value_size=4, got shape (2, 4, 3)"):
        bk.call(layer, t(bk, 2, 3, 5), t(bk, 2, 4, 3), t(bk, 2, 4, 3))
