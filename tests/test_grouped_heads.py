"""Grouped-query and multi-query attention (``num_kv_heads``) through ``multi_head_attention``
on every backend: values on every path (weights, no weights, blocks forced) with lengths,
causality and mask functions, and gradients, against the loops of tests/reference.py (query
head i using key/value head i // (num_heads / num_kv_heads)); the errors."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import multiattn
from multiattn import mods

from . import reference as ref
from .test_gradients import assert_gradients_close
from .tolerances import assert_close

B, Q, K, WIDTH, HEADS, HIDDENS = 2, 6, 5, 3, 8, 16
LENS = np.array([0, 4])  # the first sequence sees nothing: its rows are 0
CASES = {
    "none": dict(),
    "lengths": dict(valid_lens=LENS),
    "lengths+causal": dict(valid_lens=LENS, causal=True),
    "sliding_window": dict(mask_mod=mods.sliding_window(2)),
    "per-head mask": dict(attention_mask=np.random.default_rng(5).random((B, HEADS, Q, K)) < 0.7),
}


def _inputs(num_kv_heads, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(B, Q, WIDTH)), rng.normal(size=(B, K, WIDTH)), rng.normal(size=(B, K, WIDTH))
    kv_rows = HIDDENS // HEADS * num_kv_heads
    rows = {"q": HIDDENS, "k": kv_rows, "v": kv_rows, "o": HIDDENS}
    weights = {f"W_{n}": rng.normal(size=(rows[n], HIDDENS if n == "o" else WIDTH)) * 0.5 for n in "qkvo"}
    weights.update({f"b_{n}": rng.normal(size=(rows[n],)) * 0.1 for n in "qkvo"})
    return (q, k, v), weights


def _reference(inputs, weights, num_kv_heads, case):
    kw = dict(CASES[case])
    mask_mod = kw.pop("mask_mod", None)
    mask_fn = None if mask_mod is None else (lambda b, h, i, j: 0 <= i - j < 2)
    lens = kw.pop("valid_lens", None)
    return ref.multi_head_attention(
        *inputs, lens, weights, HEADS, num_kv_heads=num_kv_heads, mask_fn=mask_fn, **kw
    )


def _call_kwargs(bk, case):
    kw = dict(CASES[case])
    for name in ("valid_lens", "attention_mask"):
        if name in kw:
            kw[name] = bk.tensor(kw[name])
    return kw


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["grouped", "multi-query"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_grouped_heads_on_every_path(bk, dtype, num_kv_heads, case):
    if dtype not in bk.dtypes:
        pytest.xfail(f"{bk.name} has no {dtype}")
    inputs, weights = _inputs(num_kv_heads, seed=num_kv_heads)
    args = [bk.tensor(x, dtype) for x in inputs]
    t_weights = {n: bk.tensor(w, dtype) for n, w in weights.items()}
    r_inputs = [bk.numpy(x).astype(np.float64) for x in args]
    r_weights = {n: bk.numpy(w).astype(np.float64) for n, w in t_weights.items()}
    want, want_w = _reference(r_inputs, r_weights, num_kv_heads, case)
    kw = dict(weights=t_weights, num_heads=HEADS, num_kv_heads=num_kv_heads, **_call_kwargs(bk, case))
    got, got_w = multiattn.multi_head_attention(*args, return_weights=True, **kw)
    assert_close(bk, got, want, dtype)
    assert_close(bk, got_w, want_w, dtype)
    for block_size in (None, 2):
        assert_close(bk, multiattn.multi_head_attention(*args, block_size=block_size, **kw), want, dtype)


@functools.lru_cache(maxsize=None)
def _finite_differences(num_kv_heads, case):
    inputs, weights = _inputs(num_kv_heads, seed=10 + num_kv_heads)
    cotangent = np.random.default_rng(3).normal(size=(B, Q, HIDDENS))
    arrays = {"queries": inputs[0], "keys": inputs[1], "values": inputs[2], "W_k": weights["W_k"]}

    def loss(**changed):
        given = {**arrays, **changed}
        all_weights = {**weights, "W_k": given["W_k"]}
        out = _reference((given["queries"], given["keys"], given["values"]), all_weights, num_kv_heads, case)[
            0
        ]
        return float(np.sum(out * cotangent))

    step, grads = 1e-6, {}
    for name, array in arrays.items():
        grad = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            for sign in (1, -1):
                shifted = array.copy()
                shifted[index] += sign * step
                grad[index] += sign * loss(**{name: shifted})
        grads[name] = grad / (2 * step)
    return inputs, weights, cotangent, grads


@pytest.mark.parametrize("block_size", [None, 2], ids=["whole", "blocks"])
@pytest.mark.parametrize("case", ["lengths+causal", "sliding_window"])
@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["grouped", "multi-query"])
def test_grouped_heads_gradients(bk, num_kv_heads, case, block_size):
    """Gradients of queries, keys, values and the shared W_k (summed over each group's heads)."""
    if bk.module.vjp is None:
        pytest.xfail(f"{bk.name} has no autodiff")
    dtype = "float64" if "float64" in bk.dtypes else "float32"
    inputs, weights, cotangent, want = _finite_differences(num_kv_heads, case)
    fixed = {n: bk.tensor(w, dtype) for n, w in weights.items() if n != "W_k"}
    kw = dict(num_heads=HEADS, num_kv_heads=num_kv_heads, block_size=block_size, **_call_kwargs(bk, case))

    def fn(q, k, v, W_k):
        return bk.module.multi_head_attention(q, k, v, weights={**fixed, "W_k": W_k}, **kw)

    tensors = [bk.tensor(x, dtype) for x in (*inputs, weights["W_k"])]
    _, grads = bk.module.vjp(fn, tensors, bk.tensor(cotangent, dtype))
    got = {n: np.asarray(bk.numpy(g), dtype=np.float64) for n, g in zip(want, grads)}
    assert_gradients_close(bk, got, want, dtype)


def test_grouped_heads_errors(bk):
    inputs, weights = _inputs(2)
    args = [bk.tensor(x) for x in inputs]
    t_weights = {n: bk.tensor(w) for n, w in weights.items()}
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(8\)"):
        multiattn.multi_head_attention(*args, weights=t_weights, num_heads=HEADS, num_kv_heads=3)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="num_kv_heads must be a positive integer or None"):
            multiattn.multi_head_attention(*args, weights=t_weights, num_heads=HEADS, num_kv_heads=bad)
    with pytest.raises(
        ValueError, match=r"weights\['W_k'\] must have shape \(8, 3\) \(num_kv_heads=4 heads of 2\)"
    ):
        multiattn.multi_head_attention(*args, weights=t_weights, num_heads=HEADS, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"weights\['W_k'\] must have shape \(16, 3\)"):
        multiattn.multi_head_attention(*args, weights=t_weights, num_heads=HEADS)
