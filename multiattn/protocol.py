"""The tensor-ops protocol: the only thing multiattn's math asks of a framework.

``Ops`` is a base class in the style of einops' ``AbstractBackend``: the
required primitives raise ``NotImplementedError`` until an adapter defines
them; every optional step (a fast path, a tuning number) is defined here once,
generically, and an adapter overrides it where its framework does better.  The
math (``multiattn.core``) uses only the required primitives; the strategies
(``multiattn.strategies``) use the optional steps.  A test fails for an adapter
that defines a public member this class does not declare (a misspelled override
would otherwise switch itself off silently).

Tensors are used through these methods, plus what every array library has:
``+`` and ``*`` with a tensor or a Python float, and basic slicing
(``x[:, a:b]``, ``x[:, :, None]``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

from . import _registry

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


class Ops:
    """The primitives of one framework.  Subclasses set ``name`` and define every
    method of the first group; the rest have generic defaults."""

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

    def matmul_t(self, a: Tensor, b: Tensor) -> Tensor:
        """Batched ``a @ b^T``, the transpose over b's last two axes."""
        raise NotImplementedError

    def tanh(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def softmax(self, x: Tensor) -> Tensor:
        """Softmax over the last axis, accumulated in at least float32, in x's dtype."""
        raise NotImplementedError

    def length_mask(self, x: Tensor, lens: Tensor, axis: int = -1) -> Tensor:
        """Boolean ``arange(x.shape[axis]) < lens`` of shape (B, 1, K) or (B, Q, K), on x's device.

        lens has shape (B,) (one length per batch element: (B, 1, K)) or (B, Q),
        any integer or float dtype; the comparison is in a dtype both sides share.
        """
        raise NotImplementedError

    def causal_mask(self, n_queries: Any, n_keys: Any, like: Tensor) -> Tensor:
        """Boolean (Q, K), true where key j <= query i (top-left aligned), on like's device;
        like: the scores (..., Q, K), whose last two axes give sizes that are None."""
        raise NotImplementedError

    def logical_and(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise ``a and b`` of two boolean tensors, broadcast."""
        raise NotImplementedError

    def split_heads(self, x: Tensor, num_heads: int) -> Tensor:
        """(B, n, H * d) -> (B, H, n, d): head i takes the columns i*d .. (i+1)*d - 1."""
        raise NotImplementedError

    def merge_heads(self, x: Tensor) -> Tensor:
        """(B, H, n, d) -> (B, n, H * d), the inverse of ``split_heads``."""
        raise NotImplementedError

    def where(self, mask: Tensor, x: Tensor, fill: float) -> Tensor:
        """``x`` where mask is true, the scalar ``fill`` elsewhere (mask broadcast); never in place."""
        raise NotImplementedError

    def lowest(self, x: Tensor) -> float:
        """The most negative finite value of x's dtype."""
        raise NotImplementedError

    def cast(self, x: Tensor, like: Tensor) -> Tensor:
        """x in like's dtype (x itself where it has it already), differentiable."""
        raise NotImplementedError

    # -- optional steps: generic here, overridden where a framework does better ---------

    # Elements of one block of additive features: the scores are made block by block over
    # the queries, so the extra memory stays a few MB instead of the whole feature tensor.
    feature_block_elements: int = 1 << 20

    # Lay the additive features out as d2l does, (B, Q, K, h), instead of keys innermost,
    # (B, Q, h, K): for a compiler that fuses the w_v reduction best over the innermost axis.
    hiddens_innermost: bool = False

    # Fewest scores (batch * queries * keys) for which ``fused_attention`` pays its fixed cost.
    fused_min_scores: int = 0

    def scaled_matmul_t(self, a: Tensor, b: Tensor, scale: float) -> Tensor:
        """``scale * (a @ b^T)`` for 3-D a (B, Q, d) and b (B, K, d)."""
        n_keys, width = self.shape(b)[-2], self.shape(a)[-1]
        if n_keys is not None and width is not None and width <= n_keys:
            return self.matmul_t(a * scale, b)  # scale the smaller operand
        return self.matmul_t(a, b) * scale

    def tanh_of_sum(self, a: Tensor, b: Tensor, buffers: list) -> Tensor:
        """``tanh(a + b)`` (broadcast).  buffers: a list that lives for one call's blocks,
        where an adapter may keep its result, no longer used once the next block comes, to
        write the next result into its memory (the default keeps nothing)."""
        return self.tanh(a + b)

    def tanh_by_sigmoid(self, features: Tensor) -> bool:
        """Whether additive features like ``features`` (its dtype and device) are cheaper as
        tanh(z) = 2 sigmoid(2z) - 1 here, with ``sigmoid_of_sum``; False keeps ``tanh_of_sum``.
        Some CPUs' tanh kernels cost several times their sigmoid (``_machine.measured_faster``)."""
        return False

    def sigmoid_of_sum(self, a: Tensor, b: Tensor, buffers: list) -> Tensor:
        """``sigmoid(a + b)`` (broadcast), as ``tanh_of_sum``; for adapters whose
        ``tanh_by_sigmoid`` can be True."""
        raise NotImplementedError(f"{self.name} has no sigmoid_of_sum (tanh_by_sigmoid is False)")

    def map_query_blocks(self, score_block: Callable[[Tensor], Tensor], queries: Tensor, step: int) -> Tensor:
        """``concat([score_block(queries[:, i : i + step]) for i in range(0, Q, step)], 1)``
        for queries (B, Q, h), only one block's intermediates alive at a time."""
        blocks = []
        n_queries = self.shape(queries)[1]
        for start in range(0, n_queries, step):
            blocks.append(score_block(queries[:, start : min(start + step, n_queries), :]))
            self.settle(blocks[-1])
        return self.concat(blocks, 1)

    def check_tensors(self, **tensors: Tensor) -> None:
        """TypeError unless every non-None argument is a tensor of this backend; by name."""
        _registry.check_framework(self.name, **tensors)

    def settle(self, x: Tensor) -> None:
        """Compute x now, in a lazy framework, so that what it was computed from can be freed
        (a no-op in eager frameworks and inside compiled or vectorised functions)."""

    def can_fuse(self, queries: Tensor, keys: Tensor, values: Tensor) -> bool:
        """Whether ``fused_attention`` takes these inputs (the strategies also require
        ``fused_min_scores``, no weights wanted and no dropout)."""
        return False

    def fused_attention(
        self, queries: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], scale: float
    ) -> Tensor:
        """The framework's fused kernel for softmax(scale Q K^T, masked) V; mask is None or
        boolean (B, 1|Q, K).  The strategies zero fully masked rows and padding themselves."""
        raise NotImplementedError(f"{self.name} has no fused attention kernel (can_fuse is False)")

    def visible_key_lengths(
        self, queries: Tensor, keys: Tensor, values: Tensor, lens: Tensor
    ) -> Optional[list]:
        """lens (B,) as Python numbers where ``attend_visible_keys`` takes these inputs (B, [H,]
        n, d) and pays for its loop over the sequences; None where it does not (the default)."""
        return None

    def attend_visible_keys(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        lengths: list,
        scale: float,
        need_weights: bool = True,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """(output, weights) of dot-product attention in which sequence b attends over its first
        lengths[b] keys only (lengths from ``visible_key_lengths``, clipped): the other keys'
        scores are never made, their weights are 0, and a sequence with none visible gives 0;
        with need_weights=False, (output, None).
        Where the visible scores of a row are not finite the answer may differ from ``core``'s
        (the strategies check the output)."""
        raise NotImplementedError(f"{self.name} has no attend_visible_keys (visible_key_lengths is None)")

    def additive_key_lengths(self, q_hidden: Tensor, k_hidden: Tensor, lens: Tensor) -> Optional[list]:
        """lens (B,) as Python numbers where the additive features of each sequence are made
        over its visible keys only (``strategies.additive_scores_over_visible_keys``): lengths
        in host memory, nothing tracing or compiling (a graph would bake them in), and where
        the loop over the sequences pays; None where not (the default)."""
        return None

    def softmax_owned(self, x: Tensor) -> Tensor:
        """``softmax`` of scores the core made itself and no longer needs: the result may
        take x's memory (where autograd does not need x)."""
        return self.softmax(x)

    def where_owned(self, mask: Tensor, x: Tensor, fill: float) -> Tensor:
        """``where`` for an x the core made itself, which may be filled in place."""
        return self.where(mask, x, fill)

    def host_lengths(self, x: Tensor, lens: Tensor) -> Optional[list]:
        """lens as (nested) Python numbers where reading them costs nothing and the core's
        own copies of x (B, ...) may be written directly (``fill_padding``); None where they
        are not on the host or must not be read (a device, autograd tracking x, a tracing
        compiler).  The strategies clip them (``clip_lengths``)."""
        return None

    def copy(self, x: Tensor) -> Tensor:
        """A new tensor equal to x, which the core may write into."""
        return x * 1

    def fill_padding(self, x: Tensor, lengths: list, fill: float, uniform: bool = False) -> Tensor:
        """x (B, [H,] Q, K), the core's own, with ``x[b, ..., lengths[b]:] = fill`` written in place, one
        slice per sequence (no pass over the visible scores); lengths from ``host_lengths``,
        clipped.  uniform: x holds softmax weights with one value per row in the padding,
        so a sequence whose padding already equals fill (0: exp underflowed) is skipped.
        This default needs slice assignment (numpy, torch, paddle)."""
        shape = self.shape(x)
        n_keys = shape[-1]
        # small x: writing every padding slice costs less than the test that skips some
        if uniform and math.prod(shape) >= SKIP_TEST_MIN_ELEMENTS:
            # `<=`, not `==`: paddle's float `==` has a tolerance (1e-28 == 0); NaN is not done
            done = (x[..., -1] <= fill).reshape(len(lengths), -1).all(1).tolist()
            lengths = [n_keys if ok and n > 0 else n for n, ok in zip(lengths, done)]
        for row, n in enumerate(lengths):
            if n < n_keys:
                x[row, ..., n:] = fill
        return x

    def zero_padded_rows(self, values: Tensor, lengths: list) -> Tensor:
        """values (B, [H,] K, v) with the rows ``>= lengths[b]`` zeroed, in a copy (slice
        assignment, as ``fill_padding``); values itself where no row is padding."""
        n_keys = self.shape(values)[-2]
        if all(n >= n_keys for n in lengths):
            return values
        values = self.copy(values)
        for row, n in enumerate(lengths):
            if n < n_keys:
                values[row, ..., n:, :] = 0.0
        return values

    def all_finite(self, x: Tensor) -> bool:
        """Whether x holds no NaN or inf (read on the host: only with ``host_lengths``)."""
        return math.isfinite(float(x.sum()))


# From this many weights the test for padding that is 0 already pays for itself.
SKIP_TEST_MIN_ELEMENTS = 1 << 14

REQUIRED = (
    "shape", "dtype_kind", "zeros", "any", "expand_dims", "matrix_transpose", "concat",
    "matmul", "matmul_t", "tanh", "softmax", "length_mask", "causal_mask", "logical_and",
    "split_heads", "merge_heads", "where", "lowest", "cast",
)  # fmt: skip


def adapter_problems(cls: type) -> List[str]:
    """What is wrong with an Ops subclass: a public member Ops does not declare (a misspelled
    override would never be called), a required primitive left undefined."""
    declared = set(dir(Ops))
    problems = [
        f"{klass.__name__}.{member} is not a member of protocol.Ops (misspelled?)"
        for klass in cls.__mro__
        if issubclass(klass, Ops) and klass is not Ops
        for member in vars(klass)
        if not member.startswith("_") and member not in declared
    ]
    problems += [
        f"{cls.__name__} lacks the required primitive {member}"
        for member in REQUIRED
        if getattr(cls, member) is getattr(Ops, member)
    ]
    if not cls.name:
        problems.append(f"{cls.__name__} has no name")
    return problems


def dtype_kind_by_dtype(kind_of: Callable[[Any], str]) -> Callable[[Ops, Tensor], str]:
    """An ``Ops.dtype_kind`` that asks ``kind_of(dtype)`` once per dtype: the checks read the
    kind of every argument on every call, and some frameworks' dtype predicates cost a few us."""
    kinds: dict = {}

    def dtype_kind(self: Ops, x: Tensor) -> str:
        kind = kinds.get(x.dtype)
        if kind is None:
            kind = kinds[x.dtype] = kind_of(x.dtype)
        return kind

    return dtype_kind


def per_row(lens: Tensor) -> Tensor:
    """Lengths (B,) as (B, 1, 1), (B, Q) as (B, Q, 1): against positions (K,) they give the
    (B, 1|Q, K) mask of ``length_mask``."""
    return lens[:, None, None] if len(lens.shape) == 1 else lens[:, :, None]


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


def layer_exports(backend: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``multiattn.backends.<backend>`` that hands out the layer
    classes of ``multiattn.layers.<backend>`` on first use (no import cycle)."""

    def __getattr__(attr: str) -> Any:
        if attr in LAYER_EXPORTS:
            import importlib

            return getattr(importlib.import_module(f"multiattn.layers.{backend}"), attr)
        raise AttributeError(f"module 'multiattn.backends.{backend}' has no attribute {attr!r}")

    return __getattr__
