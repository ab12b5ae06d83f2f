"""How the tests force a specialisation at the matrix's small sizes."""

from __future__ import annotations


def force_fused(bk, monkeypatch):
    """Fused kernels at every size, on the CPU too (the adapters' own thresholds)."""
    for constant, value in (("FUSED_ON_CPU", True), ("FUSED_MIN_SCORES", 0)):
        if hasattr(bk.module, constant):
            monkeypatch.setattr(bk.module, constant, value)
