"""Score and mask functions (``multiattn.mods``): each ready-made one, alone and with lengths,
through every entry function and path (weights, no weights, blocks forced), against the
float64 reference of tests/reference.py with the mods' formulas written here as loops; a
function of the user's own, eagerly and under the frameworks' jit; block skipping; errors."""

from __future__ import annotations

import math
import weakref

import numpy as np
import pytest

import multiattn
from multiattn import blockwise, mods, tuning
from multiattn.masks import Masks

from . import reference as ref
from .tolerances import assert_close

B, Q, K, D, HEADS = 2, 7, 7, 4, 2
IDS = np.array([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 3]])  # packed documents
LENS = np.array([0, 5])  # the first sequence sees nothing: its rows are 0


def _window(w):
    return lambda b, h, i, j: 0 <= i - j < w


def _prefix(n):
    return lambda b, h, i, j: j <= i or j < (n if np.ndim(n) == 0 else n[b])


def _document(b, h, i, j):
    return IDS[b, i] == IDS[b, j]


# name -> (mask_mod, its formula, score_mod, its formula); made per test (document's ids as
# the backend's tensors or numpy)
def mod_cases(bk, heads=None):
    slopes = [0.5] if heads is None else list(mods.alibi_slopes(heads))
    return {
        "sliding_window": (mods.sliding_window(3), _window(3), None, None),
        "prefix_lm": (mods.prefix_lm(3), _prefix(3), None, None),
        "prefix_lm_per_sequence": (mods.prefix_lm(np.array([2, 5])), _prefix([2, 5]), None, None),
        "document": (mods.document(bk.tensor(IDS)), _document, None, None),
        "document_numpy_ids": (mods.document(IDS), _document, None, None),
        "and_masks": (
            mods.and_masks(mods.sliding_window(4), mods.prefix_lm(2)),
            lambda b, h, i, j: _window(4)(b, h, i, j) and _prefix(2)(b, h, i, j), None, None,
        ),
        "or_masks": (
            mods.or_masks(mods.sliding_window(2), mods.document(IDS)),
            lambda b, h, i, j: _window(2)(b, h, i, j) or _document(b, h, i, j), None, None,
        ),
        "softcap": (None, None, mods.softcap(0.7), lambda s, b, h, i, j: 0.7 * math.tanh(s / 0.7)),
        "alibi": (None, None, mods.alibi(slopes), lambda s, b, h, i, j: s + slopes[h] * (j - i)),
        "softcap+sliding_window": (
            mods.sliding_window(2), _window(2),
            mods.softcap(0.5), lambda s, b, h, i, j: 0.5 * math.tanh(s / 0.5),
        ),
    }  # fmt: skip


MODS = list(mod_cases(type("fake", (), {"tensor": staticmethod(np.asarray)})))


def supported(bk, dtype):
    if dtype not in bk.dtypes:
        pytest.xfail(f"{bk.name} has no {dtype}")


def reference_weights(scores, lens, mask_fn, score_fn):
    """The masked softmax of the scores modified by score_fn, hidden where mask_fn is False."""
    if score_fn is not None:
        scores = ref.modified_scores(scores, score_fn)
    mask = None if mask_fn is None else ref.function_mask(scores.shape, mask_fn)
    return ref.masked_softmax(scores, lens, attention_mask=mask)


