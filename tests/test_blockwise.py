"""Attention in blocks (``multiattn.blockwise``): the online softmax against the float64
reference on every backend, its block plan (what it skips, what it masks), the lse it
returns, ``combine_attention``, the automatic choice and the errors."""

from __future__ import annotations

import functools
import weakref

import numpy as np
import pytest

import multiattn
from multiattn import blockwise, mods, tuning
from multiattn.masks import Masks

from . import reference as ref
from .forcing import force_blocks
from .tolerances import assert_close

# (batch, queries, keys, width, value width, block size): blocks that divide nothing, one
# block of everything, queries past the keys (causal rows that see every key)
SHAPES = [(2, 7, 11, 4, 3, 3), (1, 5, 5, 2, 2, 8), (3, 9, 4, 3, 5, 2), (2, 16, 16, 4, 4, 4)]
MASK_KINDS = ["none", "1d", "2d", "bool", "padding", "causal", "1d+causal", "2d+bool+causal"]


def case(kind, B, Q, K, rng):
    """(numpy masks for the reference: valid_lens, attention_mask, causal); each kind with
    lengths or a mask has a row that sees nothing."""
    lens = mask = None
    if "1d" in kind:
        lens = rng.integers(0, K + 2, size=B)
        lens[0] = 0
    if "2d" in kind:
        lens = rng.integers(-1, K + 2, size=(B, Q))
        lens[0, 0] = 0
    if "bool" in kind:
        mask = rng.random((B, Q, K)) < 0.5
        mask[-1, -1] = False
    if kind == "padding":
        mask = rng.random((B, 1, K)) < 0.6
        mask[0] = False
    return lens, mask, "causal" in kind


def tensors(bk, dtype, lens, mask):
    return (None if lens is None else bk.tensor(lens)), (None if mask is None else bk.tensor(mask))


def supported(bk, dtype):
    if dtype not in bk.dtypes:
        pytest.xfail(f"{bk.name} has no {dtype}")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_dot_product_in_blocks_matches_the_reference(bk, dtype, kind, shape):
    supported(bk, dtype)
    B, Q, K, d, v_width, block = shape
    rng = np.random.default_rng(hash((kind, shape)) % 2**32)
    q, k = rng.normal(size=(B, Q, d)), rng.normal(size=(B, K, d))
    v = rng.normal(size=(B, K, v_width))
    lens, mask, causal = case(kind, B, Q, K, rng)
    args = [bk.tensor(x, dtype) for x in (q, k, v)]
    t_lens, t_mask = tensors(bk, dtype, lens, mask)
    out, lse = multiattn.dot_product_attention(
        *args, t_lens, attention_mask=t_mask, causal=causal, return_lse=True, block_size=block
    )
    rounded = [bk.numpy(x).astype(np.float64) for x in args]
    want, weights = ref.dot_product_attention(*rounded, lens, attention_mask=mask, causal=causal)
    assert_close(bk, out, want, dtype)
    want_lse = reference_lse(rounded[0], rounded[1], ref.visible((B, Q, K), lens, mask, causal))
    got_lse = bk.numpy(lse).astype(np.float64)
    assert got_lse.shape == (B, Q)
    assert ((got_lse == -np.inf) == (want_lse == -np.inf)).all(), "lse -inf exactly where nothing is visible"
    seen = want_lse > -np.inf
    np.testing.assert_allclose(got_lse[seen], want_lse[seen], rtol=0, atol=2e-2 if "16" in dtype else 1e-5)


def reference_lse(q, k, visible):
    """log sum_j exp(q_i . k_j / sqrt(d)) over the visible j, by loops; -inf where none is."""
    B, Q, d = q.shape
    lse = np.full((B, Q), -np.inf)
    for b in range(B):
        for i in range(Q):
            scores = [float(q[b, i] @ k[b, j]) / np.sqrt(d) for j in range(k.shape[1]) if visible[b, i, j]]
            if scores:
                top = max(scores)
                lse[b, i] = top + np.log(sum(np.exp(s - top) for s in scores))
    return lse


