"""Exact attention in blocks: the scores (Q x K) never exist whole, only one block of them.

Forward, the online softmax of Rabe & Staats (2021) and FlashAttention-2: for each block of
queries, over the key blocks j in turn, with S_j = scale * Q K_j^T,

    m' = max(m, rowmax S_j),   P = exp(S_j - m'),
    l' = exp(m - m') l + rowsum P,   O' = exp(m - m') O + P V_j,

then output = O / l and lse = m + log l, the log of the sum of exp over the visible scores.
Backward, by recomputation from lse (FlashAttention-2): P = exp(S - lse), D = rowsum(dO * O),
dV = P^T dO, dP = dO V^T, dS = P * (dP - D + dlse), dQ = scale dS K, dK = scale dS^T Q.

A block the masks hide entirely is skipped; one they show entirely is not masked (``Plan``).
A hidden score is -inf, and a row whose running max is still -inf (nothing visible yet) is
exponentiated against the dtype's lowest finite value, so its terms are exactly 0: a row
with nothing visible, or whose visible scores are all -inf, gives output 0 and lse -inf.
Half types are computed in float32 (``ops.widen``).  Written once, over ``adapter.Ops``.
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from . import _machine, heads, tuning
from .masks import Masks, block_visibility, visible_values
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
        # traced by torch.compile: a cache of Python state read or filled here is guarded on (a recompile)
        self.traced = like is not None and ops.unrolls_loops(like)
        lead = (1,) if like is None else tuple(ops.shape(like)[:-2])  # (B,) or (B, H)
        self.batch, self.heads = lead[0], (lead[1] if len(lead) == 2 else None)
        self._classify = None if masks.mask_mod is None else masks.mask_mod.classifier(ops)
        self.mod_values: dict = {}  # a mask function's blocks, evaluated to be classified
        self.shared_mod_values: dict = {}  # its blocks by ``MaskFunction.values_key``
        self._biases: dict = {}  # ``hidden_by_bias``'s, by the mask they were made from
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
        kept = None if self.masks.block_mask is None or self.traced else self.masks.block_mask.shown
        key = (self.block, self.heads, q0, q1)  # a mask function may depend on the head
        if kept is not None and key in kept:  # a block mask's, computed before
            return kept[key]
        lo, hi = self.key_range(q0, q1)
        found = []
        for at, (k0, k1) in enumerate(self.key_blocks):
            if k1 <= lo or k0 >= hi:
                continue
            kind, parts = self.kind(q0, q1, k0, k1)
            if kind != SKIP:
                found.append((at, (k0, k1), kind, parts))
        if kept is not None:
            kept[key] = found
        return found

    def halves(self, q0: int, q1: int, k0: int, k1: int) -> Optional[tuple]:
        """For a PARTIAL square block with a quarter off its diagonal hidden entirely (a
        sliding window's band), the key columns each half of its queries needs, ((c0, c1) of
        the first half, of the second), relative to k0; else None.  Not where a mask
        function's quarters would have to be evaluated to be known."""
        side = q1 - q0
        if side < 2 or k1 - k0 != side:
            return None
        if self.masks.mask_mod is not None and self._classify((q0, q1, k0, k1)) is None:
            return None
        half = side // 2
        if self.kind(q0, q0 + half, k0 + half, k1)[0] == SKIP:
            return (0, half), (0, side)
        if self.kind(q0 + half, q1, k0, k0 + half)[0] == SKIP:
            return (0, side), (half, side)
        return None

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

    def visibility(
        self, parts: Tuple[str, ...], q_block: Tensor, k_block: Tensor, q0: int, q1: int, k0: int, k1: int
    ) -> Tensor:
        """The boolean mask of a PARTIAL block, broadcastable to its scores (B, [H,] bq, bk)."""
        ops, masks = self.ops, self.masks
        key = masks.mask_mod.values_key((q0, q1, k0, k1)) if parts == ("mod",) else None
        if key is not None and key in self._visible:  # a block alike (a window's): its mask
            return self._visible[key]
        visible = block_visibility(
            ops, k_block, q0, k0, q1 - q0, k1 - k0, rank=len(ops.shape(q_block)),
            valid_lens=masks.valid_lens if "lengths" in parts else None,
            attention_mask=masks.attention_mask if "mask" in parts else None, causal="causal" in parts,
            mod_values=self._mod_values((q0, q1, k0, k1), q_block) if "mod" in parts else None,
        )  # fmt: skip
        if key is not None:
            self._visible[key] = visible
        return visible

    def _mod_values(self, block: tuple, q_block: Tensor) -> Tensor:
        """The mask function's booleans for a block: kept from its classification, shared with
        a block alike (``values_key``), or evaluated."""
        mod = self.masks.mask_mod
        values = self.mod_values.pop(block, None)
        if values is not None:
            return values
        key = mod.values_key(block)
        values = None if key is None else self.shared_mod_values.get(key)
        if values is None:
            values = mod.values(self.ops, q_block, self.heads, block, self.batch)
            if key is not None:
                self.shared_mod_values[key] = values
        return values

    def hidden_by_bias(self, seen: Tensor, q_block: Tensor, k_block: Tensor) -> Optional[tuple]:
        """A partial block's mask as ``ops.softmax_with_lse`` takes it: (bias: 0 where seen,
        ``HIDDEN`` where not, in the scores' shape; column: a key each row sees, any where it
        sees none; row_bias: 0, or -inf for a row that sees none), kept for a mask blocks
        share (a window's: ``visibility``), not for the others (a block of scores each); None
        where the mask cannot be read on the host."""
        found = self._biases.get(id(seen))
        if found is not None and found[0] is seen:
            return found[1]
        ops, host = self.ops, self.ops.host_values(seen)
        if host is None:
            return None
        shape = tuple(ops.shape(q_block)[:-1]) + (ops.shape(k_block)[-2],)
        host = np.broadcast_to(host, shape)
        sees = ops.constant(host.any(-1, keepdims=True), q_block)
        made = (
            ops.where(seen, ops.zeros(shape, q_block), HIDDEN),
            ops.constant(host.argmax(-1), q_block),  # the first key each row sees
            ops.where(sees, ops.zeros(ops.shape(sees), q_block), NEG_INF),
        )
        if any(seen is shared for shared in self._visible.values()):  # blocks alike: kept
            self._biases[id(seen)] = (seen, made)  # seen held: its id is not reused while kept
        return made

    def split(self, x: Tensor, blocks: List[Tuple[int, int]]) -> List[Tensor]:
        """x's rows (axis -2) in these consecutive blocks (``ops.split_rows``)."""
        return self.ops.split_rows(x, [stop - start for start, stop in blocks])

    def visible_values(
        self, parts: Tuple[str, ...], v_block: Tensor, seen: Tensor, q1: int, k1: int
    ) -> Tensor:
        """v_block with the rows no query of a PARTIAL block may see set to 0 (a NaN there must
        not reach the output as 0 * NaN); as it is where causality alone masks the block and
        its last query sees every key of it."""
        if parts == ("causal",) and k1 <= q1:
            return v_block
        return visible_values(self.ops, v_block, seen)


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


