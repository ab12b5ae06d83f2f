"""FlexAttention's names in one place, on every framework: a FlexAttention program ports by
changing its import::

    # from torch.nn.attention.flex_attention import flex_attention, create_block_mask, and_masks
    from multiattn.flex import flex_attention, create_block_mask, and_masks

``flex_attention`` and ``create_block_mask`` are ``multiattn``'s; the mask combinators and
``noop_mask`` are ``multiattn.mods``'; ``BlockMask`` is what ``create_block_mask`` returns
(docs/flex-attention.md)."""

from . import create_block_mask, flex_attention
from .block_mask import AuxOutput, BlockMask
from .mods import and_masks, noop_mask, or_masks

__all__ = [
    "AuxOutput", "BlockMask", "and_masks", "create_block_mask", "flex_attention", "noop_mask", "or_masks",
]
