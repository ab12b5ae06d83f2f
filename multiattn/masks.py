"""What hides a key from a query, as one value from the public API to the core."""

from __future__ import annotations

from typing import Any, NamedTuple

Tensor = Any


class Masks(NamedTuple):
    """Lengths (B,) or (B, Q) (key j visible for j < length), a boolean mask broadcastable to
    the scores (True: may attend), causality (key j visible from query i for j <= i); a key is
    visible only where all of them allow it.  Built by ``validation.gather_masks``."""

    valid_lens: Tensor = None
    attention_mask: Tensor = None
    causal: bool = False

    @property
    def none(self) -> bool:
        return self.valid_lens is None and self.attention_mask is None and not self.causal

    @property
    def only_lengths(self) -> bool:
        return self.valid_lens is not None and self.attention_mask is None and not self.causal

    @property
    def one_length_per_sequence(self) -> bool:
        """Lengths alone, one per sequence (B,): every query of a sequence sees the same keys."""
        return self.only_lengths and len(self.valid_lens.shape) == 1


NO_MASKS = Masks()
