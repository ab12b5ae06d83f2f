"""Each backend's tuning, as data: the sizes and choices ``benchmarks/RESULTS.md`` measured best
for it, which the core reads through ``of(ops)``; an adapter declares no tuning of its own.

Tests and benchmarks change an entry's fields (``monkeypatch.setattr(tuning.of(ops), ...)``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from ._machine import l2_cache_bytes


@dataclasses.dataclass
class Tuning:
    # a block's scores fill this many L2 caches (``blockwise.block_size_for``): where a compiler
    # fuses a block's passes and each compiled call has a fixed cost, or where larger blocks
    # measured faster (paddle: benchmarks/RESULTS.md)
    block_area: int = 1
    # each block step has a high fixed cost (a compiled call's dispatch, a namespace's per-call
    # checks): a mask function favours fewer, larger blocks (``MaskFunction.block_side``)
    costly_steps: bool = False
    # below this many scores every offer of ``dot_product_attend`` and ``masked_softmax``
    # declines, so ``specialise.run`` does not ask them (0: always ask)
    specialised_from: int = 0
    # elements of one block of additive features (the extra memory of the additive scores)
    feature_block_elements: int = 1 << 20
    # additive features laid out as d2l does, (B, Q, K, h), instead of keys innermost
    # (B, Q, h, K): for a compiler that fuses the w_v reduction best over the innermost axis
    hiddens_innermost: bool = False
    # a full block's weights and lse by ``Ops.softmax_with_lse`` (the framework's fused softmax)
    # rather than by the max, exp and sum of ``state.block_sums``
    fused_softmax: bool = False


TUNING: Dict[str, Tuning] = {
    "numpy": Tuning(),
    # one block of float32 additive features fills one core's L2: the sum, the activation and
    # the w_v product stay in it; specialised_from: the least of its offers' thresholds, set by
    # ``backends.torch`` (``least_threshold``)
    "torch": Tuning(feature_block_elements=l2_cache_bytes() // 4),
    # fewer, larger fused blocks; each step a compiled call's dispatch; larger additive blocks
    # (each eager op's high fixed cost)
    "tensorflow": Tuning(block_area=16, costly_steps=True, feature_block_elements=1 << 22),
    # fewer, larger fused blocks; a jitted call's dispatch; XLA fuses the additive reduction
    # best over the hiddens
    "jax": Tuning(block_area=4, costly_steps=True, hiddens_innermost=True),
    "paddle": Tuning(block_area=2),
    "mlx": Tuning(),
    # each op finds its namespace (array-api-compat), strict mode checks it
    "array_api": Tuning(costly_steps=True),
    # its fused softmax is faster than its max, exp and sum (long sequences)
    "mxnet": Tuning(fused_softmax=True),
}


def of(ops: Any) -> Tuning:
    """The tuning of ops' backend (a new default entry for a backend the table lacks)."""
    found = TUNING.get(ops.name)
    if found is None:
        found = TUNING[ops.name] = Tuning()
    return found
