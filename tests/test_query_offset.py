"""``query_offset=``: queries that sit after the keys (a decoding step, a prefill chunk).  Each
call's rows must equal the rows query_offset .. query_offset + n - 1 of the full causal
attention over every key (tests/reference.py's loops, float64), on every backend and path:
weights, no weights, blocks, 3-D and 4-D, grouped heads, one offset per sequence, with
``sliding_window`` and ``alibi``, under the frameworks' compilers and through gradients."""

from __future__ import annotations

import numpy as np
import pytest

import multiattn
from multiattn import mods

from . import reference as ref
from .test_gradients import assert_gradients_close, central_differences, needs_autodiff
from .test_mods import _jitted, supported
from .tolerances import assert_close

B, H, K, D = 2, 4, 9, 3
RNG = np.random.default_rng(40)
SLOPES = mods.alibi_slopes(H)
MODS = {
    "causal": (dict(causal=True), None, None),
    "sliding_window": (dict(mask_mod=mods.sliding_window(3)), lambda b, h, i, j: 0 <= i - j < 3, None),
    "alibi+causal": (
        dict(causal=True, score_mod=mods.alibi(SLOPES)),
        None,
        lambda s, b, h, i, j: s + SLOPES[h] * (j - i),
    ),
}


def _full(kv_heads, seed):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(B, H, K, D)),
        rng.normal(size=(B, kv_heads, K, D)),
        rng.normal(size=(B, kv_heads, K, 2)),
    )


def _rows(full, offsets, n):
    """Rows offsets[b] .. offsets[b] + n - 1 of each sequence b of a (B, H, K, .) array."""
    return np.stack([full[b, :, o : o + n] for b, o in enumerate(offsets)])


