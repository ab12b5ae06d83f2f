"""``create_block_mask`` and ``block_mask=``: every mask as one value, made once and reused,
giving what the same masks give as arguments (bitwise, on every backend and path) and the
float64 loops of tests/reference.py; its block map computed once; errors naming the argument."""

from __future__ import annotations

import numpy as np
import pytest

import multiattn
from multiattn import mods

from . import reference as ref
from .test_mods import _jitted, supported
from .tolerances import assert_close

B, H, KV, Q, K, D = 2, 4, 2, 9, 11, 3
RNG = np.random.default_rng(40)
LENS = np.array([[3, 5, 0, 11, 11, 7, 9, 2, 4], [11, 10, 9, 8, 7, 6, 5, 4, 3]])
MASK = RNG.random((B, 1, Q, K)) < 0.85


def _inputs(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, H, Q, D)), rng.normal(size=(B, KV, K, D)), rng.normal(size=(B, KV, K, 2))


def _window(b, h, i, j):  # the reference's sliding_window(4)
    return 0 <= i - j < 4


MASKS = dict(valid_lens=LENS, attention_mask=MASK, causal=True, mask_mod=mods.sliding_window(4))


def _block_mask(bk, like, block_size=None):
    return multiattn.create_block_mask(
        mods.sliding_window(4), batch=B, q_len=Q, kv_len=K, causal=True, valid_lens=bk.tensor(LENS),
        attention_mask=bk.tensor(MASK), block_size=block_size, like=like,
    )  # fmt: skip


@pytest.mark.parametrize("block_size", [None, 4])
def test_a_block_mask_gives_what_its_masks_give(bk, block_size):
    supported(bk, "float32")
    q, k, v = (bk.tensor(x, "float32") for x in _inputs(1))
    bm = _block_mask(bk, q, block_size)
    masks = dict(MASKS, valid_lens=bk.tensor(LENS), attention_mask=bk.tensor(MASK))
    want = ref.heads_attention(*_inputs(1), LENS, MASK, True, mask_fn=_window)[0]
    for _ in range(2):  # made once, used twice
        got = multiattn.dot_product_attention(q, k, v, block_mask=bm)
        same = multiattn.dot_product_attention(q, k, v, **masks, block_size=block_size)
        np.testing.assert_array_equal(bk.numpy(got), bk.numpy(same))
        assert_close(bk, got, want, "float32")
    if block_size is not None:
        assert bm.maps, "the block map was not kept"


def test_a_block_mask_serves_multi_head_attention_and_the_compilers(bk):
    supported(bk, "float32")
    rng = np.random.default_rng(2)
    x = bk.tensor(rng.normal(size=(B, Q, 8)), "float32")
    kv = bk.tensor(rng.normal(size=(B, K, 8)), "float32")
    weights = {n: bk.tensor(rng.normal(size=(8, 8)) * 0.3, "float32") for n in ("W_q", "W_k", "W_v", "W_o")}
    bm = _block_mask(bk, x, block_size=4)
    kw = dict(weights=weights, num_heads=2)
    got = multiattn.multi_head_attention(x, kv, kv, block_mask=bm, **kw)
    masks = dict(MASKS, valid_lens=bk.tensor(LENS), attention_mask=bk.tensor(MASK))
    np.testing.assert_array_equal(
        bk.numpy(got), bk.numpy(multiattn.multi_head_attention(x, kv, kv, **masks, block_size=4, **kw))
    )
    jitted = _jitted(bk, lambda q, k, v: multiattn.dot_product_attention(q, k, v, block_mask=bm))
    if jitted is not None:
        args = [bk.tensor(a, "float32") for a in _inputs(3)]
        want = ref.heads_attention(*_inputs(3), LENS, MASK, True, mask_fn=_window)[0]
        assert_close(bk, jitted(*args), want, "float32")


