"""Every specialisation against the core's formula (``specialise.primitives_only``) and the
independent float64 reference: forced on each backend that offers it, at the matrix's small
sizes; and the backends that must offer one do."""

from __future__ import annotations

import numpy as np
import pytest

from multiattn import core, fast_paths, specialise, tuning
from multiattn.adapter import Ops
from multiattn.masks import Masks

from . import reference as ref
from .forcing import force_fused, lower_thresholds
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


# Who must offer what (docs/architecture.md's table says the same; test_package_layout
# keeps the two in step): a backend listed here that declines at these sizes fails.
OFFERED_BY = {
    "masked_softmax_writing_padding": ("numpy", "torch", "paddle", "mxnet"),
    "masked_softmax_in_scores_memory": ("numpy", "torch", "paddle", "mxnet"),
    "additive_scores_over_visible_keys": ("numpy", "paddle"),
    "attend_fused": ("torch", "jax", "mlx"),
    "attend_over_visible_keys": ("torch",),
    "attend_by_flash_kernel": ("torch",),
    "attend_over_chunks": ("array_api",),  # dask arrays only (tests/test_dask.py)
}


def formula(fn, *args, **kwargs):
    """fn's answer with every specialisation off: the core's formula over the primitives."""
    with specialise.primitives_only():
        return fn(*args, **kwargs)


def copy(bk, x):
    """A new tensor of x's backend equal to x (which the core may own)."""
    return bk.tensor(bk.numpy(x), None)


def _both(bk, got, math_result, want, dtype):
    """The specialisation agrees with the core's formula and with the reference."""
    assert_close(bk, got, want, dtype)
    assert_close(bk, math_result, want, dtype)


def _offered(bk, name, offer, may_decline=False):
    """Whether the offer is a function; a backend of OFFERED_BY[name] must make it (unless
    it may decline these inputs, as the table of docs/architecture.md says)."""
    if isinstance(offer, str):
        assert may_decline or bk.name not in OFFERED_BY[name], f"{bk.name} declined {name}: {offer}"
        return False
    return True


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_entry_points_equal_the_formula(bk, dtype, mask):
    t, a, lens, lens_t = _case(bk, dtype, mask)
    ops, masks = bk.module.ops, Masks(lens_t)
    _both(
        bk, core.masked_softmax(ops, t["X"], masks), formula(core.masked_softmax, ops, t["X"], masks),
        ref.masked_softmax(a["X"], lens), dtype,
    )  # fmt: skip
    want = ref.dot_product_attention(a["q"], a["k"], a["v"], lens)[0]
    for need_weights in (True, False):
        got, _ = core.dot_product_attention(ops, t["q"], t["k"], t["v"], masks, need_weights=need_weights)
        math_out, _ = formula(core.dot_product_attention, ops, t["q"], t["k"], t["v"], masks)
        _both(bk, got, math_out, want, dtype)
    weights = dict(
        project_q=lambda q: ops.matmul_t(q, t["W_q"]),
        project_k=lambda k: ops.matmul_t(k, t["W_k"]),
        w_v=t["w_v"],
    )
    got, got_w = core.additive_attention(ops, t["q"], t["k"], t["v"], masks, **weights)
    math_out, math_w = formula(core.additive_attention, ops, t["q"], t["k"], t["v"], masks, **weights)
    want, want_w = ref.additive_attention(a["q"], a["k"], a["v"], lens, a["W_q"], a["W_k"], a["w_v"])
    _both(bk, got, math_out, want, dtype)
    _both(bk, got_w, math_w, want_w, dtype)


