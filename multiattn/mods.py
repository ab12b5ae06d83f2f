"""Score and mask functions of your own, written once for every framework (FlexAttention's
signatures, without its compiler), and ready-made ones.

    score_mod(score, b, h, q_idx, kv_idx) -> score      mask_mod(b, h, q_idx, kv_idx) -> bool

The arguments are the backend's own arrays, broadcastable to the scores' shape (B, H, Q, K):
b (B, 1, 1, 1), h (1, H, 1, 1) (0 for 3-D calls, which have no heads), q_idx (1, 1, Q, 1),
kv_idx (1, 1, 1, K); score is the scaled score (after 1/sqrt(d)), before any mask.  A mask
function ANDs with the lengths, ``attention_mask`` and ``causal``.  Write them with Python
operators and the helpers here (``where``, ``tanh``, ``logical_and``, ``logical_or``: mxnet
refuses & and | on booleans), which dispatch on the array's type, and they run unchanged on
every backend, eagerly and under the frameworks' jit.

The ready-made ones know which blocks of (queries x keys) they hide entirely or show
entirely, so attention in blocks (``multiattn.blockwise``) skips the first and does not mask
the second without evaluating them; a function of your own is evaluated per block and read
on the host where the framework allows (its blocks are skipped too, after the evaluation).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np

from . import tuning
from ._registry import framework_of, get_backend

Tensor = Any
Ops = Any


# -- helpers for what operators cannot say ---------------------------------------------------


def _ops_of(*xs: Any) -> Ops:
    for x in xs:
        if isinstance(x, Index):
            return x.ops
        name = framework_of(x)
        if name is not None:
            return get_backend(name).ops
    raise TypeError("expected an array of one of the backends among the arguments, got none")


def where(condition: Tensor, x: Any, y: Any) -> Tensor:
    """x where condition is true, else y (arrays of one backend, or Python numbers)."""
    ops = _ops_of(condition, x, y)
    if isinstance(x, Index):
        x, y, _ = x._pair(y)
    elif isinstance(y, Index):
        y, x, _ = y._pair(x)
    return ops.select(_native(condition), x, y)


def tanh(x: Tensor) -> Tensor:
    """The hyperbolic tangent of x, elementwise."""
    ops = _ops_of(x)
    return ops.tanh(ops.cast(x.ints, x.like) if isinstance(x, Index) else x)


def logical_and(a: Tensor, b: Tensor) -> Tensor:
    """a and b, elementwise (the operator & refuses booleans on mxnet)."""
    return _ops_of(a, b).logical_and(*_native((a, b)))


def logical_or(a: Tensor, b: Tensor) -> Tensor:
    """a or b, elementwise (the operator | refuses booleans on mxnet)."""
    return _ops_of(a, b).select(*_native((a, True, b)))


def take(table: Tensor, *indices: Any) -> Tensor:
    """table[i, j, ...] elementwise, the index arrays (positions, or integer arrays of the
    backend) broadcast together, one per axis of table: ``table[q_idx - kv_idx]`` on torch,
    numpy or jax, on every backend (tensorflow and the Array API index arrays by take)."""
    # the positions' backend first: a graph's (``multiattn.onnx``) takes numpy tables
    ops = _ops_of(*indices, table)
    shape = ops.shape(table)
    if len(indices) != len(shape):
        raise ValueError(f"take needs one index array per axis of table, {len(shape)}, got {len(indices)}")
    linear = _native(indices[0])
    for size, index in zip(shape[1:], indices[1:]):
        linear = linear * size + _native(index)
    return ops.take(ops.reshape(table, (-1,)), linear)


def _on(ops: Ops, x: Any, like: Tensor) -> Tensor:
    """x as a tensor of ops' backend: itself, or its values (numbers, numpy, another's)."""
    return x if framework_of(x) == ops.name else ops.constant(np.asarray(x), like)


# -- positions that mix with Python floats ---------------------------------------------------


class Index:
    """Integer positions (b, h, q_idx, kv_idx) handed to score and mask functions where the
    framework's integer arrays do not mix with Python floats as Python's ints do (``Ops.
    call_mod``: tensorflow and the strict Array API refuse ``0.1 * i``).  Integer arithmetic
    stays integer; with a float (a Python float or a float array) the positions are cast to the
    scores' dtype first, so ``s + 0.1 * (q_idx - kv_idx)`` is computed as Python would;
    comparisons give the framework's booleans; ``tf.gather``, ``tf.abs`` and ``take`` take
    them."""

    __slots__ = ("ints", "ops", "like")

    def __init__(self, ints: Tensor, ops: Ops, like: Tensor) -> None:
        self.ints, self.ops, self.like = ints, ops, like

    @property
    def shape(self) -> Any:
        return self.ints.shape

    @property
    def dtype(self) -> Any:
        return self.ints.dtype

    def __repr__(self) -> str:
        return f"Index({self.ints!r})"

    def __bool__(self) -> bool:
        raise TypeError(
            "positions are arrays: combine conditions with mods.where / logical_and, not if/and/or"
        )

    def _pair(self, other: Any) -> tuple:
        """(self, other) as arrays of one kind: ints where other is an int or integer array,
        else both floats (other's dtype where it is an array, else the scores')."""
        if isinstance(other, Index):
            return self.ints, other.ints, True
        if isinstance(other, bool) or isinstance(other, int):
            return self.ints, other, True
        if isinstance(other, float):
            return self.ops.cast(self.ints, self.like), other, False
        if framework_of(other) == self.ops.name:
            kind = self.ops.dtype_kind(other)
            if kind in "iub":
                return self.ints, other, True
            return self.ops.cast(self.ints, other), other, False
        return NotImplemented, None, False

    def _apply(self, other: Any, op: Callable, integer: bool, reflected: bool) -> Any:
        a, b, ints = self._pair(other)
        if a is NotImplemented:
            return NotImplemented
        out = op(b, a) if reflected else op(a, b)
        return Index(out, self.ops, self.like) if ints and integer else out

    def _binary(op: Callable, integer: bool = True) -> tuple:  # noqa: N805 (makes the methods)
        return (
            lambda self, other: self._apply(other, op, integer, False),
            lambda self, other: self._apply(other, op, integer, True),
        )

    __add__, __radd__ = _binary(lambda a, b: a + b)
    __sub__, __rsub__ = _binary(lambda a, b: a - b)
    __mul__, __rmul__ = _binary(lambda a, b: a * b)
    __floordiv__, __rfloordiv__ = _binary(lambda a, b: a // b)
    __mod__, __rmod__ = _binary(lambda a, b: a % b)
    __pow__, __rpow__ = _binary(lambda a, b: a**b)
    __and__, __rand__ = _binary(lambda a, b: a & b)
    __or__, __ror__ = _binary(lambda a, b: a | b)
    __lt__, __gt__ = _binary(lambda a, b: a < b, integer=False)
    __le__, __ge__ = _binary(lambda a, b: a <= b, integer=False)
    __eq__ = _binary(lambda a, b: a == b, integer=False)[0]  # type: ignore[assignment]
    __ne__ = _binary(lambda a, b: a != b, integer=False)[0]  # type: ignore[assignment]
    del _binary
    __hash__ = None  # type: ignore[assignment]

    def __truediv__(self, other):
        a, b, _ = self._pair(float(other) if isinstance(other, int) else other)
        return NotImplemented if a is NotImplemented else self.ops.cast(a, self.like) / b

    def __rtruediv__(self, other):
        a, b, _ = self._pair(float(other) if isinstance(other, int) else other)
        return NotImplemented if a is NotImplemented else b / self.ops.cast(a, self.like)

    def __neg__(self):
        return Index(-self.ints, self.ops, self.like)

    def __abs__(self):
        return Index(abs(self.ints), self.ops, self.like)

    # the frameworks' conversions, so that a captured tensor can be indexed with them
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.ops.host_values(self.ints), dtype=dtype)

    def __tf_tensor__(self, dtype: Any = None, name: Any = None) -> Tensor:
        return self.ints


def call_with_positions_as(fn: Callable, args: tuple, position: Callable) -> Tensor:
    """fn on args whose last four, the positions, are position(x) (``Ops.call_mod``)."""
    return fn(*args[:-4], *(position(x) for x in args[-4:]))


def call_with_index(ops: Ops, fn: Callable, args: tuple, like: Tensor) -> Tensor:
    """fn on args whose last four, the positions, are wrapped in ``Index`` (``Ops.call_mod``)."""
    return call_with_positions_as(fn, args, lambda x: Index(x, ops, like))


def _native(x: Any) -> Any:
    """x with every ``Index`` in it (nested in tuples, lists and dicts) as its integer array."""
    if isinstance(x, Index):
        return x.ints
    if isinstance(x, (tuple, list)):
        return type(x)(_native(y) for y in x)
    if isinstance(x, dict):
        return {k: _native(v) for k, v in x.items()}
    return x


# -- the functions as the core evaluates them ------------------------------------------------

Block = Tuple[int, int, int, int]  # q0, q1, k0, k1: queries [q0, q1) and keys [k0, k1)


class TracedBlock(tuple):
    """A block (q0, q1, k0, k1) whose starts are scalar tensors of a compiled loop (``blockwise``
    in the framework's loop): its sizes (q1 - q0, k1 - k0) are known, its place only when it runs."""

    def __new__(cls, q0: Any, k0: Any, sizes: Tuple[int, int]) -> "TracedBlock":
        block = super().__new__(cls, (q0, q0 + sizes[0], k0, k0 + sizes[1]))
        block.sizes = sizes
        return block


class MaskFunction:
    """A mask function: called as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``; for the
    core, ``values`` (its booleans for a block) and ``classify`` (what it shows of a block,
    known without evaluating it, or None)."""

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def values(self, ops: Ops, like: Tensor, heads: Optional[int], block: Block, batch: int) -> Tensor:
        """Its booleans for a block, broadcastable to (B, H, bq, bk) (heads None: (B, bq, bk))."""
        return call_with_positions(ops, self, like, heads, block, batch)

    def classify(self, ops: Ops, block: Block) -> Optional[Tuple[bool, bool]]:
        """(whether some key of the block may be seen, whether every one is), over every batch
        row and head, known on the host without evaluating the block; None: not known."""
        return None

    def classifier(self, ops: Ops) -> Callable[[Block], Optional[Tuple[bool, bool]]]:
        """``classify`` for the blocks of one call: what it needs from the host read once."""
        return functools.partial(self.classify, ops)

    def values_key(self, block: Block) -> Any:
        """What this mask's booleans for a block depend on, where blocks share them (a key
        for the plan's cache), else None: each block evaluated."""
        return None

    def block_side(self, ops: Ops) -> Optional[int]:
        """The largest block side at which this mask's blocks are mostly skipped or shown
        whole (a power of two), for the automatic block size to stay at or below; None: any."""
        return None

    def key_range(self, q0: int, q1: int) -> Optional[Tuple[int, int]]:
        """Keys [lo, hi) outside which no query of [q0, q1) sees any, known on the host, for
        the plan to leave the other blocks unexamined; None: any key may be seen."""
        return None

    def check_sizes(self, batch: Any, n_queries: Any, n_keys: Any) -> None:
        """ValueError naming this function where the arrays it holds do not cover a call's
        (batch, queries, keys) (None: unknown, traced)."""

    def implies_causal(self) -> bool:
        """Whether every key it shows is at or before its query (j <= i): causal=True then
        hides nothing more."""
        return False

    def traceable(self) -> bool:
        """Whether ``values`` takes a ``TracedBlock`` (a block placed when a compiled loop runs)."""
        return True


class _UserMask(MaskFunction):
    def __init__(self, fn: Callable[..., Tensor]) -> None:
        self.fn = fn

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"mask_mod({getattr(self.fn, '__name__', self.fn)!r})"


def as_mask_function(fn: Any) -> MaskFunction:
    return fn if isinstance(fn, MaskFunction) else _UserMask(fn)


def positions(ops: Ops, like: Tensor, heads: Optional[int], block: Block, batch: int) -> tuple:
    """(b, h, q_idx, kv_idx) for a block, each 4-D, broadcastable to (B, H, bq, bk)."""
    q0, q1, k0, k1 = block
    b = ops.positions(0, batch, like)
    for _ in range(3):
        b = ops.expand_dims(b, -1)
    h = ops.positions(0, heads or 1, like)
    h = ops.expand_dims(ops.expand_dims(ops.expand_dims(h, -1), -1), 0)
    sizes = getattr(block, "sizes", None)  # a ``TracedBlock``: starts known when the loop runs
    q, k = (
        (ops.positions(q0, q1, like), ops.positions(k0, k1, like))
        if sizes is None
        else (ops.positions(0, sizes[0], like) + q0, ops.positions(0, sizes[1], like) + k0)
    )
    q = ops.expand_dims(ops.expand_dims(ops.expand_dims(q, -1), 0), 0)
    for _ in range(3):
        k = ops.expand_dims(k, 0)
    return b, h, q, k


def _to_rank(ops: Ops, x: Tensor, heads: Optional[int]) -> Tensor:
    """A 4-D answer as the call's scores are: 3-D where the call has no heads."""
    if heads is None and len(ops.shape(x)) == 4:
        return x[:, 0, ...]
    return x


def call_with_positions(ops, fn, like, heads, block, batch) -> Tensor:
    mask = ops.call_mod(fn, positions(ops, like, heads, block, batch), like)
    if framework_of(mask) != ops.name or ops.dtype_kind(mask) != "b":
        got = f"{_kind(mask)} ({getattr(mask, 'dtype', type(mask).__name__)})"
        raise TypeError(
            f"mask_mod must return booleans (True: may attend), an array of the backend broadcastable "
            f"to the scores, got {got}" + ("; score_mod is the function of scores" if _numeric(mask) else "")
        )
    return _to_rank(ops, mask, heads)


def apply_score_mod(ops: Ops, score_mod: Callable, scores: Tensor, block: Block, batch: int) -> Tensor:
    """score_mod on a block of scores (B, [H,] bq, bk) whose queries and keys start at q0, k0;
    its answer in the scores' dtype (Python's promotion may have widened it)."""
    heads = ops.shape(scores)[1] if len(ops.shape(scores)) == 4 else None
    four = scores if heads is not None else ops.expand_dims(scores, 1)
    out = ops.call_mod(score_mod, (four,) + positions(ops, scores, heads, block, batch), scores)
    if framework_of(out) != ops.name or ops.dtype_kind(out) != "f":
        got = f"{_kind(out)} ({getattr(out, 'dtype', type(out).__name__)})"
        raise TypeError(
            f"score_mod must return scores, a floating array of the backend broadcastable to the "
            f"scores, got {got}" + ("; mask_mod is the function of booleans" if "bool" in got else "")
        )
    if out.dtype != scores.dtype:
        out = ops.cast(out, scores)
    return _to_rank(ops, out, heads)


def _kind(x: Any) -> str:
    if isinstance(x, Index):
        return "numbers"
    if framework_of(x) is None:
        return f"a {type(x).__name__}"
    return "booleans" if "bool" in str(x.dtype) else "numbers"


def _numeric(x: Any) -> bool:
    return isinstance(x, Index) or (framework_of(x) is not None and "bool" not in str(x.dtype))


# -- ready-made masks ------------------------------------------------------------------------


def _power_of_two_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _ints(value: Any, arg: str) -> np.ndarray:
    values = np.asarray(value)
    if values.dtype.kind not in "iu" or values.ndim > 1:
        raise TypeError(f"{arg} must be an int or a 1-D array of ints, got {value!r}")
    return values


class sliding_window(MaskFunction):
    """Key j visible from query i iff 0 <= i - j < w: the causal band of width w."""

    def __init__(self, w: int) -> None:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"sliding_window's w must be an int >= 1, got {w!r}")
        self.w = w

    def __call__(self, b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return logical_and(distance >= 0, distance < self.w)

    def classify(self, ops, block):
        q0, q1, k0, k1 = block
        lo, hi = q0 - (k1 - 1), (q1 - 1) - k0  # the distances i - j of the block
        return (hi >= 0 and lo < self.w), (lo >= 0 and hi < self.w)

    def values_key(self, block):
        q0, q1, k0, k1 = block
        return q0 - k0, q1 - q0, k1 - k0  # the band depends on i - j alone

    def key_range(self, q0, q1):
        return max(q0 - self.w + 1, 0), q1

    def implies_causal(self):
        return True

    def block_side(self, ops):
        # half the width: three blocks per row of blocks, the middle one whole; where steps are
        # costly, the width: two, the band's triangles (benchmarks/RESULTS.md, 2026-12-04)
        return _power_of_two_at_most(max(self.w // (1 if tuning.of(ops).costly_steps else 2), 1))

    def __repr__(self) -> str:
        return f"sliding_window({self.w})"


class prefix_lm(MaskFunction):
    """Key j visible from query i iff j <= i or j < n: the first n positions see each other
    (the prefix), the rest causally; n an int or one per sequence ((B,) ints)."""

    def __init__(self, n: Any) -> None:
        self.n = _ints(n, "prefix_lm's n")

    def __call__(self, b, h, q_idx, kv_idx):
        if self.n.ndim == 0:
            n = int(self.n)
        else:  # one per sequence: (B, 1, 1, 1)
            ops = _ops_of(q_idx)
            ints = _native(q_idx)
            n = ops.cast(ops.constant(self.n.reshape(-1, 1, 1, 1), ints), ints)
        return logical_or(kv_idx <= q_idx, kv_idx < n)

    def classify(self, ops, block):
        q0, q1, k0, k1 = block
        lo, hi = int(self.n.min()), int(self.n.max())
        some = k0 <= q1 - 1 or k0 < hi
        # a key hidden from some query: j > i and j >= n for some j in [k0, k1), i in [q0, q1)
        return some, not (max(k0, lo, q0 + 1) < k1)

    def key_range(self, q0, q1):
        return 0, max(q1, int(self.n.max()))

    def __repr__(self) -> str:
        return f"prefix_lm({self.n.tolist()!r})"


class document(MaskFunction):
    """Key j visible from query i iff both belong to the same document of a packed sequence:
    ids (B, N) the document of each position (``document(q_ids, kv_ids)`` where queries and
    keys differ: (B, Q) and (B, K)); arrays of the backend or numpy."""

    def __init__(self, q_ids: Any, kv_ids: Any = None) -> None:
        self.q_ids, self.kv_ids = q_ids, (q_ids if kv_ids is None else kv_ids)

    def __call__(self, b, h, q_idx, kv_idx):
        raise TypeError("document(ids) is evaluated by multiattn's calls; it takes no index arrays")

    def check_sizes(self, batch, n_queries, n_keys):
        pairs = (("q_ids", self.q_ids, n_queries, "queries"), ("kv_ids", self.kv_ids, n_keys, "keys"))
        if self.kv_ids is self.q_ids:
            pairs = (("ids", self.q_ids, n_queries, "queries"),) + (
                (("ids", self.q_ids, n_keys, "keys"),) if n_keys != n_queries else ()
            )
        for arg, ids, n, what in pairs:
            shape = tuple(getattr(ids, "shape", np.shape(ids)))
            if len(shape) != 2 or not _fits(shape[0], batch) or not _fits(shape[1], n):
                raise ValueError(
                    f"document's {arg} must have shape ({batch}, {n}) (batch, {what}): one document id "
                    f"per position, got shape {shape}"
                )

    def traceable(self):
        return False  # its ids are sliced where the block is

    def values(self, ops, like, heads, block, batch):
        q0, q1, k0, k1 = block
        q_ids, kv_ids = _on(ops, self.q_ids, like), _on(ops, self.kv_ids, like)
        q_part = ops.expand_dims(ops.expand_dims(q_ids[:, q0:q1], -1), 1)  # (B, 1, bq, 1)
        kv_part = ops.expand_dims(ops.expand_dims(kv_ids[:, k0:k1], 1), 1)  # (B, 1, 1, bk)
        return _to_rank(ops, q_part == kv_part, heads)

    def classify(self, ops, block):
        return self.classifier(ops)(block)

    def classifier(self, ops):
        found = []
        for ids in (self.q_ids, self.kv_ids):
            values = ops.host_values(ids) if framework_of(ids) == ops.name else np.asarray(ids)
            if values is None:  # traced: not known
                return lambda block: None
            found.append(np.asarray(values))
        q_ids, kv_ids = found
        ids_in = functools.lru_cache(maxsize=None)(
            lambda side, start, stop: [
                set(np.unique(row[start:stop]).tolist()) for row in (q_ids, kv_ids)[side]
            ]
        )

        def classify(block):
            q0, q1, k0, k1 = block
            pairs = list(zip(ids_in(0, q0, q1), ids_in(1, k0, k1)))
            return any(q & k for q, k in pairs), all(len(q) == 1 and q == k for q, k in pairs)

        return classify

    def block_side(self, ops):
        # the largest power of two dividing every document's start: blocks then hold one document
        starts = []
        for ids in (self.q_ids, self.kv_ids):
            values = ops.host_values(ids) if framework_of(ids) == ops.name else np.asarray(ids)
            if values is None:
                return None
            values = np.asarray(values)
            starts.extend(int(i) + 1 for i in np.nonzero(values[:, 1:] != values[:, :-1])[1])
        return min((start & -start for start in starts), default=None)

    def __repr__(self) -> str:
        return "document(ids)"


def _fits(size: Any, expected: Any) -> bool:
    return size is None or expected is None or int(size) == int(expected)


class and_masks(MaskFunction):
    """Visible iff every one of the mask functions shows the key."""

    def __init__(self, *fns: Any) -> None:
        if not fns:
            raise ValueError("and_masks needs at least one mask function")
        self.fns = [as_mask_function(fn) for fn in fns]

    def __call__(self, b, h, q_idx, kv_idx):
        found = self.fns[0](b, h, q_idx, kv_idx)
        for fn in self.fns[1:]:
            found = logical_and(found, fn(b, h, q_idx, kv_idx))
        return found

    def implies_causal(self):
        return any(fn.implies_causal() for fn in self.fns)

    def traceable(self):
        return all(fn.traceable() for fn in self.fns)

    def check_sizes(self, batch, n_queries, n_keys):
        for fn in self.fns:
            fn.check_sizes(batch, n_queries, n_keys)

    def values(self, ops, like, heads, block, batch):
        found = None
        for fn in self.fns:
            mask = fn.values(ops, like, heads, block, batch)
            found = mask if found is None else ops.logical_and(found, mask)
        return found

    def classify(self, ops, block):
        return self.classifier(ops)(block)

    def classifier(self, ops):
        parts = [fn.classifier(ops) for fn in self.fns]

        def classify(block):
            known = [part(block) for part in parts]
            if any(k is not None and not k[0] for k in known):
                return False, False
            if all(k is not None and k[1] for k in known):
                return True, True
            return None

        return classify

    def block_side(self, ops):
        sides = [side for side in (fn.block_side(ops) for fn in self.fns) if side is not None]
        return min(sides) if sides else None

    def key_range(self, q0, q1):
        ranges = [r for r in (fn.key_range(q0, q1) for fn in self.fns) if r is not None]
        if not ranges:
            return None
        return max(lo for lo, _ in ranges), min(hi for _, hi in ranges)

    def __repr__(self) -> str:
        return f"and_masks({', '.join(map(repr, self.fns))})"


class or_masks(MaskFunction):
    """Visible iff some one of the mask functions shows the key."""

    def __init__(self, *fns: Any) -> None:
        if not fns:
            raise ValueError("or_masks needs at least one mask function")
        self.fns = [as_mask_function(fn) for fn in fns]

    def __call__(self, b, h, q_idx, kv_idx):
        found = self.fns[0](b, h, q_idx, kv_idx)
        for fn in self.fns[1:]:
            found = logical_or(found, fn(b, h, q_idx, kv_idx))
        return found

    def implies_causal(self):
        return all(fn.implies_causal() for fn in self.fns)

    def traceable(self):
        return all(fn.traceable() for fn in self.fns)

    def check_sizes(self, batch, n_queries, n_keys):
        for fn in self.fns:
            fn.check_sizes(batch, n_queries, n_keys)

    def values(self, ops, like, heads, block, batch):
        found = None
        for fn in self.fns:
            mask = fn.values(ops, like, heads, block, batch)
            found = mask if found is None else ops.select(found, True, mask)
        return found

    def classify(self, ops, block):
        return self.classifier(ops)(block)

    def classifier(self, ops):
        parts = [fn.classifier(ops) for fn in self.fns]

        def classify(block):
            known = [part(block) for part in parts]
            if any(k is not None and k[1] for k in known):
                return True, True
            if all(k is not None and not k[0] for k in known):
                return False, False
            return None

        return classify

    def key_range(self, q0, q1):
        ranges = [fn.key_range(q0, q1) for fn in self.fns]
        if any(r is None for r in ranges):
            return None
        return min(lo for lo, _ in ranges), max(hi for _, hi in ranges)

    def __repr__(self) -> str:
        return f"or_masks({', '.join(map(repr, self.fns))})"


class _NoopMask(MaskFunction):
    """Every key visible (FlexAttention's ``noop_mask``)."""

    def __call__(self, b, h, q_idx, kv_idx):
        return logical_or(kv_idx >= 0, q_idx >= 0)

    def classify(self, ops, block):
        return True, True

    def values_key(self, block):
        q0, q1, k0, k1 = block
        return q1 - q0, k1 - k0

    def __repr__(self) -> str:
        return "noop_mask"


noop_mask = _NoopMask()


# -- queries that sit after the keys (``query_offset``) ---------------------------------------


class causal_mask(MaskFunction):
    """Key j visible from query i iff j <= i: ``causal=True`` as a mask function, which
    ``at_offset`` moves (top-left aligned where queries start at key 0)."""

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def classify(self, ops, block):
        q0, q1, k0, k1 = block
        return k0 <= q1 - 1, k1 - 1 <= q0

    def values_key(self, block):
        q0, q1, k0, k1 = block
        return q0 - k0, q1 - q0, k1 - k0

    def key_range(self, q0, q1):
        return 0, q1

    def implies_causal(self):
        return True

    def __repr__(self) -> str:
        return "causal_mask()"


def query_offsets(ops: Ops, offset: Any) -> Optional[np.ndarray]:
    """The offsets as numpy ints on the host (an int: 0-D), or None where traced."""
    if isinstance(offset, int):
        return np.asarray(offset)
    values = ops.host_values(offset) if framework_of(offset) == ops.name else np.asarray(offset)
    return None if values is None else np.asarray(values).astype(np.int64)


def _shift(offset: Any, q_idx: Any) -> Any:
    """The offset to add to q_idx (1, 1, bq, 1): an int, or one per sequence (B, 1, 1, 1)."""
    if isinstance(offset, int):
        return offset
    ops = _ops_of(q_idx)
    ints = _native(q_idx)
    found = _on(ops, np.asarray(offset) if framework_of(offset) is None else offset, ints)
    return ops.cast(ops.reshape(found, (-1, 1, 1, 1)), ints)


class at_offset(MaskFunction):
    """fn for queries at positions offset + i and keys at kv_offset + j: fn(b, h, offset +
    q_idx, kv_offset + kv_idx); offset an int or one per sequence ((B,) ints: numpy, or an
    array of the backend), kv_offset an int."""

    def __init__(self, fn: Any, offset: Any, kv_offset: int = 0) -> None:
        self.fn, self.offset, self.kv_offset = as_mask_function(fn), offset, kv_offset

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx + _shift(self.offset, q_idx), kv_idx + self.kv_offset)

    def _moved(self, block: Block, offset: int) -> Block:
        q0, q1, k0, k1 = block
        ko, sizes = self.kv_offset, getattr(block, "sizes", None)
        return (
            TracedBlock(q0 + offset, k0 + ko, sizes)
            if sizes
            else (q0 + offset, q1 + offset, k0 + ko, k1 + ko)
        )

    def values(self, ops, like, heads, block, batch):
        if isinstance(self.offset, int):  # the function's own values (a document's ids) where it can
            return self.fn.values(ops, like, heads, self._moved(block, self.offset), batch)
        return call_with_positions(ops, self, like, heads, block, batch)

    def classifier(self, ops):
        offsets = query_offsets(ops, self.offset)
        if offsets is None:
            return lambda block: None
        parts, inner = sorted(set(offsets.reshape(-1).tolist())), self.fn.classifier(ops)

        def classify(block):  # every sequence's offset: some key seen by one, all by every one
            known = [inner(self._moved(block, o)) for o in parts]
            if any(k is None for k in known):
                return None
            return any(k[0] for k in known), all(k[1] for k in known)

        return classify

    def classify(self, ops, block):
        return self.classifier(ops)(block)

    def values_key(self, block):
        if not isinstance(self.offset, int):
            return None
        key = self.fn.values_key(self._moved(block, self.offset))
        return None if key is None else ("at_offset", self.kv_offset, key)

    def key_range(self, q0, q1):
        offsets = self.offset if isinstance(self.offset, int) else None
        if offsets is None and framework_of(self.offset) is None:
            offsets = np.asarray(self.offset)
        if offsets is None:
            return None
        lo, hi = int(np.min(offsets)), int(np.max(offsets))
        ranges = [self.fn.key_range(q0 + lo, q1 + lo), self.fn.key_range(q0 + hi, q1 + hi)]
        if any(r is None for r in ranges):
            return None
        ko = self.kv_offset
        return max(min(r[0] for r in ranges) - ko, 0), max(max(r[1] for r in ranges) - ko, 0)

    def implies_causal(self):
        return isinstance(self.offset, int) and self.offset <= self.kv_offset and self.fn.implies_causal()

    def traceable(self):
        return self.fn.traceable()

    def block_side(self, ops):
        return self.fn.block_side(ops)

    def check_sizes(self, batch, n_queries, n_keys):
        self.fn.check_sizes(batch, None, n_keys)

    def __repr__(self) -> str:
        offset = self.offset if isinstance(self.offset, int) else "offsets"
        return f"at_offset({self.fn!r}, {offset})"


class score_at_offset:
    """score_mod for queries at positions offset + i and keys at kv_offset + j, as ``at_offset``."""

    def __init__(self, fn: Callable[..., Tensor], offset: Any, kv_offset: int = 0) -> None:
        self.fn, self.offset, self.kv_offset = fn, offset, kv_offset

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.fn(score, b, h, q_idx + _shift(self.offset, q_idx), kv_idx + self.kv_offset)

    def __repr__(self) -> str:
        return f"score_at_offset({self.fn!r})"


# -- ready-made score functions --------------------------------------------------------------


class softcap:
    """score -> c * tanh(score / c) (Gemma 2's soft-capping), applied before any mask."""

    def __init__(self, c: float) -> None:
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0:
            raise ValueError(f"softcap's c must be a number > 0, got {c!r}")
        self.c = float(c)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return tanh(score / self.c) * self.c

    def __repr__(self) -> str:
        return f"softcap({self.c:g})"


class alibi:
    """score -> score + slopes[h] * (j - i) (ALiBi, Press et al. 2022): a linear penalty with
    the distance, one slope per head; slopes (H,) numbers or an array of the backend."""

    def __init__(self, slopes: Sequence[float]) -> None:
        self.slopes = slopes if framework_of(slopes) not in (None, "numpy") else np.asarray(slopes, float)

    def __call__(self, score, b, h, q_idx, kv_idx):
        ops = _ops_of(score)
        slopes = _on(ops, self.slopes, score)
        heads = ops.shape(score)[1]
        if ops.shape(slopes)[0] != heads:
            raise ValueError(f"alibi has {ops.shape(slopes)[0]} slopes for scores with {heads} heads")
        slopes = ops.expand_dims(ops.expand_dims(ops.expand_dims(slopes, -1), -1), 0)  # (1, H, 1, 1)
        return score + ops.cast(slopes, score) * ops.cast(_native(kv_idx - q_idx), score)

    def __repr__(self) -> str:
        return "alibi(slopes)"


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The paper's slopes: the geometric sequence 2^(-8 i / n), i = 1..n, for n a power of two;
    otherwise those of the power of two below, then every other one of the next (its code)."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")

    def power_of_two(n: int) -> list:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    below = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(below)
    if below < num_heads:
        slopes += power_of_two(2 * below)[0::2][: num_heads - below]
    return np.array(slopes)
