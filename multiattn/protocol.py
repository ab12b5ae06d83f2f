"""The tensor-ops protocol: the only thing multiattn's math asks of a framework.

``Primitives`` is a base class in the style of einops' ``AbstractBackend``: the required
operations raise ``NotImplementedError`` until an adapter defines them, and are all the core's
math (``multiattn.core``) uses; the optional ones have generic defaults.  This module imports no
other multiattn module (a test).  An adapter subclasses ``adapter.Ops``: these primitives and
``specialisations.Specialisations``, the optional ways of doing a core step faster.

Tensors are used through these methods, plus what every array library has:
``+``, ``-``, ``*`` and ``/`` with a tensor or a Python float, and basic slicing
(``x[:, a:b]``, ``x[..., a:b, :]``, ``x[..., 0]``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

Tensor = Any
Shape = Tuple[Any, ...]  # ints; None where a traced/graph dimension is unknown

# What a backend module ``multiattn.backends.<name>`` exports (tests check every backend).
BACKEND_EXPORTS = (
    "ops",  # an instance of an Ops subclass
    "masked_softmax",  # the functional API, bound by multiattn.functional.bind(ops)
    "dot_product_attention",
    "additive_attention",
    "multi_head_attention",
    "from_numpy",  # (array, dtype name or None) -> a new tensor
    "to_numpy",  # tensor -> a numpy copy (bfloat16 as float32)
    "vjp",  # (fn, args, cotangent) -> (fn(*args), gradients), or None without autodiff
    "SUPPORTED_DTYPES",  # dtype names the backend computes in
    "DTYPE_NOTES",  # dtype name -> why it is unsupported (or a dict: check function -> why)
)
# The framework-native classes, in ``multiattn.layers.<name>`` (optional: array_api has none);
# a backend module re-exports them lazily with ``layer_exports``.
LAYER_EXPORTS = ("AdditiveAttention", "DotProductAttention", "MultiHeadAttention")


class Primitives:
    """The primitives of one framework, all the core's math asks.  Subclasses set ``name``
    and define every method of the first group; the others have generic defaults."""

    name: str = ""  # backend name, as in the registry

    # -- required primitives ------------------------------------------------------------

    def shape(self, x: Tensor) -> Shape:
        """The shape as a tuple (None for dimensions unknown until run time)."""
        raise NotImplementedError

    def dtype_kind(self, x: Tensor) -> str:
        """NumPy's kind letter of x's dtype: 'b' bool, 'i'/'u' integer, 'f' float, 'c' complex."""
        raise NotImplementedError

    def zeros(self, shape: Shape, like: Tensor) -> Tensor:
        """Zeros of ``shape`` in like's dtype, on like's device."""
        raise NotImplementedError

    def any(self, mask: Tensor, axis: int) -> Tensor:
        """Logical or over one axis of a boolean tensor, the axis kept (size 1)."""
        raise NotImplementedError

    def expand_dims(self, x: Tensor, axis: int) -> Tensor:
        raise NotImplementedError

    def matrix_transpose(self, x: Tensor) -> Tensor:
        """x with its last two axes swapped, laid out row-major where the framework lets
        the caller see layouts (elementwise passes run over it)."""
        raise NotImplementedError

    def concat(self, xs: Sequence[Tensor], axis: int) -> Tensor:
        raise NotImplementedError

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """Batched ``a @ b`` with NumPy's matmul broadcasting (b may be 1-D)."""
        raise NotImplementedError

    def tanh(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def softmax(self, x: Tensor) -> Tensor:
        """Softmax over the last axis, accumulated in at least float32, in x's dtype."""
        raise NotImplementedError

    def split_heads(self, x: Tensor, num_heads: int) -> Tensor:
        """(B, n, H * d) -> (B, H, n, d): head i takes the columns i*d .. (i+1)*d - 1."""
        raise NotImplementedError

    def merge_heads(self, x: Tensor) -> Tensor:
        """(B, H, n, d) -> (B, n, H * d), the inverse of ``split_heads``."""
        raise NotImplementedError

    def reshape(self, x: Tensor, shape: Shape) -> Tensor:
        """x's elements, in row-major order, in ``shape`` (ints; one of them may be -1)."""
        raise NotImplementedError

    def select(self, condition: Tensor, x: Any, y: Any) -> Tensor:
        """x where condition is true, else y, broadcast: tensors of one dtype, or one of them a
        Python number (taking the other's dtype); never in place."""
        raise NotImplementedError

    def positions(self, start: int, stop: int, like: Tensor) -> Tensor:
        """The integers start .. stop - 1, 1-D, in an integer dtype, on like's device."""
        raise NotImplementedError

    def call_mod(self, fn: Any, args: tuple, like: Tensor) -> Tensor:
        """A score or mask function called on args (the scores first for a score function, then
        the positions b, h, q_idx, kv_idx, the framework's integer arrays) in a call on like's
        dtype, so that its Python floats mix with the positions as Python says: the default
        calls fn as it is; tensorflow and the strict Array API (whose integers refuse a float)
        wrap the positions in ``mods.Index``; torch scopes the default dtype to like's (an int
        tensor times a float is in the default dtype); paddle: a Tensor subclass; mxnet: floats."""
        return fn(*args)

    def take(self, x: Tensor, indices: Tensor) -> Tensor:
        """x (n,) at integer indices of any shape: x[indices]."""
        return x[indices]

    def constant(self, values: Any, like: Tensor) -> Tensor:
        """A tensor of the numpy array's values (its kind: integers stay integers, floats stay
        floating), on like's device."""
        raise NotImplementedError

    def lowest(self, x: Tensor) -> float:
        """The most negative finite value of x's dtype."""
        raise NotImplementedError

    def cast(self, x: Tensor, like: Tensor) -> Tensor:
        """x in like's dtype (x itself where it has it already), differentiable."""
        raise NotImplementedError

    def widen(self, x: Tensor) -> Tensor:
        """x in float32 where its dtype is narrower (float16, bfloat16), else x itself."""
        raise NotImplementedError

    def exp(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def log(self, x: Tensor) -> Tensor:
        """The natural log; log 0 = -inf."""
        raise NotImplementedError

    def max(self, x: Tensor, axis: int) -> Tensor:
        """The maximum over one axis, kept (size 1); NaN where the axis holds a NaN."""
        raise NotImplementedError

    def sum(self, x: Tensor, axis: int) -> Tensor:
        """The sum over one axis, kept (size 1)."""
        raise NotImplementedError

    def maximum(self, a: Tensor, b: Any) -> Tensor:
        """Elementwise max of a and b (a tensor, broadcast, or a Python float); NaN where
        either is NaN."""
        raise NotImplementedError

    # -- primitives with a default ------------------------------------------------------

    def matmul_t(self, a: Tensor, b: Tensor) -> Tensor:
        """Batched ``a @ b^T``, the transpose over b's last two axes."""
        return self.matmul(a, self.matrix_transpose(b))

    def where(self, mask: Tensor, x: Tensor, fill: float) -> Tensor:
        """``x`` where mask is true, the scalar ``fill`` elsewhere (mask broadcast); never in place."""
        return self.select(mask, x, fill)

    def logical_and(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise ``a and b`` of two boolean tensors, broadcast."""
        return self.select(a, b, a)

    def length_mask(self, x: Tensor, lens: Tensor, axis: int = -1) -> Tensor:
        """Boolean ``arange(x.shape[axis]) < lens`` of shape (B, 1, K) or (B, Q, K), on x's device.

        lens has shape (B,) (one length per batch element: (B, 1, K)) or (B, Q),
        any integer or float dtype; the comparison is in a dtype both sides share.
        """
        keys = self.cast(self.positions(0, self.shape(x)[axis], x), lens)
        return keys < per_row(lens)

    def causal_mask(self, n_queries: Any, n_keys: Any, like: Tensor) -> Tensor:
        """Boolean (Q, K), true where key j <= query i (top-left aligned), on like's device;
        like: the scores (..., Q, K), whose last two axes give sizes that are None."""
        n_queries = self.shape(like)[-2] if n_queries is None else n_queries
        n_keys = self.shape(like)[-1] if n_keys is None else n_keys
        query = self.expand_dims(self.positions(0, n_queries, like), -1)
        return self.expand_dims(self.positions(0, n_keys, like), 0) <= query

    # Whether values are updated by returning new ones (jax): a cache's append returns a new cache.
    functional_updates: bool = False

    def write_rows(self, x: Tensor, split: Any, start: Any, rows: Tensor) -> Tensor:
        """x (splits, ..., S, w) with x[split, ..., start : start + n, :] = rows (..., n, w) (a
        cache's storage): in place where the framework's arrays take item assignment, else a
        new array."""
        n = self.shape(rows)[-2]
        try:
            x[split, ..., start : start + n, :] = rows
            return x
        except TypeError:  # immutable arrays (tensorflow): a new one
            row = x[split, ...]
            row = self.concat([row[..., :start, :], rows, row[..., start + n :, :]], -2)
            return self.concat([x[:split, ...], self.expand_dims(row, 0), x[split + 1 :, ...]], 0)

    def exp_minus(self, x: Tensor, m: Tensor, owned: bool = False) -> Tensor:
        """exp(x - m), m broadcast; owned: x is the caller's own and read no more, so the result
        may take x's memory (a block's scores: no new array, no new pages to fault in)."""
        return self.exp(x - m)

    def broadcast_to(self, x: Tensor, shape: Shape) -> Tensor:
        """x broadcast to shape, as an operand whose every batch element a batched product
        computes alike (a view where the framework has them)."""
        return x + self.zeros(shape, x)

    def safe_softmax(self, x: Tensor) -> Tensor:
        """``softmax`` with the row rule: a score of -inf gets weight exactly 0, and a row whose
        scores are all -inf gets weights 0 (not NaN); NaN stays NaN."""
        return softmax_hiding_minus_inf(self, x, self.where, self.softmax)

    def split_rows(self, x: Tensor, sizes: Sequence[int]) -> List[Tensor]:
        """x split along axis -2 into consecutive parts of these sizes (the blocks of
        ``blockwise``); the default slices each."""
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        return [x[..., start:stop, :] for start, stop in zip(bounds, bounds[1:])]

    def row_windows(self, x: Tensor, start: int, size: int, step: int, count: int) -> Tensor:
        """count windows of size rows of x (axis -2), the i-th from start + i * step, stacked on
        a new leading axis: (count, *x.shape[:-2], size, x.shape[-1]); the default copies them
        (a framework with strided views overrides it with one)."""
        return self.concat(
            [
                self.expand_dims(x[..., at : at + size, :], 0)
                for at in range(start, start + count * step, step)
            ],
            0,
        )

    def joined_rows(self, x: Tensor) -> Tensor:
        """x (count, ..., n, d) as (..., count * n, d): the count blocks' rows one after another
        (the inverse of ``row_windows`` where the windows tile); the default concatenates."""
        return self.concat([x[at, ...] for at in range(self.shape(x)[0])], -2)

    def scaled_matmul_t(self, a: Tensor, b: Tensor, scale: float) -> Tensor:
        """``scale * (a @ b^T)`` for a (B, [H,] Q, d) and b (B, [H,] K, d)."""
        n_keys, width = self.shape(b)[-2], self.shape(a)[-1]
        if n_keys is not None and width is not None and width <= n_keys:
            return self.matmul_t(a * scale, b)  # scale the smaller operand
        return self.matmul_t(a, b) * scale

    # -- the loop over the block map (``blockwise``): the framework's own where it compiles --

    # whether ``loop``, ``map_rows`` and ``rows_at`` are the framework's loop primitives, which
    # a compiler sees as one loop (compiled once, whatever its trip count), taking tensors as
    # counts and starts
    loop_primitives: bool = False

    def loop(self, count: Any, body: Callable[[Any, tuple], tuple], state: tuple) -> tuple:
        """The state after state = body(i, state) for i = 0 .. count - 1 (count: an int, or a
        scalar tensor where ``loop_primitives``); the default: a Python loop."""
        for i in range(count):
            state = body(i, state)
        return state

    def map_rows(self, fn: Callable[[Any], tuple], count: int, likes: tuple) -> tuple:
        """For each output of fn(i) (tensors (..., n, y) of likes' dtypes, one each), those of
        i = 0 .. count - 1 one after another along axis -2 (..., count * n, y); fn(i) computed
        one after another; the default: a Python loop."""
        found = [fn(i) for i in range(count)]
        return tuple(self.concat([x[n] for x in found], -2) for n in range(len(likes)))

    def rows_at(self, x: Tensor, start: Any, size: int, axis: int = -2) -> Tensor:
        """x's size entries from start along axis (start: an int, or a scalar tensor where
        ``loop_primitives``); the default slices."""
        axis = axis % len(self.shape(x))
        stop = start + size if not isinstance(start, int) else min(start + size, self.shape(x)[axis])
        return x[(slice(None),) * axis + (slice(start, stop), ...)]

    def check_tensors(self, **tensors: Tensor) -> None:
        """TypeError unless every non-None argument is a tensor of this backend; by name
        (``adapter.Ops`` asks the registry)."""

    def unrolls_loops(self, x: Tensor) -> bool:
        """Whether x is traced by a compiler that unrolls a Python loop (torch.compile,
        mx.compile): the host's plan of blocks then keeps a fixed number of query blocks, so
        that compiling takes as long at every length.  The default: False."""
        return False

    def host_count(self, value: int) -> Any:
        """A count that changes from call to call (a cache's length) as the calls take it: the
        int itself by default; torch: a 0-D CPU tensor, which torch.compile takes as an input
        rather than a constant to recompile for."""
        return value

    def host_values(self, x: Tensor) -> Any:
        """x's values as a numpy array where they can be read now and cheaply (eager, on the
        host), else None (traced, lazy, or on a device): the block plan reads lengths and
        masks so, to skip what they hide."""
        return None

    def custom_gradient(
        self,
        forward: Callable[..., Tuple[Tensor, ...]],
        backward: Callable[..., Tuple[Tensor, ...]],
        tensors: Tuple[Tensor, ...],
        constants: Tuple[Tensor, ...] = (),
        tangent: Optional[Callable[..., Tuple[Tensor, ...]]] = None,
    ) -> Tuple[Tensor, ...]:
        """forward(*tensors, *constants) -> outputs, differentiated (with respect to tensors
        only) by backward(tensors, constants, outputs, cotangents) -> one gradient per tensor,
        through the framework's own custom-gradient mechanism; cotangents: one per output,
        None where it is not used.  tangent(tensors, constants, tangents) -> one tangent per
        output, linear in tangents: the forward-mode rule, where the framework takes one (jax
        transposes it for the reverse mode too, so its forward and second-order modes stay); a
        rule with a tangent gives what the framework's own differentiation of forward gives
        where the tensors are finite, so an adapter may run forward plainly there (torch).
        The default runs forward as it is (no autodiff, or the framework's own differentiation)."""
        return forward(*tensors, *constants)

    # softmax_with_lse(x) -> (softmax(x), log sum exp(x)) along the last axis, keepdims; x
    # finite: a full block's scores, which blockwise takes where they are bounded and the
    # backend's tuning says it pays (``fused_softmax``).  Its default (``adapter.Ops``): the
    # state's lse.

    def compiled(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """step (a function of tensors alone, called many times with a few shapes) through the
        framework's compiler where that pays; the default: step itself."""
        return step

    def settle(self, x: Tensor) -> None:
        """Compute x (a tensor, or a tuple of them) now, in a lazy framework, so that what it
        was computed from can be freed (a no-op in eager frameworks and inside compiled or
        vectorised functions)."""


REQUIRED = (
    "shape", "dtype_kind", "zeros", "any", "expand_dims", "matrix_transpose", "concat", "matmul",
    "tanh", "softmax", "split_heads", "merge_heads", "reshape", "select", "positions", "constant",
    "lowest", "cast", "widen", "exp", "log", "max", "sum", "maximum",
)  # fmt: skip


def dtype_kind_by_dtype(kind_of: Callable[[Any], str]) -> Callable[[Primitives, Tensor], str]:
    """An ``Ops.dtype_kind`` that asks ``kind_of(dtype)`` once per dtype: the checks read the
    kind of every argument on every call, and some frameworks' dtype predicates cost a few us."""
    kinds: dict = {}

    def dtype_kind(self: Primitives, x: Tensor) -> str:
        kind = kinds.get(x.dtype)
        if kind is None:
            kind = kinds[x.dtype] = kind_of(x.dtype)
        return kind

    return dtype_kind


def softmax_hiding_minus_inf(ops: Primitives, x: Tensor, where: Callable, softmax: Callable) -> Tensor:
    """``Primitives.safe_softmax`` by the formula, with the ``where`` and ``softmax`` given (an
    adapter's may write into x): the -inf scores are the dtype's lowest for the softmax, whose
    weights there are then set to 0."""
    shown = x != -math.inf
    return where(shown, softmax(where(shown, x, ops.lowest(x))), 0.0)


def per_row(lens: Tensor) -> Tensor:
    """Lengths (B,) as (B, 1, 1), (B, Q) as (B, Q, 1): against positions (K,) they give the
    (B, 1|Q, K) mask of ``length_mask``."""
    return lens[:, None, None] if len(lens.shape) == 1 else lens[:, :, None]
