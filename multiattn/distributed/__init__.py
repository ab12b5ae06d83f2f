"""Attention over a sequence held by several processes: ring attention.

Each process (a rank of a ``torch.distributed`` group, or a position of a jax mesh axis) holds
its shard of the sequence: the queries, keys and values of its positions.  The shards of keys
and values travel around the ring; at each step a rank computes the state (out, lse) of its
queries over the keys it holds, at their global positions, and merges it into its rows
(``state.combine``): exact, the single-process call's rows of this shard.

The plan and the blocks are framework-free (``ring``); the exchange and the gradient are the
framework's (``backends.torch_ring``: ``torch.distributed`` point-to-point and a custom autograd function;
``backends.jax_ring``: ``lax.ppermute`` inside ``shard_map``, differentiated by jax)."""

from __future__ import annotations

from typing import Any, Optional

from .. import validation
from .._registry import framework_of
from .ring import LAYOUTS, check_layout, segments, shard, unshard

Tensor = Any

__all__ = ["ring_attention", "shard", "unshard", "segments", "LAYOUTS"]


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, valid_lens: Any = None, mask_mod: Any = None,
    score_mod: Any = None, scale: Any = None, layout: str = "contiguous", group: Any = None,
    axis_name: Any = None, timeout: Optional[float] = None,
) -> Tensor:  # fmt: skip
    """This shard's rows of ``dot_product_attention`` over the whole sequence, its shards held
    by the ranks of a ring: q (B, [H,] n, d), k, v (B, [kv_heads,] n_r, .) this rank's shard
    (``shard``: layout ``"contiguous"`` or ``"zigzag"``); valid_lens (B,) the whole sequences'
    lengths, the same on every rank; mask_mod and score_mod see global positions (an array they
    index is the whole sequence's).  torch: over ``torch.distributed`` (group, the default
    group where None; timeout, seconds to wait on any exchange, the group's own where None);
    jax: inside ``shard_map``, the sequence split over the mesh axis ``axis_name``."""
    validation.check_causal(causal)
    check_layout(layout)
    scale = validation.check_scale(scale)
    name = framework_of(q)
    if name == "torch":
        from ..backends import torch_ring

        return torch_ring.ring_attention(
            q, k, v, causal, valid_lens, mask_mod, score_mod, scale, layout, group, timeout
        )
    if name == "jax":
        if axis_name is None:
            raise ValueError(
                "ring_attention on jax needs axis_name=, the shard_map mesh axis the sequence is split over"
            )
        from ..backends import jax_ring

        return jax_ring.ring_attention(
            q, k, v, causal, valid_lens, mask_mod, score_mod, scale, layout, axis_name
        )
    raise TypeError(
        f"ring_attention runs on torch (torch.distributed) and jax (shard_map); q is {type(q).__name__}"
    )
