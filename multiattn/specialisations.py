"""The specialisations an adapter may offer: one method per way of doing a core step faster.

Each method takes the step's inputs and returns either a function of no arguments that does
the step (``multiattn.fast_paths`` has the framework-free halves) or a short string saying
why it declines; every threshold it uses is decided inside it.  The defaults here decline,
but for the additive scores in blocks, which every adapter offers from
``tuning.Tuning.feature_block_elements`` features on.  ``specialise.ORDER`` says which are tried for
which step, in which order; docs/architecture.md lists who offers what (a test keeps the
two in step).  The members after the offers are the parts of the additive blocks.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from . import fast_paths, tuning
from .masks import Masks

Tensor = Any
Offer = Any  # a function of no arguments that does the step, or a str: why not
NOT_OFFERED = "not offered by this backend"


class Specialisations:
    """The optional half of ``adapter.Ops``: offers, each declining by default."""

    # -- step ``dot_product_attend``: scores, masked softmax and pooling at once ---------------

    def attend_over_visible_keys(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        masks: Masks,
        scale: float,
        dropout: Any,
        need_weights: bool,
    ) -> Offer:
        """Each sequence over its visible keys only (one length per sequence): the padded keys'
        scores are never made.  The function gives (output, weights or None), or None where it
        finds the visible scores not finite (the core's formula then runs)."""
        return NOT_OFFERED

    def attend_fused(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        masks: Masks,
        scale: float,
        dropout: Any,
        need_weights: bool,
    ) -> Offer:
        """The framework's fused kernel (``fast_paths.fused_attention``): no weights, no dropout."""
        return NOT_OFFERED

    # -- step ``attend_past_memory``: no weights, scores past the budget ----------------------

    def attend_by_flash_kernel(
        self, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks, scale: float,
        need_lse: bool = False,
    ) -> Offer:  # fmt: skip
        """(output, lse (B, [H,] Q) or None) from a framework's kernel that, like the core's
        blocks (``blockwise``), never holds the scores whole and is faster than them; with
        need_lse, only where the kernel gives the lse."""
        return NOT_OFFERED

    # -- step ``attend_in_chunks``: arrays whose chunks are tasks (dask) -----------------------

    def attend_over_chunks(
        self, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks, scale: float, score_mod: Any,
        block_size: Any,
    ) -> Offer:  # fmt: skip
        """(output, lse) as lazy arrays: each (batch, query, key) chunk one task giving its
        partial state by the chunks' own backend, merged by a tree reduction
        (``sharding.chunked``); no weights."""
        return NOT_OFFERED

    # -- step ``masked_softmax``: the weights, and the values with hidden rows zeroed ----------

    def masked_softmax_writing_padding(
        self, scores: Tensor, values: Optional[Tensor], masks: Masks, owned: bool
    ) -> Offer:
        """One length per sequence read on the host: the padding written slice by slice
        (``fast_paths.softmax_writing_padding``) instead of two masked passes over every score."""
        return NOT_OFFERED

    def masked_softmax_in_scores_memory(
        self, scores: Tensor, values: Optional[Tensor], masks: Masks, owned: bool
    ) -> Offer:
        """The core's formula with each pass writing into the scores the core owns
        (``fast_paths.offer_in_scores_memory``)."""
        return NOT_OFFERED

    # -- step ``additive_scores`` ---------------------------------------------------------------

    def additive_scores_over_visible_keys(
        self, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor, masks: Masks
    ) -> Offer:
        """No features for the keys no query of a sequence may see
        (``fast_paths.offer_additive_over_visible_keys``)."""
        return NOT_OFFERED

    def additive_scores_in_blocks(
        self, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor, masks: Masks
    ) -> Offer:
        """The features in blocks of queries of at most ``tuning.Tuning.feature_block_elements``, so that the
        extra memory stays one block (``fast_paths.additive_scores_in_blocks``)."""
        batch, n_queries, hiddens = self.shape(q_hidden)
        per_query = (batch or 1) * (hiddens or 1) * (self.shape(k_hidden)[1] or 1)
        block = tuning.of(self).feature_block_elements
        if n_queries is None or n_queries * per_query <= block:
            return "the features fit in one block"
        step = max(1, block // per_query)
        return lambda: fast_paths.additive_scores_in_blocks(self, q_hidden, k_hidden, w_v, step)

    # -- the parts of the additive blocks ------------------------------------------------------

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

    # the primitives these defaults use (protocol.Primitives defines them)
    name: str
    shape: Callable[..., Any]
    tanh: Callable[..., Any]
    concat: Callable[..., Any]
    settle: Callable[..., Any]


OFFERS = (
    "attend_by_flash_kernel",
    "attend_over_chunks",
    "attend_over_visible_keys",
    "attend_fused",
    "masked_softmax_writing_padding",
    "masked_softmax_in_scores_memory",
    "additive_scores_over_visible_keys",
    "additive_scores_in_blocks",
)
