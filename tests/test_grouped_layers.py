"""Grouped-query attention in every framework's MultiHeadAttention (``num_kv_heads``) and its
converters: the weights' shapes, the outputs against the functional API and against plain
multi-head attention with each key/value head repeated for its query heads, Keras' config and
model files keeping num_kv_heads (copies and each framework's save/load: test_saving.py), bad
values refused, and the native layers:
Keras' GroupQueryAttention and flax's nnx.MultiHeadAttention(num_kv_heads=...) both ways, the
layers without grouped-query attention (torch, paddle, mlx, Keras' MultiHeadAttention) refusing.
"""

from __future__ import annotations

import numpy as np
import pytest

import multiattn
from multiattn.layers import converters

from .harness import harness
from .tolerances import tolerance

pytestmark = pytest.mark.layers

RNG = np.random.default_rng(23)
B, Q, K = 2, 3, 5
HIDDENS, HEADS, HEAD_DIM = 8, 4, 2
SIZES = dict(query_size=5, key_size=6, value_size=7)
QUERIES, KEYS, VALUES = (RNG.normal(size=(B, n, w)) for n, w in ((Q, 5), (K, 6), (K, 7)))
LENS = np.array([2, 5])
KV_HEADS = [2, 1]


def _weights(kv_heads, bias=True, query_size=5, key_size=6, value_size=7, rng=RNG):
    kv = kv_heads * HEAD_DIM
    shapes = {"W_q": (HIDDENS, query_size), "W_k": (kv, key_size), "W_v": (kv, value_size)}
    shapes["W_o"] = (HIDDENS, HIDDENS)
    if bias:
        shapes.update({"b_q": (HIDDENS,), "b_k": (kv,), "b_v": (kv,), "b_o": (HIDDENS,)})
    return {name: rng.uniform(-0.5, 0.5, shape) for name, shape in shapes.items()}


def _repeated(weights, kv_heads):
    """Plain multi-head weights: key/value head j's rows repeated for query heads
    j * groups ... (j + 1) * groups - 1, the order every framework's grouped-query attention uses."""
    groups = HEADS // kv_heads
    out = dict(weights)
    for name in ("W_k", "W_v", "b_k", "b_v"):
        if name in weights:
            w = weights[name]
            out[name] = np.repeat(w.reshape((kv_heads, HEAD_DIM) + w.shape[1:]), groups, axis=0).reshape(
                (HIDDENS,) + w.shape[1:]
            )
    return out


def _inputs(bk, dtype="float64"):
    return [bk.tensor(x, dtype) for x in (QUERIES, KEYS, VALUES)] + [bk.tensor(LENS)]


def _grouped(bk, kv_heads, dtype="float64", weights=None, bias=True):
    weights = _weights(kv_heads, bias) if weights is None else weights
    return bk.multi_head(
        HIDDENS, HEADS, bias=bias, dtype=dtype, weights=weights, num_kv_heads=kv_heads, **SIZES
    )


def _close(bk, got, want, dtype="float64"):
    tol = tolerance(bk.name, dtype)
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=tol, atol=tol)


# --- the layers --------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_grouped_layers_have_kv_heads_weights_and_compute_grouped_query_attention(bk, kv_heads):
    weights = _weights(kv_heads)
    layer = _grouped(bk, kv_heads, weights=weights)
    assert layer.num_kv_heads == kv_heads and layer.num_heads == HEADS
    got = layer.get_weights()
    kv = kv_heads * HEAD_DIM
    assert {n: w.shape for n, w in got.items()} == {
        "W_q": (8, 5), "W_k": (kv, 6), "W_v": (kv, 7), "W_o": (8, 8),
        "b_q": (8,), "b_k": (kv,), "b_v": (kv,), "b_o": (8,),
    }  # fmt: skip
    for name, value in weights.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)  # float64: exact
    out = bk.numpy(bk.call(layer, *_inputs(bk)))
    assert out.shape == (B, Q, HIDDENS)
    want = multiattn.multi_head_attention(
        QUERIES, KEYS, VALUES, LENS, weights=got, num_heads=HEADS, num_kv_heads=kv_heads
    )
    _close(bk, out, want)
    # the same as plain multi-head attention with each key/value head repeated for its group
    plain = multiattn.multi_head_attention(
        QUERIES, KEYS, VALUES, LENS, weights=_repeated(got, kv_heads), num_heads=HEADS
    )
    _close(bk, out, plain)
    assert bk.numpy(layer.attention_weights).shape == (B, HEADS, Q, K)