@pytest.mark.parametrize("lengths", [False, True], ids=["alone", "lengths"])
@pytest.mark.parametrize("name", MODS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_each_mod_through_the_dot_product_paths(bk, dtype, name, lengths):
    """masked_softmax, and dot_product_attention with weights, without, and in blocks."""
    supported(bk, dtype)
    mask_mod, mask_fn, score_mod, score_fn = mod_cases(bk)[name]
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    q, k, v = (rng.normal(size=(B, n, D)) for n in (Q, K, K))
    args = [bk.tensor(x, dtype) for x in (q, k, v)]
    rq, rk, rv = (bk.numpy(x).astype(np.float64) for x in args)
    lens, t_lens = (LENS, bk.tensor(LENS)) if lengths else (None, None)
    want_w = reference_weights(ref.dot_product_scores(rq, rk), lens, mask_fn, score_fn)
    want = ref.pool(want_w, rv)
    kw = dict(mask_mod=mask_mod, score_mod=score_mod)
    out, weights = multiattn.dot_product_attention(*args, t_lens, return_weights=True, **kw)
    assert_close(bk, out, want, dtype)
    assert_close(bk, weights, want_w, dtype)
    assert_close(bk, multiattn.dot_product_attention(*args, t_lens, **kw), want, dtype)
    assert_close(bk, multiattn.dot_product_attention(*args, t_lens, block_size=3, **kw), want, dtype)
    X = rng.normal(size=(B, Q, K))
    t_X = bk.tensor(X, dtype)
    want_sm = reference_weights(bk.numpy(t_X).astype(np.float64), lens, mask_fn, score_fn)
    assert_close(bk, multiattn.masked_softmax(t_X, t_lens, **kw), want_sm, dtype)
    if lengths:  # the first sequence sees nothing: 0, not NaN
        assert not np.asarray(bk.numpy(out))[0].any()


@pytest.mark.parametrize("name", MODS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_each_mod_through_multi_head_and_additive_attention(bk, dtype, name):
    supported(bk, dtype)
    mask_mod, mask_fn, score_mod, score_fn = mod_cases(bk, heads=HEADS)[name]
    rng = np.random.default_rng(abs(hash(name)) % 2**32 + 1)
    q, k, v = (rng.normal(size=(B, n, 5)) for n in (Q, K, K))
    args = [bk.tensor(x, dtype) for x in (q, k, v)]
    rq, rk, rv = (bk.numpy(x).astype(np.float64) for x in args)
    h = 8
    weights = {f"W_{n}": rng.normal(size=(h, 5 if n != "o" else h)) * 0.5 for n in "qkvo"}
    t_weights = {n: bk.tensor(w, dtype) for n, w in weights.items()}
    r_weights = {n: bk.numpy(w).astype(np.float64) for n, w in t_weights.items()}
    kw = dict(mask_mod=mask_mod, score_mod=score_mod)
    # multi-head: the reference's heads, each by the formula (per-head scores and mask)
    heads_q, heads_k, heads_v = (
        ref.project(x, r_weights[f"W_{n}"]).reshape(B, -1, HEADS, h // HEADS).transpose(0, 2, 1, 3)
        for n, x in zip("qkv", (rq, rk, rv))
    )
    scores = np.einsum("bhqd,bhkd->bhqk", heads_q, heads_k) / math.sqrt(h // HEADS)
    w = reference_weights(scores, LENS, mask_fn, score_fn)
    pooled = np.einsum("bhqk,bhkd->bhqd", w, heads_v).transpose(0, 2, 1, 3).reshape(B, Q, h)
    want = ref.project(pooled, r_weights["W_o"])
    t_lens = bk.tensor(LENS)
    for block_size in (None, 3):
        got = multiattn.multi_head_attention(
            *args, t_lens, weights=t_weights, num_heads=HEADS, block_size=block_size, **kw
        )
        assert_close(bk, got, want, dtype)
    got, got_w = multiattn.multi_head_attention(
        *args, t_lens, weights=t_weights, num_heads=HEADS, return_weights=True, **kw
    )
    assert_close(bk, got, want, dtype)
    assert_close(bk, got_w, w, dtype)
    # additive: 3-D, one slope for alibi
    mask_mod, mask_fn, score_mod, score_fn = mod_cases(bk)[name]
    kw = dict(mask_mod=mask_mod, score_mod=score_mod)
    W_q, W_k, w_v = rng.normal(size=(h, 5)), rng.normal(size=(h, 5)), rng.normal(size=(h,))
    t_add = dict(W_q=bk.tensor(W_q, dtype), W_k=bk.tensor(W_k, dtype), w_v=bk.tensor(w_v, dtype))
    r_add = {n: bk.numpy(x).astype(np.float64) for n, x in t_add.items()}
    w = reference_weights(ref.additive_scores(rq, rk, **r_add), LENS, mask_fn, score_fn)
    want = ref.pool(w, rv)
    for block_size in (None, 3):
        assert_close(
            bk, multiattn.additive_attention(*args, t_lens, block_size=block_size, **t_add, **kw), want, dtype
        )
    got, got_w = multiattn.additive_attention(*args, t_lens, return_weights=True, **t_add, **kw)
    assert_close(bk, got_w, w, dtype)


# -- a function of the user's own, once for every backend ----------------------------------


def user_mask(b, h, q_idx, kv_idx):
    """Every other key, and none more than 4 back: operators and a helper."""
    return mods.logical_and((kv_idx % 2) == 0, q_idx - kv_idx < 4)


def user_score(score, b, h, q_idx, kv_idx):
    """A capped score with a penalty for keys after the query: operators and helpers."""
    return mods.where(kv_idx > q_idx, mods.tanh(score) - 1.0, score)


def _user_reference(rq, rk, rv):
    def score_fn(s, b, h, i, j):
        return math.tanh(s) - 1.0 if j > i else s

    w = reference_weights(
        ref.dot_product_scores(rq, rk), None, lambda b, h, i, j: j % 2 == 0 and i - j < 4, score_fn
    )
    return ref.pool(w, rv)


def _jitted(bk, fn):
    """fn under the framework's jit, where it has one (else None)."""
    if bk.name == "jax":
        import jax

        return jax.jit(fn)
    if bk.name == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    if bk.name == "mlx":
        import mlx.core as mx

        return mx.compile(fn)
    return None


@pytest.mark.parametrize("block_size", [None, 3])
def test_a_users_own_functions_run_unchanged_on_every_backend(bk, block_size):
    rng = np.random.default_rng(11)
    q, k, v = (rng.normal(size=(B, n, D)) for n in (Q, K, K))
    args = [bk.tensor(x, "float32") for x in (q, k, v)]
    want = _user_reference(*(bk.numpy(x).astype(np.float64) for x in args))

    def attend(q, k, v):
        return multiattn.dot_product_attention(
            q, k, v, score_mod=user_score, mask_mod=user_mask, block_size=block_size
        )

    assert_close(bk, attend(*args), want, "float32")
    jitted = _jitted(bk, attend)
    if jitted is not None:
        assert_close(bk, jitted(*args), want, "float32")


# -- block skipping -------------------------------------------------------------------------


def test_ready_made_masks_skip_their_hidden_blocks_and_mask_only_partial_ones():
    from multiattn.backends import numpy as backend

    ops = backend.ops
    q = np.zeros((1, 16, 4))
    plan = blockwise.Plan(ops, Masks(mask_mod=mods.sliding_window(4)), 16, 16, 4, like=q)
    assert plan.kind(4, 8, 0, 4) == (blockwise.PARTIAL, ("mod",))
    assert plan.kind(8, 12, 0, 4)[0] == blockwise.SKIP  # distances 5..11: past the window
    assert plan.kind(0, 4, 4, 8)[0] == blockwise.SKIP  # keys after the queries
    wide = blockwise.Plan(ops, Masks(mask_mod=mods.sliding_window(16)), 16, 16, 4, like=q)
    assert wide.kind(8, 12, 0, 4)[0] == blockwise.FULL  # distances 5..11, all inside 16
    ids = np.repeat(np.arange(4), 4)[None]  # four documents of four
    docs = blockwise.Plan(ops, Masks(mask_mod=mods.document(ids)), 16, 16, 4, like=q)
    assert docs.kind(4, 8, 4, 8)[0] == blockwise.FULL
    assert docs.kind(4, 8, 0, 4)[0] == blockwise.SKIP
    # a function of the user's own: evaluated per block, read on the host
    own = blockwise.Plan(
        ops, Masks(mask_mod=mods.as_mask_function(lambda b, h, i, j: j <= 3)), 16, 16, 4, like=q
    )
    assert own.kind(8, 12, 4, 8)[0] == blockwise.SKIP
    assert own.kind(8, 12, 0, 4)[0] == blockwise.FULL


def _score_areas(bk, monkeypatch):
    """The list that each q k^T product's area (queries x keys) will be appended to; the
    compiled steps made afresh."""
    areas = []
    real, shape = bk.module.ops.matmul_t, bk.module.ops.shape
    monkeypatch.setattr(
        type(bk.module.ops),
        "matmul_t",
        lambda self, a, b: areas.append(shape(a)[-2] * shape(b)[-2]) or real(a, b),
    )
    monkeypatch.setattr(blockwise, "_PROGRAMS", weakref.WeakKeyDictionary())
    return areas


def test_a_window_in_compiled_steps_matches_the_reference(bk, monkeypatch):
    """Where each block step is a compiled program (jax, tensorflow), forced at a small size:
    a window's blocks, partial and full, match the reference."""
    areas = _score_areas(bk, monkeypatch)
    monkeypatch.setattr(blockwise, "COMPILE_MIN_BLOCKS", 1)
    monkeypatch.setattr(blockwise, "_has_compiler", lambda ops: True)
    rng = np.random.default_rng(2)
    q = bk.tensor(rng.normal(size=(1, 24, 4)), "float32")
    out = multiattn.dot_product_attention(q, q, q, mask_mod=mods.sliding_window(4), block_size=4)
    x = bk.numpy(q).astype(np.float64)
    want = ref.dot_product_attention(x, x, x, attention_mask=ref.function_mask((1, 24, 24), _window(4)))[0]
    assert_close(bk, out, want, "float32")
    if bk.name not in ("jax", "tensorflow"):  # their steps are traced once: the areas once each
        assert areas == [16] * 11, "the 6 blocks on the diagonal and the 5 before them"


def test_key_ranges_hold_every_key_a_block_of_queries_sees():
    """``MaskFunction.key_range``: the plan leaves blocks outside it unexamined, so every
    visible key must lie inside it."""
    n = prefix = np.array([3, 9])
    cases = [
        (mods.sliding_window(4), _window(4)),
        (mods.prefix_lm(prefix), _prefix(prefix)),
        (
            mods.and_masks(mods.sliding_window(5), mods.prefix_lm(n)),
            lambda b, h, i, j: _window(5)(b, h, i, j) and _prefix(n)(b, h, i, j),
        ),
        (
            mods.or_masks(mods.sliding_window(2), mods.prefix_lm(n)),
            lambda b, h, i, j: _window(2)(b, h, i, j) or _prefix(n)(b, h, i, j),
        ),
    ]
    for fn, formula in cases:
        for q0 in range(0, 20, 3):
            q1 = q0 + 3
            lo, hi = fn.key_range(q0, q1)
            seen = [j for b in range(2) for i in range(q0, q1) for j in range(20) if formula(b, 0, i, j)]
            assert seen and lo <= min(seen) and max(seen) < hi, (fn, q0, lo, hi)
    assert mods.or_masks(mods.sliding_window(2), mods.document(IDS)).key_range(0, 3) is None
    assert mods.document(IDS).key_range(0, 3) is None


def test_a_sliding_window_computes_only_the_blocks_it_shows(bk, monkeypatch):
    areas = _score_areas(bk, monkeypatch)
    rng = np.random.default_rng(1)
    q = bk.tensor(rng.normal(size=(1, 24, 4)), "float32")  # 36 blocks: not compiled
    out = multiattn.dot_product_attention(q, q, q, mask_mod=mods.sliding_window(4), block_size=4)
    assert areas == [16] * (6 + 5), "the 6 blocks on the diagonal and the 5 before them"
    x = bk.numpy(q).astype(np.float64)
    want = ref.dot_product_attention(x, x, x, attention_mask=ref.function_mask((1, 24, 24), _window(4)))[0]
    assert_close(bk, out, want, "float32")


# -- errors ---------------------------------------------------------------------------------


def test_mod_errors_name_the_argument(bk):
    q = bk.tensor(np.zeros((1, 3, 2)), "float32")
    with pytest.raises(TypeError, match="score_mod must be a function"):
        multiattn.dot_product_attention(q, q, q, score_mod=3)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        multiattn.masked_softmax(bk.tensor(np.zeros((1, 3, 3)), "float32"), mask_mod="window")
    with pytest.raises(TypeError, match=r"mask_mod must return booleans .* got numbers"):
        multiattn.dot_product_attention(q, q, q, mask_mod=lambda b, h, i, j: i - j)
    with pytest.raises(ValueError, match="alibi has 2 slopes for scores with 1 heads"):
        multiattn.dot_product_attention(q, q, q, score_mod=mods.alibi([0.5, 0.25]))
    with pytest.raises(ValueError, match="sliding_window's w must be an int >= 1, got 0"):
        mods.sliding_window(0)
    with pytest.raises(ValueError, match="softcap's c must be a number > 0"):
        mods.softcap(-1)


def test_alibi_slopes_are_the_papers():
    np.testing.assert_allclose(mods.alibi_slopes(8), [2 ** (-(i + 1)) for i in range(8)])
    np.testing.assert_allclose(mods.alibi_slopes(4), [2 ** (-2 * (i + 1)) for i in range(4)])
    # not a power of two: those of 4, then every other one of 8's (the paper's code)
    np.testing.assert_allclose(mods.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])


# -- the layers' calls ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dot", "additive", "multi_head"])
def test_the_layers_take_score_and_mask_functions(bk, kind):
    """Each layer's call with score_mod and mask_mod gives what the functions give with the
    layer's canonical weights (the functions are held to the reference above)."""
    rng = np.random.default_rng(12)
    q, k, v = (bk.tensor(rng.normal(size=(B, n, 4)), "float32") for n in (Q, K, K))
    lens = bk.tensor(LENS)
    kw = dict(mask_mod=mods.sliding_window(3), score_mod=mods.softcap(0.8))
    if kind == "dot":
        layer, want = bk.dot(), multiattn.dot_product_attention(q, k, v, lens, **kw)
    elif kind == "additive":
        layer = bk.additive(4, 4, 6)
        w = {n: bk.tensor(x, "float32") for n, x in layer.get_weights().items()}
        want = multiattn.additive_attention(q, k, v, lens, **w, **kw)
    else:
        layer = bk.multi_head(8, 2, query_size=4, key_size=4, value_size=4)
        w = {n: bk.tensor(x, "float32") for n, x in layer.get_weights().items()}
        want = multiattn.multi_head_attention(q, k, v, lens, weights=w, num_heads=2, **kw)
    got = bk.call(layer, q, k, v, lens, **kw)
    np.testing.assert_allclose(bk.numpy(got), bk.numpy(want), rtol=1e-5, atol=1e-6)
    unmodified = bk.numpy(bk.call(layer, q, k, v, lens))
    assert not np.allclose(unmodified, bk.numpy(got)), "the functions changed nothing"


def test_the_automatic_block_follows_the_mask_structure(monkeypatch):
    """A sliding window asks for blocks of half its width (those inside the band are then shown
    whole; its width where steps are costly), documents for the largest power of two dividing
    every document's start; never below MIN_BLOCK, never above the machine's side."""
    ops = multiattn.get_backend("numpy").ops
    monkeypatch.setattr(blockwise, "SCORES_BUDGET_BYTES", 0)
    q = np.zeros((1, 8192, 64), dtype=np.float32)
    side = blockwise.automatic_block_size(ops, q, q)
    assert blockwise.automatic_block_size(ops, q, q, mask_mod=mods.sliding_window(512)) == min(side, 256)
    assert blockwise.automatic_block_size(ops, q, q, mask_mod=mods.sliding_window(8)) == blockwise.MIN_BLOCK
    assert mods.sliding_window(512).block_side(ops) == 256
    monkeypatch.setattr(
        tuning.of(ops), "costly_steps", True
    )  # fewer, larger blocks: the band's two triangles
    assert mods.sliding_window(512).block_side(ops) == 512
    monkeypatch.setattr(tuning.of(ops), "costly_steps", False)
    ids = np.repeat(np.arange(8), 1024)[None]
    assert mods.document(ids).block_side(ops) == 1024
    assert mods.document(np.array([[0, 0, 0, 1, 1, 1, 1, 1]])).block_side(ops) == 1  # a start at 3
    assert mods.document(np.zeros((1, 8), dtype=int)).block_side(ops) is None  # one document
    both = mods.and_masks(mods.sliding_window(512), mods.document(ids))
    assert both.block_side(ops) == 256
    assert mods.prefix_lm(4).block_side(ops) is None


def test_masks_that_hide_nothing_more_are_dropped():
    """causal=True beside a mask function that is causal already (a sliding window), and
    lengths that hide no key (read on the host, for the blocks): the call then runs as the
    other masks alone (their fast paths)."""
    from multiattn import validation
    from multiattn.backends.numpy import ops

    causal = Masks(None, None, True)
    for fn, implied in (
        (mods.sliding_window(4), True),
        (mods.prefix_lm(2), False),
        (mods.and_masks(mods.sliding_window(4), mods.document(IDS)), True),
        (mods.or_masks(mods.sliding_window(4), mods.prefix_lm(2)), False),
        (lambda b, h, i, j: j <= i, False),  # a function of the user's: not known
    ):
        assert validation.with_mods(None, fn, causal)[1].causal is not implied
    for lens, dropped in (([7, 9], True), ([6, 9], False), ([6.5, 7.0], True), ([np.nan, 9.0], False)):
        masks = Masks(np.array(lens), None, True).without_idle_lengths(ops, 7)
        assert (masks.valid_lens is None) is dropped and masks.causal