# -- forward ---------------------------------------------------------------------------------------

ScoreFn = Callable[..., Tensor]  # (query block, key block, *, block=(q0, q1, k0, k1)) -> scores
DIAGONAL = "diagonal"  # a causal block on the diagonal, in two halves (``_diagonal``)
PARTIAL_FINITE = "partial, finite values"  # a partial block whose values need no masking
# (HALVES, the key columns of each half of the queries, mask the values?): where each step is a
# program of its own (jax), a partial block's hidden quarter is left out at no dispatch's cost
HALVES = "halves"
# through the framework's fused softmax (``Ops.softmax_with_lse``), where the scores are bounded
FULL_FUSED, PARTIAL_FUSED = "full, fused softmax", "partial, fused softmax"


def attention_in_blocks(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    masks: Masks,
    *,
    block_size: int,
    scale: float = 1.0,
    score: Optional[ScoreFn] = None,
) -> Tuple[Tensor, Tensor]:
    """(output (B, [H,] Q, v), lse (B, [H,] Q, 1)) of masked attention, the online softmax over
    square blocks of ``block_size``.  score(query block, key block, block=(q0, q1, k0, k1))
    -> its scores (default: ``scale * q k^T``); queries and keys are whatever it takes,
    blocked along axis -2."""
    like = values
    queries, keys, values = ops.widen(queries), ops.widen(keys), ops.widen(values)
    n_queries, n_keys = ops.shape(queries)[-2], ops.shape(keys)[-2]
    if n_queries is None or n_keys is None:
        raise ValueError(
            f"block_size={block_size} needs the numbers of queries and keys known when the call is "
            f"traced, got {n_queries} queries and {n_keys} keys (None: unknown)"
        )
    if score is None:
        queries = queries * scale  # once, not per block
    plan = Plan(ops, masks, n_queries, n_keys, block_size, like=queries)
    how = _How(ops, plan, queries, keys, values, score)
    key_blocks = list(zip(plan.split(keys, plan.key_blocks), plan.split(values, plan.key_blocks)))
    found: list = []  # (output, lse) of each query block in turn
    pending: list = []  # (query block, row) for one compiled program of rows (``_run_rows``)
    for (q0, q1), q_block in zip(plan.query_blocks, plan.split(queries, plan.query_blocks)):
        row = how.row(q0, q1, q_block, key_blocks, keys, values)
        length = _program_length(ops, q_block, row) if row and how.compile_rows else 0
        if row and len(row) <= length:  # a short row: several in one program, within its length
            if len(pending) == ROWS_PER_PROGRAM or sum(len(r) for _, r in pending) + len(row) > length:
                found.extend(_run_rows(ops, pending))
                pending = []
            pending.append((q_block, row))
            continue
        found.extend(_run_rows(ops, pending))
        pending = []
        if row:
            out, lse = _run_row(ops, q_block, row, how.compile_rows, finished=how.compile_steps)
        else:  # every key block hidden: nothing to attend to
            out, lse = finish(ops, empty(ops, tuple(ops.shape(q_block)[:-1]), ops.shape(values)[-1], values))
        ops.settle((out, lse))  # lazy frameworks: the sums would keep every block of scores alive
        found.append((out, lse))
    found.extend(_run_rows(ops, pending))
    outs, lses = [out for out, _ in found], [lse for _, lse in found]
    out = outs[0] if len(outs) == 1 else ops.concat(outs, -2)
    lse = lses[0] if len(lses) == 1 else ops.concat(lses, -2)
    return ops.cast(out, like), lse


