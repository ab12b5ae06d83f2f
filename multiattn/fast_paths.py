"""The framework-free halves of the adapters' specialisations (``multiattn.specialisations``).

Each function here does one core step another way, for an adapter's offer to return: the
adapter decides whether it applies (sizes, devices, autograd) and hands in its own kernels;
what is the same for every adapter is written here once, over the core's own steps where
the math is the same.  The tests hold each to the float64 reference, forced at small sizes.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, List, NamedTuple, Optional

from . import blockwise, core, tuning
from .masks import Masks
from .protocol import softmax_hiding_minus_inf

Tensor = Any
Ops = Any


# -- lengths read on the host ----------------------------------------------------------------


def clip_lengths(raw: list, n_keys: int) -> List[Any]:
    """How many of n_keys positions each length shows: position j is visible for
    j < length, so 2.5 shows 3 (ceil), lengths <= 0 and NaN show none (j < NaN is false),
    lengths past the end show all.  raw: one number per row, or a list per row."""
    return [
        clip_lengths(n, n_keys)
        if isinstance(n, list)
        else 0
        if not n > 0
        else n_keys
        if n >= n_keys
        else math.ceil(n)
        for n in raw
    ]


def hiding_enough(raw: list, n_keys: int, max_share: float) -> Any:
    """The clipped lengths where they hide at least ``1 - max_share`` of the keys, else the
    reason they do not."""
    lengths = clip_lengths(raw, n_keys)
    if sum(lengths) > max_share * n_keys * len(lengths):
        return f"the lengths show more than {max_share:.0%} of the keys"
    return lengths


def lengths_per_sequence(masks: Masks, read: Callable[[Tensor], Optional[list]]) -> Any:
    """One length per sequence as Python numbers, read by the adapter's ``read(lens)`` (None
    where it may not read them), else the reason there are none."""
    if not masks.one_length_per_sequence:
        return "not one length per sequence"
    raw = read(masks.valid_lens)
    return "the lengths are not readable on the host here" if raw is None else raw


# -- the masked softmax with the padding written directly ------------------------------------


def offer_writing_padding(
    ops: Ops,
    scores: Tensor,
    values: Optional[Tensor],
    owned: bool,
    lengths: Any,
    *,
    copy: Callable[[Tensor], Tensor],
    softmax: Callable[[Tensor], Tensor],
    fill: Optional[Callable[..., Tensor]] = None,
    zero_rows: Optional[Callable[[Tensor, list], Tensor]] = None,
) -> Any:
    """The offer of ``softmax_writing_padding`` from the lengths an adapter read (or the
    reason it could not); the caller's scores are copied first.  fill and zero_rows: slice
    assignment unless the adapter has its own kernels."""
    if isinstance(lengths, str):
        return lengths
    n_keys = ops.shape(scores)[-1]
    lengths = clip_lengths(lengths, n_keys)
    if _unpadded_row_of_minus_inf(ops, scores, lengths, n_keys):
        return "a row without padding whose scores are all -inf (its softmax would be NaN)"
    scores = scores if owned else copy(scores)
    return functools.partial(
        softmax_writing_padding,
        ops,
        scores,
        values,
        lengths,
        fill or fill_by_slices,
        softmax,
        zero_rows,
        copy,
    )


def _unpadded_row_of_minus_inf(ops: Ops, scores: Tensor, lengths: list, n_keys: int) -> bool:
    """Whether a sequence showing every key has a row of -inf scores (read on the host, as the
    lengths were): padded rows keep a finite maximum, the dtype's lowest, and get weights 0."""
    if any(isinstance(n, list) for n in lengths):  # a length per row: any unpadded row counts
        return any(n == n_keys for row in lengths for n in row)
    for b in (b for b, n in enumerate(lengths) if n == n_keys):
        top = ops.host_values(ops.max(scores[b], -1))
        if top is None or (top == -math.inf).any():
            return True
    return False


