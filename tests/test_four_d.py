"""4-D calls, torch SDPA's layout: queries (B, H, Q, d), keys and values (B, H_kv, K, .) with
H_kv dividing H, on every backend and path (weights, no weights, blocks forced), with lengths,
a (B, 1, Q, K) mask, causality, ``scale=``, the ready-made mods and a user's own functions,
under the frameworks' compilers and through gradients, against the loops of
tests/reference.py (``heads_attention``)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import multiattn
from multiattn import mods

from . import reference as ref
from .test_gradients import assert_gradients_close, needs_autodiff
from .test_mods import _jitted, supported
from .tolerances import assert_close

B, H, Q, K, D = 2, 4, 5, 6, 3
RNG = np.random.default_rng(38)
MASK = RNG.random((B, 1, Q, K)) < 0.8
IDS = np.array([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]])  # packed documents, Q = K = 6 below
CASES = {
    "lengths (B,)": dict(valid_lens=np.array([3, 6])),
    "lengths (B, Q), mask, causal, scale": dict(
        valid_lens=np.array([[1, 2, 3, 0, 6], [6, 5, 4, 3, 2]]), attention_mask=MASK, causal=True, scale=0.3
    ),
}


def _inputs(kv_heads, seed, q=Q, k=K):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, H, q, D)), rng.normal(size=(B, kv_heads, k, D)), rng.normal(size=(B, kv_heads, k, 2))


def _as(bk, kw):
    return {n: bk.tensor(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_four_d_calls_match_the_reference(bk, dtype, kv_heads, case):
    supported(bk, dtype)
    args = [bk.tensor(x, dtype) for x in _inputs(kv_heads, seed=kv_heads)]
    kw = dict(CASES[case])
    lens = kw.pop("valid_lens")
    want, want_w = ref.heads_attention(*(bk.numpy(x).astype(np.float64) for x in args), lens, **kw)
    call = functools.partial(multiattn.dot_product_attention, *args, bk.tensor(lens), **_as(bk, kw))
    out, weights = call(return_weights=True)
    assert_close(bk, out, want, dtype)
    assert_close(bk, weights, want_w, dtype)
    assert_close(bk, call(), want, dtype)
    out, lse = call(block_size=2, return_lse=True)
    assert_close(bk, out, want, dtype)
    assert tuple(bk.numpy(lse).shape) == (B, H, Q)


def _window(b, h, i, j):
    return 0 <= i - j < 3


def _alibi(slopes):
    return lambda s, b, h, i, j: s + slopes[h] * (j - i)


def mod_cases(bk):
    slopes = mods.alibi_slopes(H)
    return {
        "sliding_window+causal": (dict(mask_mod=mods.sliding_window(3), causal=True), _window, None),
        "prefix_lm": (dict(mask_mod=mods.prefix_lm(np.array([2, 4]))), lambda b, h, i, j: j <= i or j < [2, 4][b], None),
        "document": (dict(mask_mod=mods.document(bk.tensor(IDS))), lambda b, h, i, j: IDS[b, i] == IDS[b, j], None),
        "alibi+window": (dict(score_mod=mods.alibi(slopes), mask_mod=mods.sliding_window(3)), _window, _alibi(slopes)),
        "softcap": (dict(score_mod=mods.softcap(0.5)), None, lambda s, b, h, i, j: 0.5 * np.tanh(s / 0.5)),
        "users own": (
            dict(
                score_mod=lambda s, b, h, i, j: s + 0.1 * (i - j) - 0.25 * h,
                mask_mod=lambda b, h, i, j: mods.logical_or(j <= i, (j + h) % 3 == 0),
            ),
            lambda b, h, i, j: j <= i or (j + h) % 3 == 0,
            lambda s, b, h, i, j: s + 0.1 * (i - j) - 0.25 * h,
        ),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(mod_cases(type("fake", (), {"tensor": staticmethod(np.asarray)}))))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_four_d_mods_in_every_path(bk, dtype, name):
    supported(bk, dtype)
    kw, mask_fn, score_fn = mod_cases(bk)[name]
    args = [bk.tensor(x, dtype) for x in _inputs(2, seed=len(name), q=6, k=6)]
    lens = np.array([6, 5])
    want, want_w = ref.heads_attention(
        *(bk.numpy(x).astype(np.float64) for x in args), lens, causal=kw.get("causal", False),
        mask_fn=mask_fn, score_fn=score_fn,
    )  # fmt: skip
    call = functools.partial(multiattn.dot_product_attention, *args, bk.tensor(lens), **kw)
    if (bk.name, dtype, name) == ("paddle", "float64", "users own"):
        # paddle computes an integer tensor times a Python float in float32 (docs/mods.md)
        check = lambda got, want, dtype: np.testing.assert_allclose(bk.numpy(got), want, atol=1e-7)  # noqa: E731
    else:
        check = functools.partial(assert_close, bk)
    out, weights = call(return_weights=True)
    check(out, want, dtype)
    check(weights, want_w, dtype)
    check(call(), want, dtype)
    check(call(block_size=2), want, dtype)


@pytest.mark.parametrize("block_size", [None, 2])
def test_four_d_grouped_calls_under_the_compilers(bk, block_size):
    """jax.jit, tf.function, mx.compile (torch.compile: test_frameworks), with lengths, a
    mask, causality and a user's score function."""
    args = [bk.tensor(x, "float32") for x in _inputs(2, seed=3)]
    lens, mask = np.array([4, 6]), MASK

    def score(s, b, h, i, j):
        return s - 0.05 * (i - j)

    want, _ = ref.heads_attention(
        *(bk.numpy(x).astype(np.float64) for x in args), lens, mask, True,
        score_fn=lambda s, b, h, i, j: s - 0.05 * (i - j),
    )  # fmt: skip
    t_lens, t_mask = bk.tensor(lens), bk.tensor(mask)

    def attend(q, k, v):
        return multiattn.dot_product_attention(
            q, k, v, t_lens, attention_mask=t_mask, causal=True, score_mod=score, block_size=block_size
        )

    assert_close(bk, attend(*args), want, "float32")
    jitted = _jitted(bk, attend)
    if jitted is not None:
        assert_close(bk, jitted(*args), want, "float32")


