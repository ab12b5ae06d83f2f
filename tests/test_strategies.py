"""Every strategy against the math module (multiattn.core) and the independent float64
reference: forced on each backend that can take it, at the matrix's small sizes."""

from __future__ import annotations

import numpy as np
import pytest

from multiattn import core, strategies
from multiattn.protocol import Ops, clip_lengths

from . import reference as ref
from .test_matrix import lengths
from .tolerances import assert_close

DTYPES = ["float32", "float64"]
MASKS = ["none", "1d", "2d"]
B, Q, K, D, V, H = 3, 4, 7, 5, 2, 6


def _case(bk, dtype, mask, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {
        "q": rng.normal(size=(B, Q, D)), "k": rng.normal(size=(B, K, D)), "v": rng.normal(size=(B, K, V)),
        "X": rng.normal(size=(B, Q, K)), "W_q": rng.normal(size=(H, D)), "W_k": rng.normal(size=(H, D)),
        "w_v": rng.normal(size=(H,)),
    }  # fmt: skip
    lens = lengths(mask, B, Q, K, rng)
    tensors = {name: bk.tensor(a, dtype) for name, a in arrays.items()}
    rounded = {name: bk.numpy(t).astype(np.float64) for name, t in tensors.items()}
    return tensors, rounded, lens, None if lens is None else bk.tensor(lens)


def _never(name):
    def called(*args, **kwargs):
        raise AssertionError(f"{name} was called where the adapter said it does not apply")

    return called


def _both(bk, got, math_result, want, dtype):
    """The strategy agrees with the math module's function and with the reference."""
    assert_close(bk, got, want, dtype)
    assert_close(bk, math_result, want, dtype)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_entry_points_equal_the_math_module(bk, dtype, mask):
    t, a, lens, lens_t = _case(bk, dtype, mask)
    ops = bk.module.ops
    _both(
        bk, strategies.masked_softmax(ops, t["X"], lens_t), core.masked_softmax(ops, t["X"], lens_t),
        ref.masked_softmax(a["X"], lens), dtype,
    )  # fmt: skip
    for need_weights in (True, False):
        got, _ = strategies.dot_product_attention(
            ops, t["q"], t["k"], t["v"], lens_t, need_weights=need_weights
        )
        math_out, _ = core.dot_product_attention(ops, t["q"], t["k"], t["v"], lens_t)
        _both(bk, got, math_out, ref.dot_product_attention(a["q"], a["k"], a["v"], lens)[0], dtype)
    weights = {name: t[name] for name in ("W_q", "W_k", "w_v")}
    got, got_w = strategies.additive_attention_from_weights(ops, t["q"], t["k"], t["v"], lens_t, **weights)
    math_out, math_w = core.additive_attention(ops, t["q"], t["k"], t["v"], lens_t, **weights)
    want, want_w = ref.additive_attention(a["q"], a["k"], a["v"], lens, a["W_q"], a["W_k"], a["w_v"])
    _both(bk, got, math_out, want, dtype)
    _both(bk, got_w, math_w, want_w, dtype)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("mask", ["1d", "2d"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_where_in_the_scores_memory(bk, dtype, mask, exact):
    t, a, lens, lens_t = _case(bk, dtype, mask, seed=1)
    ops = bk.module.ops
    mask_t = core.visibility(ops, t["X"], lens_t)
    got = strategies.masked_softmax_in_place(ops, ops.copy(t["X"]), mask_t, exact)
    want = ref.masked_softmax(a["X"], lens)
    if not exact:  # rows where nothing is visible stay uniform over the padding (attend's contract)
        visible = np.array([[ref.valid_count(n, K) for n in row] for row in np.broadcast_to(
            lens.reshape(B, -1), (B, Q))])  # fmt: skip
        want = np.where(visible[:, :, None] == 0, 1.0 / K, want)
    _both(bk, got, core.masked_softmax(ops, t["X"], lens_t) if exact else got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_written_directly(bk, dtype, monkeypatch):
    ops = bk.module.ops
    if hasattr(bk.module, "SLICE_MIN_SEQUENCE_ELEMENTS"):  # torch: slices at every size
        monkeypatch.setattr(bk.module, "SLICE_MIN_SEQUENCE_ELEMENTS", 0)
    t, a, lens, lens_t = _case(bk, dtype, "1d", seed=2)
    raw = ops.host_lengths(t["X"], lens_t)
    if raw is None:  # the masked where runs instead, and the padding is never written directly
        monkeypatch.setattr(ops, "fill_padding", _never("fill_padding"))
        got = strategies.masked_softmax(ops, t["X"], lens_t)
        _both(bk, got, core.masked_softmax(ops, t["X"], lens_t), ref.masked_softmax(a["X"], lens), dtype)
        return
    host = clip_lengths(raw, K)
    assert host == [ref.valid_count(n, K) for n in lens]
    got = strategies.softmax_writing_padding(ops, ops.copy(t["X"]), host)
    _both(bk, got, core.masked_softmax(ops, t["X"], lens_t), ref.masked_softmax(a["X"], lens), dtype)
    values = bk.numpy(ops.zero_padded_rows(t["v"], host))
    for b, n in enumerate(host):
        assert (values[b, n:] == 0).all() and (values[b, :n] == a["v"][b, :n]).all()


def force_activation(bk, monkeypatch, activation):
    """Make the additive blocks use tanh or sigmoid whatever this CPU's calibration says;
    False where the adapter has no sigmoid form (and then it must never choose one)."""
    ops = bk.module.ops
    if type(ops).sigmoid_of_sum is Ops.sigmoid_of_sum:
        assert not ops.tanh_by_sigmoid(bk.tensor(np.ones((1, 1, 1)), "float32"))
        return activation == "tanh"
    monkeypatch.setattr(ops, "tanh_by_sigmoid", lambda features: activation == "sigmoid")
    return True


@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
@pytest.mark.parametrize("hiddens_innermost", [False, True])
@pytest.mark.parametrize("step", [1, 3, Q])
@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_scores_in_blocks(bk, dtype, step, hiddens_innermost, activation, monkeypatch):
    ops = bk.module.ops
    monkeypatch.setattr(ops, "hiddens_innermost", hiddens_innermost)
    forced = force_activation(bk, monkeypatch, activation)
    t, a, lens, lens_t = _case(bk, dtype, "1d", seed=3)
    q_hidden, k_hidden = ops.matmul_t(t["q"], t["W_q"]), ops.matmul_t(t["k"], t["W_k"])
    got = strategies.additive_scores_in_blocks(ops, q_hidden, k_hidden, t["w_v"], step)
    want = ref.additive_scores(a["q"], a["k"], a["W_q"], a["W_k"], a["w_v"])
    math_scores = core.additive_scores(ops, q_hidden, k_hidden, t["w_v"])
    if forced and activation == "sigmoid":  # every score shifted by sum(w_v), the weights the same
        assert_close(bk, got, want + a["w_v"].sum(), dtype)
        assert_close(bk, strategies.masked_softmax(ops, got, lens_t), ref.masked_softmax(want, lens), dtype)
        assert_close(bk, math_scores, want, dtype)
    else:
        _both(bk, got, math_scores, want, dtype)


# the adapters whose additive_key_lengths reads the lengths (measured faster there)
READ_ADDITIVE_KEY_LENGTHS = ("numpy", "paddle")


def force_additive_visible_keys(monkeypatch):
    """Every size and share of hidden keys takes the additive features over the visible keys
    where the adapter reads the lengths; the list records each run's lengths."""
    runs: list = []
    real = strategies.additive_scores_over_visible_keys

    def spy(ops, q_hidden, k_hidden, w_v, lengths):
        runs.append(list(lengths))
        return real(ops, q_hidden, k_hidden, w_v, lengths)

    monkeypatch.setattr(strategies, "ADDITIVE_VISIBLE_KEYS_MIN_FEATURES", 0)
    monkeypatch.setattr(strategies, "VISIBLE_KEYS_MAX_SHARE", 1.0)
    monkeypatch.setattr(strategies, "additive_scores_over_visible_keys", spy)
    return runs


@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_features_over_the_visible_keys(bk, dtype, activation, monkeypatch):
    # lengths with a fully masked sequence and an over-long one; blocks of one query, so that
    # each sequence's scores come from several blocks
    ops = bk.module.ops
    runs = force_additive_visible_keys(monkeypatch)
    monkeypatch.setattr(ops, "feature_block_elements", 1)
    force_activation(bk, monkeypatch, activation)
    t, a, lens, lens_t = _case(bk, dtype, "1d", seed=5)
    weights = {name: t[name] for name in ("W_q", "W_k", "w_v")}
    got, got_w = strategies.additive_attention_from_weights(ops, t["q"], t["k"], t["v"], lens_t, **weights)
    want, want_w = ref.additive_attention(a["q"], a["k"], a["v"], lens, a["W_q"], a["W_k"], a["w_v"])
    math_out, math_w = core.additive_attention(ops, t["q"], t["k"], t["v"], lens_t, **weights)
    _both(bk, got, math_out, want, dtype)
    _both(bk, got_w, math_w, want_w, dtype)
    if bk.name in READ_ADDITIVE_KEY_LENGTHS:
        assert runs == [[ref.valid_count(n, K) for n in lens]], "not run, or the lengths misread"
    else:
        assert runs == []


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernel(bk, dtype, mask, monkeypatch):
    if hasattr(bk.module, "FUSED_ON_CPU"):
        monkeypatch.setattr(bk.module, "FUSED_ON_CPU", True)
    ops = bk.module.ops
    t, a, lens, lens_t = _case(bk, dtype, mask, seed=4)
    q, k, v = t["q"], t["k"], bk.tensor(np.random.default_rng(5).normal(size=(B, K, D)), dtype)
    monkeypatch.setattr(ops, "fused_min_scores", 0)
    if ops.can_fuse(q, k, v):
        got = strategies.fused_attention(ops, q, k, v, strategies.Masks(lens_t), 1 / np.sqrt(D))
    else:  # no kernel for these inputs: the no-weights call runs the unfused math, never a kernel
        monkeypatch.setattr(ops, "fused_attention", _never("fused_attention"))
        got, _ = strategies.dot_product_attention(ops, q, k, v, lens_t, need_weights=False)
    want = ref.dot_product_attention(a["q"], a["k"], bk.numpy(v).astype(np.float64), lens)[0]
    _both(bk, got, core.dot_product_attention(ops, q, k, v, lens_t)[0], want, dtype)


# Masks beside the lengths: a boolean mask with a fully masked row, causality, and both with
# lengths; per-head (4-D) inputs as multi-head attention makes them.
MASK_KINDS = ["attention_mask", "causal", "all"]


def _masks(bk, kind, rng, heads=False):
    """(Masks of tensors, the same as numpy for the reference), for scores (B, [2,] Q, K)."""
    lens = lengths("1d", B, Q, K, rng) if kind == "all" else None
    mask = None
    if kind in ("attention_mask", "all"):
        mask = rng.random((B, 2, Q, K) if heads else (B, Q, K)) < 0.6
        mask[0, ..., 1, :] = False  # a fully masked row
    causal = kind in ("causal", "all")
    tensors = strategies.Masks(
        None if lens is None else bk.tensor(lens), None if mask is None else bk.tensor(mask), causal
    )
    return tensors, dict(valid_lens=lens, attention_mask=mask, causal=causal)


def _heads_reference(q, k, v, masks):
    """ref.dot_product_attention per head of (B, 2, n, d) inputs."""
    outs, weights = [], []
    for h in range(2):
        mask = masks["attention_mask"]
        per_head = dict(masks, attention_mask=None if mask is None else mask[:, h])
        out, w = ref.dot_product_attention(q[:, h], k[:, h], v[:, h], **per_head)
        outs.append(out)
        weights.append(w)
    return np.stack(outs, 1), np.stack(weights, 1)


@pytest.mark.parametrize("heads", [False, True], ids=["3d", "heads"])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_strategy_takes_the_masks(bk, dtype, kind, heads, monkeypatch):
    """The masked where, the fused kernel (forced where the adapter has one) and the entry
    point, with boolean masks and causality, against the math module and the reference."""
    if hasattr(bk.module, "FUSED_ON_CPU"):
        monkeypatch.setattr(bk.module, "FUSED_ON_CPU", True)
    monkeypatch.setattr(bk.module.ops, "fused_min_scores", 0)
    ops = bk.module.ops
    rng = np.random.default_rng(6)
    lead = (B, 2) if heads else (B,)
    arrays = [rng.normal(size=lead + (n, D)) for n in (Q, K, K)]
    q, k, v = (bk.tensor(a, dtype) for a in arrays)
    a_q, a_k, a_v = (bk.numpy(t).astype(np.float64) for t in (q, k, v))
    masks, np_masks = _masks(bk, kind, rng, heads)
    want, want_w = _heads_reference(a_q, a_k, a_v, np_masks) if heads else ref.dot_product_attention(
        a_q, a_k, a_v, **np_masks
    )  # fmt: skip
    math_out, math_w = core.dot_product_attention(ops, q, k, v, masks.valid_lens, None, *masks[1:])
    scale = 1 / float(np.sqrt(D))
    for need_weights in (True, False):
        got, got_w = strategies.scaled_dot_product(ops, q, k, v, masks, scale, need_weights=need_weights)
        _both(bk, got, math_out, want, dtype)
        if need_weights:
            _both(bk, got_w, math_w, want_w, dtype)
    if ops.can_fuse(q, k, v):
        _both(bk, strategies.fused_attention(ops, q, k, v, masks, scale), math_out, want, dtype)
    if not heads:
        X = ops.matmul_t(q, k)
        got = strategies.masked_softmax(ops, X, masks.valid_lens, masks.attention_mask, masks.causal)
        want_sm = ref.masked_softmax(bk.numpy(X).astype(np.float64), **np_masks)
        _both(bk, got, core.masked_softmax(ops, X, *masks), want_sm, dtype)