def softmax_writing_padding(
    ops: Ops,
    scores: Tensor,
    values: Optional[Tensor],
    lengths: list,
    fill: Callable[..., Tensor],
    softmax: Callable[[Tensor], Tensor],
    zero_rows: Optional[Callable[[Tensor, list], Tensor]],
    copy: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Optional[Tensor]]:
    """``core.masked_weights`` for one length per sequence, read on the host (clipped): the
    padding of the scores, which the core owns, is set to the dtype's lowest, the softmax
    runs (``softmax`` may write into them), and the padding of the weights is set to 0;
    ``fill(x, lengths, value, uniform)`` writes ``x[b, ..., lengths[b]:] = value``.  Every
    masked score is the same, so a row's masked weights are equal and mostly 0 already
    (exp underflows): the second fill may skip those (uniform).  A padded row whose visible
    scores are all -inf gets weights 0 (the row rule): its maximum is finite.  Padded values are zeroed by
    ``zero_rows`` (a finite tensor needs none: 0 * x is 0), by slices in a ``copy`` if None."""
    weights = fill(softmax(fill(scores, lengths, ops.lowest(scores), False)), lengths, 0.0, True)
    if values is None:
        return weights, None
    return weights, zero_rows_by_slices(values, lengths, copy) if zero_rows is None else zero_rows(
        values, lengths
    )


# Below this many weights writing every padding slice costs less than the test that skips some.
SKIP_TEST_MIN_ELEMENTS = 1 << 14


def fill_by_slices(x: Tensor, lengths: list, value: float, uniform: bool = False) -> Tensor:
    """``x[b, ..., lengths[b]:] = value`` in place, one slice per sequence, for frameworks with
    slice assignment (numpy, torch, paddle).  uniform: x holds softmax weights with one value
    per row in the padding, so a sequence whose padding already equals value is skipped."""
    shape = tuple(x.shape)
    n_keys = shape[-1]
    if uniform and math.prod(shape) >= SKIP_TEST_MIN_ELEMENTS:
        # `<=`, not `==`: paddle's float `==` has a tolerance (1e-28 == 0); NaN is not done
        done = (x[..., -1] <= value).reshape(len(lengths), -1).all(1).tolist()
        lengths = [n_keys if ok and n > 0 else n for n, ok in zip(lengths, done)]
    for row, n in enumerate(lengths):
        if n < n_keys:
            x[row, ..., n:] = value
    return x


def zero_rows_by_slices(values: Tensor, lengths: list, copy: Callable[[Tensor], Tensor]) -> Tensor:
    """values (B, [H,] K, v) with the rows ``>= lengths[b]`` zeroed, in a copy, where some
    are not finite; values itself where they are all finite or none is padding."""
    n_keys = values.shape[-2]
    if math.isfinite(float(values.sum())) or all(n >= n_keys for n in lengths):
        return values
    values = copy(values)
    for row, n in enumerate(lengths):
        if n < n_keys:
            values[row, ..., n:, :] = 0.0
    return values


# -- the masked softmax in the scores' memory ----------------------------------------------


def offer_in_scores_memory(
    ops: Ops,
    scores: Tensor,
    values: Optional[Tensor],
    masks: Masks,
    owned: bool,
    *,
    where: Callable[[Tensor, Tensor, float], Tensor],
    softmax: Optional[Callable[[Tensor], Tensor]] = None,
    safe_softmax: Optional[Callable[[Tensor], Tensor]] = None,
) -> Any:
    """The offer of ``core.softmax_where`` with the adapter's passes that write into the
    scores (and the weights), which the core owns: its ``safe_softmax``, or the formula
    (``protocol.softmax_hiding_minus_inf``) over its ``where`` and ``softmax``."""
    if not owned:
        return "the caller's scores are never written"
    if safe_softmax is None:
        safe_softmax = functools.partial(softmax_hiding_minus_inf, ops, where=where, softmax=softmax)
    return functools.partial(
        core.softmax_where, ops, scores, values, masks, where=where, safe_softmax=safe_softmax
    )


# -- a fused kernel ----------------------------------------------------------------------------