def test_without_num_kv_heads_a_layer_has_a_key_value_head_per_query_head(bk):
    default = bk.multi_head(HIDDENS, HEADS, **SIZES)
    assert default.num_kv_heads == HEADS
    assert default.get_weights()["W_k"].shape == (HIDDENS, 6)
    weights = _weights(HEADS)
    explicit = _grouped(bk, HEADS, weights=weights)
    plain = bk.multi_head(HIDDENS, HEADS, bias=True, dtype="float64", weights=weights, **SIZES)
    assert explicit.num_kv_heads == HEADS
    np.testing.assert_array_equal(
        bk.numpy(bk.call(explicit, *_inputs(bk))), bk.numpy(bk.call(plain, *_inputs(bk)))
    )


@pytest.mark.parametrize("bad", [3, 0, -2, True, 2.0, "2"])
def test_a_bad_num_kv_heads_is_a_value_error_naming_it(bk, bad):
    with pytest.raises(ValueError, match="num_kv_heads") as err:
        bk.module.MultiHeadAttention(HIDDENS, HEADS, num_kv_heads=bad)
    assert repr(bad) in str(err.value) or f"({bad})" in str(err.value)


def test_num_kv_heads_is_keyword_only(bk):
    with pytest.raises(TypeError):
        bk.module.MultiHeadAttention(HIDDENS, HEADS, 0.0, False, 2)


# --- Keras' config and model files ------------------------------------------------------


