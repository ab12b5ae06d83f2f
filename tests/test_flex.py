"""FlexAttention's calls on every backend (``multiattn.flex``: ``create_block_mask(mask_mod, B,
H, Q_LEN, KV_LEN)`` positional, ``flex_attention``), and FlexAttention-style functions written
with torch's own tensor methods, against the loops of tests/reference.py."""

from __future__ import annotations

import numpy as np
import pytest

import multiattn
from multiattn import mods
from multiattn.flex import create_block_mask, flex_attention

from . import reference as ref
from .test_mods import _jitted, supported
from .tolerances import assert_close, tolerance

B, H, HKV, N, E = 2, 4, 2, 12, 3


def window_mask(b, h, q_idx, kv_idx):  # a FlexAttention mask_mod; row 0 of sequence 1 sees nothing
    causal_window = mods.logical_and(q_idx >= kv_idx, q_idx - kv_idx < 5)
    return mods.logical_and(causal_window, mods.logical_or(b == 0, q_idx > 0))


def bias(score, b, h, q_idx, kv_idx):  # float constants: exact in float64 calls
    return score - 0.1 * (q_idx - kv_idx) + 0.25 * h


def _ref_mask(b, h, i, j):
    return i >= j and i - j < 5 and (b == 0 or i > 0)


def _ref_bias(s, b, h, i, j):
    return s - 0.1 * (i - j) + 0.25 * h


def _inputs(bk, dtype, seed):
    rng = np.random.default_rng(seed)
    shapes = ((B, H, N, E), (B, HKV, N, E), (B, HKV, N, 2))
    args = [bk.tensor(rng.normal(size=shape), dtype) for shape in shapes]
    return args, [bk.numpy(x).astype(np.float64) for x in args]