def test_a_block_mask_is_normalised():
    lens = np.array([K, K + 3])  # hide no key
    bm = multiattn.create_block_mask(
        mods.sliding_window(4), batch=B, q_len=Q, kv_len=K, causal=True, valid_lens=lens, like=lens
    )
    assert bm.valid_lens is None and not bm.causal and repr(bm.mask_mod) == "sliding_window(4)"
    assert repr(bm).startswith("BlockMask(batch=2, q_len=9, kv_len=11, mask_mod=sliding_window(4)")


def test_block_mask_mistakes_name_the_argument():
    q, k, v = (x.astype("float32") for x in _inputs(0))
    bm = multiattn.create_block_mask(batch=B, q_len=Q, kv_len=K, causal=True, like=q)
    with pytest.raises(ValueError, match=r"^block_mask holds the call's masks: pass valid_lens, causal to "):
        multiattn.dot_product_attention(q, k, v, np.array([3, 4]), causal=True, block_mask=bm)
    made_for = r"^block_mask was made for \(batch, q_len, kv_len\) = \(2, 9, 11\), the call has \(2, 9, 5\)"
    with pytest.raises(ValueError, match=made_for):
        multiattn.dot_product_attention(q, k[:, :, :5], v[:, :, :5], block_mask=bm)
    with pytest.raises(TypeError, match=r"^block_mask must be a multiattn.create_block_mask\(...\) value"):
        multiattn.dot_product_attention(q, k, v, block_mask=np.ones((Q, K), bool))
    with pytest.raises(ValueError, match=r"^create_block_mask's q_len must be a positive int, got 0"):
        multiattn.create_block_mask(batch=B, q_len=0, kv_len=K, like=q)
    with pytest.raises(ValueError, match=r"^valid_lens must have shape \(2,\) \(batch,\) or \(2, 9\)"):
        multiattn.create_block_mask(batch=B, q_len=Q, kv_len=K, valid_lens=np.ones(3), like=q)


@pytest.mark.backend("torch")
def test_a_block_mask_of_another_framework_is_refused():
    import torch

    q = np.zeros((B, H, Q, D), "float32")
    bm = multiattn.create_block_mask(batch=B, q_len=Q, kv_len=K, causal=True, like=torch.zeros(1))
    with pytest.raises(TypeError, match=r"^block_mask was made for torch tensors, the call's are numpy's"):
        multiattn.dot_product_attention(q, q[:, :2, :K], q[:, :2, :K], block_mask=bm)


def test_every_frameworks_layers_take_a_block_mask(bk):
    """One block mask for the layers of a model: each call gives what its masks as arguments give."""
    supported(bk, "float32")
    rng = np.random.default_rng(4)
    weights = {n: rng.normal(size=(8, 8)) * 0.3 for n in ("W_q", "W_k", "W_v", "W_o")}
    x, kv = (bk.tensor(rng.normal(size=(B, n, 8)), "float32") for n in (Q, K))
    layers = [bk.multi_head(8, 2, weights=weights, need_weights=need) for need in (True, False)]
    bm, in_blocks = _block_mask(bk, x), _block_mask(bk, x, block_size=4)
    masks = dict(MASKS, valid_lens=bk.tensor(LENS), attention_mask=bk.tensor(MASK))
    for layer in layers * 2:  # each layer twice, the same block mask
        want = bk.numpy(bk.call(layer, x, kv, kv, **masks))
        np.testing.assert_array_equal(bk.numpy(bk.call(layer, x, kv, kv, block_mask=bm)), want)
        # the block mask's block size: the blocks even where the weights are not kept
        assert_close(bk, bk.call(layer, x, kv, kv, block_mask=in_blocks), want, "float32")
    q, k, v = (bk.tensor(a, "float32") for a in _inputs(5))
    dot = bk.dot()
    got = bk.call(dot, q, k, v, block_mask=in_blocks)
    assert_close(bk, got, ref.heads_attention(*_inputs(5), LENS, MASK, True, mask_fn=_window)[0], "float32")
