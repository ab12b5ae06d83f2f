"""The matrix: backend x function x dtype x mask kind x shape, against the float64 reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import multiattn
from multiattn import specialise, tuning

from . import reference as ref
from .forcing import force_blocks, force_fused
from .tolerances import assert_close

DTYPES = ["float32", "float64", "float16", "bfloat16"]
MASKS = ["none", "1d", "2d"]
# (batch, queries, keys, query width, key width (additive), value width)
# the last shape has value width == query width, which jax's fused kernel needs
SHAPES = [(2, 3, 5, 4, 3, 3), (1, 1, 1, 2, 5, 1), (3, 4, 7, 8, 2, 6), (2, 3, 6, 4, 3, 4)]
SHAPE_IDS = ["2x3x5", "1x1x1", "3x4x7", "2x3x6v4"]


# the tests whose calls without weights also run with the block path forced
IN_BLOCKS = {
    "test_dot_product_fast_path_without_weights",
    "test_masks_on_every_function",
    "test_multi_head_attention",
    "test_multi_head_fused_kernel",
    "test_rows_with_nothing_to_attend_to",
}


def pytest_generate_tests(metafunc):
    if "path" in metafunc.fixturenames:
        paths = ["specialised", "primitives_only"] + (["blocks"] * (metafunc.function.__name__ in IN_BLOCKS))
        metafunc.parametrize("path", paths, indirect=True)


@pytest.fixture(autouse=True)
def path(request, monkeypatch):
    """The matrix twice: as the calls run, and with every specialisation off (the core's
    formulas over the required primitives alone); the tests of IN_BLOCKS a third time, with
    every call without weights in blocks of 2 (``multiattn.blockwise``)."""
    if request.param == "blocks":
        calls = force_blocks(monkeypatch, 2)
        yield
        report = getattr(request.node, "rep_call", None)
        assert calls or report is None or not report.passed, "no call ran in blocks"
        return
    with specialise.primitives_only(request.param == "primitives_only"):
        yield


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
    force_fused(bk, monkeypatch)  # kernels the CPU default skips, and at these sizes
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
    in both feature layouts (each adapter uses one, see fast_paths.additive_scores_in_blocks)."""
    supported(bk, dtype)
    from .test_specialisations import force_activation

    force_activation(bk, monkeypatch, activation)  # tanh(z) or 2 sigmoid(2z) - 1, forced
    monkeypatch.setattr(tuning.of(bk.module.ops), "hiddens_innermost", hiddens_innermost)
    # 3 x 6 x 7 = 126 features per query: 2 queries a block, the last block shorter
    monkeypatch.setattr(tuning.of(bk.module.ops), "feature_block_elements", 260)
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


# -- masks beside the lengths, and multi-head attention (d2l 11.5) -------------------------

MASK_KINDS = ["bool_mask", "int_mask", "padding_mask", "causal", "lengths+mask+causal"]


def mask_args(bk, kind, batch, n_queries, n_keys, rng, heads=None):
    """(the masks as tensors, the same as numpy for the reference) for one kind of mask; every
    kind with a mask has a fully masked row.  heads: also a per-head mask (multi-head)."""
    lens = mask = None
    causal = "causal" in kind
    if kind in ("1d", "2d"):
        lens = lengths(kind, batch, n_queries, n_keys, rng)
    elif kind in ("bool_mask", "lengths+mask+causal"):
        mask = rng.random((batch, n_queries, n_keys)) < 0.6
        mask[-1, -1] = False
        if kind == "lengths+mask+causal":
            lens = lengths("2d", batch, n_queries, n_keys, rng)
    elif kind == "int_mask":  # (Q, K) 0/1, shared by the batch
        mask = (rng.random((n_queries, n_keys)) < 0.7).astype("int32")
        mask[0] = 0
    elif kind == "padding_mask":  # (B, 1, K), as from a padding mask of the keys
        mask = rng.random((batch, 1, n_keys)) < 0.7
        mask[0] = False
    elif kind == "head_mask":
        mask = rng.random((batch, heads, n_queries, n_keys)) < 0.6
        mask[0, -1, 0] = False
    tensors = dict(attention_mask=None if mask is None else bk.tensor(mask), causal=causal)
    return as_lens(bk, lens), tensors, dict(valid_lens=lens, attention_mask=mask, causal=causal)