class _How:
    """How one call's blocks run: which steps are compiled (``Ops.compiled``), alone or a row's
    several at once (``tuning.Tuning.compiled_rows``); whether the framework's fused softmax takes them
    (bounded scores), whether hidden values need masking; and each query block's row of steps."""

    def __init__(self, ops: Ops, plan: Plan, queries: Tensor, keys: Tensor, values: Tensor, score) -> None:
        self.ops, self.plan, self.score = ops, plan, score
        compile_ = score is None and len(plan.query_blocks) * len(plan.key_blocks) >= COMPILE_MIN_BLOCKS
        self.compile_rows = compile_ and tuning.of(ops).compiled_rows
        self.compile_steps = compile_ and not self.compile_rows
        # finite values (or nothing hidden): no hidden value can reach an output as 0 * NaN
        self.finite_values = plan.masks.none or known_finite(ops, values)
        self.fused = score is None and tuning.of(ops).fused_softmax and bounded_scores(ops, queries, keys)
        self.merge = not (compile_ and _has_compiler(ops))  # a row's blocks as one span (``_spans``)
        self.jitted_steps = self.compile_steps and not self.merge  # each step a program of the compiler's

    def row(self, q0: int, q1: int, q_block: Tensor, key_blocks: list, keys: Tensor, values: Tensor) -> list:
        """(step kind, its step, its tensors after the query block) of each key block [q0, q1) sees."""
        ops, plan, score, row = self.ops, self.plan, self.score, []
        for (k0, k1), tensors, kind, parts in _spans(plan, q0, q1, key_blocks, keys, values, self.merge):
            kind, tensors = self.kind(kind, parts, q0, q1, k0, k1, q_block, tensors)
            if score is None:
                step = _step(ops, kind, self.compile_steps, cached=not plan.traced)
            else:  # the caller's scores, told where the block is
                step = _made(ops, kind, functools.partial(score, block=(q0, q1, k0, k1)), (q0, k0))
            row.append((kind, step, tensors))
        if row and self.compile_steps:  # the row's last step finishes it, compiled with it
            kind, _, tensors = row[-1]
            row[-1] = (kind, _step(ops, kind, True, finishing=True, cached=not plan.traced), tensors)
        return row

    def kind(self, kind: str, parts: tuple, q0, q1, k0, k1, q_block: Tensor, tensors: tuple) -> tuple:
        """(the step's kind, its tensors (k, v[, the mask's])) of a block the plan keeps."""
        if parts == ("causal",) and (q0, q1) == (k0, k1) and q1 - q0 > 1:  # on the diagonal
            return DIAGONAL, tensors
        if kind == FULL:
            return (FULL_FUSED if self.fused else FULL), tensors
        seen = self.plan.visibility(parts, q_block, tensors[0], q0, q1, k0, k1)
        hidden = self.fused and self.finite_values and self.plan.hidden_by_bias(seen, q_block, tensors[0])
        if hidden:
            return PARTIAL_FUSED, tensors + hidden
        kind = PARTIAL_FINITE if self.finite_values else PARTIAL
        halves = self.plan.halves(q0, q1, k0, k1) if self.jitted_steps else None
        return (kind if halves is None else (HALVES, halves, kind == PARTIAL)), tensors + (seen,)