@pytest.mark.parametrize("kind", ["none", "1d", "bool", "2d+bool+causal"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_multi_head_and_additive_in_blocks_match_the_reference(bk, dtype, kind):
    supported(bk, dtype)
    B, Q, K, h, heads = 2, 6, 9, 8, 2
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(B, n, 5)) for n in (Q, K, K))
    lens, mask, causal = case(kind, B, Q, K, rng)
    t_lens, t_mask = tensors(bk, dtype, lens, mask)
    args = [bk.tensor(x, dtype) for x in (q, k, v)]
    weights = {f"W_{n}": rng.normal(size=(h, 5 if n != "o" else h)) * 0.5 for n in "qkvo"}
    got = multiattn.multi_head_attention(
        *args, t_lens, weights={n: bk.tensor(w, dtype) for n, w in weights.items()}, num_heads=heads,
        attention_mask=t_mask, causal=causal, block_size=4,
    )  # fmt: skip
    want = ref.multi_head_attention(q, k, v, lens, weights, heads, attention_mask=mask, causal=causal)[0]
    assert_close(bk, got, want, dtype)
    W_q, W_k, w_v = rng.normal(size=(h, 5)), rng.normal(size=(h, 5)), rng.normal(size=(h,))
    got = multiattn.additive_attention(
        *args, t_lens, W_q=bk.tensor(W_q, dtype), W_k=bk.tensor(W_k, dtype), w_v=bk.tensor(w_v, dtype),
        attention_mask=t_mask, causal=causal, block_size=4,
    )  # fmt: skip
    want = ref.additive_attention(q, k, v, lens, W_q, W_k, w_v, attention_mask=mask, causal=causal)[0]
    assert_close(bk, got, want, dtype)


def test_nan_in_what_the_masks_hide_never_reaches_the_output(bk):
    """Hidden keys' values (beyond the lengths, in skipped and in partial blocks) may be NaN."""
    rng = np.random.default_rng(5)
    q, k, v = rng.normal(size=(2, 6, 4)), rng.normal(size=(2, 10, 4)), rng.normal(size=(2, 10, 3))
    lens = np.array([3, 7])
    want = ref.dot_product_attention(q, k, v, lens)[0]
    k[0, 3:], v[0, 3:], k[1, 7:], v[1, 7:] = np.nan, np.nan, np.nan, np.inf
    out = multiattn.dot_product_attention(
        *(bk.tensor(x, "float32") for x in (q, k, v)), bk.tensor(lens), block_size=4
    )
    assert_close(bk, out, want, "float32")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_scores_far_apart_in_partial_blocks_match_the_reference(bk, dtype):
    """Rows whose first visible score is 800 below another (its softmax weight underflows,
    in float64 too: a fused softmax's lse must not be read from it), with rows that see
    nothing.  The scores are small integers, exact in every dtype."""
    supported(bk, dtype)
    rng = np.random.default_rng(6)
    q = np.ones((2, 12, 1))
    k = np.where(np.arange(12) % 3 == 0, -800.0, np.arange(12) % 3)[None, :, None].repeat(2, 0)
    v = rng.normal(size=(2, 12, 3))
    lens = np.array([0, 9])
    visible = ref.function_mask((2, 12, 12), lambda b, h, i, j: 0 <= i - j < 6 and j < lens[b])
    args = [bk.tensor(x, dtype) for x in (q, k, v)]
    got, lse = multiattn.dot_product_attention(
        *args, bk.tensor(lens), mask_mod=mods.sliding_window(6), block_size=4, return_lse=True
    )
    rounded = [bk.numpy(x).astype(np.float64) for x in args]
    want = ref.dot_product_attention(*rounded, attention_mask=visible)[0]
    want_lse, got_lse = reference_lse(rounded[0], rounded[1], visible), bk.numpy(lse).astype(np.float64)
    assert ((got_lse == -np.inf) == (want_lse == -np.inf)).all(), "lse -inf exactly where nothing is visible"
    seen = want_lse > -np.inf
    if dtype == "float64":
        assert_close(bk, got, want, dtype)
        np.testing.assert_allclose(got_lse[seen], want_lse[seen], rtol=0, atol=1e-7)
    else:  # within the rounding of a float32 score of -800: 800 * 2^-23 ~ 1e-4
        np.testing.assert_allclose(bk.numpy(got).astype(np.float64), want, rtol=0, atol=1e-4)
        np.testing.assert_allclose(got_lse[seen], want_lse[seen], rtol=0, atol=1e-4)