@functools.lru_cache(maxsize=None)
def _finite_differences():
    q, k, v = _inputs(1, seed=9, q=3, k=4)
    q, k, v = q[:1, :2], k[:1], v[:1]
    lens = np.array([[3, 0, 4]])
    fn = lambda q, k, v: ref.heads_attention(q, k, v, lens, causal=True, scale=0.7)[0]  # noqa: E731
    cotangent = np.random.default_rng(1).normal(size=fn(q, k, v).shape)
    inputs, grads, step = dict(q=q, k=k, v=v), {}, 1e-6
    for name, array in inputs.items():
        grad = np.zeros_like(array)
        for idx in np.ndindex(array.shape):
            for sign in (1, -1):
                shifted = dict(inputs, **{name: array.copy()})
                shifted[name][idx] += sign * step
                grad[idx] += sign * float(np.sum(fn(**shifted) * cotangent))
        grads[name] = grad / (2 * step)
    return inputs, lens, cotangent, grads


@pytest.mark.parametrize("block_size", [None, 2])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_four_d_grouped_gradients_match_finite_differences(bk, dtype, block_size):
    needs_autodiff(bk)
    supported(bk, dtype)
    inputs, lens, cotangent, want = _finite_differences()
    t_lens = bk.tensor(lens)

    def fn(q, k, v):
        return bk.module.dot_product_attention(q, k, v, t_lens, causal=True, scale=0.7, block_size=block_size)

    tensors = [bk.tensor(x, dtype) for x in inputs.values()]
    _, grads = bk.module.vjp(fn, tensors, bk.tensor(cotangent, dtype))
    got = {n: np.asarray(bk.numpy(g), dtype=np.float64) for n, g in zip(inputs, grads)}
    assert_gradients_close(bk, got, want, dtype)


def test_four_d_parts_combine_to_the_whole(bk):
    q, k, v = (bk.tensor(x, "float32") for x in _inputs(2, seed=5))
    whole = multiattn.dot_product_attention(q, k, v, return_lse=True)
    halves = [
        multiattn.dot_product_attention(q, k[:, :, s, :], v[:, :, s, :], return_lse=True)
        for s in (slice(0, 3), slice(3, K))
    ]
    out, lse = multiattn.combine_attention(halves)
    assert_close(bk, out, np.asarray(bk.numpy(whole[0]), np.float64), "float32")
    assert_close(bk, lse, np.asarray(bk.numpy(whole[1]), np.float64), "float32")


@pytest.mark.layers
def test_the_dot_product_layer_takes_four_d_inputs(bk):
    args = [bk.tensor(x, "float32") for x in _inputs(2, seed=6)]
    lens = np.array([2, 5])
    want, want_w = ref.heads_attention(*(bk.numpy(x).astype(np.float64) for x in args), lens)
    layer = bk.dot()
    assert_close(bk, bk.call(layer, *args, bk.tensor(lens)), want, "float32")


def test_four_d_errors_name_the_argument(bk):
    q, k, v = (bk.tensor(x, "float32") for x in _inputs(2, seed=7))
    three = bk.tensor(np.zeros((B, K, D)), "float32")
    with pytest.raises(ValueError, match=r"keys must be 4-D \(batch, kv_heads, keys, features\) like queries"):
        multiattn.dot_product_attention(q, three, three)
    k3 = bk.tensor(np.zeros((B, 3, K, D)), "float32")
    with pytest.raises(ValueError, match=r"keys must have a number of heads dividing the queries' 4"):
        multiattn.dot_product_attention(q, k3, bk.tensor(np.zeros((B, 3, K, 2)), "float32"))
    with pytest.raises(ValueError, match=r"values must have 2 heads like keys"):
        multiattn.dot_product_attention(q, k, bk.tensor(np.zeros((B, 1, K, 2)), "float32"))
    with pytest.raises(ValueError, match=r"valid_lens must have shape \(2,\) \(batch,\) or \(2, 5\)"):
        multiattn.dot_product_attention(q, k, v, bk.tensor(np.array([[1, 2]])))
    with pytest.raises(TypeError, match=r"scale must be a finite number .* got 'x'"):
        multiattn.dot_product_attention(q, k, v, scale="x")
