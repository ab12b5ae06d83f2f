"""The layers decode: ``MultiHeadAttention``'s call with ``cache=`` returns (output, cache), the
projected keys and values kept in the cache; a prefill then single-token steps give the full
causal call's rows on every framework; and d2l's 11.7 Transformer decoder, written with it,
greedily decodes the same tokens as d2l's own way (the inputs concatenated into ``state[2]``
and every projection recomputed each step)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from .test_mods import supported
from .tolerances import assert_close

B, N, HIDDENS, HEADS, KV = 2, 9, 16, 4, 2


@pytest.mark.parametrize("page_size", [None, 4])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_layers_decode_token_by_token(bk, dtype, page_size):
    supported(bk, dtype)
    if not bk.has_layers:
        pytest.skip(f"{bk.name} has no layer classes")
    layer = bk.multi_head(HIDDENS, HEADS, bias=True, dtype=dtype, num_kv_heads=KV)
    x = bk.tensor(np.random.default_rng(0).normal(size=(B, N, HIDDENS)), dtype)
    want = np.asarray(bk.numpy(bk.call(layer, x, x, x, causal=True)), dtype=np.float64)
    cache = layer.new_cache(B, like=x, page_size=page_size)
    outs = []
    for lo, hi in [(0, 4)] + [(t, t + 1) for t in range(4, N)]:
        part = x[:, lo:hi]
        out, cache = bk.call(layer, part, part, part, causal=True, cache=cache)
        outs.append(np.asarray(bk.numpy(out), dtype=np.float64))
    assert int(cache.length) == N
    assert_close(bk, bk.tensor(np.concatenate(outs, axis=1), dtype), want, dtype)


def test_cache_is_refused_by_the_other_layers_and_with_masks_of_one_call(bk):
    if not bk.has_layers:
        pytest.skip(f"{bk.name} has no layer classes")
    x = bk.tensor(np.zeros((B, 3, HIDDENS)), "float32")
    layer = bk.multi_head(HIDDENS, HEADS)
    cache = layer.new_cache(B, like=x)
    with pytest.raises(TypeError, match="DotProductAttention takes no cache="):
        bk.call(bk.dot(), x, x, x, cache=cache)
    with pytest.raises(ValueError, match="cache= takes causal=, mask_mod= and score_mod="):
        bk.call(layer, x, x, x, bk.tensor(np.array([1, 2])), cache=cache)


# -- d2l 11.7's decoder, in torch, with the cache and d2l's own way ---------------------------


def _d2l_decoder(torch, m, vocab, num_hiddens, num_heads, num_blks, cached):
    from torch import nn

    class PositionWiseFFN(nn.Module):
        def __init__(self, ffn_num_hiddens, ffn_num_outputs):
            super().__init__()
            self.dense1, self.relu = nn.LazyLinear(ffn_num_hiddens), nn.ReLU()
            self.dense2 = nn.LazyLinear(ffn_num_outputs)

        def forward(self, X):
            return self.dense2(self.relu(self.dense1(X)))

    class AddNorm(nn.Module):
        def __init__(self, norm_shape):
            super().__init__()
            self.ln = nn.LayerNorm(norm_shape)

        def forward(self, X, Y):
            return self.ln(Y + X)

    class TransformerDecoderBlock(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i
            self.attention1 = m.MultiHeadAttention(num_hiddens, num_heads, bias=True)
            self.addnorm1 = AddNorm(num_hiddens)
            self.attention2 = m.MultiHeadAttention(num_hiddens, num_heads, bias=True)
            self.addnorm2 = AddNorm(num_hiddens)
            self.ffn = PositionWiseFFN(2 * num_hiddens, num_hiddens)
            self.addnorm3 = AddNorm(num_hiddens)

        def forward(self, X, state):
            enc_outputs, enc_valid_lens = state[0], state[1]
            if cached:  # the keys and values of the earlier positions, projected, in the cache
                if state[2][self.i] is None:
                    state[2][self.i] = self.attention1.new_cache(X.shape[0], like=X)
                X2, state[2][self.i] = self.attention1(X, X, X, causal=True, cache=state[2][self.i])
            else:  # d2l: every input so far in state[2], projected again each step
                key_values = X if state[2][self.i] is None else torch.cat((state[2][self.i], X), dim=1)
                state[2][self.i] = key_values
                X2 = self.attention1(X, key_values, key_values)  # prediction: every key so far
            Y = self.addnorm1(X, X2)
            Y2 = self.attention2(Y, enc_outputs, enc_outputs, enc_valid_lens)
            Z = self.addnorm2(Y, Y2)
            return self.addnorm3(Z, self.ffn(Z)), state

    class TransformerDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, num_hiddens)
            self.blks = nn.ModuleList([TransformerDecoderBlock(i) for i in range(num_blks)])
            self.dense = nn.LazyLinear(vocab)

        def init_state(self, enc_outputs, enc_valid_lens):
            return [enc_outputs, enc_valid_lens, [None] * num_blks]

        def forward(self, X, state, position):
            X = self.embedding(X) * math.sqrt(num_hiddens)
            i = torch.arange(num_hiddens // 2, dtype=torch.float64)
            angle = position / torch.pow(10000, 2 * i / num_hiddens)  # d2l's sinusoidal encoding, one row
            X = X + torch.stack([torch.sin(angle), torch.cos(angle)], -1).reshape(num_hiddens).to(X.dtype)
            for blk in self.blks:
                X, state = blk(X, state)
            return self.dense(X), state

    return TransformerDecoder()


def test_d2l_decoder_greedy_tokens_with_the_cache_equal_recomputing(bk):
    if bk.name != "torch":
        pytest.skip("the decoder of d2l 11.7 in torch (the layers' cache on every framework: above)")
    import torch

    torch.manual_seed(0)
    vocab, steps = 11, 12
    decoders = [_d2l_decoder(torch, bk.module, vocab, 16, 4, 2, cached) for cached in (True, False)]
    enc_outputs, enc_valid_lens = torch.randn(2, 5, 16, dtype=torch.float64), torch.tensor([3, 5])
    decoders[0](
        torch.zeros(2, 1, dtype=torch.long), decoders[0].init_state(enc_outputs.float(), enc_valid_lens), 0
    )
    decoders[1].load_state_dict(decoders[0].state_dict())
    found = []
    with torch.no_grad():
        for decoder in decoders:
            decoder.double().eval()
            state, token, tokens = (
                decoder.init_state(enc_outputs, enc_valid_lens),
                torch.zeros(2, 1, dtype=torch.long),
                [],
            )
            for position in range(steps):  # d2l's predict_seq2seq: the argmax fed back
                logits, state = decoder(token, state, position)
                token = logits.argmax(-1)
                tokens.append(token)
            found.append(torch.cat(tokens, 1))
    assert torch.equal(found[0], found[1])
    assert len(set(found[0].flatten().tolist())) > 1  # not one token over and over