# -- the plan: what is skipped, what is masked ------------------------------------------------


def test_the_plan_skips_hidden_blocks_and_masks_only_partial_ones():
    from multiattn.backends import numpy as backend

    ops = backend.ops
    causal = blockwise.Plan(ops, Masks(causal=True), 8, 8, 4)
    assert causal.kind(0, 4, 4, 8) == (blockwise.SKIP, ())  # above the diagonal
    assert causal.kind(4, 8, 0, 4) == (blockwise.FULL, ())  # below it
    assert causal.kind(4, 8, 4, 8) == (blockwise.PARTIAL, ("causal",))
    lengths = blockwise.Plan(ops, Masks(np.array([3, 6])), 8, 12, 4)
    assert lengths.kind(0, 4, 0, 4) == (blockwise.PARTIAL, ("lengths",))  # the first sees 3 of 4
    assert lengths.kind(0, 4, 4, 8) == (blockwise.PARTIAL, ("lengths",))
    assert lengths.kind(0, 4, 8, 12) == (blockwise.SKIP, ())  # past every length
    full = blockwise.Plan(ops, Masks(np.array([8, 9])), 4, 12, 4)
    assert full.kind(0, 4, 4, 8) == (blockwise.FULL, ())
    mask = np.ones((1, 8, 8), bool)
    mask[:, :4, 4:] = False
    mask[:, 5, 1] = False
    masked = blockwise.Plan(ops, Masks(attention_mask=mask), 8, 8, 4)
    assert masked.kind(0, 4, 4, 8)[0] == blockwise.SKIP
    assert masked.kind(0, 4, 0, 4)[0] == blockwise.FULL
    assert masked.kind(4, 8, 0, 4) == (blockwise.PARTIAL, ("mask",))


def test_causal_and_lengths_compute_only_the_visible_blocks(bk, monkeypatch):
    calls, areas = [], []
    real, shape = bk.module.ops.matmul_t, bk.module.ops.shape

    def counted(self, a, b):
        calls.append(1)
        areas.append(shape(a)[-2] * shape(b)[-2])
        return real(a, b)

    monkeypatch.setattr(type(bk.module.ops), "matmul_t", counted)
    # steps made anew, with the counting matmul_t
    monkeypatch.setattr(blockwise, "_PROGRAMS", weakref.WeakKeyDictionary())
    q = bk.tensor(np.random.default_rng(1).normal(size=(1, 16, 4)), "float32")
    multiattn.dot_product_attention(q, q, q, causal=True, block_size=4)
    # 6 blocks below the diagonal; each of the 4 on it in two halves of its queries, the first
    # half against the first half of its keys (2 x 2 + 2 x 4 scores of its 4 x 4)
    assert sorted(areas) == [4] * 4 + [8] * 4 + [16] * 6, "causal: no score above the diagonal's quarters"
    calls.clear()
    multiattn.dot_product_attention(q, q, q, bk.tensor(np.array([4])), block_size=4)
    if bk.module.ops.host_values(bk.tensor(np.array([4]))) is not None:
        assert len(calls) == 4, "lengths: one key block per query block"
    else:
        assert len(calls) == 16


