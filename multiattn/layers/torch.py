"""PyTorch layers: ``torch.nn.Module`` classes.

They keep d2l's attribute names (``W_q``, ``W_k``, ``w_v``, ``W_v``, ``W_o`` as
``nn.Linear``, ``dropout`` as ``nn.Dropout``), so a state_dict saved from d2l's
``AdditiveAttention`` or ``MultiHeadAttention`` loads into ours and back.
"""

from __future__ import annotations

from typing import Any, Optional

from .._registry import framework_imports  # noqa: E402

with framework_imports("torch"):  # not installed: an error naming the install
    import torch
    from torch import nn

from ..backends.torch import ops, to_numpy
from . import (
    AdditiveWeights,
    AttentionCall,
    MultiHeadWeights,
    check_dropout,
    converters,
)


class _Layer(AttentionCall, nn.Module):
    """What the layers share: the ops, their parameters by canonical name, and copies that
    keep the last weights detached (``copy.deepcopy`` refuses tensors of an autograd graph;
    EMA copies and target networks deep-copy a module after a forward call)."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)

    def __getstate__(self):
        state = dict(super().__getstate__())
        if isinstance(state.get("attention_weights"), torch.Tensor):
            state["attention_weights"] = state["attention_weights"].detach()
        return state

    def _parameter(self, name):
        return self._variable(name)

    def _assign(self, name, value):
        param = self._parameter(name)
        with torch.no_grad():
            param.copy_(torch.from_numpy(value).reshape(param.shape))

    def _dropout_now(self):
        return self.dropout if self.training and self.dropout.p > 0 else None

    def _add_linear(self, name, in_size, out_size, bias, **options):
        setattr(self, name, nn.Linear(in_size, out_size, bias=bias, **options))

    def _add_dropout(self, dropout: float) -> None:
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.attention_weights: Optional[torch.Tensor] = None

    def forward(self, queries, keys, values, valid_lens=None, **keywords):
        """The output; ``keywords``: attention_mask, causal, score_mod, mask_mod, block_mask
        (not for additive attention) and cache (multi-head attention only)."""
        out, self.attention_weights = self._attend(
            queries, keys, values, valid_lens, self._dropout_now(), keywords
        )
        return out


class DotProductAttention(_Layer):
    """Scaled dot-product attention; dropout on the weights in training mode only."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._add_dropout(dropout)
        self.need_weights = need_weights  # False: fused SDPA kernel, attention_weights stays None


class AdditiveAttention(AdditiveWeights, _Layer):
    """Additive attention (d2l 11.3.2); ``device``/``dtype`` go to the nn.Linear layers."""

    def __init__(
        self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0, *, device: Any = None,
        dtype: Optional[torch.dtype] = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self._set_sizes(key_size, query_size, num_hiddens)
        self._build(device=device, dtype=dtype)
        self._add_dropout(dropout)

    def _w_v(self):
        return self.w_v.weight[0]


class MultiHeadAttention(MultiHeadWeights, _Layer):
    """Multi-head attention (d2l 11.5): W_q, W_k, W_v, W_o as ``nn.Linear`` (d2l's names, so
    its state_dict loads), heads of num_hiddens / num_heads contiguous columns.

    ``attention_weights``: (batch, num_heads, queries, keys) before dropout; d2l keeps
    (batch * num_heads, queries, keys), which is ``attention_weights.reshape(-1, Q, K)``.
    ``need_weights=False``: the fused SDPA kernel, ``attention_weights`` stays None.
    ``num_kv_heads`` (default num_heads): grouped-query attention, W_k and W_v projecting to
    num_kv_heads heads of num_hiddens / num_heads, query head i using key/value head
    i // (num_heads / num_kv_heads).
    """

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, bias: bool = False, *,
        query_size: Optional[int] = None, key_size: Optional[int] = None, value_size: Optional[int] = None,
        need_weights: bool = True, num_kv_heads: Optional[int] = None, device: Any = None,
        dtype: Optional[torch.dtype] = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self._set_sizes(num_hiddens, num_heads, (query_size, key_size, value_size), bias, num_kv_heads)
        self._build(device=device, dtype=dtype)
        self._add_dropout(dropout)
        self.need_weights = need_weights

    @classmethod
    def from_native(cls, layer: nn.MultiheadAttention) -> "MultiHeadAttention":
        """A MultiHeadAttention with the weights, sizes, dropout and mode of a
        ``torch.nn.MultiheadAttention`` (either ``batch_first``; this layer is batch first)."""
        if not isinstance(layer, nn.MultiheadAttention):
            raise TypeError(f"from_native takes a torch.nn.MultiheadAttention, got {type(layer).__name__}")
        arrays = converters.read(
            lambda path: converters.attribute(layer, path), converters.TORCH_PATHS, to_numpy
        )
        config, weights = converters.torch_from(
            arrays, embed_dim=layer.embed_dim, num_heads=layer.num_heads, kdim=layer.kdim, vdim=layer.vdim,
            dropout=layer.dropout, add_zero_attn=layer.add_zero_attn,
        )  # fmt: skip
        p = layer.out_proj.weight
        out = cls(**config.kwargs(), device=p.device, dtype=p.dtype)
        out.set_weights(weights)
        return out.train(layer.training)

    def to_native(self, batch_first: bool = True) -> nn.MultiheadAttention:
        """A new ``torch.nn.MultiheadAttention`` with these weights (needs query_size == num_hiddens
        and num_kv_heads == num_heads: it has no grouped-query attention)."""
        kwargs, arrays = converters.torch_to(converters.config(self, self.dropout.p), self.get_weights())
        p = self.W_o.weight
        layer = nn.MultiheadAttention(**kwargs, batch_first=batch_first, device=p.device, dtype=p.dtype)
        with torch.no_grad():
            for path, value in arrays.items():
                param = layer.get_parameter(path)
                param.copy_(torch.from_numpy(value).reshape(param.shape))
        return layer.train(self.training)
