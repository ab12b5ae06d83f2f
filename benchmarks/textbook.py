"""The implementations multiattn is measured against, per framework, written from the seeds.

``textbook``: d2l's way (repeat the lengths per row with repeat_interleave, fill
masked scores with -1e6, softmax, batched matmul; additive attention
materialises the whole (B, Q, K, h) feature tensor).
``floor``: batched matmul, softmax, batched matmul with no mask at all: the
least work any implementation that materialises the weights can do.
Each returns functions (q, k, v, lens) and (q, k, v, lens, W_q, W_k, w_v),
weights in the canonical layout W_q (h, q), W_k (h, k), w_v (h,); and, under
``textbook_mha`` and ``floor_mha``, multi-head attention (d2l 11.5)
(q, k, v, lens, W_q, W_k, W_v, W_o, *, num_heads), weights W_q (h, q), W_k (h, k),
W_v (h, v), W_o (h, h), no biases: project (x @ W.T), d2l's transpose_qkv to
(B * H, n, h / H), the lengths repeated per head (repeat_interleave), the
dot-product above on every head, transpose_output back to (B, Q, h), @ W_o.T.
``floor_mha`` is the same with the floor's unmasked dot-product.
"""

from __future__ import annotations

import math


def _numpy(
    np,
    softmax,
    bmm,
    transpose,
    repeat,
    arange,
    where,
    tanh,
    reshape=lambda x, s: x.reshape(s),
    permute=None,
):
    """The d2l formulas over a namespace of primitives (numpy-like frameworks)."""
    if permute is None:  # (0, 2, 1, 3), the heads' axis swapped with the rows'

        def permute(x):
            return np.transpose(x, (0, 2, 1, 3))

    def masked_softmax(X, valid_lens):
        B, Q, K = X.shape
        lens = repeat(valid_lens, Q)  # one length per row, as d2l does
        flat = reshape(X, (-1, K))
        mask = arange(K)[None, :] < lens[:, None]
        return softmax(reshape(where(mask, flat, -1e6), (B, Q, K)))

    def dot(q, k, v, lens):
        scores = bmm(q, transpose(k)) / math.sqrt(q.shape[-1])
        return bmm(masked_softmax(scores, lens), v)

    def additive(q, k, v, lens, W_q, W_k, w_v):
        features = tanh(bmm(q, transpose(W_q))[:, :, None, :] + bmm(k, transpose(W_k))[:, None, :, :])
        scores = bmm(features, w_v)
        return bmm(masked_softmax(scores, lens), v)

    def floor(q, k, v, lens):
        return bmm(softmax(bmm(q, transpose(k)) / math.sqrt(q.shape[-1])), v)

    def floor_additive(q, k, v, lens, W_q, W_k, w_v):
        features = tanh(bmm(q, transpose(W_q))[:, :, None, :] + bmm(k, transpose(W_k))[:, None, :, :])
        return bmm(softmax(bmm(features, w_v)), v)

    def transpose_qkv(X, num_heads):  # (B, n, h) -> (B * H, n, h / H)
        X = permute(reshape(X, (X.shape[0], X.shape[1], num_heads, -1)))
        return reshape(X, (-1, X.shape[2], X.shape[3]))

    def transpose_output(X, num_heads):  # (B * H, Q, h / H) -> (B, Q, h)
        X = permute(reshape(X, (-1, num_heads, X.shape[1], X.shape[2])))
        return reshape(X, (X.shape[0], X.shape[1], -1))

    def multi_head(attention, q, k, v, W_q, W_k, W_v, W_o, num_heads):
        q, k, v = (transpose_qkv(bmm(x, transpose(W)), num_heads) for x, W in ((q, W_q), (k, W_k), (v, W_v)))
        return bmm(transpose_output(attention(q, k, v), num_heads), transpose(W_o))

    def mha(q, k, v, lens, W_q, W_k, W_v, W_o, *, num_heads):
        lens = repeat(lens, num_heads)  # d2l: repeat_interleave(valid_lens, num_heads)
        return multi_head(lambda *qkv: dot(*qkv, lens), q, k, v, W_q, W_k, W_v, W_o, num_heads)

    def floor_mha(q, k, v, lens, W_q, W_k, W_v, W_o, *, num_heads):
        return multi_head(lambda *qkv: floor(*qkv, None), q, k, v, W_q, W_k, W_v, W_o, num_heads)

    return {
        "textbook": (dot, additive),
        "floor": (floor, floor_additive),
        "textbook_mha": mha,
        "floor_mha": floor_mha,
    }