# -- combine_attention --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("parts", [1, 2, 5])
def test_combine_attention_over_disjoint_key_sets_is_attention_over_all(bk, dtype, parts):
    """Random disjoint subsets of the keys, some of which a row sees nothing of (and one row
    that sees no key at all), merged: attention over every key."""
    supported(bk, dtype)
    rng = np.random.default_rng(parts)
    B, Q, K, d = 2, 5, 13, 4
    q, k, v = rng.normal(size=(B, Q, d)), rng.normal(size=(B, K, d)), rng.normal(size=(B, K, 3))
    visible = rng.random((B, Q, K)) < 0.5
    visible[0, 0] = False
    args = [bk.tensor(x, dtype) for x in (q, k, v)]
    owner = rng.integers(0, parts, size=K)
    pieces = []
    for p in range(parts):
        subset = visible & (owner == p)
        pieces.append(
            multiattn.dot_product_attention(*args, attention_mask=bk.tensor(subset), return_lse=True)
        )
    out, lse = multiattn.combine_attention(pieces)
    want_out, want_lse = multiattn.dot_product_attention(
        *args, attention_mask=bk.tensor(visible), return_lse=True
    )
    assert_close(bk, out, ref.dot_product_attention(q, k, v, attention_mask=visible)[0], dtype)
    got_lse, want_lse = bk.numpy(lse).astype(np.float64), bk.numpy(want_lse).astype(np.float64)
    assert got_lse[0, 0] == -np.inf and (bk.numpy(out)[0, 0] == 0).all()
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5)


def test_combine_attention_errors(bk):
    out = bk.tensor(np.zeros((2, 3, 4)), "float32")
    lse = bk.tensor(np.zeros((2, 3)), "float32")
    with pytest.raises(ValueError, match="at least one"):
        multiattn.combine_attention([])
    with pytest.raises(ValueError, match=r"parts\[1\]: lse must have the shape of output"):
        multiattn.combine_attention([(out, lse), (out, bk.tensor(np.zeros((2, 4)), "float32"))])
    with pytest.raises(ValueError, match=r"parts\[0\] must be an \(output, lse\) pair"):
        multiattn.combine_attention([(out,)])


# -- the automatic choice, and the keywords' errors ---------------------------------------------


def test_scores_past_the_budget_run_in_blocks_without_being_asked(bk, monkeypatch):
    calls = force_blocks(monkeypatch, 3)  # records; the size the budget would choose: 3
    monkeypatch.setattr(blockwise, "automatic_block_size", lambda ops, q, k, *args, **options: 3)
    rng = np.random.default_rng(2)
    q, k, v = (bk.tensor(rng.normal(size=(2, 7, 4)), "float32") for _ in range(3))
    out = multiattn.dot_product_attention(q, k, v, causal=True)
    assert calls == [(3, 7, 7)]
    assert_close(
        bk, out, ref.dot_product_attention(*(bk.numpy(x) for x in (q, k, v)), causal=True)[0], "float32"
    )
    calls.clear()
    multiattn.dot_product_attention(q, k, v, causal=True, return_weights=True)
    assert calls == [], "the weights are wanted: the scores whole"


def test_the_automatic_block_size_follows_the_budget_and_the_cache(monkeypatch):
    from multiattn.backends import numpy as backend

    small, large = np.zeros((1, 64, 8), np.float32), np.zeros((1, 4096, 8), np.float32)
    monkeypatch.setattr(blockwise, "SCORES_BUDGET_BYTES", 64 * 64 * 4)
    assert blockwise.automatic_block_size(backend.ops, small, small) is None
    assert blockwise.automatic_block_size(backend.ops, large, large) is not None
    assert blockwise.block_size_for(1, 4, cache_bytes=1 << 20) == 512
    assert blockwise.block_size_for(1, 4, cache_bytes=2 << 20) == 512  # powers of two
    assert blockwise.block_size_for(64, 4, cache_bytes=1 << 20) == blockwise.MIN_BLOCK
    assert blockwise.block_size_for(1, 4, cache_bytes=1 << 30) == blockwise.MAX_BLOCK
    # additive attention's blocks hold its features: hiddens per score
    assert blockwise.automatic_block_size(backend.ops, large, large, per_score=64) == blockwise.MIN_BLOCK
    side = blockwise.automatic_block_size(backend.ops, large, large)
    monkeypatch.setattr(tuning.of(backend.ops), "block_area", 4)  # compiled steps: larger blocks
    assert blockwise.automatic_block_size(backend.ops, large, large) == 2 * side
    monkeypatch.setattr(tuning.of(backend.ops), "block_area", 2)  # twice the bytes: a power of two
    assert blockwise.automatic_block_size(backend.ops, large, large) in (side, 2 * side)
    assert blockwise.block_size_for(8, 4, cache_bytes=1 << 20, area=2) == 256  # 2 MiB of scores
    assert blockwise.block_size_for(1, 4, cache_bytes=1 << 30, area=16) == 4 * blockwise.MAX_BLOCK