def fused_attention(
    ops: Ops,
    kernel: Callable[..., Tensor],
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    masks: Masks,
    scale: float,
) -> tuple[Tensor, None]:
    """(output, None) of ``core.dot_product_attention`` from a framework's fused kernel,
    ``kernel(queries, keys, values, mask or None, scale)``, with the core's guarantees:
    nothing from the padding reaches an output (kernels add the mask to NaN scores), and
    fully masked rows are 0 (kernels spread them uniformly)."""
    if masks.none:
        return kernel(queries, keys, values, None, scale), None
    mask = core.visibility(ops, masks, queries=queries, keys=keys)
    keys = core.visible_values(ops, keys, mask)
    values = core.visible_values(ops, values, mask)
    # a prefix of lengths shows the first key if any: one column tells which rows see nothing
    seen = mask[..., :1] if masks.only_lengths else ops.any(mask, -1)
    return ops.where(seen, kernel(queries, keys, values, mask, scale), 0.0), None


def attention_over_spans(
    ops: Ops,
    kernel: Callable[..., Tensor],
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    masks: Masks,
    scale: float,
    block_size: int,
) -> tuple[Tensor, None]:
    """(output, None) of ``core.dot_product_attention`` by a framework's fused kernel,
    ``kernel(queries, keys, values, mask or None, scale)``: each block of block_size queries
    over the span of keys from the first to the last key block the masks do not hide
    (``blockwise.Plan``: a sliding window's band, a document), with the span's mask (None where
    it shows the span whole): the scores of the hidden blocks outside the span are never made.
    Blocks showing one span whole run as one; spans alike at a steady stride as one call
    (``_strided``).  Hidden values never reach an output; a row that sees nothing is 0, where
    the kernel gives it 0 or NaN (a softmax over nothing but -inf; not a uniform spread: a
    kernel's mask as a large finite negative would need ``fused_attention``'s any-row pass per
    block)."""
    n_queries, n_keys = ops.shape(queries)[-2], ops.shape(keys)[-2]
    plan = blockwise.Plan(ops, masks, n_queries, n_keys, block_size, like=queries)
    finite_values = blockwise.known_finite(ops, values)  # then no hidden value can reach an output
    stackable = finite_values and (len(ops.shape(queries)) == 3 or ops.shape(queries)[0] == 1)
    outs = []
    for group in _strided(_spans(ops, plan, queries, keys), stackable):
        first = group[0]
        if first.k0 is None:  # the block sees nothing
            shape = tuple(ops.shape(queries)[:-2]) + (first.q1 - first.q0, ops.shape(values)[-1])
            outs.append(ops.zeros(shape, values))
        elif len(group) == 1:
            q_block = blockwise.rows(queries, first.q0, first.q1)
            k_span, v_span = (
                blockwise.rows(keys, first.k0, first.k1),
                blockwise.rows(values, first.k0, first.k1),
            )
            if first.seen is not None and not finite_values:
                v_span = core.visible_values(ops, v_span, first.seen)
            outs.append(_kernel_call(ops, kernel, q_block, k_span, v_span, first.seen, scale))
        else:
            outs.append(_over_strided_spans(ops, kernel, queries, keys, values, group, scale))
    return (outs[0] if len(outs) == 1 else ops.concat(outs, -2)), None


class _Span(NamedTuple):
    q0: int
    q1: int
    k0: Optional[int]  # None: no key visible
    k1: Optional[int]
    seen: Optional[Tensor]  # the span's mask, None where it is shown whole


def _spans(ops: Ops, plan: blockwise.Plan, queries: Tensor, keys: Tensor) -> List[_Span]:
    """Each block of queries and its span, consecutive blocks showing the same span whole as one."""
    spans: List[_Span] = []
    for q0, q1 in plan.query_blocks:
        shown = [block for _, block, _, _ in plan.shown(q0, q1)]
        if not shown:
            spans.append(_Span(q0, q1, None, None, None))
            continue
        k0, k1 = shown[0][0], shown[-1][1]
        kind, parts = plan.kind(q0, q1, k0, k1)
        last = spans[-1] if spans else None
        if kind == blockwise.FULL and last and last.seen is None and (last.k0, last.k1) == (k0, k1):
            spans[-1] = last._replace(q1=q1)
            continue
        seen = None
        if kind != blockwise.FULL:
            q_block, k_span = blockwise.rows(queries, q0, q1), blockwise.rows(keys, k0, k1)
            seen = plan.visibility(parts, q_block, k_span, q0, q1, k0, k1)
        spans.append(_Span(q0, q1, k0, k1, seen))
    return spans