@pytest.mark.parametrize("mask", ["1d", "2d"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_softmax_in_the_scores_memory(bk, dtype, mask, monkeypatch):
    lower_thresholds(bk.module, monkeypatch, SMALL_ELEMENTS=0)  # torch: in the scores' memory at every size
    t, a, lens, lens_t = _case(bk, dtype, mask, seed=1)
    if bk.name != "mxnet" or dtype != "float32":  # a NaN row: NaN where visible, 0 where hidden
        a["X"] = a["X"].copy()
        a["X"][0, 0, 0] = np.nan
        t["X"] = bk.tensor(a["X"], dtype)
    ops, masks = bk.module.ops, Masks(lens_t)
    assert isinstance(ops.masked_softmax_in_scores_memory(t["X"], None, masks, False), str)  # the caller's
    offer = ops.masked_softmax_in_scores_memory(copy(bk, t["X"]), None, masks, True)
    if not _offered(bk, "masked_softmax_in_scores_memory", offer):
        return
    got, _ = offer()
    want = ref.masked_softmax(a["X"], lens)
    _both(bk, got, formula(core.masked_softmax, ops, t["X"], masks), want, dtype)


@pytest.mark.parametrize("poisoned", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_written_directly(bk, dtype, poisoned, monkeypatch):
    ops = bk.module.ops
    lower_thresholds(bk.module, monkeypatch, SLICE_MIN_SEQUENCE_ELEMENTS=0)  # torch: slices at every size
    t, a, lens, lens_t = _case(bk, dtype, "1d", seed=2)
    values = a["v"].copy()
    host = [ref.valid_count(n, K) for n in lens]
    if poisoned:  # NaN past each length must not reach the output as 0 * NaN
        for b, n in enumerate(host):
            values[b, n:] = np.nan
    v = bk.tensor(values, dtype)
    masks = Masks(lens_t)
    offer = ops.masked_softmax_writing_padding(t["X"], v, masks, False)  # the caller's X: a copy
    float64_fill = bk.name == "mxnet" and dtype == "float64"  # its sequence mask fills in float32
    if not _offered(bk, "masked_softmax_writing_padding", offer, may_decline=float64_fill):
        return
    weights, visible_values = offer()
    _both(
        bk, weights, formula(core.masked_softmax, ops, t["X"], masks), ref.masked_softmax(a["X"], lens), dtype
    )
    assert_close(bk, t["X"], a["X"], dtype)  # not written
    got = bk.numpy(visible_values).astype(np.float64)
    for b, n in enumerate(host):
        assert (got[b, :n] == bk.numpy(v)[b, :n]).all()
        assert poisoned <= (got[b, n:] == 0).all()


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
    monkeypatch.setattr(tuning.of(ops), "hiddens_innermost", hiddens_innermost)
    forced = force_activation(bk, monkeypatch, activation)
    t, a, lens, lens_t = _case(bk, dtype, "1d", seed=3)
    q_hidden, k_hidden = ops.matmul_t(t["q"], t["W_q"]), ops.matmul_t(t["k"], t["W_k"])
    got = fast_paths.additive_scores_in_blocks(ops, q_hidden, k_hidden, t["w_v"], step)
    want = ref.additive_scores(a["q"], a["k"], a["W_q"], a["W_k"], a["w_v"])
    math_scores = formula(core.additive_scores, ops, q_hidden, k_hidden, t["w_v"])
    if forced and activation == "sigmoid":  # every score shifted by sum(w_v), the weights the same
        assert_close(bk, got, want + a["w_v"].sum(), dtype)
        assert_close(bk, core.masked_softmax(ops, got, Masks(lens_t)), ref.masked_softmax(want, lens), dtype)
        assert_close(bk, math_scores, want, dtype)
    else:
        _both(bk, got, math_scores, want, dtype)
    monkeypatch.setattr(tuning.of(ops), "feature_block_elements", B * K * H * step)
    offer = ops.additive_scores_in_blocks(q_hidden, k_hidden, t["w_v"], Masks())
    assert isinstance(offer, str) == (step == Q)  # offered by every backend where Q queries do not fit


# the adapters that offer the additive features over the visible keys (measured faster there)
READ_ADDITIVE_KEY_LENGTHS = OFFERED_BY["additive_scores_over_visible_keys"]


def force_additive_visible_keys(monkeypatch):
    """Every size and share of hidden keys takes the additive features over the visible keys
    where the adapter reads the lengths; the list records each run's lengths."""
    runs: list = []
    real = fast_paths.additive_scores_over_visible_keys

    def spy(ops, q_hidden, k_hidden, w_v, lengths):
        runs.append(list(lengths))
        return real(ops, q_hidden, k_hidden, w_v, lengths)

    monkeypatch.setattr(fast_paths, "ADDITIVE_VISIBLE_KEYS_MIN_FEATURES", 0)
    monkeypatch.setattr(fast_paths, "ADDITIVE_VISIBLE_KEYS_MAX_SHARE", 1.0)
    monkeypatch.setattr(fast_paths, "additive_scores_over_visible_keys", spy)
    return runs


@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_features_over_the_visible_keys(bk, dtype, activation, monkeypatch):
    # lengths with a fully masked sequence and an over-long one; blocks of one query, so that
    # each sequence's scores come from several blocks
    ops = bk.module.ops
    runs = force_additive_visible_keys(monkeypatch)
    monkeypatch.setattr(tuning.of(ops), "feature_block_elements", 1)
    force_activation(bk, monkeypatch, activation)
    t, a, lens, lens_t = _case(bk, dtype, "1d", seed=5)
    weights = {name: t[name] for name in ("W_q", "W_k", "w_v")}
    got, got_w = bk.module.additive_attention(t["q"], t["k"], t["v"], lens_t, **weights, return_weights=True)
    assert runs == ([[ref.valid_count(n, K) for n in lens]] if bk.name in READ_ADDITIVE_KEY_LENGTHS else [])
    want, want_w = ref.additive_attention(a["q"], a["k"], a["v"], lens, a["W_q"], a["W_k"], a["w_v"])
    math_out, math_w = formula(
        bk.module.additive_attention, t["q"], t["k"], t["v"], lens_t, **weights, return_weights=True
    )
    _both(bk, got, math_out, want, dtype)
    _both(bk, got_w, math_w, want_w, dtype)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernel(bk, dtype, mask, monkeypatch):
    force_fused(bk, monkeypatch)
    ops = bk.module.ops
    t, a, lens, lens_t = _case(bk, dtype, mask, seed=4)
    q, k, v = t["q"], t["k"], bk.tensor(np.random.default_rng(5).normal(size=(B, K, D)), dtype)
    masks, scale = Masks(lens_t), 1 / np.sqrt(D)
    assert isinstance(ops.attend_fused(q, k, v, masks, scale, None, True), str)  # no weights from a kernel
    offer = ops.attend_fused(q, k, v, masks, scale, None, False)
    want = ref.dot_product_attention(a["q"], a["k"], bk.numpy(v).astype(np.float64), lens)[0]
    math_out = formula(core.dot_product_attention, ops, q, k, v, masks)[0]
    if isinstance(offer, str):  # jax declines float64 (its kernel's softmax is float32)
        assert bk.name not in OFFERED_BY["attend_fused"] or dtype == "float64", offer
        got, _ = core.dot_product_attention(ops, q, k, v, masks, need_weights=False)
    else:
        got, weights = offer()
        assert weights is None
    _both(bk, got, math_out, want, dtype)


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
    tensors = Masks(
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
def test_every_specialisation_takes_the_masks(bk, dtype, kind, heads, monkeypatch):
    """The masked softmax in the scores' memory, the fused kernel (forced where the adapter
    has one) and the entry points, with boolean masks and causality, against the core's
    formula and the reference."""
    force_fused(bk, monkeypatch)
    lower_thresholds(bk.module, monkeypatch, SMALL_ELEMENTS=0)  # torch: in the scores' memory at every size
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
    math_out, math_w = formula(core.dot_product_attention, ops, q, k, v, masks)
    for need_weights in (True, False):
        got, got_w = core.dot_product_attention(ops, q, k, v, masks, need_weights=need_weights)
        _both(bk, got, math_out, want, dtype)
        if need_weights:
            _both(bk, got_w, math_w, want_w, dtype)
    offer = ops.attend_fused(q, k, v, masks, 1 / float(np.sqrt(D)), None, False)
    if not isinstance(offer, str):
        _both(bk, offer()[0], math_out, want, dtype)
    if not heads:
        X = ops.matmul_t(q, k)
        want_sm = ref.masked_softmax(bk.numpy(X).astype(np.float64), **np_masks)
        _both(
            bk,
            core.masked_softmax(ops, X, masks),
            formula(core.masked_softmax, ops, X, masks),
            want_sm,
            dtype,
        )
        offer = ops.masked_softmax_in_scores_memory(copy(bk, X), None, masks, True)
        if _offered(bk, "masked_softmax_in_scores_memory", offer):
            assert_close(bk, offer()[0], want_sm, dtype)


@pytest.mark.parametrize("kind", ["none", "causal", "1d"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_past_memory_by_a_kernel(bk, dtype, kind):
    """``attend_past_memory``'s specialisations (torch: SDPA's flash kernel; causal in blocks
    of queries merged by their lse where nothing is differentiated), forced at a small size
    with an odd number of queries, against the reference; what it does not take, it declines."""
    names = specialise.ORDER["attend_past_memory"]
    offered = [name for name in names if bk.name in OFFERED_BY[name]]
    ops = bk.module.ops
    rng = np.random.default_rng(8)
    n = 13
    arrays = [rng.normal(size=(B, n, D)) for _ in range(3)]
    q, k, v = (bk.tensor(a, dtype) for a in arrays)
    a_q, a_k, a_v = (bk.numpy(t).astype(np.float64) for t in (q, k, v))
    lens = np.array([5, 13, 1]) if kind == "1d" else None
    masks = Masks(None if lens is None else bk.tensor(lens), None, kind == "causal")
    want = ref.dot_product_attention(a_q, a_k, a_v, lens, causal=kind == "causal")[0]
    for name in set(names) - set(offered):  # the others decline, saying why
        assert isinstance(getattr(ops, name)(q, k, v, masks, 1.0), str)
    for name in offered:
        offer = getattr(ops, name)(q, k, v, masks, 1 / float(np.sqrt(D)))
        assert _offered(bk, name, offer)
        got, weights = offer()
        assert weights is None
        assert_close(bk, got, want, dtype)
        mask = bk.tensor(rng.random((B, n, n)) < 0.5)
        assert isinstance(getattr(ops, name)(q, k, v, Masks(None, mask, False), 1.0), str)