@pytest.mark.parametrize("mod", list(MODS))
@pytest.mark.parametrize("where", ["first", "middle", "last", "per sequence"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_query_offset_rows_equal_the_full_causal_rows(bk, dtype, where, mod):
    supported(bk, dtype)
    kw, mask_fn, score_fn = MODS[mod]
    n = 1 if where == "last" else 3
    offsets = {"first": [0, 0], "middle": [4, 4], "last": [K - 1, K - 1], "per sequence": [2, 6]}[where]
    q_full, k, v = (bk.numpy(bk.tensor(x, dtype)).astype(np.float64) for x in _full(2, seed=len(where)))
    want_full, want_w_full = ref.heads_attention(
        q_full, k, v, causal=kw.get("causal", False), mask_fn=mask_fn, score_fn=score_fn
    )
    want, want_w = _rows(want_full, offsets, n), _rows(want_w_full, offsets, n)
    offset = offsets[0] if where != "per sequence" else bk.tensor(np.array(offsets))
    q, k, v = (bk.tensor(x, dtype) for x in (_rows(q_full, offsets, n), k, v))

    def call(**more):
        return multiattn.dot_product_attention(q, k, v, query_offset=offset, **kw, **more)

    out, weights = call(return_weights=True)
    assert_close(bk, out, want, dtype)
    assert_close(bk, weights, want_w, dtype)
    assert_close(bk, call(), want, dtype)
    assert_close(bk, call(block_size=2), want, dtype)


def test_query_offset_in_3d_and_with_lengths(bk):
    # 3-D (B, Q, d), one head; lengths hide keys as well: rows of the full call with both
    q_full, k, v = (x[:, 0] for x in _full(4, seed=7))
    lens = np.array([K, 6])
    want_full, _ = ref.dot_product_attention(q_full, k, v, lens, causal=True)
    args = [bk.tensor(x, "float32") for x in (q_full[:, 5:8], k, v)]
    for block_size in (None, 2):
        got = multiattn.dot_product_attention(
            *args, bk.tensor(lens), causal=True, query_offset=5, block_size=block_size
        )
        assert_close(bk, got, want_full[:, 5:8], "float32")


def test_query_offset_under_the_compilers(bk):
    """A decoding step compiled once, the offset a traced argument where the framework takes
    one (jax, tensorflow, torch), its rows against the reference at each offset."""

    def step(q, k, v, t):
        return multiattn.dot_product_attention(q, k, v, causal=True, query_offset=t)

    if bk.name == "torch":
        import torch

        jitted = torch.compile(step, backend="aot_eager")
    else:
        jitted = _jitted(bk, step)
    if jitted is None:
        pytest.skip(f"{bk.name} has no compiler here (eager calls: the tests above)")
    q_full, k, v = _full(2, seed=3)
    want_full, _ = ref.heads_attention(
        *(bk.numpy(bk.tensor(x, "float32")).astype(np.float64) for x in (q_full, k, v)), causal=True
    )
    k_t, v_t = bk.tensor(k, "float32"), bk.tensor(v, "float32")
    for t in (2, 5, K - 1):
        offset = bk.tensor(np.array(t)) if bk.name in ("jax", "tensorflow", "torch") else t
        got = jitted(bk.tensor(q_full[:, :, t : t + 1], "float32"), k_t, v_t, offset)
        assert_close(bk, got, want_full[:, :, t : t + 1], "float32")


@pytest.mark.parametrize("bad, error, words", [
    (np.array([[1, 2]]), TypeError, "query_offset must be an int or"),
    (1.5, TypeError, "query_offset must be an int or"),
    (True, TypeError, "query_offset must be"),
    ([1, 2, 3], ValueError, "got 3 offsets"),
])  # fmt: skip
def test_bad_query_offsets_are_refused_by_name(bk, bad, error, words):
    q, k, v = (bk.tensor(x[:, 0], "float32") for x in _full(4, seed=1))
    with pytest.raises(error, match=words):
        multiattn.dot_product_attention(q, k, v, causal=True, query_offset=bad)


@pytest.mark.parametrize("block_size", [None, 2])
def test_query_offset_gradients(bk, block_size):
    """dq, dk, dv of a prefill chunk (3 queries at 4 .. 6 over 9 keys), materialised and in
    blocks, against central differences of the reference's full causal rows."""
    needs_autodiff(bk)
    dtype = "float64" if "float64" in bk.dtypes else "float32"
    q_full, k, v = (x[:1, :2] for x in _full(4, seed=5))  # (1, 2, ., .): small for the differences
    cotangent = np.random.default_rng(6).normal(size=(1, 2, 3, 2))

    def reference(q, k, v):
        full = np.concatenate([q_full[:, :, :4], q, q_full[:, :, 7:]], axis=2)
        return ref.heads_attention(full, k, v, causal=True)[0][:, :, 4:7]

    inputs = {"q": q_full[:, :, 4:7], "k": k, "v": v}
    want = central_differences(reference, inputs, cotangent)

    def call(q, k, v):
        return multiattn.dot_product_attention(q, k, v, causal=True, query_offset=4, block_size=block_size)

    args = [bk.tensor(inputs[n], dtype) for n in "qkv"]
    _, grads = bk.module.vjp(call, args, bk.tensor(cotangent, dtype))
    got = {n: np.asarray(bk.numpy(g), dtype=np.float64) for n, g in zip("qkv", grads)}
    assert_gradients_close(bk, got, want, dtype)


def test_multi_head_attention_with_query_offset(bk):
    """Multi-head attention (d2l 11.5, grouped heads) of 2 queries at 6 and 7 over 9 keys: the
    rows of the full causal call."""
    rng = np.random.default_rng(8)
    X = rng.normal(size=(B, K, 8))
    weights = {
        n: rng.normal(size=(8 if n in ("W_q", "W_o") else 4, 8)) / 3 for n in ("W_q", "W_k", "W_v", "W_o")
    }
    want, want_w = ref.multi_head_attention(X, X, X, None, weights, num_heads=4, causal=True, num_kv_heads=2)
    t = {n: bk.tensor(w, "float32") for n, w in weights.items()}
    out, attn = multiattn.multi_head_attention(
        bk.tensor(X[:, 6:8], "float32"), bk.tensor(X, "float32"), bk.tensor(X, "float32"), weights=t,
        num_heads=4, num_kv_heads=2, causal=True, query_offset=6, return_weights=True,
    )  # fmt: skip
    assert_close(bk, out, want[:, 6:8], "float32")
    assert_close(bk, attn, want_w[:, :, 6:8], "float32")
