"""Each layer survives its framework's copy and save idioms after a forward call: copy.deepcopy
and pickle everywhere, Keras model.save/load_model; the copy gives the same outputs.  Grouped
layers (num_kv_heads 2 and 1) among them: copies and loads keep num_kv_heads."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from .test_worked_example import example

EXAMPLE_ADDITIVE = 20  # the books' query width for additive attention
KV_HEADS = {"grouped": 2, "multi_query": 1}  # key/value heads of 4 query heads of width 2

pytestmark = pytest.mark.layers


def _layer(bk, kind):
    if kind == "additive":
        return bk.additive(2, EXAMPLE_ADDITIVE, 8)
    if kind == "multi_head":
        return bk.multi_head(8, 2, bias=True, query_size=EXAMPLE_ADDITIVE, key_size=2, value_size=4)
    if kind in KV_HEADS:
        return _grouped(bk, KV_HEADS[kind])
    return bk.dot()


def _grouped(bk, kv_heads, **weights):
    sizes = dict(query_size=EXAMPLE_ADDITIVE, key_size=2, value_size=4)
    return bk.multi_head(8, 4, bias=True, num_kv_heads=kv_heads, **sizes, **weights)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", ["additive", "dot", "multi_head", *KV_HEADS])
def test_copies_after_a_forward_call_give_the_same_outputs(bk, kind, how):
    q, k, v, lens = example(bk, query_size=2 if kind == "dot" else EXAMPLE_ADDITIVE)
    layer = _layer(bk, kind)
    out = bk.numpy(bk.call(layer, q, k, v, lens))
    twin = copy.deepcopy(layer) if how == "deepcopy" else pickle.loads(pickle.dumps(layer))
    if twin.attention_weights is not None:  # Keras rebuilds a copy from its config and weights
        np.testing.assert_array_equal(bk.numpy(twin.attention_weights), bk.numpy(layer.attention_weights))
    np.testing.assert_array_equal(bk.numpy(bk.call(twin, q, k, v, lens)), out)
    if kind in KV_HEADS:
        assert twin.num_kv_heads == layer.num_kv_heads == KV_HEADS[kind]
    if kind != "dot":
        for name, value in layer.get_weights().items():
            np.testing.assert_array_equal(twin.get_weights()[name], value)


@pytest.mark.backend("tensorflow")
def test_keras_models_holding_the_layers_save_and_load(tmp_path):
    import keras

    from multiattn.backends import tensorflow as m

    q_in, k_in, v_in = keras.Input((1, 20)), keras.Input((10, 2)), keras.Input((10, 4))
    lens_in = keras.Input((), dtype="int32")
    additive = m.AdditiveAttention(2, 20, 8, dropout=0.1)(q_in, k_in, v_in, lens_in)
    dot = m.DotProductAttention(dropout=0.5, need_weights=False)(k_in, k_in, v_in, lens_in)
    model = keras.Model([q_in, k_in, v_in, lens_in], [additive, dot])
    rng = np.random.default_rng(0)
    inputs = [rng.normal(size=(2, 1, 20)), rng.normal(size=(2, 10, 2)), rng.normal(size=(2, 10, 4))]
    inputs = [x.astype("float32") for x in inputs] + [np.array([2, 6], dtype="int32")]
    want = model.predict(inputs, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    for got, expected in zip(loaded.predict(inputs, verbose=0), want):
        np.testing.assert_array_equal(got, expected)
    layer = next(x for x in loaded.layers if isinstance(x, m.DotProductAttention))
    assert layer.need_weights is False and layer.rate == 0.5


def _example_args(bk):
    q, k, v, lens = example(bk, query_size=EXAMPLE_ADDITIVE)
    return q, k, v, lens


def _round_trip(bk, save, load):
    """A trained-looking layer (additive, multi-head with biases, grouped-query with two
    key/value heads of four) saved the framework's way and loaded into a fresh one: the same
    num_kv_heads, canonical weights and outputs."""
    args = _example_args(bk)
    rng = np.random.default_rng(5)
    additive = {"W_q": rng.normal(size=(8, 20)), "W_k": rng.normal(size=(8, 2)), "w_v": rng.normal(size=(8,))}
    multi_head = {"W_q": (8, 20), "W_k": (8, 2), "W_v": (8, 4), "W_o": (8, 8)}
    multi_head.update({f"b_{n}": (8,) for n in "qkvo"})
    grouped = dict(multi_head, W_k=(4, 2), W_v=(4, 4), b_k=(4,), b_v=(4,))
    sizes = dict(query_size=EXAMPLE_ADDITIVE, key_size=2, value_size=4)
    for make, weights in (
        (lambda **w: bk.additive(2, EXAMPLE_ADDITIVE, 8, **w), additive),
        (
            lambda **w: bk.multi_head(8, 2, bias=True, **sizes, **w),
            {n: rng.normal(size=s) for n, s in multi_head.items()},
        ),
        (lambda **w: _grouped(bk, 2, **w), {n: rng.normal(size=s) for n, s in grouped.items()}),
    ):
        layer, fresh = make(weights=weights), make()
        want = bk.numpy(bk.call(layer, *args))
        before = fresh.get_weights()
        assert any(not np.array_equal(before[n], w) for n, w in layer.get_weights().items())  # fresh differs
        fresh = load(fresh, save(layer)) or fresh
        assert getattr(fresh, "num_kv_heads", None) == getattr(layer, "num_kv_heads", None)
        for name, value in layer.get_weights().items():
            np.testing.assert_array_equal(fresh.get_weights()[name], value)
        np.testing.assert_array_equal(bk.numpy(bk.call(fresh, *args)), want)


@pytest.mark.backend("torch")
def test_torch_state_dict_and_torch_save(tmp_path):
    import torch

    from .harness import harness

    bk = harness("torch")
    _round_trip(
        bk, lambda layer: layer.state_dict(), lambda fresh, state: fresh.load_state_dict(state) and None
    )
    path = tmp_path / "layer.pt"
    _round_trip(
        bk,
        lambda layer: torch.save(layer, path),
        lambda fresh, _: bk.eval(torch.load(path, weights_only=False)),
    )


@pytest.mark.backend("tensorflow")
def test_keras_weight_lists():
    # Keras 3 layers have no save_weights (models do, tested above): their idiom is the list
    from .harness import harness

    _round_trip(
        harness("tensorflow"),
        lambda layer: layer.get_weights(format="keras"),
        lambda fresh, weights: fresh.set_weights(weights),
    )


@pytest.mark.backend("jax")
def test_nnx_state_and_update():
    from flax import nnx

    from .harness import harness

    _round_trip(
        harness("jax"),
        lambda layer: nnx.state(layer, nnx.Param),
        lambda fresh, state: nnx.update(fresh, state),
    )


@pytest.mark.backend("paddle")
def test_paddle_save_and_set_state_dict(tmp_path):
    import paddle

    from .harness import harness

    path = str(tmp_path / "layer.pdparams")
    _round_trip(
        harness("paddle"),
        lambda layer: paddle.save(layer.state_dict(), path),
        lambda fresh, _: fresh.set_state_dict(paddle.load(path)) and None,
    )


@pytest.mark.backend("mlx")
def test_mlx_save_weights_and_load_weights(tmp_path):
    from .harness import harness

    path = str(tmp_path / "layer.safetensors")
    _round_trip(
        harness("mlx"),
        lambda layer: layer.save_weights(path),
        lambda fresh, _: fresh.load_weights(path) and None,
    )


@pytest.mark.backend("mxnet")
def test_gluon_save_parameters_and_load_parameters(tmp_path):
    from .harness import harness

    path = str(tmp_path / "layer.params")
    _round_trip(
        harness("mxnet"),
        lambda layer: layer.save_parameters(path),
        lambda fresh, _: fresh.load_parameters(path),
    )