def _spans(plan: Plan, q0: int, q1: int, key_blocks: list, keys: Tensor, values: Tensor, merge: bool) -> list:
    """The key blocks a query block [q0, q1) sees, as ((k0, k1), (keys, values), kind, parts):
    with a mask function, where they are consecutive and at most ``SPAN_BLOCKS`` blocks wide,
    and merge (the steps run eagerly, each op dispatched per block), one span of them all: one
    step instead of several (a sliding window's band).  A compiler fuses each block's passes:
    there, the blocks stay (benchmarks/RESULTS.md)."""
    found = [(block, key_blocks[at], kind, parts) for at, block, kind, parts in plan.shown(q0, q1)]
    if not merge or plan.masks.mask_mod is None or len(found) < 2:
        return found
    k0, k1 = found[0][0][0], found[-1][0][1]
    if k1 - k0 > SPAN_BLOCKS * plan.block or k1 - k0 != sum(b - a for (a, b), *_ in found):
        return found
    for block, *_ in found:  # the blocks' kept mask values: the span's are evaluated whole
        plan.mod_values.pop((q0, q1) + block, None)
    kind, parts = plan.kind(q0, q1, k0, k1)
    return [((k0, k1), (rows(keys, k0, k1), rows(values, k0, k1)), kind, parts)]


SPAN_BLOCKS = 4


def _has_compiler(ops: Ops) -> bool:
    """Whether ``ops.compiled`` is a compiler's, not the default that returns a step as it is."""
    return ops.compiled(_same_score) is not _same_score


