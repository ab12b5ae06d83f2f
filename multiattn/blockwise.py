"""Exact attention in blocks: the scores (Q x K) never exist whole, only one block of them.

Forward, the online softmax of Rabe & Staats (2021) and FlashAttention-2 (``state``): for each
block of queries, over the key blocks j the block map keeps (``BlockMap``: FlexAttention's
tables, the blocks that need a mask and those that need none), with S_j = scale * Q K_j^T,

    m' = max(m, rowmax S_j),   P = exp(S_j - m'),
    l' = exp(m - m') l + rowsum P,   O' = exp(m - m') O + P V_j,

then output = O / l and lse = m + log l, the log of the sum of exp over the visible scores.
Backward, by recomputation from lse (FlashAttention-2): for each key block over the query
blocks that visit it, P = exp(S - lse), D = rowsum(dO * O), dV = P^T dO, dP = dO V^T,
dS = P * (dP - D + dlse), dQ = scale dS K, dK = scale dS^T Q.

One loop, written once over ``adapter.Ops``: in the framework's loop primitives where a
compiler traces the call (``Ops.loop``, ``Ops.map_rows``, ``Ops.rows_at``: jax's ``lax``,
tensorflow's ``while_loop``; one loop, compiled in the same time at any length), else a Python
loop over host ints.  A hidden score is -inf; a row with nothing visible gives output 0 and
lse -inf (``state.finish``).  Half types are computed in float32 (``ops.widen``).
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import numpy as np

from . import _machine, heads, tuning
from .masks import Masks, block_visibility, visible_values
from .protocol import Primitives
from .state import NEG_INF, block_sums, empty, finish, finite, finite_factor, merge_sums, weights

Tensor = Any
Ops = Any

# What the scores of one call may take before the automatic choice computes them in blocks.
SCORES_BUDGET_BYTES = int(os.environ.get("MULTIATTN_SCORES_BUDGET_BYTES", 64 << 20))
MIN_BLOCK, MAX_BLOCK = 128, 1024


# read once, at import: a compiler (torch.compile) cannot trace the read of the OS's files
L2_CACHE_BYTES = _machine.l2_cache_bytes()


def block_size_for(batch_rows: int, itemsize: int, cache_bytes: Optional[int] = None, area: int = 1) -> int:
    """The side of a square block whose scores, for all batch_rows (batch x heads) at once,
    fill ``area`` times one core's L2 cache: a power of two in [MIN_BLOCK, MAX_BLOCK] times
    the side that area adds."""
    cache = (L2_CACHE_BYTES if cache_bytes is None else cache_bytes) * area
    side = math.isqrt(max(cache // (max(itemsize, 4) * max(batch_rows, 1)), 1))
    side = 1 << max(side.bit_length() - 1, 0)
    reach = math.isqrt(area)
    return min(max(side, MIN_BLOCK * reach), MAX_BLOCK * reach)


def automatic_block_size(
    ops: Ops, queries: Tensor, keys: Tensor, per_score: int = 1, mask_mod: Any = None, masks: Masks = None
) -> Optional[int]:
    """The block size where the scores of this call would exceed ``SCORES_BUDGET_BYTES``, or half
    of it where the masks keep at most ``KEPT_FOR_BLOCKS`` of them (``kept_fraction``), else None
    (the materialised path).  per_score: the values made per score (additive attention: its
    hidden features); mask_mod: a mask function, whose structure may ask for smaller blocks
    (``MaskFunction.block_side``, not below MIN_BLOCK).  Unknown (traced) sizes count as fitting."""
    shape = tuple(ops.shape(queries)[:-1]) + (ops.shape(keys)[-2],)
    if any(size is None for size in shape):
        return None
    itemsize = 8 if ops.lowest(queries) < -1e300 else 4  # half types are computed in float32
    scores = math.prod(shape) * itemsize
    if scores <= SCORES_BUDGET_BYTES and not (
        masks is not None
        and scores > SCORES_BUDGET_BYTES // 2
        and kept_fraction(ops, masks, shape[-2], shape[-1]) <= KEPT_FOR_BLOCKS
    ):
        return None
    area = 1 if per_score > 1 else tuning.of(ops).block_area
    side = block_size_for(math.prod(shape[:-2]) * per_score, itemsize, area=area)
    favoured = None if mask_mod is None else mask_mod.block_side(ops)
    return side if favoured is None else min(side, max(favoured, MIN_BLOCK))


# where the masks keep at most this much of the scores, the blocks, which skip the rest, beat
# the whole scores from half the budget on every backend (benchmarks/RESULTS.md, 2026-12-05)
KEPT_FOR_BLOCKS = 0.6


def kept_fraction(ops: Ops, masks: Masks, n_queries: int, n_keys: int) -> float:
    """At most how much of the scores the masks keep, from what the host knows: causality, a
    mask function's key ranges, lengths read on the host (1.0: not known)."""
    kept = 1.0
    mod = masks.mask_mod
    if masks.causal or (mod is not None and mod.implies_causal()):  # sum over i of min(i + 1, K)
        below = min(n_queries, n_keys)
        kept = (below * (below + 1) // 2 + (n_queries - below) * n_keys) / (n_queries * n_keys)
    if mod is not None:
        step = MIN_BLOCK
        ranges = [(q0, min(q0 + step, n_queries), mod.key_range(q0, min(q0 + step, n_queries)))
                  for q0 in range(0, n_queries, step)]  # fmt: skip
        if all(r is not None for *_, r in ranges):
            seen = sum((q1 - q0) * max(min(hi, n_keys) - max(lo, 0), 0) for q0, q1, (lo, hi) in ranges)
            kept = min(kept, seen / (n_queries * n_keys))
    host = None if masks.valid_lens is None else ops.host_values(masks.valid_lens)
    if host is not None and host.size:
        lengths = np.nan_to_num(np.asarray(host, dtype=np.float64), nan=0.0)
        kept = min(kept, float(np.clip(lengths, 0, n_keys).mean()) / n_keys)
    return kept


# -- which blocks run, and which need masking ---------------------------------------------------

SKIP, FULL, PARTIAL = "skip", "full", "partial"


class Plan:
    """The blocks of one call: for a query block [q0, q1) and a key block [k0, k1), whether the
    masks hide it for every sequence (SKIP), show all of it (FULL: no masking work) or part
    of it (PARTIAL: its mask, from the parts that do not show it all).  Lengths and masks
    are read on the host where the framework allows (``ops.host_values``); unknown, a
    block is PARTIAL.  Causality is known from the positions alone."""

    def __init__(
        self, ops: Ops, masks: Masks, n_queries: int, n_keys: int, block: int, like: Tensor = None
    ) -> None:
        self.ops, self.masks, self.block, self._like = ops, masks, block, like
        lead = (1,) if like is None else tuple(ops.shape(like)[:-2])  # (B,) or (B, H)
        self.batch, self.heads = lead[0], (lead[1] if len(lead) == 2 else None)
        self._classify = None if masks.mask_mod is None else masks.mask_mod.classifier(ops)
        self.mod_values: dict = {}  # a mask function's blocks, evaluated to be classified
        self._visible: dict = {}  # ``visibility`` of a mask function alone, by its ``values_key``
        self.query_blocks = [(i, min(i + block, n_queries)) for i in range(0, n_queries, block)]
        self.key_blocks = [(j, min(j + block, n_keys)) for j in range(0, n_keys, block)]
        self.n_keys = n_keys
        self.lengths = None if masks.valid_lens is None else ops.host_values(masks.valid_lens)
        if self.lengths is not None and self.lengths.dtype.kind == "f":  # a NaN length shows nothing
            self.lengths = self.lengths.copy()
            self.lengths[self.lengths != self.lengths] = 0
        self.mask = None if masks.attention_mask is None else ops.host_values(masks.attention_mask)

    def kind(self, q0: int, q1: int, k0: int, k1: int) -> Tuple[str, Tuple[str, ...]]:
        """(SKIP, FULL or PARTIAL, the mask parts the block needs: "lengths", "mask", "causal")."""
        parts = []
        masks = self.masks
        if masks.causal:
            if k0 > q1 - 1:
                return SKIP, ()
            if k1 - 1 > q0:
                parts.append("causal")
        if masks.valid_lens is not None:
            if self.lengths is None:
                parts.append("lengths")
            else:
                lens = self.lengths if self.lengths.ndim == 1 else self.lengths[:, q0:q1]
                if k0 >= lens.max(initial=0):
                    return SKIP, ()
                if k1 > lens.min(initial=k1):
                    parts.append("lengths")
        if masks.attention_mask is not None:
            if self.mask is None:
                parts.append("mask")
            else:
                seen = _block_of(self.mask, q0, q1, k0, k1)
                if not seen.any():
                    return SKIP, ()
                if not seen.all():
                    parts.append("mask")
        if masks.mask_mod is not None:
            known = self._mod_kind((q0, q1, k0, k1))
            if known is not None and not known[0]:
                return SKIP, ()
            if known is None or not known[1]:
                parts.append("mod")
        return (PARTIAL if parts else FULL), tuple(parts)

    def key_range(self, q0: int, q1: int) -> Tuple[int, int]:
        """Keys [lo, hi) outside which the mask function hides every key from the queries
        [q0, q1) (``MaskFunction.key_range``); all keys where it does not tell."""
        mod = self.masks.mask_mod
        found = None if mod is None else mod.key_range(q0, q1)
        return (0, self.n_keys) if found is None else found

    def shown(self, q0: int, q1: int) -> List[Tuple[int, Tuple[int, int], str, Tuple[str, ...]]]:
        """(index, (k0, k1), kind, parts) of each key block the queries [q0, q1) do not skip;
        blocks outside ``key_range`` known hidden without examining them."""
        lo, hi = self.key_range(q0, q1)
        found = []
        for at, (k0, k1) in enumerate(self.key_blocks):
            if k1 <= lo or k0 >= hi:
                continue
            kind, parts = self.kind(q0, q1, k0, k1)
            if kind != SKIP:
                found.append((at, (k0, k1), kind, parts))
        return found

    def visibility(self, parts: tuple, q_block: Tensor, k_block: Tensor, q0: int, q1: int, k0: int, k1: int):
        """The boolean mask of a PARTIAL block from the parts it needs, broadcastable to its
        scores (B, [H,] bq, bk): one tensor for blocks alike (a window's, by the mask
        function's ``values_key``); the mask function's booleans kept from classifying it."""
        masks = self.masks
        key = masks.mask_mod.values_key((q0, q1, k0, k1)) if parts == ("mod",) else None
        if key is not None and key in self._visible:
            return self._visible[key]
        visible = block_visibility(
            self.ops, q_block, q0, k0, q1 - q0, k1 - k0, rank=len(self.ops.shape(q_block)),
            valid_lens=masks.valid_lens if "lengths" in parts else None,
            attention_mask=masks.attention_mask if "mask" in parts else None, causal="causal" in parts,
            mask_mod=masks.mask_mod if "mod" in parts else None, heads=self.heads, batch=self.batch,
            mod_values=self.mod_values.pop((q0, q1, k0, k1), None) if "mod" in parts else None,
        )  # fmt: skip
        if key is not None:
            self._visible[key] = visible
        return visible

    def _mod_kind(self, block: tuple) -> Optional[Tuple[bool, bool]]:
        """(some key visible, every key) for the mask function over a block: from what it
        knows, else from its booleans read on the host (kept for ``visibility``), else None."""
        ops, mod = self.ops, self.masks.mask_mod
        known = self._classify(block)
        if known is not None or self._like is None:  # no tensor to evaluate it on: not known
            return known
        values = mod.values(ops, self._like, self.heads, block, self.batch)
        host = ops.host_values(values)
        known = None if host is None else (bool(host.any()), bool(host.all()))
        if known is None or (known[0] and not known[1]):  # to be masked: kept for ``visibility``
            self.mod_values[block] = values
        return known


def _block_of(mask: Tensor, q0: int, q1: int, k0: int, k1: int) -> Tensor:
    """The block of a mask broadcastable to the scores (size-1 axes stay whole)."""
    shape = mask.shape
    if len(shape) == 1:
        return mask if shape[0] == 1 else mask[k0:k1]
    rows = slice(q0, q1) if shape[-2] != 1 else slice(None)
    cols = slice(k0, k1) if shape[-1] != 1 else slice(None)
    return mask[..., rows, cols]


def rows(x: Tensor, start: int, stop: int) -> Tensor:
    """x[..., start:stop, :], the rows of one block."""
    return x[..., start:stop, :]


class BlockMap:
    """FlexAttention's block tables: per query block i, the key blocks that need a mask,
    ``kv_index[i][:kv_count[i]]``, and those that need none, ``full_kv_index[i][:full_kv_count[i]]``;
    per key block j, the query blocks that visit it likewise (``q_index``, ``full_q_index``: the
    backward's); from the plan (``Plan``), kept for the masks of the partial blocks (the parts
    each needs, known on the host).  like: the queries, on which a mask function's blocks may
    be evaluated to be classified (None: not).  padded: the framework's loop pads the last
    blocks to whole ones, so the blocks at the padding need its mask (none is full)."""

    def __init__(
        self, ops: Ops, masks: Masks, n_queries: int, n_keys: int, block: int, like=None, padded: bool = False
    ) -> None:
        self.plan = plan = Plan(ops, masks, n_queries, n_keys, block, like=like)
        self.parts: dict = {}
        partial: List[List[int]] = []
        full: List[List[int]] = []
        last = len(plan.key_blocks) - 1 if n_keys % block else None  # a padded key block
        for i, (q0, q1) in enumerate(plan.query_blocks):
            shown = plan.shown(q0, q1)
            is_full = [
                kind == FULL and not (padded and (q1 - q0 < block or j == last)) for j, _, kind, _ in shown
            ]
            partial.append([j for (j, *_), f in zip(shown, is_full) if not f])
            full.append([j for (j, *_), f in zip(shown, is_full) if f])
            self.parts.update(((i, j), parts) for j, _, _, parts in shown)
        plan._like = None  # classified: the queries are not held by a block mask that keeps this map
        self.block, self.n_queries, self.n_keys = block, n_queries, n_keys
        self.kv_index, self.full_kv_index = partial, full
        self.q_index, self.full_q_index = (
            _transposed(partial, len(plan.key_blocks)),
            _transposed(full, len(plan.key_blocks)),
        )
        self.kv_count, self.full_kv_count, self.q_count, self.full_q_count = (
            [len(row) for row in table] for table in (partial, full, self.q_index, self.full_q_index)
        )

    def tables(self) -> list:
        """The tables as integer arrays, each row padded with 0 past its count (the framework's)."""
        found = []
        for table in (self.kv_index, self.full_kv_index, self.q_index, self.full_q_index):
            array = np.zeros((len(table), max(max(map(len, table), default=0), 1)), np.int32)
            for i, row in enumerate(table):
                array[i, : len(row)] = row
            found += [array, np.array([len(row) for row in table], np.int32)]
        return found


def _transposed(table: List[List[int]], count: int) -> List[List[int]]:
    found: List[List[int]] = [[] for _ in range(count)]
    for i, row in enumerate(table):
        for j in row:
            found[j].append(i)
    return found


def framework_loop(ops: Ops, queries: Tensor, masks: Masks) -> bool:
    """Whether this call runs the loop in the framework's loop primitives: traced, by a
    framework that has them (``Ops.loop_primitives``), with sizes known and a mask function (if
    any) that takes traced blocks; else the loop is Python's, over host ints."""
    return (
        ops.loop_primitives
        and ops.host_values(queries) is None
        and None not in ops.shape(queries)
        and (masks.mask_mod is None or masks.mask_mod.traceable())
    )


class _Blocks:
    """One call's blocks: where the loop is the framework's (``framework_loop``), its tensors
    padded to whole blocks, the tables as tensors and each block at a traced start; else
    Python's loop over ints, the last block as long as what is left.  ``seen``: the mask of a
    partial block."""

    def __init__(self, ops: Ops, bmap: BlockMap, masks: Masks, like: Tensor, in_framework: bool) -> None:
        self.ops, self.bmap, self.masks, self.in_framework = ops, bmap, masks, in_framework
        shape, b = ops.shape(like), bmap.block
        self.batch, self.heads, self.rank = shape[0], (shape[1] if len(shape) == 4 else None), len(shape)
        self.loop = ops.loop if in_framework else _python_loop
        self.map_rows = ops.map_rows if in_framework else functools.partial(Primitives.map_rows, ops)
        self.q_rows, self.k_rows = bmap.n_queries, bmap.n_keys
        tables = (bmap.kv_index, bmap.kv_count, bmap.full_kv_index, bmap.full_kv_count,
                  bmap.q_index, bmap.q_count, bmap.full_q_index, bmap.full_q_count)  # fmt: skip
        self.masks_padded = masks
        self.limits: tuple = (None, None)
        if in_framework:
            tables = tuple(ops.constant(x, like) for x in bmap.tables())
            self.q_rows, self.k_rows = len(bmap.kv_count) * b, len(bmap.q_count) * b
            self.limits = (
                None if self.q_rows == bmap.n_queries else bmap.n_queries,
                None if self.k_rows == bmap.n_keys else bmap.n_keys,  # the padding
            )
            lens, mask = masks.valid_lens, masks.attention_mask
            if lens is not None and len(ops.shape(lens)) == 2:
                lens = _padded(ops, lens, self.q_rows, axis=-1)
            if mask is not None:
                for axis, n in ((-2, self.q_rows), (-1, self.k_rows)):
                    if len(ops.shape(mask)) >= -axis and ops.shape(mask)[axis] != 1:  # else broadcast
                        mask = _padded(ops, mask, n, axis)
            self.masks_padded = Masks(lens, mask, masks.causal, masks.mask_mod)
        (self.kv_index, self.kv_count, self.full_kv_index, self.full_kv_count,
         self.q_index, self.q_count, self.full_q_index, self.full_q_count) = tables  # fmt: skip

    def q(self, x: Tensor) -> Any:
        """x's rows (axis -2) by query block: padded to whole blocks in the framework's loop, a
        list of its blocks (cut in one op, ``Ops.split_rows``) in Python's."""
        return self._blocks(x, self.q_rows, self.bmap.n_queries)

    def k(self, x: Tensor) -> Any:
        """x's rows by key block, as ``q``."""
        return self._blocks(x, self.k_rows, self.bmap.n_keys)

    def _blocks(self, x: Tensor, padded_rows: int, rows: int) -> Any:
        if self.in_framework:
            return _padded(self.ops, x, padded_rows)
        b = self.bmap.block
        return self.ops.split_rows(x, [min(b, rows - at) for at in range(0, rows, b)])

    def at(self, x: Any, i: Any) -> Tensor:
        """Block i of x's rows (``q``, ``k``)."""
        return self.ops.rows_at(x, i * self.bmap.block, self.bmap.block) if self.in_framework else x[i]

    def seen(self, i: Any, j: Any, q: Tensor, k: Tensor) -> Optional[Tensor]:
        """The boolean mask of the partial block (i, j) of queries q and keys k, broadcastable to
        its scores: in the framework's loop every mask's (and the padding's), else the parts
        the host found it needs."""
        ops, masks, b = self.ops, self.masks_padded, self.bmap.block
        q0, k0 = i * b, j * b
        n_queries, n_keys = ops.shape(q)[-2], ops.shape(k)[-2]
        common = dict(rank=self.rank, heads=self.heads, batch=self.batch)
        if self.in_framework:
            return block_visibility(
                ops, q, q0, k0, n_queries, n_keys, limits=self.limits, valid_lens=masks.valid_lens,
                attention_mask=masks.attention_mask, causal=masks.causal, mask_mod=masks.mask_mod, **common,
            )  # fmt: skip
        parts = self.bmap.parts[i, j]
        return self.bmap.plan.visibility(parts, q, k, q0, q0 + n_queries, k0, k0 + n_keys)

    def hides_values(self, i: Any, j: Any, k: Tensor) -> bool:
        """Whether a partial block's hidden values must be set to 0 (a NaN there must not reach
        the output as 0 * NaN): not where causality alone masks it and its last query sees
        every key of it."""
        if self.in_framework:
            return True
        b = self.bmap.block
        return self.bmap.parts[i, j] != ("causal",) or j * b + self.ops.shape(k)[-2] > min(
            (i + 1) * b, self.q_rows
        )

    def add(self, blocks: Any, i: Any, x: Tensor) -> Any:
        """blocks (a list of blocks, or a tensor (count, ..., b, d) in the framework's loop)
        with x added to block i."""
        if not self.in_framework:
            blocks[i] = x if blocks[i] is None else blocks[i] + x
            return blocks
        return self.ops.write_rows(blocks, i, 0, self.ops.rows_at(blocks, i, 1, axis=0)[0] + x)

    def settle(self, acc: tuple) -> None:
        """``Ops.settle`` of the accumulated gradients (blocks, then tensors)."""
        head = [x for x in acc[0] if x is not None] if isinstance(acc[0], list) else [acc[0]]
        self.ops.settle(tuple(head) + tuple(acc[1:]))

    def joined(self, blocks: Any, like: Tensor, n: int) -> Tensor:
        """The blocks' rows one after another, the first n of them; zeros for a block none added to."""
        if self.in_framework:
            return self.ops.joined_rows(blocks)[..., :n, :]
        b, ops = self.bmap.block, self.ops
        parts = [
            ops.zeros(tuple(ops.shape(like)[:-2]) + (min(b, n - at * b), ops.shape(like)[-1]), like)
            if x is None else x
            for at, x in enumerate(blocks)
        ]  # fmt: skip
        return parts[0] if len(parts) == 1 else ops.concat(parts, -2)

    def buffer(self, count: int, like: Tensor) -> Any:
        """count blocks of zeros shaped like like's rows (a list of Nones on the host)."""
        if not self.in_framework:
            return [None] * count
        b, ops = self.bmap.block, self.ops
        return ops.zeros((count,) + tuple(ops.shape(like)[:-2]) + (b, ops.shape(like)[-1]), like)


def _python_loop(count: int, body: Callable[[int, tuple], tuple], state: tuple) -> tuple:
    for n in range(count):
        state = body(n, state)
    return state


def _padded(ops: Ops, x: Tensor, n: int, axis: int = -2) -> Tensor:
    """x with zeros (False) after its entries along axis, to n of them."""
    shape = list(ops.shape(x))
    missing = n - shape[axis]
    if missing == 0:
        return x
    shape[axis] = missing
    return ops.concat([x, ops.zeros(tuple(shape), x)], axis)


# -- forward ---------------------------------------------------------------------------------------

ScoreFn = Callable[..., Tensor]  # (query block, key block, *, block=(q0, q1, k0, k1)) -> scores


def forward(
    ops: Ops, bmap: BlockMap, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks, *,
    scale: float = 1.0, score: Optional[ScoreFn] = None, in_framework: bool = False,
) -> Tuple[Tensor, Tensor]:  # fmt: skip
    """(output (B, [H,] Q, v), lse (B, [H,] Q, 1)) of masked attention, the online softmax for
    each query block over its partial key blocks, then its full ones.  score(query block, key
    block, block=(q0, q1, k0, k1)) -> its scores (default: ``scale * q k^T``); queries and keys
    are whatever it takes, blocked along axis -2.  in_framework: the framework's loop."""
    like = values
    queries, keys, values = ops.widen(queries), ops.widen(keys), ops.widen(values)
    if score is None:
        queries = queries * scale  # once, not per block
    blocks = _Blocks(ops, bmap, masks, queries, in_framework)
    steps = _Steps(ops, blocks, queries, keys, values, score)
    q_all, k_all, v_all = blocks.q(queries), blocks.k(keys), blocks.k(values)
    lead, width = tuple(ops.shape(queries)[:-2]), ops.shape(values)[-1]

    def query_block(i: Any) -> Tuple[Tensor, Tensor]:
        q, counts = blocks.at(q_all, i), (blocks.kv_count[i], blocks.full_kv_count[i])

        def key_block(table: Any, masked: bool) -> Callable[[Any, tuple], tuple]:
            def visit(n: Any, state: tuple) -> tuple:
                j = table[i][n]
                last = not in_framework and n == counts[not masked] - 1 and (not masked or not counts[1])
                return steps.run(i, j, q, blocks.at(k_all, j), blocks.at(v_all, j), masked, state, last)

            return visit

        # Python's loop starts a row from its first block's sums and finishes it in its last
        # step (where steps are compiled, nothing runs between them); the framework's from none
        state = empty(ops, lead + (ops.shape(q)[-2],), width, q) if in_framework or counts == (0, 0) else ()
        state = blocks.loop(counts[0], key_block(blocks.kv_index, True), state)
        state = blocks.loop(counts[1], key_block(blocks.full_kv_index, False), state)
        found = finish(ops, state) if len(state) == 3 else state
        ops.settle(found)  # lazy frameworks: the sums would keep every block of scores alive
        return found

    out, lse = blocks.map_rows(query_block, len(bmap.kv_count), (queries, queries))
    n = bmap.n_queries
    return ops.cast(out[..., :n, :], like), lse[..., :n, :]


class _Steps:
    """The step of one block: its scores (the caller's ``score``, else q k^T), its mask where
    partial, merged into the row's sums; compiled by the framework where that pays (``Ops.compiled``:
    one dispatch per block, from ``COMPILE_MIN_BLOCKS`` blocks), through its fused softmax where
    the tuning asks (``tuning.Tuning.fused_softmax``) and the scores are bounded."""

    def __init__(
        self, ops: Ops, blocks: _Blocks, queries: Tensor, keys: Tensor, values: Tensor, score
    ) -> None:
        self.ops, self.blocks, self.score = ops, blocks, score
        host = not blocks.in_framework and score is None
        # finite values (or nothing hidden): no hidden value can reach an output as 0 * NaN
        self.finite_values = not blocks.in_framework and (blocks.masks.none or known_finite(ops, values))
        self.fused = host and tuning.of(ops).fused_softmax and bounded_scores(ops, queries, keys)
        grid = len(blocks.bmap.kv_count) * len(blocks.bmap.q_count)
        self.compiled = host and grid >= COMPILE_MIN_BLOCKS and _has_compiler(ops)

    def run(self, i: Any, j: Any, q: Tensor, k: Tensor, v: Tensor, masked: bool, state: tuple, last: bool):
        """The sums after block (i, j) of q, k, v (state: the sums before, () for a row's first
        block); finished, (out, lse), where last."""
        ops, blocks, b = self.ops, self.blocks, self.blocks.bmap.block
        if masked and self.score is None and self._on_diagonal(i, j, q, k):
            kind, args = StepKind(diagonal=True, full=False, last=last), ()  # its mask: made in the step
        else:
            seen = blocks.seen(i, j, q, k) if masked else None
            hide = masked and not self.finite_values and blocks.hides_values(i, j, k)
            if self.score is not None:
                n_queries, n_keys = ops.shape(q)[-2], ops.shape(k)[-2]
                s = self.score(q, k, block=(i * b, i * b + n_queries, j * b, j * b + n_keys))
                found = _sums(ops, False, hide, False, s, v, seen, *state)
                return finish(ops, found) if last else found
            kind = StepKind(fused=self.fused and not masked, hide=hide, full=seen is None, last=last)
            args = () if seen is None else (seen,)
        step = _program(ops, kind) if self.compiled else functools.partial(_step, ops, kind)
        return step(q, k, v, *args, *state)

    def _on_diagonal(self, i: Any, j: Any, q: Tensor, k: Tensor) -> bool:
        """Whether a partial block is a square on the causal diagonal that causality alone
        masks (in Python's loop): its halves then leave out its hidden quarter."""
        blocks, side = self.blocks, self.ops.shape(q)[-2]
        if blocks.in_framework or i != j or blocks.bmap.parts[i, j] != ("causal",):
            return False
        return 1 < side == self.ops.shape(k)[-2]


class StepKind(NamedTuple):
    """What a block's step does (the key of its compiled program): a square on the causal
    diagonal in two halves (``_diagonal``), or q k^T and the sums, by the framework's fused
    softmax where fused, its hidden values 0 where hide, with no mask where full; finished,
    (out, lse), where last."""

    diagonal: bool = False
    fused: bool = False
    hide: bool = False
    full: bool = True
    last: bool = False


def _step(ops: Ops, kind: StepKind, q: Tensor, k: Tensor, v: Tensor, *tensors: Tensor) -> tuple:
    """The dot-product step of a kind of block; tensors: the block's mask (not where full),
    then the running sums (none for a row's first block)."""
    tensors = tuple(tensors)
    if kind.diagonal:
        found = _diagonal(ops, q, k, v, *tensors)
    else:
        seen, state = (None, tensors) if kind.full else (tensors[0], tensors[1:])
        found = _sums(ops, kind.fused, kind.hide, True, heads.matmul_t(ops, q, k), v, seen, *state)
    return finish(ops, found) if kind.last else found


def _diagonal(ops: Ops, q: Tensor, k: Tensor, v: Tensor, *state: Tensor) -> tuple:
    """A square block on the causal diagonal, its queries in two halves: the first half sees
    only the first half of the keys, so the top-right quarter, all hidden, is never computed.
    Each half's last query sees all of its keys: no values to mask."""
    side = ops.shape(q)[-2]
    half, seen = side // 2, ops.causal_mask(side, side, k)
    found = []
    for r0, r1, width in ((0, half, half), (half, side, side)):
        s = heads.matmul_t(ops, rows(q, r0, r1), rows(k, 0, width))
        part = tuple(rows(x, r0, r1) for x in state) or None
        found.append(block_sums(ops, s, rows(v, 0, width), seen[r0:r1, :width], part, owned=True))
    return tuple(ops.concat(halves, -2) for halves in zip(*found))


def _sums(ops: Ops, fused: bool, hide: bool, owned: bool, s: Tensor, v: Tensor, seen, *state) -> tuple:
    """The running sums with a block's scores s and values v merged in: its hidden values 0
    where hide; by the framework's fused softmax where fused (no mask)."""
    if fused:
        w, lse = ops.softmax_with_lse(s)
        ones = ops.zeros(ops.shape(lse), lse) + 1.0
        return merge_sums(ops, state or None, (lse, ones, heads.matmul(ops, w, v)))
    v = visible_values(ops, v, seen) if hide else v
    return block_sums(ops, s, v, seen, state or None, owned=owned)


def _program(ops: Ops, kind: StepKind) -> Callable[..., tuple]:
    """``_step`` of a kind compiled by the framework, made once per process."""
    programs = _PROGRAMS.get(ops)
    if programs is None:
        programs = _PROGRAMS[ops] = {}
    if kind not in programs:
        programs[kind] = ops.compiled(functools.partial(_step, ops, kind))
    return programs[kind]


COMPILE_MIN_BLOCKS = 64  # blocks of the grid: below, a compiler's time for each new shape is not paid back
# ops -> {a kind of step: it compiled}; keyed by the adapter itself, not by an id()
_PROGRAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _has_compiler(ops: Ops) -> bool:
    """Whether ``ops.compiled`` is a compiler's, not the default that returns a step as it is."""
    return ops.compiled(_python_loop) is not _python_loop


def known_finite(ops: Ops, x: Tensor) -> bool:
    """Whether x, read on the host, holds finite numbers only (False where it cannot be read)."""
    host = ops.host_values(x)
    return host is not None and bool(np.isfinite(host).all())


def bounded_scores(ops: Ops, queries: Tensor, keys: Tensor) -> bool:
    """Whether every dot-product score of queries and keys, read on the host, is finite and
    within ``SCORES_BOUND`` (|q . k| <= d max|q| max|k|); False where they cannot be read."""
    q, k = ops.host_values(queries), ops.host_values(keys)
    if q is None or k is None:
        return False
    top = float(abs(q).max(initial=0)) * float(abs(k).max(initial=0)) * q.shape[-1]
    return top <= SCORES_BOUND  # False where top is NaN or inf


SCORES_BOUND = 1e20  # |scores| below it: a fused softmax's exp(s - max) neither overflows nor is NaN


# -- backward --------------------------------------------------------------------------------------


def backward(
    ops: Ops, bmap: BlockMap, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks, out: Tensor,
    lse: Tensor, d_out: Tensor, d_lse: Optional[Tensor] = None, *, scale: float, in_framework: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(dQ, dK, dV) of ``forward`` (dot-product scores) from its saved output and lse, for each
    key block over the query blocks that visit it, each block's P and dS recomputed (no block
    of scores outlives its use): dK and dV summed there, dQ added to each query block's.
    d_lse: the cotangent of lse, None where lse was not used."""
    likes = (queries, keys, values)
    query_rows, key_rows = backward_rows(ops, queries, keys, values, out, lse, d_out, d_lse, scale)
    kv_heads = ops.shape(keys)[1] if len(ops.shape(keys)) == 4 else None
    blocks = _Blocks(ops, bmap, masks, query_rows[0], in_framework)
    q_all, qs_all, do_all, lse_all, dot_all = (blocks.q(x) for x in query_rows)
    k_all, kf_all, v_all = (blocks.k(x) for x in key_rows)
    n_q, n_k = len(bmap.kv_count), len(bmap.q_count)

    def key_block(j: Any, grads: tuple) -> tuple:
        k, k_finite, v = blocks.at(k_all, j), blocks.at(kf_all, j), blocks.at(v_all, j)

        def query_block(table: Any, masked: bool) -> Callable[[Any, tuple], tuple]:
            def visit(n: Any, acc: tuple) -> tuple:
                d_q, d_k, d_v = acc
                i = table[j][n]
                q, q_scaled, do, lse_, dot = (
                    blocks.at(x, i) for x in (q_all, qs_all, do_all, lse_all, dot_all)
                )
                s, v_seen, seen = heads.matmul_t(ops, q_scaled, k), v, None
                if masked:
                    seen = blocks.seen(i, j, q, k)
                    s = ops.where(seen, s, NEG_INF)
                    v_seen = visible_values(ops, v, seen) if blocks.hides_values(i, j, k) else v
                p, ds = score_gradients(ops, s, seen, do, v_seen, lse_, dot)
                d_q = blocks.add(d_q, i, heads.matmul(ops, ds, k_finite))
                return (
                    d_q,
                    d_k + heads.summed_tn(ops, ds, q, kv_heads),
                    d_v + heads.summed_tn(ops, p, do, kv_heads),
                )

            return visit

        d_q, d_k, d_v = grads
        acc = (d_q, ops.zeros(ops.shape(k), k), ops.zeros(ops.shape(v), v))
        acc = blocks.loop(blocks.q_count[j], query_block(blocks.q_index, True), acc)
        acc = blocks.loop(blocks.full_q_count[j], query_block(blocks.full_q_index, False), acc)
        blocks.settle(acc)  # lazy frameworks: else every block's dS would stay alive
        return acc[0], blocks.add(d_k, j, acc[1]), blocks.add(d_v, j, acc[2])

    grads = (blocks.buffer(n_q, q_all), blocks.buffer(n_k, k_all), blocks.buffer(n_k, v_all))
    d_q, d_k, d_v = blocks.loop(n_k, key_block, grads)
    found = (
        blocks.joined(d_q, query_rows[0], bmap.n_queries) * scale,
        blocks.joined(d_k, key_rows[0], bmap.n_keys) * scale,
        blocks.joined(d_v, key_rows[2], bmap.n_keys),
    )
    return tuple(ops.cast(g, like) for g, like in zip(found, likes))


def backward_rows(
    ops: Ops, queries, keys, values, out, lse, d_out, d_lse, scale: float
) -> Tuple[tuple, tuple]:
    """What the backward reads by query row, (Q with non-finite entries 0, scale Q, dO, lse with
    -inf as 0, D = rowsum(dO * O) - dlse), and by key row, (K, K with non-finite entries 0, V),
    widened: the finite factors give a row that sees nothing, or keys of -inf, gradients 0."""
    queries, keys, values = ops.widen(queries), ops.widen(keys), ops.widen(values)
    out, d_out = ops.widen(out), ops.widen(d_out)
    row_dot = ops.sum(d_out * out, -1)
    if d_lse is not None:
        row_dot = row_dot - ops.widen(d_lse)
    query_rows = (finite_factor(ops, queries), queries * scale, d_out, finite(ops, lse), row_dot)
    return query_rows, (keys, finite_factor(ops, keys), values)


def score_gradients(
    ops: Ops, s: Tensor, seen, d_out: Tensor, v: Tensor, lse: Tensor, row_dot: Tensor
) -> tuple:
    """(P, dS) of a block of scores s (hidden ones -inf; seen: its mask or None), recomputed
    from lse: P = exp(s - lse), dS = P * (dO V^T - D)."""
    p = weights(ops, s, lse, seen)
    return p, p * (heads.matmul_t(ops, d_out, v) - row_dot)


# -- the differentiable call ---------------------------------------------------------------------


def attention(
    ops: Ops, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks, *, scale: float, block_size: int
) -> Tuple[Tensor, Tensor]:
    """(output, lse (B, [H,] Q)) of dot-product attention in blocks, forward and backward over
    one block map, in the framework's loop where it has one and the call is traced
    (``framework_loop``), else in Python's: the gradients, too, in memory linear in the length."""
    in_framework = framework_loop(ops, queries, masks)
    n_queries, n_keys = ops.shape(queries)[-2], ops.shape(keys)[-2]
    _check_known(block_size, n_queries, n_keys)
    made = masks.block_mask
    like = None if in_framework else queries  # traced: a mask function's blocks are not evaluated
    if made is not None and not ops.unrolls_loops(queries):  # its maps kept (not where traced by torch)
        bmap = made.block_map(block_size, like)
    else:
        bmap = BlockMap(ops, masks, n_queries, n_keys, block_size, like=like, padded=in_framework)

    def forward_(q: Tensor, k: Tensor, v: Tensor, masks: Masks) -> Tuple[Tensor, Tensor]:
        return forward(ops, bmap, q, k, v, masks, scale=scale, in_framework=in_framework)

    def backward_(q, k, v, masks, out, lse, d_out, d_lse):
        return backward(
            ops, bmap, q, k, v, masks, out, lse, d_out, d_lse, scale=scale, in_framework=in_framework
        )

    return differentiated(ops, forward_, backward_, queries, keys, values, masks)


def attention_in_blocks(
    ops: Ops, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks, *, block_size: int,
    scale: float = 1.0, score: Optional[ScoreFn] = None,
) -> Tuple[Tensor, Tensor]:  # fmt: skip
    """(output, lse (B, [H,] Q, 1)) of ``forward`` in Python's loop, differentiated by the
    framework itself (a caller's score function: additive attention, ``score_mod``)."""
    n_queries, n_keys = ops.shape(queries)[-2], ops.shape(keys)[-2]
    _check_known(block_size, n_queries, n_keys)
    bmap = BlockMap(ops, masks, n_queries, n_keys, block_size, like=queries)
    return forward(ops, bmap, queries, keys, values, masks, scale=scale, score=score)


def _check_known(block_size: int, n_queries: Any, n_keys: Any) -> None:
    if n_queries is None or n_keys is None:
        raise ValueError(
            f"block_size={block_size} needs the numbers of queries and keys known when the call is "
            f"traced, got {n_queries} queries and {n_keys} keys (None: unknown)"
        )


def differentiated(
    ops: Ops,
    forward: Callable,
    backward: Callable,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    masks: Masks,
) -> Tuple[Tensor, Tensor]:
    """(output, lse (B, [H,] Q)) of forward(q, k, v, masks) -> (output, lse (..., Q, 1)),
    differentiated by backward(q, k, v, masks, output, lse, d_out, d_lse) -> (dq, dk, dv)
    through the framework's own mechanism (``ops.custom_gradient``); the masks' tensors are
    passed along as constants (a compiler's inputs, not captured)."""
    names = [name for name in ("valid_lens", "attention_mask") if getattr(masks, name) is not None]

    def rebuilt(given: Tuple[Tensor, ...]) -> Masks:
        kept = dict(causal=masks.causal, mask_mod=masks.mask_mod, block_mask=masks.block_mask)
        return Masks(**dict(zip(names, given)), **kept)

    def forward_(q: Tensor, k: Tensor, v: Tensor, *given: Tensor) -> Tuple[Tensor, Tensor]:
        return forward(q, k, v, rebuilt(given))

    def backward_(tensors, given, outputs, cotangents):
        (out, lse), (d_out, d_lse) = outputs, cotangents
        d_out = ops.zeros(ops.shape(out), out) if d_out is None else d_out
        return backward(*tensors, rebuilt(given), out, lse, d_out, d_lse)

    constants = tuple(getattr(masks, name) for name in names)
    out, lse = ops.custom_gradient(forward_, backward_, (queries, keys, values), constants)
    return out, lse[..., 0]


def no_lse(ops: Ops, out: Tensor) -> Tensor:
    """The lse of rows with nothing to attend to: -inf, (B, [H,] Q) for out (B, [H,] Q, v)."""
    rows = ops.zeros(tuple(ops.shape(out)[:-1]) + (1,), ops.widen(out))
    return ops.log(rows)[..., 0]
