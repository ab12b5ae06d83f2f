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
from .test_gradients import assert_gradients_close, central_differences, needs_autodiff
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
    return (
        rng.normal(size=(B, H, q, D)),
        rng.normal(size=(B, kv_heads, k, D)),
        rng.normal(size=(B, kv_heads, k, 2)),
    )


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
        "prefix_lm": (
            dict(mask_mod=mods.prefix_lm(np.array([2, 4]))), lambda b, h, i, j: j <= i or j < [2, 4][b], None
        ),
        "document": (
            dict(mask_mod=mods.document(bk.tensor(IDS))), lambda b, h, i, j: IDS[b, i] == IDS[b, j], None
        ),
        "alibi+window": (
            dict(score_mod=mods.alibi(slopes), mask_mod=mods.sliding_window(3)), _window, _alibi(slopes)
        ),
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
    out, weights = call(return_weights=True)
    assert_close(bk, out, want, dtype)
    assert_close(bk, weights, want_w, dtype)
    assert_close(bk, call(), want, dtype)
    assert_close(bk, call(block_size=2), want, dtype)


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
    inputs = dict(q=q, k=k, v=v)
    return inputs, lens, cotangent, central_differences(fn, inputs, cotangent)


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
    with pytest.raises(
        ValueError, match=r"keys must be 4-D \(batch, kv_heads, keys, features\) like queries"
    ):
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


def test_the_mistakes_people_type_get_one_line_naming_the_argument(bk):
    q = bk.tensor(np.zeros((B, Q, D)), "float32")
    cases = [
        (dict(mask_mod=lambda s, b, h, i, j: i >= j),
         r"^mask_mod must take 4 arguments \(b, h, q_idx, kv_idx\), got a function of 5 \(s, b, h, i, j\); "
         r"it looks like a score_mod$"),
        (dict(score_mod=lambda b, h, i, j: i >= j),
         r"^score_mod must take 5 arguments .* it looks like a mask_mod$"),
        (dict(score_mod=lambda s, b, h, i, j: i >= j), r"^score_mod must return scores, .* got booleans"),
        (dict(mask_mod=lambda b, h, i, j: i - j), r"^mask_mod must return booleans .* got numbers"),
        (dict(casual=True),
         r"^dot_product_attention\(\) got an unexpected keyword argument 'casual'; did you mean 'causal'\?$"),
        (dict(attn_mask=q), r"'attn_mask'; use attention_mask= \(boolean, True: may attend"),
        (dict(is_causal=True), r"'is_causal'; use causal=$"),
        (dict(enable_gqa=True), r"'enable_gqa'; drop it: grouped heads are read from the shapes"),
    ]  # fmt: skip
    for kw, message in cases:
        with pytest.raises(TypeError, match=message):
            multiattn.dot_product_attention(q, q, q, **kw)
    with pytest.raises(ValueError, match=r"^document's ids must have shape \(2, 5\) \(batch, queries\): one "
                       r"document id per position, got shape \(2, 6\)$"):  # fmt: skip
        multiattn.dot_product_attention(q, q, q, mask_mod=mods.document(bk.tensor(IDS)))
    with pytest.raises(
        TypeError, match=r"^masked_softmax\(\) got .* 'valid_len'; did you mean 'valid_lens'\?$"
    ):
        multiattn.masked_softmax(q, valid_len=None)
    if bk.has_layers:
        with pytest.raises(TypeError, match=r"MultiHeadAttention.__call__\(\) got .* 'casual'; did you mean"):
            bk.call(bk.multi_head(4, 2), q, q, q, casual=True)


def test_four_d_masked_softmax(bk):
    X = np.random.default_rng(2).normal(size=(B, H, Q, K))
    lens = np.array([[1, 2, 3, 0, 6], [6, 5, 4, 3, 2]])
    want = ref.masked_softmax(X, lens, MASK, causal=True)
    got = multiattn.masked_softmax(
        bk.tensor(X, "float32"), bk.tensor(lens), attention_mask=bk.tensor(MASK), causal=True
    )
    assert_close(bk, got, want, "float32")


# -- Hugging Face's attention and FlexAttention's functions, ported as torch users write them ---


