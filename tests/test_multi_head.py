"""Multi-head attention in each framework's idioms, and d2l 11.5's own code as the judge
where d2l defines the output (every valid length >= 1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from . import reference as ref

RNG = np.random.default_rng(16)
B, Q, K, H, HEADS = 2, 3, 6, 8, 2
QUERIES, KEYS, VALUES = RNG.normal(size=(B, Q, 5)), RNG.normal(size=(B, K, 3)), RNG.normal(size=(B, K, 4))
LENS = np.array([2, 6])
WEIGHTS = {
    "W_q": RNG.normal(size=(H, 5)) * 0.5, "W_k": RNG.normal(size=(H, 3)) * 0.5,
    "W_v": RNG.normal(size=(H, 4)) * 0.5, "W_o": RNG.normal(size=(H, H)) * 0.5,
}  # fmt: skip
SIZES = dict(query_size=5, key_size=3, value_size=4)


def d2l_torch_multi_head_attention(num_hiddens, num_heads, dropout, bias=False):
    """d2l 11.5's MultiHeadAttention and 11.3's DotProductAttention and masked_softmax (d2l/torch.py)."""
    import torch
    from torch import nn

    def masked_softmax(X, valid_lens):
        def _sequence_mask(X, valid_len, value=0):
            maxlen = X.size(1)
            mask = torch.arange((maxlen), dtype=torch.float32, device=X.device)[None, :] < valid_len[:, None]
            X[~mask] = value
            return X

        if valid_lens is None:
            return nn.functional.softmax(X, dim=-1)
        shape = X.shape
        if valid_lens.dim() == 1:
            valid_lens = torch.repeat_interleave(valid_lens, shape[1])
        else:
            valid_lens = valid_lens.reshape(-1)
        X = _sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
        return nn.functional.softmax(X.reshape(shape), dim=-1)

    class DotProductAttention(nn.Module):
        def __init__(self, dropout):
            super().__init__()
            self.dropout = nn.Dropout(dropout)

        def forward(self, queries, keys, values, valid_lens=None):
            d = queries.shape[-1]
            scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
            self.attention_weights = masked_softmax(scores, valid_lens)
            return torch.bmm(self.dropout(self.attention_weights), values)

    class MultiHeadAttention(nn.Module):
        def __init__(self, num_hiddens, num_heads, dropout, bias=False, **kwargs):
            super().__init__()
            self.num_heads = num_heads
            self.attention = DotProductAttention(dropout)
            self.W_q = nn.LazyLinear(num_hiddens, bias=bias)
            self.W_k = nn.LazyLinear(num_hiddens, bias=bias)
            self.W_v = nn.LazyLinear(num_hiddens, bias=bias)
            self.W_o = nn.LazyLinear(num_hiddens, bias=bias)

        def forward(self, queries, keys, values, valid_lens):
            queries = self.transpose_qkv(self.W_q(queries))
            keys = self.transpose_qkv(self.W_k(keys))
            values = self.transpose_qkv(self.W_v(values))
            if valid_lens is not None:
                valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
            output = self.attention(queries, keys, values, valid_lens)
            output_concat = self.transpose_output(output)
            return self.W_o(output_concat)

        def transpose_qkv(self, X):
            X = X.reshape(X.shape[0], X.shape[1], self.num_heads, -1)
            X = X.permute(0, 2, 1, 3)
            return X.reshape(-1, X.shape[2], X.shape[3])

        def transpose_output(self, X):
            X = X.reshape(-1, self.num_heads, X.shape[1], X.shape[2])
            X = X.permute(0, 2, 1, 3)
            return X.reshape(X.shape[0], X.shape[1], -1)

    return MultiHeadAttention(num_hiddens, num_heads, dropout, bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.backend("torch")
def test_a_d2l_state_dict_loads_and_gives_d2ls_outputs(bias):
    import torch

    from multiattn.backends import torch as m

    q, k, v = (torch.tensor(x) for x in (QUERIES, KEYS, VALUES))
    lens = torch.tensor([[2, 6, 1], [6, 3, 4]])  # every row sees a key: d2l defines them all
    d2l = d2l_torch_multi_head_attention(H, HEADS, 0.5, bias).double()
    d2l(q, k, v, torch.tensor(LENS))  # lazy layers: sized by a first call
    d2l.eval()
    ours = m.MultiHeadAttention(H, HEADS, 0.5, bias, **SIZES).double()
    ours.load_state_dict(d2l.state_dict())  # strict: the same keys
    ours.eval()
    with torch.no_grad():
        for valid_lens in (torch.tensor(LENS), lens, None):
            want = d2l(q, k, v, valid_lens)
            np.testing.assert_allclose(
                ours(q, k, v, valid_lens).numpy(), want.numpy(), rtol=1e-12, atol=1e-12
            )
            # d2l's (batch * heads, queries, keys) weights are ours reshaped
            np.testing.assert_allclose(
                ours.attention_weights.reshape(-1, Q, K).numpy(),
                d2l.attention.attention_weights.numpy(),
                atol=1e-12,
            )
    d2l.load_state_dict(ours.state_dict())  # and back


@pytest.mark.backend("torch")
def test_torch_multi_head_modes_autograd_and_compile():
    import torch

    from multiattn.backends import torch as m

    q, k, v = (torch.tensor(x, dtype=torch.float64) for x in (QUERIES, KEYS, VALUES))
    layer = m.MultiHeadAttention(H, HEADS, dropout=0.5, **SIZES).double()
    layer.set_weights(WEIGHTS)
    want = ref.multi_head_attention(QUERIES, KEYS, VALUES, LENS, WEIGHTS, HEADS)[0]
    train_out = layer(q, k, v, torch.tensor(LENS))
    layer.eval()
    out = layer(q, k, v, torch.tensor(LENS))
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(train_out, out)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    compiled = torch.compile(layer)
    got = compiled(q, k, v, torch.tensor(LENS), causal=True)
    want_causal = ref.multi_head_attention(QUERIES, KEYS, VALUES, LENS, WEIGHTS, HEADS, causal=True)[0]
    np.testing.assert_allclose(got.detach().numpy(), want_causal, rtol=1e-10, atol=1e-12)


@pytest.mark.backend("tensorflow")
def test_keras_multi_head_in_a_model_and_tf_function(tmp_path):
    import keras
    import tensorflow as tf

    from multiattn.backends import tensorflow as m

    q, k, v = (tf.constant(x) for x in (QUERIES, KEYS, VALUES))
    layer = m.MultiHeadAttention(H, HEADS, **SIZES, dtype="float64")
    layer.set_weights(WEIGHTS)
    want = ref.multi_head_attention(QUERIES, KEYS, VALUES, LENS, WEIGHTS, HEADS, causal=True)[0]
    graph = tf.function(lambda q, k, v, lens: layer(q, k, v, lens, causal=True))
    np.testing.assert_allclose(graph(q, k, v, tf.constant(LENS)).numpy(), want, rtol=1e-10)
    inputs = [keras.Input((None, width), dtype="float64") for width in (5, 3, 4)]  # unknown lengths
    model = keras.Model(inputs, layer(*inputs, causal=True))
    np.testing.assert_allclose(
        model([q, k, v]).numpy(),
        ref.multi_head_attention(QUERIES, KEYS, VALUES, None, WEIGHTS, HEADS, causal=True)[0],
        rtol=1e-10,
    )
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded([q, k, v]).numpy(), model([q, k, v]).numpy())


@pytest.mark.backend("jax")
def test_nnx_multi_head_under_jit_and_grad():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from multiattn.backends import jax as m

    m.enable_float64()
    q, k, v = (jnp.asarray(x) for x in (QUERIES, KEYS, VALUES))
    layer = m.MultiHeadAttention(H, HEADS, **SIZES, param_dtype=jnp.float64)
    layer.set_weights(WEIGHTS)
    layer.eval()

    @nnx.jit
    def run(layer, q, k, v, lens):
        return layer(q, k, v, lens, causal=True)

    want = ref.multi_head_attention(QUERIES, KEYS, VALUES, LENS, WEIGHTS, HEADS, causal=True)[0]
    np.testing.assert_allclose(np.asarray(run(layer, q, k, v, jnp.asarray(LENS))), want, rtol=1e-10)
    assert layer.attention_weights.shape == (B, HEADS, Q, K)
    grads = nnx.grad(lambda layer: run(layer, q, k, v, jnp.asarray(LENS)).sum())(layer)
    assert float(jnp.abs(grads.W_q.kernel[...]).sum()) > 0
    out, weights = jax.jit(lambda q: layer(q, k, v, return_weights=True))(q)
    assert weights.shape == (B, HEADS, Q, K)