@pytest.mark.backend("tensorflow")
def test_keras_config_and_model_files_of_grouped_layers(tmp_path):
    import keras

    from multiattn.backends import tensorflow as m

    layer = _grouped(harness("tensorflow"), 1, dtype="float32")
    config = layer.get_config()
    assert config["num_kv_heads"] == 1
    twin = m.MultiHeadAttention.from_config(config)
    assert twin.num_kv_heads == 1 and twin.get_weights()["W_k"].shape == (HEAD_DIM, 6)

    q_in, k_in, v_in = keras.Input((Q, 5)), keras.Input((K, 6)), keras.Input((K, 7))
    lens_in = keras.Input((), dtype="int32")
    model = keras.Model([q_in, k_in, v_in, lens_in], layer(q_in, k_in, v_in, lens_in))
    inputs = [x.astype("float32") for x in (QUERIES, KEYS, VALUES)] + [LENS.astype("int32")]
    want = model.predict(inputs, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(loaded.predict(inputs, verbose=0), want)
    (twin,) = [x for x in loaded.layers if isinstance(x, m.MultiHeadAttention)]
    assert twin.num_kv_heads == 1
    for name, value in layer.get_weights().items():
        np.testing.assert_array_equal(twin.get_weights()[name], value, err_msg=name)


# --- the converters, framework-free ------------------------------------------------------


def test_the_converters_config_keeps_num_kv_heads():
    from multiattn.backends import numpy as m

    plain = converters.Config(8, 4, 8, 6, 7, True, 0.0)  # the constructions before num_kv_heads
    assert plain.num_kv_heads is None and plain.kv_heads == 4 and plain.kv_hiddens == 8
    assert plain.kwargs()["num_kv_heads"] is None
    grouped = converters.config(m.MultiHeadAttention(8, 4, num_kv_heads=2, **SIZES), 0.25)
    assert grouped == converters.Config(8, 4, 5, 6, 7, False, 0.25, 2)
    assert grouped.kv_heads == 2 and grouped.kv_hiddens == 4


@pytest.mark.parametrize(
    "to, native",
    [
        (converters.torch_to, converters.TORCH),
        (converters.paddle_to, converters.PADDLE),
        (converters.mlx_to, converters.MLX),
        (converters.keras_to, converters.KERAS),
    ],
    ids=["torch", "paddle", "mlx", "keras-multi-head"],
)
@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_native_layers_without_grouped_query_attention_refuse_it(to, native, kv_heads):
    cfg = converters.Config(8, 4, 8, 8, 8, True, 0.0, kv_heads)
    pattern = rf"num_kv_heads={kv_heads} != num_heads=4\) cannot be expressed by {native}"
    with pytest.raises(ValueError, match=pattern):
        to(cfg, _weights(kv_heads, query_size=8, key_size=8, value_size=8))


@pytest.mark.parametrize("kv_heads", KV_HEADS + [HEADS])
def test_the_grouped_layouts_round_trip_exactly(kv_heads):
    """Keras' GroupQueryAttention and flax's layouts of a grouped layer, and back, in numpy:
    the key/value kernels (in, kv_heads, head_dim) are W_k^T and W_v^T reshaped."""
    weights = _weights(kv_heads, query_size=8, key_size=6, value_size=6)
    cfg = converters.Config(8, 4, 8, 6, 6, True, 0.0, kv_heads)
    kwargs, arrays, build = converters.keras_gqa_to(cfg, weights)
    assert kwargs == dict(
        head_dim=2, num_query_heads=4, num_key_value_heads=kv_heads, dropout=0.0, use_bias=True
    )
    assert build == dict(query_shape=(None, None, 8), value_shape=(None, None, 6), key_shape=(None, None, 6))
    np.testing.assert_array_equal(arrays["_key_dense.kernel"], weights["W_k"].T.reshape(6, kv_heads, 2))
    np.testing.assert_array_equal(arrays["_value_dense.bias"], weights["b_v"].reshape(kv_heads, 2))
    back_cfg, back = converters.keras_gqa_from(
        arrays, head_dim=2, num_query_heads=4, num_key_value_heads=kv_heads, dropout=0.0, use_gate=False,
        sliding_window=None,
    )  # fmt: skip
    assert back_cfg == cfg
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)

    kwargs, arrays = converters.flax_to(cfg, weights)
    assert kwargs["num_heads"] == 4 and kwargs["num_kv_heads"] == kv_heads
    assert arrays["key.kernel"].shape == (6, kv_heads, 2) and arrays["query.kernel"].shape == (8, 4, 2)
    back_cfg, back = converters.flax_from(
        arrays, num_heads=4, num_kv_heads=kv_heads, in_features=8, qkv_features=8, out_features=8,
        in_kv_features=6, dropout_rate=0.0, normalize_qk=False, default_attention_fn=True,
    )  # fmt: skip
    assert back_cfg == cfg
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


# --- the converters of each framework's layer ---------------------------------------------


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.backend(n)) for n in ("torch", "paddle", "mlx")]
)
def test_to_native_of_a_grouped_layer_is_a_value_error_without_native_grouped_query_attention(name):
    layer = multiattn.get_backend(name).MultiHeadAttention(8, 4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 != num_heads=4\) cannot be expressed"):
        layer.to_native()


def _f32(*arrays):
    return [np.asarray(a, dtype=np.float32) for a in arrays]


KERAS_WIDTHS = (8, 6, 7)  # GroupQueryAttention outputs its query width: query_size == num_hiddens


def _keras_gqa(rng, kv_heads, bias=True, dropout=0.0, widths=KERAS_WIDTHS, **options):
    import keras

    layer = keras.layers.GroupQueryAttention(
        head_dim=HEAD_DIM, num_query_heads=HEADS, num_key_value_heads=kv_heads, use_bias=bias,
        dropout=dropout, **options,
    )  # fmt: skip
    q, k, v = widths
    layer.build((None, None, q), (None, None, v), (None, None, k))
    for variable in layer.weights:
        variable.assign(rng.uniform(-0.5, 0.5, tuple(variable.shape)).astype(np.float32))
    return layer