def _strided(spans: List[_Span], stackable: bool) -> List[List[_Span]]:
    """spans in runs of one shape and one mask (the same tensor, a window's) whose keys start
    at a steady stride: each run one kernel call (``_over_strided_spans``), where stackable."""
    runs: List[List[_Span]] = []
    for span in spans:
        run = runs[-1] if runs else None
        if stackable and run and span.k0 is not None and _continues(run, span):
            run.append(span)
        else:
            runs.append([span])
    return runs


def _continues(run: List[_Span], span: _Span) -> bool:
    first, last = run[0], run[-1]
    if last.k0 is None or span.seen is not first.seen:
        return False
    if (span.q1 - span.q0, span.k1 - span.k0) != (first.q1 - first.q0, first.k1 - first.k0):
        return False
    step = span.k0 - last.k0
    return step > 0 and (len(run) == 1 or step == run[1].k0 - first.k0)


def _over_strided_spans(
    ops: Ops,
    kernel: Callable[..., Tensor],
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    run: list,
    scale: float,
) -> Tensor:
    """The output of a run of spans (``_strided``) by one kernel call on views of the inputs
    stacked on a leading axis (``Ops.row_windows``): one call's fixed cost and thread wake-up
    for the run, not one per block."""
    first, count = run[0], len(run)
    n, width, step = first.q1 - first.q0, first.k1 - first.k0, run[1].k0 - first.k0
    q = ops.row_windows(queries, first.q0, n, n, count)
    k, v = (ops.row_windows(x, first.k0, width, step, count) for x in (keys, values))
    heads = len(ops.shape(queries)) == 4  # one sequence (``stackable``): its axis dropped
    if heads:
        q, k, v = (ops.reshape(x, (count,) + tuple(ops.shape(x)[2:])) for x in (q, k, v))
    seen = first.seen
    while seen is not None and len(ops.shape(seen)) < len(ops.shape(q)):  # q's rank: SDPA's fast mask
        seen = ops.expand_dims(seen, 0)
    out = ops.joined_rows(_kernel_call(ops, kernel, q, k, v, seen, scale))
    return ops.expand_dims(out, 0) if heads else out


def _kernel_call(ops: Ops, kernel: Callable[..., Tensor], q, k, v, seen: Optional[Tensor], scale: float):
    out = kernel(q, k, v, seen, scale)
    if seen is not None and _non_finite_on_host(ops, out):  # a row seeing nothing as NaN (older SDPA)
        out = ops.where(ops.any(seen, -1), out, 0.0)
    return out


def _non_finite_on_host(ops: Ops, x: Tensor) -> bool:
    """Whether x, read on the host (an eager path that plans on the host), holds a NaN or inf."""
    host = ops.host_values(x)
    return host is not None and not bool((host * 0 == 0).all())  # x * 0 is NaN where x is not finite


def declines_fused(masks: Masks, dropout: Any, need_weights: bool) -> Optional[str]:
    """Why a fused kernel, which gives no weights and has no dropout, cannot do this call."""
    if need_weights:
        return "the weights are wanted"
    if dropout is not None:
        return "dropout on the weights"
    return None


def at_least(shape: tuple, elements: int) -> bool:
    """Whether a tensor of this shape has at least ``elements`` elements (unknown
    dimensions, as in a symbolic graph, count as large)."""
    total = 1
    for size in shape:
        if size is None:
            return True
        total *= size
    return total >= elements


# -- additive scores ---------------------------------------------------------------------------


