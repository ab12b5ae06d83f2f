"""PyTorch layers: ``torch.nn.Module`` classes.

They keep d2l's attribute names (``W_q``, ``W_k``, ``w_v`` as
``nn.Linear(bias=False)``, ``dropout`` as ``nn.Dropout``), so a state_dict
saved from d2l's ``AdditiveAttention`` loads into ours and back.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..backends.torch import ops, to_numpy
from . import (
    AttentionCall,
    CanonicalWeights,
    CanonicalWeightsMixin,
    check_dropout,
    check_sizes,
)


class _Layer(AttentionCall, nn.Module):
    """What both layers share: the ops, and copies that keep the last weights detached
    (``copy.deepcopy`` refuses tensors of an autograd graph; EMA copies and target networks
    deep-copy a module after a forward call)."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)

    def __getstate__(self):
        state = dict(super().__getstate__())
        if isinstance(state.get("attention_weights"), torch.Tensor):
            state["attention_weights"] = state["attention_weights"].detach()
        return state


class DotProductAttention(_Layer):
    """Scaled dot-product attention; dropout on the weights in training mode only."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.need_weights = need_weights  # False: fused SDPA kernel, attention_weights stays None
        self.attention_weights: Optional[torch.Tensor] = None

    def forward(self, queries, keys, values, valid_lens=None) -> torch.Tensor:
        dropout = self.dropout if self.training and self.dropout.p > 0 else None
        out, self.attention_weights = self._dot_product(
            queries, keys, values, valid_lens, dropout, self.need_weights
        )
        return out


class AdditiveAttention(CanonicalWeightsMixin, _Layer):
    """Additive attention (d2l 11.3.2); ``device``/``dtype`` go to the nn.Linear layers."""

    _stored_in_out = False

    def __init__(
        self,
        key_size: int,
        query_size: int,
        num_hiddens: int,
        dropout: float = 0.0,
        *,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        linear = dict(bias=False, device=device, dtype=dtype)
        self.W_k = nn.Linear(self.key_size, self.num_hiddens, **linear)
        self.W_q = nn.Linear(self.query_size, self.num_hiddens, **linear)
        self.w_v = nn.Linear(self.num_hiddens, 1, **linear)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.attention_weights: Optional[torch.Tensor] = None

    def _write_weights(self, weights: CanonicalWeights) -> None:
        with torch.no_grad():
            for key, value in weights.items():
                param = getattr(self, key).weight
                param.copy_(torch.from_numpy(value).reshape(param.shape))

    def _stored_weights(self):
        return self.W_q.weight, self.W_k.weight, self.w_v.weight[0]  # W_q, W_k stored (out, in); w_v (h,)

    def forward(self, queries, keys, values, valid_lens=None) -> torch.Tensor:
        out, self.attention_weights = self._additive(queries, keys, values, valid_lens, self.dropout)
        return out
