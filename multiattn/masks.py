"""What hides a key from a query, as one value from the public API to the core."""

from __future__ import annotations

from typing import Any

Tensor = Any


class Masks:
    """Lengths (B,) or (B, Q) (key j visible for j < length), a boolean mask broadcastable to
    the scores (True: may attend), causality (key j visible from query i for j <= i); a key is
    visible only where all of them allow it.  Built by ``validation.gather_masks``; what the
    steps ask of it is answered once, here (``none``, ``only_lengths``,
    ``one_length_per_sequence``: lengths alone, one per sequence (B,), so that every query of
    a sequence sees the same keys)."""

    __slots__ = ("valid_lens", "attention_mask", "causal", "none", "only_lengths", "one_length_per_sequence")

    def __init__(
        self, valid_lens: Tensor = None, attention_mask: Tensor = None, causal: bool = False
    ) -> None:
        self.valid_lens, self.attention_mask, self.causal = valid_lens, attention_mask, causal
        others = attention_mask is not None or causal
        self.none = valid_lens is None and not others
        self.only_lengths = valid_lens is not None and not others
        self.one_length_per_sequence = self.only_lengths and len(valid_lens.shape) == 1

    def __repr__(self) -> str:
        lens, mask = self.valid_lens, self.attention_mask
        return f"Masks(valid_lens={lens!r}, attention_mask={mask!r}, causal={self.causal})"


NO_MASKS = Masks()