def implementations(backend: str) -> dict:
    if backend == "numpy":
        import numpy as np

        def softmax(x):
            e = np.exp(x - x.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True)

        return _numpy(
            np,
            softmax,
            np.matmul,
            lambda x: np.swapaxes(x, -1, -2),
            np.repeat,
            np.arange,
            np.where,
            np.tanh,
        )
    if backend == "torch":
        import torch

        def masked_softmax(X, valid_lens):  # d2l/torch.py, including its in-place fill
            shape = X.shape
            lens = torch.repeat_interleave(valid_lens, shape[1])
            X = X.reshape(-1, shape[-1])
            mask = torch.arange(shape[-1], device=X.device)[None, :] < lens[:, None]
            X[~mask] = -1e6
            return torch.softmax(X.reshape(shape), dim=-1)

        def dot(q, k, v, lens):
            return torch.bmm(
                masked_softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1]), lens), v
            )

        def additive(q, k, v, lens, W_q, W_k, w_v):
            features = torch.tanh((q @ W_q.T).unsqueeze(2) + (k @ W_k.T).unsqueeze(1))
            return torch.bmm(masked_softmax(features @ w_v, lens), v)

        def floor(q, k, v, lens):
            return torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1]), -1), v)

        def floor_additive(q, k, v, lens, W_q, W_k, w_v):
            features = torch.tanh((q @ W_q.T).unsqueeze(2) + (k @ W_k.T).unsqueeze(1))
            return torch.bmm(torch.softmax(features @ w_v, -1), v)

        def transpose_qkv(X, num_heads):  # d2l/torch.py
            X = X.reshape(X.shape[0], X.shape[1], num_heads, -1)
            X = X.permute(0, 2, 1, 3)
            return X.reshape(-1, X.shape[2], X.shape[3])

        def transpose_output(X, num_heads):
            X = X.reshape(-1, num_heads, X.shape[1], X.shape[2])
            X = X.permute(0, 2, 1, 3)
            return X.reshape(X.shape[0], X.shape[1], -1)

        def multi_head(attention, q, k, v, W_q, W_k, W_v, W_o, num_heads):
            q, k, v = (transpose_qkv(x @ W.T, num_heads) for x, W in ((q, W_q), (k, W_k), (v, W_v)))
            return transpose_output(attention(q, k, v), num_heads) @ W_o.T

        def mha(q, k, v, lens, W_q, W_k, W_v, W_o, *, num_heads):
            lens = torch.repeat_interleave(lens, repeats=num_heads, dim=0)
            return multi_head(lambda *qkv: dot(*qkv, lens), q, k, v, W_q, W_k, W_v, W_o, num_heads)

        def floor_mha(q, k, v, lens, W_q, W_k, W_v, W_o, *, num_heads):
            return multi_head(lambda *qkv: floor(*qkv, None), q, k, v, W_q, W_k, W_v, W_o, num_heads)

        return {
            "textbook": (dot, additive),
            "floor": (floor, floor_additive),
            "textbook_mha": mha,
            "floor_mha": floor_mha,
        }
    if backend == "tensorflow":
        import tensorflow as tf

        return _numpy(
            tf,
            lambda x: tf.nn.softmax(x, -1),
            lambda a, b: tf.tensordot(a, b, 1) if len(b.shape) < 3 else tf.matmul(a, b),
            lambda x: tf.linalg.matrix_transpose(x) if len(x.shape) > 1 else x,
            lambda x, n: tf.repeat(x, n),
            lambda n: tf.range(n, dtype=tf.int64),
            lambda m, x, f: tf.where(m, x, tf.constant(f, x.dtype)),
            tf.tanh,
            tf.reshape,
        )
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        impls = _numpy(
            jnp,
            lambda x: jax.nn.softmax(x, -1),
            jnp.matmul,
            lambda x: jnp.swapaxes(x, -1, -2) if x.ndim > 1 else x,
            jnp.repeat,
            jnp.arange,
            jnp.where,
            jnp.tanh,
        )
        return {
            name: jax.jit(fs, static_argnames="num_heads") if callable(fs) else tuple(jax.jit(f) for f in fs)
            for name, fs in impls.items()
        }
    if backend == "paddle":
        import paddle

        return _numpy(
            paddle,
            lambda x: paddle.nn.functional.softmax(x, -1),
            paddle.matmul,
            lambda x: x.T if x.ndim == 2 else (x if x.ndim == 1 else paddle.transpose(x, [0, 2, 1])),
            lambda x, n: paddle.repeat_interleave(x, n),
            lambda n: paddle.arange(n, dtype="int64"),
            lambda m, x, f: paddle.where(m, x, paddle.full([], f, x.dtype)),
            paddle.tanh,
        )
    if backend == "mlx":
        import mlx.core as mx

        return _numpy(
            mx,
            lambda x: mx.softmax(x, -1),
            mx.matmul,
            lambda x: mx.swapaxes(x, -1, -2) if x.ndim > 1 else x,
            mx.repeat,
            mx.arange,
            mx.where,
            mx.tanh,
        )
    if backend == "mxnet":
        from mxnet import np, npx

        return _numpy(
            np,
            lambda x: npx.softmax(x, axis=-1),
            np.matmul,
            lambda x: np.swapaxes(x, -1, -2) if x.ndim > 1 else x,
            np.repeat,
            lambda n: np.arange(n, dtype="float32"),
            np.where,
            np.tanh,
        )
    raise ValueError(f"no textbook implementation for {backend!r}")