def test_masks_that_hide_most_scores_take_the_blocks_from_half_the_budget(monkeypatch):
    """The choice counts the scores the masks keep (``kept_fraction``): from half the budget, a
    call keeping at most ``KEPT_FOR_BLOCKS`` of them runs in blocks, which skip the rest."""
    from multiattn.backends import numpy as backend

    x = np.zeros((1, 1024, 8), np.float32)
    kept = functools.partial(blockwise.kept_fraction, backend.ops, n_queries=1024, n_keys=1024)
    assert kept(Masks()) == 1.0
    assert kept(Masks(causal=True)) == pytest.approx(0.5 + 0.5 / 1024)
    assert kept(Masks(valid_lens=np.array([256, np.nan]))) == 0.125  # a NaN length shows nothing
    assert kept(Masks(mask_mod=mods.sliding_window(128))) < 0.25  # its key ranges, by 128 queries
    assert kept(Masks(valid_lens=np.array([1000]), causal=True)) == pytest.approx(0.5 + 0.5 / 1024)
    monkeypatch.setattr(blockwise, "SCORES_BUDGET_BYTES", 1024 * 1024 * 4)  # the scores fit
    choose = functools.partial(blockwise.automatic_block_size, backend.ops, x, x)
    assert choose(masks=Masks()) is None
    assert choose(masks=Masks(valid_lens=np.array([700]))) is None  # keeps 0.68
    assert choose(masks=Masks(causal=True)) is not None
    assert choose(masks=Masks(valid_lens=np.array([256]))) is not None
    monkeypatch.setattr(blockwise, "SCORES_BUDGET_BYTES", 1024 * 1024 * 8)  # below half of it
    assert choose(masks=Masks(causal=True)) is None


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "8"])
def test_block_size_errors_name_the_argument(bk, bad):
    q = bk.tensor(np.zeros((1, 2, 4)), "float32")
    with pytest.raises(ValueError, match=r"block_size must be a positive integer or None \(automatic\), got"):
        multiattn.dot_product_attention(q, q, q, block_size=bad)


def test_block_size_with_weights_is_an_error(bk):
    q = bk.tensor(np.zeros((1, 2, 4)), "float32")
    with pytest.raises(ValueError, match="block_size=4 needs return_weights=False"):
        multiattn.dot_product_attention(q, q, q, block_size=4, return_weights=True)
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        multiattn.dot_product_attention(q, q, q, return_lse=1)


