"""The tensor-ops protocol: the only thing the core math asks of a framework.

Each adapter in ``multiattn.backends`` provides one object with these methods.
They are primitives, not attention: the scoring math lives once, in
``multiattn.core``.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, Tuple

Tensor = Any
Shape = Tuple[Any, ...]  # ints; None where a traced/graph dimension is unknown


class Ops(Protocol):
    """The primitives every adapter implements.  The optional fast paths are in
    ``OptionalOps``: the core uses one when the adapter has it, else the same math
    from these."""

    name: str  # backend name, as in the registry

    def shape(self, x: Tensor) -> Shape:
        """The shape as a tuple (None for dimensions unknown until run time)."""

    def dtype_kind(self, x: Tensor) -> str:
        """NumPy's kind letter of x's dtype: 'b' bool, 'i'/'u' integer, 'f' float, 'c' complex."""

    def zeros(self, shape: Shape, like: Tensor) -> Tensor:
        """Zeros of ``shape`` in like's dtype, on like's device."""

    def any(self, mask: Tensor, axis: int) -> Tensor:
        """Logical or over one axis of a boolean tensor, the axis kept (size 1)."""

    def expand_dims(self, x: Tensor, axis: int) -> Tensor: ...

    def matrix_transpose(self, x: Tensor) -> Tensor:
        """x with its last two axes swapped, laid out row-major where the framework lets
        the caller see layouts (the core runs elementwise passes over it)."""

    def concat(self, xs: Sequence[Tensor], axis: int) -> Tensor: ...

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """Batched ``a @ b`` with NumPy's matmul broadcasting (b may be 1-D)."""

    def matmul_t(self, a: Tensor, b: Tensor) -> Tensor:
        """Batched ``a @ b^T``, the transpose over b's last two axes."""

    def tanh(self, x: Tensor) -> Tensor: ...

    def softmax(self, x: Tensor) -> Tensor:
        """Softmax over the last axis, accumulated in at least float32, in x's dtype."""

    def length_mask(self, x: Tensor, lens: Tensor, axis: int = -1) -> Tensor:
        """Boolean ``arange(x.shape[axis]) < lens`` of shape (B, 1, K) or (B, Q, K), on x's device.

        lens has shape (B,) (one length per batch element: (B, 1, K)) or (B, Q),
        any integer or float dtype; the comparison is in a dtype both sides share.
        """

    def where(self, mask: Tensor, x: Tensor, fill: float) -> Tensor:
        """``x`` where mask is true, the scalar ``fill`` elsewhere; never in place."""

    def lowest(self, x: Tensor) -> float:
        """The most negative finite value of x's dtype."""


class OptionalOps(Protocol):
    """Fast paths an adapter may offer, any subset (the core looks each up with getattr).
    Each must give what the required primitives would, within the dtype's rounding."""

    # Elements of one block of additive features (core.FEATURE_BLOCK_ELEMENTS when absent):
    # cache-sized for an eager CPU framework, larger where ops cost more.
    feature_block_elements: int

    # Lay the additive features out as d2l does, (B, Q, K, h), instead of keys innermost,
    # (B, Q, h, K) (False when absent): for a compiler that fuses the w_v reduction best
    # over the innermost axis.
    hiddens_innermost: bool

    # Fewest scores (batch * queries * keys) for which ``fused_attention`` is worth its
    # fixed cost (0 when absent): below it the core runs the unfused math.
    fused_min_scores: int

    def scaled_matmul_t(self, a: Tensor, b: Tensor, scale: float) -> Tensor:
        """``scale * (a @ b^T)`` for 3-D a and b, the scale applied inside the
        product (e.g. a GEMM's alpha) rather than in a pass of its own."""

    def tanh_of_sum(self, a: Tensor, b: Tensor, dead: Tensor) -> Tensor:
        """``tanh(a + b)`` (broadcast).  dead is None or this method's result of the
        previous call, no longer used by the core: the adapter may write the new result
        into its memory (one cache-resident buffer for all additive blocks)."""

    def map_query_blocks(self, score_block: Any, queries: Tensor, step: int) -> Optional[Tensor]:
        """``concat([score_block(queries[:, i : i + step]) for i in range(0, Q, step)], 1)``
        for queries (B, Q, h) and score_block (B, step, h) -> (B, step, K), run so that only
        one block's intermediates are alive at a time (e.g. a compiled loop); None where
        the core's Python loop is the better way."""

    def settle(self, x: Tensor) -> None:
        """Compute x now, in a lazy framework, so that what it was computed from can be
        freed before the next additive block is built; do nothing where that is not
        allowed (inside a compiled or vectorised function)."""

    def fused_attention(
        self, queries: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float
    ) -> Tensor:
        """The framework's fused kernel for softmax(scale Q K^T, masked) V.

        mask is None or boolean (B, 1|Q, K).  The core zeroes fully masked rows
        and padding itself; the kernel may return None where it cannot take these
        inputs.  Adapters without a fused kernel do not define it.
        """

    def where_owned(self, mask: Tensor, x: Tensor, fill: float) -> Tensor:
        """``where`` for an x the core made itself, which may be filled in place
        (when autograd does not need it).  Adapters without a faster way omit it."""

    def softmax_owned(self, x: Tensor) -> Tensor:
        """``softmax`` of an x the core made itself and no longer needs: the adapter may
        write the result into x's memory (when autograd does not need x), saving a
        (B, Q, K) allocation and its first-touch cost.  Adapters without one omit it."""

    def host_lengths(self, x: Tensor, lens: Tensor) -> Optional[list]:
        """lens (B,) as a list of Python numbers where reading them costs nothing (host
        memory) and the core may write x (B, ...) slice by slice: one slice per sequence
        then beats a masked pass (the core clips, rounds and writes the slices).  None
        otherwise: per-query lengths, a device, autograd tracking x, a tracing compiler,
        or sizes where the masked pass is as fast.  Adapters with it also define ``copy``."""

    def copy(self, x: Tensor) -> Tensor:
        """A new tensor equal to x (the core then writes into it)."""

    def fill_padding(
        self, x: Tensor, lens: Tensor, fill: float, uniform: bool = False, owned: bool = False
    ) -> Optional[Tensor]:
        """x with the positions ``>= lens`` of its last axis set to ``fill``, by the
        framework's own kernel; None where that is not faster than a masked pass (the core
        then uses ``length_mask`` and ``where``).  owned: x is the core's own, which the
        adapter may write into and return; otherwise x is the caller's: a new tensor (or x
        itself where nothing changes).  For frameworks whose ``where`` is slow next to such
        a kernel (mxnet's sequence mask); host lengths are the other way (``host_lengths``).

        lens is checked as for ``length_mask`` (lengths <= 0 mask the whole row, lengths
        past the end mask nothing).  uniform: the caller guarantees that the padding of a
        row holds one value, so a row whose padding already equals ``fill`` may be skipped.
        """

    def zero_padded_rows(self, values: Tensor, lens: Tensor) -> Optional[Tensor]:
        """values (B, K, v) with the rows ``>= lens`` zeroed (a new tensor, or values itself
        where no row is padding), lens as for ``length_mask`` (per-query lengths: a row
        is kept if any query may see it); None where the masked ``where`` is as fast."""