def _torch_ports():
    """name -> (keywords of one 4-D torch call written with torch ops and captured tensors,
    kv heads, the reference's (mask_fn, score_fn, causal, scale))."""
    import torch

    n, window, cap = 16, 5, 2.0
    doc = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    slopes = torch.tensor(mods.alibi_slopes(8))
    table = torch.linspace(-1.0, 1.0, 2 * n - 1, dtype=torch.float64)
    doc_np, slopes_np, table_np = doc.numpy(), slopes.numpy(), table.numpy()
    return {
        "llama": (dict(causal=True), 8, (None, None, True, None)),
        "qwen2 (grouped 8/2)": (dict(causal=True), 2, (None, None, True, None)),
        "mistral (sliding window)": (
            dict(causal=True, mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx < window), 2,
            (lambda b, h, i, j: i - j < window, None, True, None),
        ),
        "gemma 2 (grouped 8/4, soft-cap, window, query scale)": (
            dict(causal=True, scale=0.2, score_mod=lambda s, b, h, q_idx, kv_idx: cap * torch.tanh(s / cap),
                 mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx < window), 4,
            (lambda b, h, i, j: i - j < window, lambda s, b, h, i, j: cap * np.tanh(s / cap), True, 0.2),
        ),
        "documents (captured ids), alibi (captured slopes)": (
            dict(mask_mod=lambda b, h, q_idx, kv_idx: (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx),
                 score_mod=lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx)), 2,
            (lambda b, h, i, j: doc_np[b, i] == doc_np[b, j] and j <= i,
             lambda s, b, h, i, j: s + slopes_np[h] * (j - i), False, None),
        ),
        "relative bias table, float constant": (
            dict(causal=True, score_mod=lambda s, b, h, q, kv: s + table[q - kv + n - 1] - 0.1 * h), 8,
            (None, lambda s, b, h, i, j: s + table_np[i - j + n - 1] - 0.1 * h, True, None),
        ),
        "dilated window, prefix-LM (or)": (
            dict(mask_mod=lambda b, h, q, kv: ((q - kv) % 2 == 0) & (q >= kv) | (kv < 3)), 2,
            (lambda b, h, i, j: ((i - j) % 2 == 0 and i >= j) or j < 3, None, False, None),
        ),
        "2-D neighbourhood (4 x 4 grid)": (
            dict(mask_mod=lambda b, h, q_idx, kv_idx: (torch.abs(q_idx // 4 - kv_idx // 4) <= 1)
                 & (torch.abs(q_idx % 4 - kv_idx % 4) <= 1)), 4,
            (lambda b, h, i, j: abs(i // 4 - j // 4) <= 1 and abs(i % 4 - j % 4) <= 1, None, False, None),
        ),
    }  # fmt: skip


@pytest.mark.backend("torch")
@pytest.mark.parametrize("name", range(8))
def test_hugging_face_and_flex_attention_run_unchanged_in_one_torch_call(name):
    import torch

    name, (kw, kv_heads, (mask_fn, score_fn, causal, scale)) = list(_torch_ports().items())[name]
    rng = np.random.default_rng(len(name))
    q, k, v = (
        rng.normal(size=(2, 8, 16, 4)),
        rng.normal(size=(2, kv_heads, 16, 4)),
        rng.normal(size=(2, kv_heads, 16, 4)),
    )
    want, want_w = ref.heads_attention(
        q, k, v, causal=causal, scale=scale, mask_fn=mask_fn, score_fn=score_fn
    )
    args = [torch.tensor(x) for x in (q, k, v)]
    out, weights = multiattn.dot_product_attention(*args, return_weights=True, **kw)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-12)
    np.testing.assert_allclose(weights.numpy(), want_w, atol=1e-12)
    np.testing.assert_allclose(
        multiattn.dot_product_attention(*args, block_size=4, **kw).numpy(), want, atol=1e-12
    )
    if "gemma" in name:  # compiled, as a model's forward is
        compiled = torch.compile(
            lambda q, k, v: multiattn.dot_product_attention(q, k, v, **kw), backend="aot_eager"
        )
        np.testing.assert_allclose(compiled(*args).numpy(), want, atol=1e-12)