MASK_SHAPES = [(2, 3, 5, 4, 3, 3), (3, 6, 4, 4, 2, 4)]  # queries > keys: causal rows see all


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=["2x3x5", "3x6x4"])
@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_masks_on_every_function(bk, dtype, mask, shape):
    """masked_softmax, dot-product and additive attention, functions and layers, with boolean
    and integer masks and causality, alone and with lengths (AND), against the reference."""
    supported(bk, dtype)
    B, Q, K, d, k_width, v_width = shape
    rng = np.random.default_rng(7)
    lens, masks, np_masks = mask_args(bk, mask, B, Q, K, rng)
    X = bk.tensor(rng.normal(size=(B, Q, K)) * 3, dtype)
    got = multiattn.masked_softmax(X, lens, **masks)
    assert_close(bk, got, ref.masked_softmax(bk.numpy(X), **np_masks), dtype)

    q, k, v, _, _ = inputs(bk, dtype, shape, "none", seed=8)
    want_out, want_w = ref.dot_product_attention(bk.numpy(q), bk.numpy(k), bk.numpy(v), **np_masks)
    layer = bk.dot()
    assert_close(bk, bk.call(layer, q, k, v, lens, **masks), want_out, dtype)
    assert_close(bk, layer.attention_weights, want_w, dtype)
    assert_close(bk, multiattn.dot_product_attention(q, k, v, lens, **masks), want_out, dtype)

    q, k, v, _, _ = inputs(bk, dtype, shape, "none", seed=9, additive=True)
    weights = {
        "W_q": rng.normal(size=(6, d)),
        "W_k": rng.normal(size=(6, k_width)),
        "w_v": rng.normal(size=(6,)),
    }
    layer = bk.additive(k_width, d, 6, dtype=dtype, weights=weights)
    stored = layer.get_weights()
    want_out, want_w = ref.additive_attention(
        bk.numpy(q), bk.numpy(k), bk.numpy(v), np_masks.pop("valid_lens"), stored["W_q"], stored["W_k"],
        stored["w_v"], **np_masks,
    )  # fmt: skip
    assert_close(bk, bk.call(layer, q, k, v, lens, **masks), want_out, dtype)
    assert_close(bk, layer.attention_weights, want_w, dtype)
    canonical = {name: bk.tensor(w, dtype) for name, w in stored.items()}
    assert_close(bk, multiattn.additive_attention(q, k, v, lens, **canonical, **masks), want_out, dtype)


MULTI_HEAD_MASKS = ["none", "1d", "2d", "bool_mask", "int_mask", "head_mask", "causal", "lengths+mask+causal"]
# (batch, queries, keys, query width, key width, value width, num_hiddens, heads, bias)
MULTI_HEAD_SHAPES = [
    (2, 3, 5, 5, 3, 4, 8, 2, False),
    (3, 4, 4, 8, 8, 8, 8, 4, True),
    (1, 1, 1, 2, 2, 2, 4, 1, True),
]


def multi_head_case(bk, dtype, shape, rng):
    B, Q, K, q_width, k_width, v_width, h, heads, bias = shape
    q = bk.tensor(rng.normal(size=(B, Q, q_width)), dtype)
    k = bk.tensor(rng.normal(size=(B, K, k_width)), dtype)
    v = bk.tensor(rng.normal(size=(B, K, v_width)), dtype)
    weights = {
        "W_q": rng.normal(size=(h, q_width)) * 0.5, "W_k": rng.normal(size=(h, k_width)) * 0.5,
        "W_v": rng.normal(size=(h, v_width)) * 0.5, "W_o": rng.normal(size=(h, h)) * 0.5,
    }  # fmt: skip
    if bias:
        weights.update({f"b_{n}": rng.normal(size=(h,)) for n in "qkvo"})
    sizes = dict(query_size=q_width, key_size=k_width, value_size=v_width)
    return q, k, v, weights, sizes


