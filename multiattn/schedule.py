"""How a call without weights runs where its scores would not fit the budget (or blocks are
asked for): a framework's kernel that never holds the scores whole (``specialise``), else the
loop over the block map (``blockwise``).  None where the scores fit: the core's formula holds
them whole."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from . import blockwise, mods, specialise, state
from .masks import Masks

Tensor = Any
Ops = Any  # an adapter (``adapter.Ops``)


def dot_product_in_blocks(
    ops: Ops, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks, scale: float,
    block_size: Optional[int], need_lse: bool, score_mod: Optional[Callable[..., Tensor]],
) -> Optional[tuple]:  # fmt: skip
    """(output, lse (B, [H,] Q) or None) of ``core.dot_product_attention`` without the scores
    whole, in blocks of block_size (None: where the scores would exceed the budget), else None."""
    done = specialise.run(ops, "attend_in_chunks", queries, keys, values, masks, scale, score_mod, block_size)
    if done is not None:  # lazy arrays whose chunks are tasks
        return done[0], (done[1] if need_lse else None)
    forced = block_size is not None
    block_size = block_size or blockwise.automatic_block_size(
        ops, queries, keys, mask_mod=masks.mask_mod, masks=masks
    )
    if block_size is None:
        return None
    masks = masks.without_idle_lengths(ops, ops.shape(keys)[-2])
    if score_mod is not None:  # the framework differentiates the blocks (and score_mod) itself
        score = functools.partial(_modified_scores, ops, score_mod, scale)
        out, lse = blockwise.attention_in_blocks(
            ops, queries, keys, values, masks, block_size=block_size, score=score
        )
        return out, lse[..., 0]
    if not forced:  # grouped heads and a mask function's too, where an offer takes them
        done = specialise.run(ops, "attend_past_memory", queries, keys, values, masks, scale, need_lse)
        if done is not None:
            return done[0], done[1] if need_lse else None
    if not forced and blockwise.framework_loop(ops, queries, masks):
        block_size = min(block_size, FRAMEWORK_LOOP_MAX_BLOCK)
    elif not forced and ops.unrolls_loops(queries):  # the same program at every length
        block_size = max(block_size, -(-ops.shape(queries)[-2] // UNROLLED_QUERY_BLOCKS))
    return blockwise.attention(ops, queries, keys, values, masks, scale=scale, block_size=block_size)


# the automatic block side at most in the framework's loop: past it a block's passes, unfused in
# tensorflow's loop, cost more than the fewer steps save (benchmarks/RESULTS.md, 2026-12-05)
FRAMEWORK_LOOP_MAX_BLOCK = 1024


# where a compiler unrolls the host's plan, the query blocks it sees: compiling then takes as
# long at N = 8192 as at 2048 (benchmarks/RESULTS.md, 2026-12-06), each block's scores growing
UNROLLED_QUERY_BLOCKS = 8


def additive_in_blocks(
    ops: Ops, q_hidden: Tensor, k_hidden: Tensor, values: Tensor, masks: Masks,
    score: Callable[..., Tensor], block_size: Optional[int],
) -> Optional[Tensor]:  # fmt: skip
    """The output of ``core.additive_attention`` with its features and scores made in blocks
    (score(q, k, block)), of block_size or where they would exceed the budget, else None."""
    per_score = ops.shape(q_hidden)[-1] or 1  # the features of a block are its scores x hiddens
    block_size = block_size or blockwise.automatic_block_size(
        ops, q_hidden, k_hidden, per_score, mask_mod=masks.mask_mod
    )
    if block_size is None:
        return None
    return blockwise.attention_in_blocks(
        ops, q_hidden, k_hidden, values, masks, block_size=block_size, score=score
    )[0]


def _modified_scores(ops: Ops, score_mod: Callable[..., Tensor], scale: float, q, k, block) -> Tensor:
    """A block's scaled dot-product scores, then score_mod on them."""
    scores = state.scores(ops, q, k, scale)
    return mods.apply_score_mod(ops, score_mod, scores, block, ops.shape(q)[0])