def _assert_lse(bk, got, want, dtype):
    got = np.asarray(bk.numpy(got), dtype=np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    tol = tolerance(bk.name, dtype) * max(1.0, float(np.abs(want[finite]).max()))
    assert float(np.abs(got[finite] - want[finite]).max()) <= tol


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_flex_attention_with_a_block_mask_reused_matches_the_reference(bk, dtype):
    supported(bk, dtype)
    block_mask = create_block_mask(window_mask, B, None, N, N)  # FlexAttention's positional form
    for seed in (1, 2):  # the block mask reused by a second call with new data
        args, f64 = _inputs(bk, dtype, seed)
        out, lse = flex_attention(
            *args, score_mod=bias, block_mask=block_mask, enable_gqa=True, return_lse=True
        )
        want, _ = ref.heads_attention(*f64, mask_fn=_ref_mask, score_fn=_ref_bias)
        assert_close(bk, out, want, dtype)
        _assert_lse(bk, lse, ref.heads_lse(*f64[:2], mask_fn=_ref_mask, score_fn=_ref_bias), dtype)
        assert float(np.abs(bk.numpy(out)[1, :, 0]).max()) == 0.0  # a row that sees nothing: 0
    # no block mask: every key; scale given
    out = flex_attention(*args, scale=0.3, enable_gqa=True)
    assert_close(bk, out, ref.heads_attention(*f64, scale=0.3)[0], dtype)


def test_flex_attention_under_the_compilers(bk):
    """jax.jit, tf.function, mx.compile (torch.compile: tests/test_torch_compile.py)."""
    args, f64 = _inputs(bk, "float32", 3)
    block_mask = create_block_mask(window_mask, B, H, N, N, BLOCK_SIZE=4)

    def attend(q, k, v):
        return flex_attention(
            q, k, v, score_mod=bias, block_mask=block_mask, enable_gqa=True, return_lse=True
        )

    jitted = _jitted(bk, attend)
    if jitted is None:
        pytest.skip(f"{bk.name} has no compiler of its own")
    out, lse = jitted(*args)
    assert_close(bk, out, ref.heads_attention(*f64, mask_fn=_ref_mask, score_fn=_ref_bias)[0], "float32")
    _assert_lse(bk, lse, ref.heads_lse(*f64[:2], mask_fn=_ref_mask, score_fn=_ref_bias), "float32")


def test_flex_attention_errors_are_flex_attentions(bk):
    args, _ = _inputs(bk, "float32", 4)
    with pytest.raises(ValueError, match=r"same number of heads but got Hq=4 and Hkv=2\. Try setting"):
        flex_attention(*args)
    q3 = bk.tensor(np.ones((B, N, E)), "float32")
    with pytest.raises(ValueError, match=r"4-D query, key and value \(B, H, L, E\), got shapes \(2, 12, 3\)"):
        flex_attention(q3, q3, q3)
    block_mask = create_block_mask(window_mask, 3, None, N, N)
    with pytest.raises(ValueError, match=r"made for \(batch, q_len, kv_len\) = \(3, 12, 12\), the call has"):
        flex_attention(*args, block_mask=block_mask, enable_gqa=True)
    with pytest.raises(ValueError, match=r"made for H = 3 heads, the call has 4"):
        flex_attention(*args, block_mask=create_block_mask(window_mask, B, 3, N, N), enable_gqa=True)
    with pytest.raises(TypeError, match=r"got both B=2 and batch=2; pass one"):
        create_block_mask(window_mask, 2, None, N, N, batch=2)
    with pytest.raises(ValueError, match=r"^create_block_mask's Q_LEN must be a positive int, got 0"):
        create_block_mask(window_mask, 2, None, 0, N)


# -- FlexAttention's own functions, as torch users write them (attention-gym) -----------------


def _gym():
    """name -> (mask_mod, score_mod) written with torch tensor methods, (mask_fn, score_fn) of the
    reference."""
    import torch

    width, kernel = 4, 3  # NATTEN on a 4 x 4 grid: each query sees the 3 x 3 around its centre
    doc = torch.tensor([0] * 5 + [1] * 6 + [2] * 5)
    prefix = torch.tensor([3, 6])
    table = torch.linspace(-1.0, 1.0, 16, dtype=torch.float64)
    slopes = torch.tensor(mods.alibi_slopes(H))
    doc_np, table_np, slopes_np = doc.numpy(), table.numpy(), slopes.numpy()

    def natten(b, h, q_idx, kv_idx):
        q_x, q_y, kv_x, kv_y = q_idx // width, q_idx % width, kv_idx // width, kv_idx % width
        centre_x = q_x.clamp(kernel // 2, (width - 1) - kernel // 2)
        centre_y = q_y.clamp(kernel // 2, (width - 1) - kernel // 2)
        return ((centre_x - kv_x).abs() <= kernel // 2) & ((centre_y - kv_y).abs() <= kernel // 2)

    def natten_np(b, h, i, j):
        cx, cy = min(max(i // width, 1), width - 2), min(max(i % width, 1), width - 2)
        return abs(cx - j // width) <= 1 and abs(cy - j % width) <= 1

    return {
        "sliding window": (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 3), None,
                           lambda b, h, i, j: 0 <= i - j <= 3, None),
        "prefix lm (captured per sequence)": (
            lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < prefix[b]), None,
            lambda b, h, i, j: j <= i or j < [3, 6][b], None),
        "document (captured ids)": (lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx], None,
                                    lambda b, h, i, j: doc_np[i] == doc_np[j], None),
        "natten 2-D (clamp, abs)": (natten, None, natten_np, None),
        "noop (new_ones)": (
            lambda b, h, q_idx, kv_idx: b.new_ones(size=(), dtype=torch.bool), None, None, None),
        "alibi (captured slopes)": (None, lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx),
                                    None, lambda s, b, h, i, j: s + slopes_np[h] * (j - i)),
        "relative bias table, float constant": (
            None, lambda s, b, h, q_idx, kv_idx: s + table[(q_idx - kv_idx).abs()] - 0.05 * (q_idx - kv_idx),
            None, lambda s, b, h, i, j: s + table_np[abs(i - j)] - 0.05 * (i - j)),
        "causal by where (new_zeros, to)": (
            None, lambda s, b, h, q_idx, kv_idx: torch.where(
                q_idx >= kv_idx, s, s.new_zeros(()) - float("inf")) + (q_idx - kv_idx).to(s.dtype) * 0.01,
            lambda b, h, i, j: j <= i, lambda s, b, h, i, j: s + 0.01 * (i - j)),
    }  # fmt: skip


@pytest.mark.backend("torch")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(range(8)))
def test_attention_gym_functions_run_unchanged_on_torch(dtype, name):
    import torch

    name, (mask_mod, score_mod, mask_fn, score_fn) = list(_gym().items())[name]
    seen = []

    def spy(b, h, q_idx, kv_idx):  # what FlexAttention promises: torch tensors
        seen.append(all(isinstance(x, torch.Tensor) for x in (b, h, q_idx, kv_idx)))
        return mask_mod(b, h, q_idx, kv_idx)

    kw = dict(mask_mod=None if mask_mod is None else spy, score_mod=score_mod)
    rng = np.random.default_rng(len(name))
    q, k, v = (rng.normal(size=(B, heads, 16, 4)) for heads in (H, 2, 2))
    args = [torch.tensor(x).to(getattr(torch, dtype)) for x in (q, k, v)]
    f64 = [x.double().numpy() for x in args]
    want, want_w = ref.heads_attention(*f64, mask_fn=mask_fn, score_fn=score_fn)
    out, weights = multiattn.dot_product_attention(*args, return_weights=True, **kw)
    check = dict(bk=type("bk", (), {"name": "torch", "numpy": staticmethod(lambda t: t.detach().numpy())}),
                 dtype=dtype)  # fmt: skip
    assert_close(got=out, want=want, **check)
    assert_close(got=weights, want=want_w, **check)
    assert_close(got=multiattn.dot_product_attention(*args, block_size=4, **kw), want=want, **check)
    assert mask_mod is None or (seen and all(seen))

    x = torch.tensor(rng.normal(size=(B, 16, 8))).to(args[0].dtype)
    weights = {n: torch.tensor(rng.normal(size=(8, 8))).to(x.dtype) for n in ("W_q", "W_k", "W_v", "W_o")}
    grouped = {n: w[:4] if n in ("W_k", "W_v") else w for n, w in weights.items()}
    f64w = {n: w.double().numpy() for n, w in grouped.items()}
    want, want_w = ref.multi_head_attention(
        *(x.double().numpy(),) * 3, None, f64w, H, num_kv_heads=2, mask_fn=mask_fn, score_fn=score_fn
    )
    out, got_w = multiattn.multi_head_attention(
        x, x, x, weights=grouped, num_heads=H, num_kv_heads=2, return_weights=True, **kw
    )
    assert_close(got=out, want=want, **check)
    assert_close(got=got_w, want=want_w, **check)
    out = multiattn.multi_head_attention(
        x, x, x, weights=grouped, num_heads=H, num_kv_heads=2, block_size=4, **kw
    )
    assert_close(got=out, want=want, **check)


@pytest.mark.backend("tensorflow")
def test_tensorflow_users_idioms_with_positions():
    """tf.gather, tf.abs and tf.where take the positions; float constants exact in float64."""
    import tensorflow as tf

    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(B, H, 8, E)) for _ in range(3))
    table = np.linspace(-1.0, 1.0, 15)
    captured = tf.constant(table)

    def score_mod(s, b, h, q_idx, kv_idx):
        s = tf.where(q_idx >= kv_idx, s, s + 0.5)
        return s + tf.gather(captured, q_idx - kv_idx + 7) - 0.05 * (q_idx - kv_idx)

    def mask_mod(b, h, q_idx, kv_idx):
        return tf.abs(q_idx - kv_idx) <= 2

    want, _ = ref.heads_attention(
        q, k, v, mask_fn=lambda b, h, i, j: abs(i - j) <= 2,
        score_fn=lambda s, b, h, i, j: (s if i >= j else s + 0.5) + table[i - j + 7] - 0.05 * (i - j),
    )  # fmt: skip
    attend = tf.function(
        lambda q, k, v: multiattn.dot_product_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    )
    np.testing.assert_allclose(attend(*(tf.constant(x) for x in (q, k, v))).numpy(), want, atol=1e-12)