@pytest.mark.parametrize("kind", ["none", "2d+bool+causal"])
def test_the_compiled_block_steps_match_the_reference(bk, kind, monkeypatch):
    """Where a framework compiles the block steps (``Ops.compiled``: tensorflow, jax), forced
    here at a small size, with gradients."""
    monkeypatch.setattr(blockwise, "COMPILE_MIN_BLOCKS", 1)
    monkeypatch.setattr(blockwise, "_PROGRAMS", weakref.WeakKeyDictionary())
    rng = np.random.default_rng(6)
    B, Q, K = 2, 10, 7
    q, k, v = rng.normal(size=(B, Q, 4)), rng.normal(size=(B, K, 4)), rng.normal(size=(B, K, 3))
    lens, mask, causal = case(kind, B, Q, K, rng)
    t_lens, t_mask = tensors(bk, "float32", lens, mask)
    args = [bk.tensor(x, "float32") for x in (q, k, v)]
    fn = lambda q, k, v: multiattn.dot_product_attention(  # noqa: E731
        q, k, v, t_lens, attention_mask=t_mask, causal=causal, block_size=3
    )
    assert_close(
        bk,
        fn(*args),
        ref.dot_product_attention(q, k, v, lens, attention_mask=mask, causal=causal)[0],
        "float32",
    )
    if bk.module.vjp is not None:
        from .test_gradients import assert_gradients_close

        cotangent = rng.normal(size=(B, Q, 3))
        _, grads = bk.module.vjp(fn, args, bk.tensor(cotangent, "float32"))
        step, want = 1e-6, {}
        for name, x in zip("qkv", (q, k, v)):
            grad = np.zeros_like(x)
            for idx in np.ndindex(x.shape):
                for sign in (1, -1):
                    shifted = [a.copy() for a in (q, k, v)]
                    shifted["qkv".index(name)][idx] += sign * step
                    out = ref.dot_product_attention(*shifted, lens, attention_mask=mask, causal=causal)[0]
                    grad[idx] += sign * float(np.sum(out * cotangent))
            want[name] = grad / (2 * step)
        got = {name: bk.numpy(g).astype(np.float64) for name, g in zip("qkv", grads)}
        assert_gradients_close(bk, got, want, "float32")


def test_float_lengths_in_blocks_compare_as_the_reference(bk):
    """2.5 keeps 3 keys, NaN none, inf all: the plan reads them as the mask does."""
    rng = np.random.default_rng(9)
    q, k, v = rng.normal(size=(4, 3, 4)), rng.normal(size=(4, 9, 4)), rng.normal(size=(4, 9, 2))
    lens = np.array([2.5, np.nan, np.inf, 4.0])
    out = multiattn.dot_product_attention(
        *(bk.tensor(x, "float32") for x in (q, k, v)), bk.tensor(lens, "float32"), block_size=2
    )
    assert_close(bk, out, ref.dot_product_attention(q, k, v, lens)[0], "float32")