@pytest.mark.parametrize("shape", MULTI_HEAD_SHAPES, ids=["2x3x5-h8x2", "3x4x4-h8x4-bias", "1x1x1-h4x1-bias"])
@pytest.mark.parametrize("mask", MULTI_HEAD_MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_head_attention(bk, dtype, mask, shape):
    """The layer (with and without weights), the functional form with the same canonical
    weights, against the reference's multi-head attention."""
    supported(bk, dtype)
    B, Q, K, *_, h, heads, bias = shape
    rng = np.random.default_rng(10)
    q, k, v, weights, sizes = multi_head_case(bk, dtype, shape, rng)
    lens, masks, np_masks = mask_args(bk, mask, B, Q, K, rng, heads=heads)
    layer = bk.multi_head(h, heads, bias=bias, dtype=dtype, weights=weights, **sizes)
    stored = layer.get_weights()  # rounded to the layer's dtype
    want_out, want_w = ref.multi_head_attention(
        bk.numpy(q), bk.numpy(k), bk.numpy(v), np_masks.pop("valid_lens"), stored, heads, **np_masks
    )
    assert_close(bk, bk.call(layer, q, k, v, lens, **masks), want_out, dtype)
    assert_close(bk, layer.attention_weights, want_w, dtype)
    tensors = {name: bk.tensor(w, dtype) for name, w in stored.items()}
    got = multiattn.multi_head_attention(q, k, v, lens, weights=tensors, num_heads=heads, **masks)
    assert_close(bk, got, want_out, dtype)
    if bk.has_layers:
        fast = bk.multi_head(h, heads, bias=bias, dtype=dtype, weights=weights, need_weights=False, **sizes)
        assert_close(bk, bk.call(fast, q, k, v, lens, **masks), want_out, dtype)
        assert fast.attention_weights is None


@pytest.mark.parametrize("mask", ["1d", "lengths+mask+causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_head_fused_kernel(bk, dtype, mask, monkeypatch):
    """need_weights=False with the fused kernel forced even at this size (where there is one)."""
    supported(bk, dtype)
    force_fused(bk, monkeypatch)  # kernels the CPU default skips, and at these sizes
    shape = MULTI_HEAD_SHAPES[1]
    rng = np.random.default_rng(11)
    q, k, v, weights, _ = multi_head_case(bk, dtype, shape, rng)
    lens, masks, np_masks = mask_args(bk, mask, *shape[:3], rng, heads=shape[7])
    tensors = {name: bk.tensor(w, dtype) for name, w in weights.items()}
    rounded = {name: bk.numpy(t).astype(np.float64) for name, t in tensors.items()}
    got = bk.module.multi_head_attention(q, k, v, lens, weights=tensors, num_heads=shape[7], **masks)
    want = ref.multi_head_attention(
        bk.numpy(q), bk.numpy(k), bk.numpy(v), np_masks.pop("valid_lens"), rounded, shape[7], **np_masks
    )[0]
    assert_close(bk, got, want, dtype)


# -- the row rule: a row with nothing to attend to gets 0 ----------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_with_nothing_to_attend_to(bk, dtype):
    """A row whose visible keys are none, or whose visible scores are all -inf, gets weights 0,
    output 0 and lse -inf, with or without masks, on every path; NaN in a visible score is NaN."""
    supported(bk, dtype)
    rng = np.random.default_rng(12)
    X = rng.normal(size=(2, 4, 5))
    X[0, 1] = -np.inf  # all -inf, nothing masked
    X[1, 0, :3] = -np.inf  # its visible scores all -inf (lengths 3)
    with_nan = X.copy()
    with_nan[1, 2, 1] = np.nan
    # paddle's softmax gives exp(-inf) as about 1e-28 where its row has finite scores too,
    # and nothing else is wrong in the output to tell (docs/errors.md)
    zero = (lambda x: np.abs(x) <= 1e-27) if bk.name == "paddle" else (lambda x: x == 0)
    for scores, lens in itertools.product((X, with_nan), (None, np.array([5, 3]))):
        got = multiattn.masked_softmax(bk.tensor(scores, dtype), as_lens(bk, lens))
        got = bk.numpy(got).astype(np.float64)
        assert (got[0, 1] == 0).all(), "a row of -inf scores must be 0"
        if lens is not None:
            assert zero(got[1, 0]).all(), "a row whose visible scores are -inf must be 0"
        if scores is with_nan:
            assert np.isnan(got[1, 2, 1]), "NaN in a visible score must stay NaN"
        ok = np.ones(X.shape, bool)
        ok[0, 1] = ok[1, 0] = ok[1, 2] = False
        assert not np.isnan(got[ok]).any()

    q = np.ones((2, 3, 4))
    q[0, 0] = np.inf  # its scores all -inf: the keys are negative
    q[1, 2, 1] = np.nan
    k = -rng.uniform(0.5, 1.0, size=(2, 5, 4))
    v = rng.normal(size=(2, 5, 3))
    lens = np.array([5, 0])  # the second sequence sees nothing
    tensors = [bk.tensor(x, dtype) for x in (q, k, v)]
    out, weights, lse = multiattn.dot_product_attention(
        *tensors, bk.tensor(lens), return_weights=True, return_lse=True
    )
    fast = multiattn.dot_product_attention(*tensors, bk.tensor(lens))
    for got in (bk.numpy(out), bk.numpy(weights), bk.numpy(fast)):
        got = got.astype(np.float64)
        assert (got[0, 0] == 0).all() and (got[1] == 0).all(), "rows with nothing to attend to must be 0"
        assert not np.isnan(got[0, 1:]).any()
    lse = bk.numpy(lse).astype(np.float64)
    assert (lse[0, 0] == -np.inf) and (lse[1] == -np.inf).all() and np.isfinite(lse[0, 1:]).all()
    unmasked = bk.numpy(multiattn.dot_product_attention(*tensors)).astype(np.float64)
    assert (unmasked[0, 0] == 0).all() and np.isnan(unmasked[1, 2]).any()
