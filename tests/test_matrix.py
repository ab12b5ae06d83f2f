"""The matrix: backend x function x dtype x mask kind x shape, against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import multiattn

from . import reference as ref
from .tolerances import assert_close

DTYPES = ["float32", "float64", "float16", "bfloat16"]
MASKS = ["none", "1d", "2d"]
# (batch, queries, keys, query width, key width (additive), value width)
# the last shape has value width == query width, which jax's fused kernel needs
SHAPES = [(2, 3, 5, 4, 3, 3), (1, 1, 1, 2, 5, 1), (3, 4, 7, 8, 2, 6), (2, 3, 6, 4, 3, 4)]
SHAPE_IDS = ["2x3x5", "1x1x1", "3x4x7", "2x3x6v4"]


def lengths(kind, batch, n_queries, n_keys, rng):
    """Lengths that always include a fully masked row and an over-long one."""
    if kind == "none":
        return None
    shape = (batch,) if kind == "1d" else (batch, n_queries)
    lens = rng.integers(-1, n_keys + 3, size=shape)
    flat = lens.reshape(-1)
    flat[0] = 0
    if flat.size > 1:
        flat[-1] = n_keys + 2
    if kind == "2d" and flat.size > 2:
        flat[1] = -3
    return lens


def supported(bk, dtype):
    if dtype not in bk.dtypes:
        pytest.xfail(f"{bk.name} has no {dtype} (documented in README)")


def inputs(bk, dtype, shape, mask, seed, additive=False):
    B, Q, K, d, k_width, v = shape
    rng = np.random.default_rng(seed)
    q = bk.tensor(rng.normal(size=(B, Q, d)), dtype)
    k = bk.tensor(rng.normal(size=(B, K, k_width if additive else d)), dtype)
    vals = bk.tensor(rng.normal(size=(B, K, v)), dtype)
    lens = lengths(mask, B, Q, K, rng)
    return q, k, vals, lens, rng


def as_lens(bk, lens):
    return None if lens is None else bk.tensor(lens)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_softmax(bk, dtype, mask, shape):
    supported(bk, dtype)
    B, Q, K = shape[:3]
    rng = np.random.default_rng(1)
    X = bk.tensor(rng.normal(size=(B, Q, K)) * 3, dtype)
    lens = lengths(mask, B, Q, K, rng)
    got = multiattn.masked_softmax(X, as_lens(bk, lens))
    assert_close(bk, got, ref.masked_softmax(bk.numpy(X), lens), dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_product_attention(bk, dtype, mask, shape):
    supported(bk, dtype)
    q, k, v, lens, _ = inputs(bk, dtype, shape, mask, seed=2)
    layer = bk.dot()
    out = bk.call(layer, q, k, v, as_lens(bk, lens))
    want_out, want_weights = ref.dot_product_attention(bk.numpy(q), bk.numpy(k), bk.numpy(v), lens)
    assert_close(bk, out, want_out, dtype)
    assert_close(bk, layer.attention_weights, want_weights, dtype)
    functional = multiattn.dot_product_attention(q, k, v, as_lens(bk, lens))
    assert_close(bk, functional, want_out, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_attention(bk, dtype, mask, shape):
    supported(bk, dtype)
    B, Q, K, d, k_width, v_width = shape
    q, k, v, lens, rng = inputs(bk, dtype, shape, mask, seed=3, additive=True)
    hiddens = 6
    weights = {
        "W_q": rng.normal(size=(hiddens, d)) * 0.5,
        "W_k": rng.normal(size=(hiddens, k_width)) * 0.5,
        "w_v": rng.normal(size=(hiddens,)),
    }
    layer = bk.additive(k_width, d, hiddens, dtype=dtype, weights=weights)
    stored = layer.get_weights()  # the weights rounded to the layer's dtype
    out = bk.call(layer, q, k, v, as_lens(bk, lens))
    want_out, want_weights = ref.additive_attention(
        bk.numpy(q), bk.numpy(k), bk.numpy(v), lens, stored["W_q"], stored["W_k"], stored["w_v"]
    )
    assert_close(bk, out, want_out, dtype)
    assert_close(bk, layer.attention_weights, want_weights, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_product_fast_path_without_weights(bk, dtype, mask, shape, monkeypatch):
    """need_weights=False takes the framework's fused kernel where there is one: same results."""
    supported(bk, dtype)
    if hasattr(bk.module, "FUSED_ON_CPU"):  # a kernel the CPU default skips: test it anyway
        monkeypatch.setattr(bk.module, "FUSED_ON_CPU", True)
    monkeypatch.setattr(bk.module.ops, "fused_min_scores", 0)  # even at these sizes
    q, k, v, lens, _ = inputs(bk, dtype, shape, mask, seed=4)
    want = ref.dot_product_attention(bk.numpy(q), bk.numpy(k), bk.numpy(v), lens)[0]
    assert_close(bk, bk.module.dot_product_attention(q, k, v, as_lens(bk, lens)), want, dtype)
    if bk.has_layers:
        layer = bk.eval(bk.module.DotProductAttention(need_weights=False))
        out = bk.call(layer, q, k, v, as_lens(bk, lens))
        assert layer.attention_weights is None
        assert_close(bk, out, want, dtype)


@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
@pytest.mark.parametrize("hiddens_innermost", [False, True], ids=["keys-innermost", "hiddens-innermost"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_scores_in_blocks_equal_the_reference(
    bk, dtype, mask, hiddens_innermost, activation, monkeypatch
):
    """Large inputs are scored in blocks of queries (bounded memory); force tiny blocks here,
    in both feature layouts (each adapter uses one, see strategies.additive_scores_in_blocks)."""
    supported(bk, dtype)
    from .test_strategies import force_activation

    force_activation(bk, monkeypatch, activation)  # tanh(z) or 2 sigmoid(2z) - 1, forced
    monkeypatch.setattr(bk.module.ops, "hiddens_innermost", hiddens_innermost)
    # 3 x 6 x 7 = 126 features per query: 2 queries a block, the last block shorter
    monkeypatch.setattr(bk.module.ops, "feature_block_elements", 260)
    shape = (3, 5, 7, 4, 3, 2)
    q, k, v, lens, rng = inputs(bk, dtype, shape, mask, seed=5, additive=True)
    weights = {"W_q": rng.normal(size=(6, 4)), "W_k": rng.normal(size=(6, 3)), "w_v": rng.normal(size=(6,))}
    layer = bk.additive(3, 4, 6, dtype=dtype, weights=weights)
    stored = layer.get_weights()
    out = bk.call(layer, q, k, v, as_lens(bk, lens))
    want = ref.additive_attention(
        bk.numpy(q), bk.numpy(k), bk.numpy(v), lens, stored["W_q"], stored["W_k"], stored["w_v"]
    )[0]
    assert_close(bk, out, want, dtype)