def _keras_params(layer):
    return {v.path.split("/", 1)[1]: np.asarray(v.numpy()) for v in layer.weights}


@pytest.mark.backend("tensorflow")
@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_keras_group_query_attention_converts_both_ways(kv_heads):
    import keras

    from multiattn.backends.tensorflow import MultiHeadAttention

    rng = np.random.default_rng(kv_heads)
    native = _keras_gqa(rng, kv_heads)
    m = MultiHeadAttention.from_native(native)
    assert (m.num_hiddens, m.num_heads, m.num_kv_heads, m.bias) == (8, 4, kv_heads, True)
    assert (m.query_size, m.key_size, m.value_size) == KERAS_WIDTHS
    q, k, v = _f32(RNG.normal(size=(B, Q, 8)), KEYS, VALUES)
    lengths = np.arange(K)[None, None, :] < LENS[:, None, None]  # True: may attend
    mask = RNG.uniform(size=(B, Q, K)) < 0.6
    mask[..., 0] = True  # no fully masked rows, where the frameworks differ
    cases = [
        (dict(attention_mask=lengths), dict(valid_lens=LENS)),
        (dict(use_causal_mask=True), dict(causal=True)),
        (dict(attention_mask=mask), dict(attention_mask=mask)),
    ]
    unmasked = np.asarray(native(q, v, k))
    for theirs, ours in cases:
        want = np.asarray(native(q, v, k, **theirs))  # Keras: (query, value, key)
        lens = ours.pop("valid_lens", None)
        got = np.asarray(m(q, k, v, lens, training=False, **ours))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.abs(unmasked - want).max() > 1e-3  # the mask mattered
    back = m.to_native()
    assert type(back) is keras.layers.GroupQueryAttention
    assert back.num_key_value_heads == kv_heads and back.head_dim == HEAD_DIM
    got, want = _keras_params(back), _keras_params(native)
    assert sorted(got) == sorted(want)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