COMPILE_MIN_BLOCKS = 64  # below, a compiler's time for each new shape is not paid back
# ops -> {(step kinds, tensor counts, resumed, last): compiled program of a row's steps,
# ("rows", ((step kinds, tensor counts) of each row)): program of rows, ("step", kind, compiled,
# finishing): a step}; keyed by the adapter itself, not by an id() another object may reuse
_PROGRAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _programs(ops: Ops) -> dict:
    found = _PROGRAMS.get(ops)
    if found is None:
        found = _PROGRAMS[ops] = {}
    return found


def _run_row(ops: Ops, q: Tensor, row: list, compiled: bool, finished: bool = False) -> Tuple[Tensor, Tensor]:
    """(output, lse) of one query block over its row of key blocks (not empty): step by step,
    or (compiled) in programs of the framework's compiler (``ops.compiled``: one dispatch each,
    and the compiler schedules their blocks), each of as many steps as keep their blocks of
    scores within the budget (XLA computes every block's scores before the softmax passes),
    made once per process for each sequence of step kinds (a causal row: its full blocks, then
    the diagonal).  finished: the row's last step finishes it (``_step``'s finishing)."""
    if not compiled:
        return _row(ops, [step for _, step, _ in row], _counts(row), False, not finished, q, *_flat(row))
    length = _program_length(ops, q, row)
    state: tuple = ()
    for start in range(0, len(row), length):
        part, last = row[start : start + length], start + length >= len(row)
        signature = (tuple(kind for kind, _, _ in part), _counts(part), bool(state), last)
        programs = _programs(ops)
        program = programs.get(signature)
        if program is None:
            program = functools.partial(_row, ops, [step for _, step, _ in part], *signature[1:])
            program = programs[signature] = ops.compiled(program)
        state = program(q, *state, *_flat(part))
    return state


