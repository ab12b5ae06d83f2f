"""One loop over the block map, the loop a compiler sees.

The online softmax (``state``: ``block_sums``, ``finish``), for each
query block over the key blocks the map keeps, and its backward recomputed from lse, written
with ``Ops.loop``, ``Ops.map_rows`` and ``Ops.rows_at``.  Where those are the framework's loop
primitives (``Ops.loop_primitives``: jax's ``lax``, tensorflow's ``while_loop``), a compiler
sees one loop: it compiles in the same time at any length and holds one block of scores at a
time, forward and through gradients (``Ops.custom_gradient`` wraps the loop).  Which blocks to
visit is known on the host from the structure of the masks (causal, a mask function's
``classify``); lengths and boolean masks, unknown there, are applied in the graph.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import blockwise, heads
from .masks import Masks, block_visibility, visible_values
from .state import NEG_INF, block_sums, empty, finish

Tensor = Any
Ops = Any
# the automatic block side at most: past it a block's passes, unfused in tensorflow's loop, cost
# more than the fewer steps save (benchmarks/RESULTS.md, 2026-12-05 fourth session)
MAX_BLOCK = 1024


class BlockMap:
    """Per query block i, the key blocks to visit, ``kv_index[i, :kv_count[i]]``; per key block
    j, the query blocks that visit it, ``q_index[j, :q_count[j]]`` (the backward's); blocks of
    ``block`` rows, from what the host knows of the masks (``blockwise.Plan``)."""

    def __init__(self, ops: Ops, masks: Masks, n_queries: int, n_keys: int, block: int) -> None:
        plan = blockwise.Plan(ops, masks, n_queries, n_keys, block)
        visits = np.zeros((len(plan.query_blocks), len(plan.key_blocks)), bool)
        for i, (q0, q1) in enumerate(plan.query_blocks):
            for at, *_ in plan.shown(q0, q1):
                visits[i, at] = True
        self.block, self.n_queries, self.n_keys = block, n_queries, n_keys
        self.kv_index, self.kv_count = _indices(visits)
        self.q_index, self.q_count = _indices(visits.T)


def _indices(visits: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    counts = visits.sum(1).astype(np.int32)
    index = np.zeros((len(visits), max(int(counts.max(initial=0)), 1)), np.int32)
    for i, row in enumerate(visits):
        found = np.nonzero(row)[0]
        index[i, : len(found)] = found
    return index, counts


def usable(ops: Ops, queries: Tensor, masks: Masks) -> bool:
    """Whether this call runs the loop: traced, by a framework with loop primitives, with sizes
    known and a mask function (if any) that takes traced blocks."""
    return (
        ops.loop_primitives
        and ops.host_values(queries) is None
        and None not in ops.shape(queries)
        and (masks.mask_mod is None or masks.mask_mod.traceable())
    )


def attention(
    ops: Ops, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks, *, scale: float, block_size: int
) -> Tuple[Tensor, Tensor]:
    """(output, lse (B, [H,] Q)) of dot-product attention, the loop over the block map forward
    and backward (``Ops.custom_gradient``)."""
    n_queries, n_keys = ops.shape(queries)[-2], ops.shape(keys)[-2]
    made = masks.block_mask
    bmap = BlockMap(ops, masks, n_queries, n_keys, block_size) if made is None else made.block_map(block_size)

    def forward(q: Tensor, k: Tensor, v: Tensor, masks: Masks) -> Tuple[Tensor, Tensor]:
        return _forward(ops, bmap, q, k, v, masks, scale)

    def backward(q, k, v, masks, out, lse, d_out, d_lse):
        return _backward(ops, bmap, q, k, v, masks, out, lse, d_out, d_lse, scale)

    return blockwise.differentiated(ops, forward, backward, queries, keys, values, masks)


class _Blocks:
    """A call's tensors padded to whole blocks, and the mask of a block where it runs."""

    def __init__(self, ops: Ops, bmap: BlockMap, masks: Masks, like: Tensor, kv_heads: Optional[int]) -> None:
        self.ops, self.bmap, self.masks, self.kv_heads = ops, bmap, masks, kv_heads
        shape = ops.shape(like)
        self.batch, self.heads, self.rank = shape[0], (shape[1] if len(shape) == 4 else None), len(shape)
        b = bmap.block
        self.q_rows, self.k_rows = len(bmap.kv_count) * b, len(bmap.q_count) * b
        table = ops.constant if ops.loop_primitives else (lambda values, like: values)
        self.kv_index, self.kv_count, self.q_index, self.q_count = (
            table(x, like) for x in (bmap.kv_index, bmap.kv_count, bmap.q_index, bmap.q_count)
        )
        lens, mask = masks.valid_lens, masks.attention_mask  # padded to whole blocks
        if lens is not None and len(ops.shape(lens)) == 2:
            lens = _padded(ops, lens, self.q_rows, axis=-1)
        if mask is not None:
            for axis, rows in ((-2, self.q_rows), (-1, self.k_rows)):
                if len(ops.shape(mask)) >= -axis and ops.shape(mask)[axis] != 1:  # else broadcast
                    mask = _padded(ops, mask, rows, axis)
        self.padded = dict(valid_lens=lens, attention_mask=mask, causal=masks.causal, mask_mod=masks.mask_mod)
        self.some = not masks.none or (self.q_rows, self.k_rows) != (bmap.n_queries, bmap.n_keys)

    def q(self, x: Tensor) -> Tensor:
        return _padded(self.ops, x, self.q_rows)

    def k(self, x: Tensor) -> Tensor:
        return _padded(self.ops, x, self.k_rows)

    def seen(self, q0: Any, k0: Any, like: Tensor) -> Optional[Tensor]:
        """The boolean mask of the block at (q0, k0), broadcastable to its scores; None: all seen."""
        if not self.some:
            return None
        bmap, b = self.bmap, self.bmap.block
        limits = (
            None if self.q_rows == bmap.n_queries else bmap.n_queries,
            None if self.k_rows == bmap.n_keys else bmap.n_keys,  # the padding
        )
        return block_visibility(
            self.ops, like, q0, k0, b, b, rank=self.rank, heads=self.heads, batch=self.batch, limits=limits,
            **self.padded,
        )  # fmt: skip

    def scores(self, q: Tensor, k: Tensor, v: Tensor, q0: Any, k0: Any) -> Tuple[Tensor, Tensor, Any]:
        """A block's scores (q scaled) with the hidden ones -inf, its values with the rows no
        query sees 0 (a NaN there must not reach the output as 0 * NaN), and its mask."""
        s, seen = heads.matmul_t(self.ops, q, k), self.seen(q0, k0, q)
        if seen is None:
            return s, v, None
        return self.ops.where(seen, s, NEG_INF), visible_values(self.ops, v, seen), seen


def _padded(ops: Ops, x: Tensor, rows: int, axis: int = -2) -> Tensor:
    """x with zeros (False) after its entries along axis, to rows of them."""
    shape = list(ops.shape(x))
    missing = rows - shape[axis]
    if missing == 0:
        return x
    shape[axis] = missing
    return ops.concat([x, ops.zeros(tuple(shape), x)], axis)


def _forward(ops, bmap, queries, keys, values, masks, scale):
    """(output, lse (..., Q, 1)): for each query block, the online softmax over its key blocks."""
    like = values
    queries, keys, values = ops.widen(queries), ops.widen(keys), ops.widen(values)
    blocks, b = _Blocks(ops, bmap, masks, queries, None), bmap.block
    q_all, k_all, v_all = blocks.q(queries * scale), blocks.k(keys), blocks.k(values)
    rows = tuple(ops.shape(queries)[:-2]) + (b,)

    def query_block(i):
        q0 = i * b
        q = ops.rows_at(q_all, q0, b)

        def key_block(j, state):
            k0 = blocks.kv_index[i][j] * b
            s, v, _ = blocks.scores(q, ops.rows_at(k_all, k0, b), ops.rows_at(v_all, k0, b), q0, k0)
            return block_sums(ops, s, v, None, state, owned=True)

        start = empty(ops, rows, ops.shape(values)[-1], q)
        return finish(ops, ops.loop(blocks.kv_count[i], key_block, start))

    out, lse = ops.map_rows(query_block, len(bmap.kv_count), (queries, queries))
    n = bmap.n_queries
    return ops.cast(out[..., :n, :], like), lse[..., :n, :]


def _backward(ops, bmap, queries, keys, values, masks, out, lse, d_out, d_lse, scale):
    """(dQ, dK, dV) from the saved output and lse (FlashAttention-2, in ``blockwise``'s words):
    dQ by query block over its key blocks, then dK and dV by key block over the query blocks
    that see it, each block's P and dS recomputed."""
    likes = (queries, keys, values)
    query_rows, key_rows = blockwise.backward_rows(ops, queries, keys, values, out, lse, d_out, d_lse, scale)
    kv_heads = ops.shape(keys)[1] if len(ops.shape(keys)) == 4 else None
    blocks, b = _Blocks(ops, bmap, masks, query_rows[0], kv_heads), bmap.block
    q_all, qs_all, do_all, lse_all, dot_all = (blocks.q(x) for x in query_rows)
    k_all, kf_all, v_all = (blocks.k(x) for x in key_rows)

    def block(x, start):
        return ops.rows_at(x, start, b)

    def d_scores(q0, k0):
        """(P, dS, the query block, dO's) of the block at (q0, k0)."""
        q, do = block(q_all, q0), block(do_all, q0)
        s, v, _ = blocks.scores(block(qs_all, q0), block(k_all, k0), block(v_all, k0), q0, k0)
        return (
            *blockwise.score_gradients(ops, s, None, do, v, block(lse_all, q0), block(dot_all, q0)),
            q,
            do,
        )

    def d_query_block(i):  # dQ = scale dS K
        def key_block(j, state):
            k0 = blocks.kv_index[i][j] * b
            return (state[0] + heads.matmul(ops, d_scores(i * b, k0)[1], block(kf_all, k0)),)

        start = (ops.zeros(ops.shape(block(q_all, 0)), q_all),)
        return (ops.loop(blocks.kv_count[i], key_block, start)[0] * scale,)

    def d_key_block(j):  # dK = scale dS^T Q, dV = P^T dO, over each group's heads
        def query_block(i, state):
            p, ds, q, do = d_scores(blocks.q_index[j][i] * b, j * b)
            dk, dv = heads.summed_tn(ops, ds, q, kv_heads), heads.summed_tn(ops, p, do, kv_heads)
            return state[0] + dk, state[1] + dv

        start = tuple(ops.zeros(ops.shape(block(x, 0)), x) for x in (k_all, v_all))
        dk, dv = ops.loop(blocks.q_count[j], query_block, start)
        return dk * scale, dv

    (dq,) = ops.map_rows(d_query_block, len(bmap.kv_count), query_rows[:1])
    dk, dv = ops.map_rows(d_key_block, len(bmap.q_count), key_rows[::2])
    found = (dq[..., : bmap.n_queries, :], dk[..., : bmap.n_keys, :], dv[..., : bmap.n_keys, :])
    return tuple(ops.cast(g, like) for g, like in zip(found, likes))