@pytest.mark.backend("tensorflow")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_keras_from_native_of_to_native_has_the_grouped_layers_weights(kv_heads, bias):
    from multiattn.backends.tensorflow import MultiHeadAttention

    weights = {n: w.astype(np.float32) for n, w in _weights(kv_heads, bias, 8, 6, 7).items()}
    m = MultiHeadAttention(8, 4, bias=bias, num_kv_heads=kv_heads, key_size=6, value_size=7)
    m.set_weights(weights)
    native = m.to_native()
    back = MultiHeadAttention.from_native(native)
    assert (back.num_kv_heads, back.bias, back.key_size, back.value_size) == (kv_heads, bias, 6, 7)
    got = back.get_weights()
    assert sorted(got) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    q, k, v = _f32(RNG.normal(size=(B, Q, 8)), KEYS, VALUES)
    lengths = np.arange(K)[None, None, :] < LENS[:, None, None]
    np.testing.assert_allclose(
        np.asarray(m(q, k, v, LENS, training=False)), np.asarray(native(q, v, k, attention_mask=lengths)),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip


@pytest.mark.backend("tensorflow")
def test_keras_grouped_option_dropout_and_refusals():
    import keras

    from multiattn.backends.tensorflow import MultiHeadAttention

    rng = np.random.default_rng(7)
    # a GroupQueryAttention with a key/value head per query head: num_kv_heads == num_heads;
    # back to one with grouped=True
    native = _keras_gqa(rng, HEADS)
    m = MultiHeadAttention.from_native(native)
    assert m.num_kv_heads == HEADS
    assert type(m.to_native()) is keras.layers.MultiHeadAttention  # the default: not grouped
    back = m.to_native(grouped=True)
    assert type(back) is keras.layers.GroupQueryAttention
    for path, value in _keras_params(native).items():
        np.testing.assert_array_equal(_keras_params(back)[path], value, err_msg=path)
    with pytest.raises(TypeError, match="grouped must be True, False or None"):
        m.to_native(grouped="yes")
    # the dropout rate both ways
    m = MultiHeadAttention.from_native(_keras_gqa(rng, 2, dropout=0.25))
    assert m.rate == 0.25 and m.to_native().dropout == 0.25
    # what one side cannot express
    grouped = MultiHeadAttention(8, 4, num_kv_heads=2)
    with pytest.raises(
        ValueError, match=r"num_kv_heads=2 != num_heads=4\) cannot be expressed by keras.layers.Multi"
    ):
        grouped.to_native(grouped=False)
    with pytest.raises(ValueError, match=r"needs query_size == num_hiddens .*query_size=5, num_hiddens=8"):
        MultiHeadAttention(8, 4, num_kv_heads=2, query_size=5).to_native()
    with pytest.raises(ValueError, match="query width 5 .*cannot be expressed"):
        MultiHeadAttention.from_native(_keras_gqa(rng, 2, widths=(5, 6, 7)))
    with pytest.raises(ValueError, match="use_gate=True cannot be expressed"):
        MultiHeadAttention.from_native(_keras_gqa(rng, 2, use_gate=True))
    with pytest.raises(ValueError, match="sliding_window=2 cannot be expressed"):
        MultiHeadAttention.from_native(_keras_gqa(rng, 2, sliding_window=2))
    unbuilt = keras.layers.GroupQueryAttention(head_dim=2, num_query_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="GroupQueryAttention is not built"):
        MultiHeadAttention.from_native(unbuilt)
    with pytest.raises(
        TypeError, match="keras.layers.MultiHeadAttention or keras.layers.GroupQueryAttention"
    ):
        MultiHeadAttention.from_native(keras.layers.Dense(3))
    # float64 both ways
    layer = MultiHeadAttention(8, 4, num_kv_heads=1, dtype="float64").to_native()
    assert layer._key_dense.kernel.dtype == "float64"
    assert MultiHeadAttention.from_native(layer).W_k.dtype == "float64"


@pytest.mark.backend("jax")
@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_flax_grouped_query_attention_converts_both_ways(kv_heads):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from multiattn.backends.jax import MultiHeadAttention

    native = nnx.MultiHeadAttention(
        num_heads=HEADS, num_kv_heads=kv_heads, in_features=5, qkv_features=8, out_features=8,
        in_kv_features=6, bias_init=nnx.initializers.normal(0.5), decode=False, deterministic=True,
        rngs=nnx.Rngs(kv_heads),
    )  # fmt: skip
    m = MultiHeadAttention.from_native(native)
    assert (m.num_heads, m.num_kv_heads, m.query_size, m.key_size, m.value_size) == (4, kv_heads, 5, 6, 6)
    assert m.get_weights()["W_k"].shape == (kv_heads * HEAD_DIM, 6)
    q, k, v = (jnp.asarray(x) for x in _f32(QUERIES, KEYS, VALUES[..., :6]))
    mask = RNG.uniform(size=(B, Q, K)) < 0.6
    mask[..., 0] = True
    want = np.asarray(native(q, k, v, mask=jnp.asarray(mask)[:, None]))  # flax: (B, heads, Q, K)
    got = np.asarray(m(q, k, v, attention_mask=jnp.asarray(mask)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(native(q, k, v)) - want).max() > 1e-3  # the mask mattered
    back = m.to_native()
    assert back.num_kv_heads == kv_heads
    same = jax.tree.map(
        lambda a, b: bool((a == b).all()), nnx.state(back, nnx.Param), nnx.state(native, nnx.Param)
    )
    assert all(jax.tree.leaves(same)) and len(jax.tree.leaves(same)) == 8
    # and from_native(m.to_native()) has exactly m's canonical weights
    weights = {n: w.astype(np.float32) for n, w in _weights(kv_heads, True, 5, 6, 6).items()}
    ours = MultiHeadAttention(8, 4, bias=True, num_kv_heads=kv_heads, query_size=5, key_size=6, value_size=6)
    ours.set_weights(weights)
    again = MultiHeadAttention.from_native(ours.to_native()).get_weights()
    for name, value in weights.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