@pytest.mark.backend("mlx")
def test_under_mx_compile_which_unrolls_the_plan_the_query_blocks_are_as_many_at_every_n(monkeypatch):
    """mx.compile unrolls the host's plan: its blocks are N / 8 a side at every N, so that the
    program (and its compile time) does not grow with N; the output and the gradients are the
    reference's, causal with lengths."""
    from multiattn import schedule

    from .harness import harness

    bk = harness("mlx")
    sides: list = []
    real = blockwise.attention
    spy = lambda *a, **kw: sides.append(kw["block_size"]) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(blockwise, "attention", spy)
    monkeypatch.setattr(blockwise, "SCORES_BUDGET_BYTES", 16 * 16 * 4)
    monkeypatch.setattr(blockwise, "block_size_for", lambda *a, **kw: 2)  # eagerly: blocks of 2
    for n in (32, 96):
        _compiled_causal_case(bk, n, np.random.default_rng(n), gradients=n == 32)
        assert sides[-2 if n == 32 else -1 :] == [n // schedule.UNROLLED_QUERY_BLOCKS] * (2 if n == 32 else 1)


def _compiled_causal_case(bk, n, rng, gradients):
    import mlx.core as mx

    from .test_gradients import assert_gradients_close, central_differences

    q, k, v, cotangent = (rng.normal(size=(1, n, 4)) for _ in range(4))
    lens = np.array([n - 5])
    tensors = [bk.tensor(x, "float32") for x in (q, k, v)]

    def attend(q, k, v):
        return bk.module.dot_product_attention(q, k, v, bk.tensor(lens), causal=True)

    assert_close(
        bk, mx.compile(attend)(*tensors), ref.dot_product_attention(q, k, v, lens, causal=True)[0], "float32"
    )
    if gradients:
        loss = lambda q, k, v: (attend(q, k, v) * bk.tensor(cotangent, "float32")).sum()  # noqa: E731
        grads = mx.compile(mx.grad(loss, argnums=(0, 1, 2)))(*tensors)

        def fn(queries, keys, values):
            return ref.dot_product_attention(queries, keys, values, lens, causal=True)[0]

        want = central_differences(fn, dict(queries=q, keys=k, values=v), cotangent)
        got = {name: np.array(g, dtype=np.float64) for name, g in zip(want, grads)}
        assert_gradients_close(bk, got, want, "float32")


@pytest.mark.backend("torch")
def test_under_torch_compile_which_unrolls_the_plan_the_query_blocks_are_as_many_at_every_n(monkeypatch):
    """As under mx.compile: torch.compile (AOTAutograd, its backward too) of a causal call with
    lengths in blocks of N / 8, output and gradients against the reference."""
    import torch

    from multiattn import schedule

    from .harness import harness
    from .test_gradients import assert_gradients_close, central_differences

    sides: list = []
    real = blockwise.attention
    spy = lambda *a, **kw: sides.append(kw["block_size"]) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(blockwise, "attention", spy)
    monkeypatch.setattr(blockwise, "SCORES_BUDGET_BYTES", 16 * 16 * 8)
    monkeypatch.setattr(blockwise, "block_size_for", lambda *a, **kw: 2)
    m, n, rng = multiattn.get_backend("torch"), 32, np.random.default_rng(7)
    q, k, v, cotangent = (rng.normal(size=(1, n, 4)) for _ in range(4))
    lens = np.array([n - 5])
    compiled = torch.compile(
        lambda q, k, v: m.dot_product_attention(q, k, v, torch.tensor(lens), causal=True), backend="aot_eager"
    )
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = compiled(*tensors)
    grads = torch.autograd.grad((out * torch.tensor(cotangent)).sum(), tensors)
    assert sides and set(sides) == {n // schedule.UNROLLED_QUERY_BLOCKS}

    def fn(queries, keys, values):
        return ref.dot_product_attention(queries, keys, values, lens, causal=True)[0]

    np.testing.assert_allclose(out.detach().numpy(), fn(q, k, v), rtol=1e-10, atol=1e-12)
    want = central_differences(fn, dict(queries=q, keys=k, values=v), cotangent)
    got = {name: g.numpy() for name, g in zip(want, grads)}
    assert_gradients_close(harness("torch"), got, want, "float64")


@pytest.mark.backend("torch")
def test_torch_compile_is_known_to_unroll_the_plan():
    import torch

    ops = multiattn.get_backend("torch").ops
    compiled = torch.compile(lambda x: x + 1 if ops.unrolls_loops(x) else x - 1)
    assert compiled(torch.zeros(2)).tolist() == [1, 1] and not ops.unrolls_loops(torch.zeros(2))


def test_hidden_keys_get_exactly_zero_weight_in_partial_blocks(bk, monkeypatch):
    """A causal call in blocks of 64 whose last value row is 1e38 (finite): every query before the
    last key must not see it, not even as 1e38 times exp(-inf) (paddle's vectorised exp gives a
    denormal there, which also made its diagonal blocks 8x slower)."""
    monkeypatch.setattr(blockwise, "automatic_block_size", lambda ops, q, k, *args, **options: 64)
    rng = np.random.default_rng(9)
    q, k, v = (rng.normal(size=(1, 128, 4)) for _ in range(3))
    v[0, -1] = 1e38
    got = bk.numpy(
        multiattn.dot_product_attention(*(bk.tensor(x, "float32") for x in (q, k, v)), causal=True)
    )
    want = ref.dot_product_attention(q, k, v, causal=True)[0]
    np.testing.assert_allclose(np.asarray(got, np.float64)[0, :-1], want[0, :-1], rtol=1e-4, atol=1e-5)