def _program_length(ops: Ops, q: Tensor, row: list) -> int:
    """How many of a row's steps one compiled program takes: their blocks of scores within
    ``PROGRAM_BUDGET_BYTES`` (XLA computes every block's scores before the softmax passes)."""
    side = max(ops.shape(q)[-2], max(ops.shape(tensors[0])[-2] for _, _, tensors in row))
    itemsize = 8 if ops.lowest(q) < -1e300 else 4  # q is widened: float32 or float64
    scores = math.prod(ops.shape(q)[:-2]) * side * side * itemsize  # one block of scores
    return max(PROGRAM_BUDGET_BYTES // scores, 1)


# half the scores budget: a program's scores and their exponentials exist at once, and a first
# call also compiles a program for each layout of its rows (benchmarks/RESULTS.md, 2026-12-05)
PROGRAM_BUDGET_BYTES = SCORES_BUDGET_BYTES // 2
ROWS_PER_PROGRAM = int(os.environ.get("MULTIATTN_ROWS_PER_PROGRAM", 8))


def _run_rows(ops: Ops, rows_: list) -> list:
    """[(output, lse)] of short rows [(query block, row)], each within one program's length,
    as one compiled program: one dispatch for them all."""
    if not rows_:
        return []
    layout = tuple((tuple(kind for kind, _, _ in row), _counts(row)) for _, row in rows_)
    programs = _programs(ops)
    program = programs.get(("rows", layout))
    if program is None:
        steps = [[step for _, step, _ in row] for _, row in rows_]
        program = functools.partial(_rows, ops, steps, [counts for _, counts in layout])
        program = programs["rows", layout] = ops.compiled(program)
    flat = program(*(t for q, row in rows_ for t in (q, *_flat(row))))
    results = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    ops.settle(tuple(flat))
    return results


def _rows(ops: Ops, steps: list, counts: list, *tensors: Tensor) -> tuple:
    """``_run_rows``'s program: each row's (output, lse), flat."""
    found, at = [], 0
    for row_steps, row_counts in zip(steps, counts):
        size = 1 + sum(row_counts)
        found.extend(_row(ops, row_steps, row_counts, False, True, *tensors[at : at + size]))
        at += size
    return tuple(found)


def _counts(row: list) -> tuple:
    return tuple(len(tensors) for _, _, tensors in row)


def _flat(row: list) -> list:
    return [tensor for _, _, tensors in row for tensor in tensors]


def _row(
    ops: Ops, steps: list, counts: tuple, resumed: bool, last: bool, q: Tensor, *tensors: Tensor
) -> tuple:
    """``_run_row``'s steps in turn, each taking its count of the flat tensors: from the state
    (m, l, O) first among them where resumed; finished where last, else the state."""
    state, at = (tuple(tensors[:3]), 3) if resumed else ((), 0)
    for step, count in zip(steps, counts):
        state = step(q, *tensors[at : at + count], *state)
        at += count
    return finish(ops, state) if last else state


def _step(
    ops: Ops, kind: Any, compiled: bool = False, finishing: bool = False, cached: bool = True
) -> Callable[..., tuple]:
    """The dot-product step of a kind, through the framework's compiler if compiled, made once
    per process (made anew where not cached: ``Plan.traced``); finishing: a row's last,
    returning (output, lse) (``_finish`` compiled with it)."""
    key = ("step", kind, compiled, finishing)
    found = _programs(ops).get(key) if cached else None
    if found is None:
        step = _made(ops, kind, functools.partial(heads.matmul_t, ops), owned=True)
        step = functools.partial(_finishing, ops, step) if finishing else step
        found = ops.compiled(step) if compiled else step
        if cached:
            _programs(ops)[key] = found
    return found


def _finishing(ops: Ops, step: Callable[..., tuple], *tensors: Tensor) -> Tuple[Tensor, Tensor]:
    return finish(ops, step(*tensors))


def _made(
    ops: Ops, kind: Any, score: ScoreFn, start: Optional[tuple] = None, owned: bool = False
) -> Callable[..., tuple]:
    """The step of a kind over score, a function of tensors alone: step(q, k, v[, seen],
    *state), state (m, l, O) from the blocks before, none for a row's first.  start: where the
    block is (q0, k0), for a caller's scores on a block's parts (None: they do not depend on it);
    owned: score's results are new arrays, which the step may overwrite (not a caller's)."""
    at = (
        functools.partial(_same_score, score)
        if start is None
        else functools.partial(_score_at, score, *start)
    )
    if kind == FULL:
        return functools.partial(_full, ops, score, owned)
    if kind == FULL_FUSED:
        return functools.partial(_full_fused, ops, score)
    if kind == PARTIAL_FUSED:
        return functools.partial(_partial_fused, ops, score)
    if kind in (PARTIAL, PARTIAL_FINITE):
        return functools.partial(_partial, ops, score, kind == PARTIAL)
    if kind == DIAGONAL:
        return functools.partial(_diagonal, ops, at)
    _, columns, mask_values = kind
    return functools.partial(_halves, ops, at, columns, mask_values)


def _full(ops, score, owned, q, k, v, *state):
    return block_sums(ops, score(q, k), v, None, state or None, owned)


def _full_fused(ops, score, q, k, v, *state):
    w, lse = ops.softmax_with_lse(score(q, k))
    return _merge_fused(ops, w, lse, v, state or None)


def _partial_fused(ops, score, q, k, v, bias, column, row_bias, *state):  # ``Plan.hidden_by_bias``
    w, lse = ops.softmax_with_lse(score(q, k) + bias, column)
    return _merge_fused(ops, w, lse + row_bias, v, state or None)


def _partial(ops, score, mask_values, q, k, v, seen, *state):  # hidden values: 0, not 0 * NaN
    v = visible_values(ops, v, seen) if mask_values else v
    return block_sums(ops, score(q, k), v, seen, state or None)


def known_finite(ops: Ops, x: Tensor) -> bool:
    """Whether x, read on the host, holds finite numbers only (False where it cannot be read)."""
    host = ops.host_values(x)
    return host is not None and bool(np.isfinite(host).all())


def _diagonal(ops: Ops, score_at: Callable[..., ScoreFn], q: Tensor, k: Tensor, v: Tensor, *state) -> tuple:
    """A square block on the causal diagonal, its queries in two halves: the first half sees
    only the first half of the keys, so the top-right quarter, all hidden, is never computed.
    Each half's last query sees all of its keys: no values to mask.  score_at(r0, r1, c0, c1):
    the scores of the block's queries r0 .. r1 - 1 against its keys c0 .. c1 - 1."""
    side = ops.shape(q)[-2]
    half = side // 2
    seen = ops.causal_mask(side, side, k)
    found = []
    for r0, r1, width in ((0, half, half), (half, side, side)):
        s = score_at(r0, r1, 0, width)(rows(q, r0, r1), rows(k, 0, width))
        part = tuple(rows(x, r0, r1) for x in state) or None
        found.append(block_sums(ops, s, rows(v, 0, width), seen[r0:r1, :width], part))
    return tuple(ops.concat(halves, -2) for halves in zip(*found))


def _halves(ops: Ops, score_at, columns: tuple, mask_values: bool, q, k, v, seen, *state) -> tuple:
    """A partial square block whose queries' halves each need only some of its keys (a quarter
    off the diagonal hidden entirely, ``Plan.halves``): each half against its columns, masked;
    the hidden quarter is never computed."""
    side = ops.shape(q)[-2]
    found = []
    for (r0, r1), (c0, c1) in zip(((0, side // 2), (side // 2, side)), columns):
        s = score_at(r0, r1, c0, c1)(rows(q, r0, r1), rows(k, c0, c1))
        part_seen, part_v = _block_of(seen, r0, r1, c0, c1), rows(v, c0, c1)
        part_v = visible_values(ops, part_v, part_seen) if mask_values else part_v
        part = tuple(rows(x, r0, r1) for x in state) or None
        found.append(block_sums(ops, s, part_v, part_seen, part))
    return tuple(ops.concat(halves, -2) for halves in zip(*found))


def _score_at(score: ScoreFn, q0: int, k0: int, r0: int, r1: int, c0: int, c1: int) -> ScoreFn:
    """A caller's scores of the part (queries r0 .. r1 - 1, keys c0 .. c1 - 1) of the block at
    (q0, k0)."""
    return functools.partial(score, block=(q0 + r0, q0 + r1, k0 + c0, k0 + c1))


def _same_score(score: ScoreFn, *where: int) -> ScoreFn:
    """score_at of ``_diagonal`` where the scores do not depend on where the block is."""
    return score


def _merge_fused(ops: Ops, w: Tensor, lse: Tensor, v: Tensor, state: tuple = None) -> tuple:
    """A block's own softmax weights W and lse (a fused softmax's) into the running sums: the
    block's sums are (lse, 1, W V)."""
    return merge_sums(ops, state, (lse, ops.zeros(ops.shape(lse), lse) + 1.0, heads.matmul(ops, w, v)))


def bounded_scores(ops: Ops, queries: Tensor, keys: Tensor) -> bool:
    """Whether every dot-product score of queries and keys, read on the host, is finite and
    within ``SCORES_BOUND`` (|q . k| <= d max|q| max|k|); False where they cannot be read."""
    q, k = ops.host_values(queries), ops.host_values(keys)
    if q is None or k is None:
        return False
    top = float(abs(q).max(initial=0)) * float(abs(k).max(initial=0)) * q.shape[-1]
    return top <= SCORES_BOUND  # False where top is NaN or inf


HIDDEN = -1e30  # a hidden score where the fused softmax takes them finite: exp(HIDDEN - s) = 0
SCORES_BOUND = 1e20  # |scores| below it: s + HIDDEN stays far below every visible score


# -- backward --------------------------------------------------------------------------------------


def attention_in_blocks_backward(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    masks: Masks,
    out: Tensor,
    lse: Tensor,
    d_out: Tensor,
    d_lse: Optional[Tensor] = None,
    *,
    block_size: int,
    scale: float,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dQ, dK, dV) of ``attention_in_blocks`` (dot-product scores) from its saved output and
    lse, block by block: no block of scores outlives its use.  d_lse: the cotangent of lse,
    None where lse was not used."""
    likes = (queries, keys, values)
    query_rows, key_rows = backward_rows(ops, queries, keys, values, out, lse, d_out, d_lse, scale)
    plan = Plan(ops, masks, ops.shape(queries)[-2], ops.shape(keys)[-2], block_size, like=query_rows[0])
    kv_heads = ops.shape(keys)[1] if len(ops.shape(keys)) == 4 else None
    query_blocks = list(zip(*(plan.split(x, plan.query_blocks) for x in query_rows)))
    d_queries: List[Optional[Tensor]] = [None] * len(query_blocks)
    d_keys, d_values = [], []
    key_blocks = zip(*(plan.split(x, plan.key_blocks) for x in key_rows))
    for (k0, k1), (k_block, k_finite, v_block) in zip(plan.key_blocks, key_blocks):
        dk = dv = None
        for i, ((q0, q1), (q_block, q_scaled, do_block, lse_block, dot_block)) in enumerate(
            zip(plan.query_blocks, query_blocks)
        ):
            kind, parts = plan.kind(q0, q1, k0, k1)
            if kind == SKIP:
                continue
            s, v_seen, seen = heads.matmul_t(ops, q_scaled, k_block), v_block, None
            if kind == PARTIAL:
                seen = plan.visibility(parts, q_block, k_block, q0, q1, k0, k1)
                s, v_seen = ops.where(seen, s, NEG_INF), plan.visible_values(parts, v_block, seen, q1, k1)
            p, ds = score_gradients(ops, s, seen, do_block, v_seen, lse_block, dot_block)
            dq_part = heads.matmul(ops, ds, k_finite)
            dk_part, dv_part = (
                heads.summed_tn(ops, ds, q_block, kv_heads),
                heads.summed_tn(ops, p, do_block, kv_heads),
            )
            dv = dv_part if dv is None else dv + dv_part
            dk = dk_part if dk is None else dk + dk_part
            d_queries[i] = dq_part if d_queries[i] is None else d_queries[i] + dq_part
        if dk is None:  # no query sees this key block
            dk, dv = ops.zeros(ops.shape(k_block), k_block), ops.zeros(ops.shape(v_block), v_block)
        ops.settle((dk, dv, *(dq for dq in d_queries if dq is not None)))
        d_keys.append(dk * scale)
        d_values.append(dv)
    d_queries = [
        ops.zeros(ops.shape(q_block), q_block) if dq is None else dq * scale
        for dq, (q_block, *_) in zip(d_queries, query_blocks)
    ]
    joined = [
        (parts[0] if len(parts) == 1 else ops.concat(parts, -2)) for parts in (d_queries, d_keys, d_values)
    ]
    return tuple(ops.cast(g, like) for g, like in zip(joined, likes))


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
    """(output, lse (B, [H,] Q)) of dot-product attention in blocks, differentiated by
    ``attention_in_blocks_backward``: the gradients, too, in memory linear in the length."""

    def forward(q: Tensor, k: Tensor, v: Tensor, masks: Masks) -> Tuple[Tensor, Tensor]:
        return attention_in_blocks(ops, q, k, v, masks, block_size=block_size, scale=scale)

    def backward(q, k, v, masks, out, lse, d_out, d_lse):
        return attention_in_blocks_backward(
            ops, q, k, v, masks, out, lse, d_out, d_lse, block_size=block_size, scale=scale
        )

    return differentiated(ops, forward, backward, queries, keys, values, masks)


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