def additive_scores_over_visible_keys(
    ops: Ops, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor, lengths: list
) -> Tensor:
    """``core.additive_scores`` of each sequence over its first lengths[b] keys only, the other
    scores 0 (for the masked softmax to hide): no features are made for keys that no query of
    the sequence may see."""
    n_queries, n_keys = ops.shape(q_hidden)[1], ops.shape(k_hidden)[1]
    rows = []
    for b, n in enumerate(lengths):
        parts = [core.additive_scores(ops, q_hidden[b : b + 1], k_hidden[b : b + 1, :n], w_v)] if n else []
        if n < n_keys:
            parts.append(ops.zeros((1, n_queries, n_keys - n), q_hidden))
        rows.append(ops.concat(parts, -1) if len(parts) > 1 else parts[0])
    return ops.concat(rows, 0)


# From this many features per sequence (queries x hiddens x keys) the loop over the sequences
# pays for itself; and only where the lengths hide enough of the keys.
ADDITIVE_VISIBLE_KEYS_MIN_FEATURES = 1 << 16
ADDITIVE_VISIBLE_KEYS_MAX_SHARE = 0.85


def offer_additive_over_visible_keys(
    ops: Ops, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor, masks: Masks, read: Callable[[Tensor], Any]
) -> Any:
    """The offer of ``additive_scores_over_visible_keys`` for an adapter whose ``read(lens)``
    gives the lengths (B,) as Python numbers (None where it may not read them)."""
    _, n_queries, hiddens = ops.shape(q_hidden)
    n_keys = ops.shape(k_hidden)[1]
    features = None if None in (n_queries, hiddens, n_keys) else n_queries * hiddens * n_keys
    if features is None or features < ADDITIVE_VISIBLE_KEYS_MIN_FEATURES:
        return "too few features per sequence for the loop to pay"
    lengths = lengths_per_sequence(masks, read)
    if isinstance(lengths, str):
        return lengths
    lengths = hiding_enough(lengths, n_keys, ADDITIVE_VISIBLE_KEYS_MAX_SHARE)
    if isinstance(lengths, str):
        return lengths
    return lambda: additive_scores_over_visible_keys(ops, q_hidden, k_hidden, w_v, lengths)


def additive_scores_in_blocks(ops: Ops, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor, step: int) -> Tensor:
    """``core.additive_scores`` block by block of ``step`` queries (``ops.map_query_blocks``),
    the features laid out (B, q, h, K) by default: keys innermost, the sum adds one number to
    each row of keys and w_v contracts as one (1, h) @ (h, K) product; d2l's (B, q, K, h) where
    the adapter prefers it (``hiddens_innermost``)."""
    # tanh(z) = 2 sigmoid(2z) - 1 where sigmoid is cheaper: the 2s go into the (small)
    # projections and w_v, and the -sum(w_v) is left out (every score of a row shifts alike,
    # which the softmax ignores: the scores are core's plus sum(w_v), the weights the same).
    by_sigmoid = ops.tanh_by_sigmoid(q_hidden)
    if by_sigmoid:
        q_hidden, k_hidden, w_v = q_hidden * 2.0, k_hidden * 2.0, w_v * 2.0
    activation = ops.sigmoid_of_sum if by_sigmoid else ops.tanh_of_sum
    if tuning.of(ops).hiddens_innermost:
        k_side, q_axis = ops.expand_dims(k_hidden, 1), 2  # (B, 1, K, h)

        def contract(features: Tensor) -> Tensor:  # (B, q, K, h) -> (B, q, K)
            return ops.matmul(features, w_v)

    else:
        k_side, q_axis = ops.expand_dims(ops.matrix_transpose(k_hidden), 1), 3  # (B, 1, h, K)
        w_row = ops.expand_dims(w_v, 0)  # (1, h)

        def contract(features: Tensor) -> Tensor:  # (B, q, h, K) -> (B, q, K)
            return ops.matmul(w_row, features)[:, :, 0, :]

    buffers: list = []  # where the activation may keep a dead block's features to reuse

    def score_block(q_block: Tensor) -> Tensor:  # (B, q, h) -> (B, q, K)
        return contract(activation(ops.expand_dims(q_block, q_axis), k_side, buffers))

    return ops.map_query_blocks(score_block, q_hidden, step)
