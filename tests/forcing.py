"""How the tests force a specialisation at the matrix's small sizes."""

from __future__ import annotations

from multiattn import tuning


def lower_thresholds(module, monkeypatch, **thresholds):
    """Set an adapter module's thresholds (those it has); where its ops skip every offer below
    the least of them (torch's ``specialised_from``), that follows."""
    for constant, value in thresholds.items():
        if hasattr(module, constant):
            monkeypatch.setattr(module, constant, value)
    if hasattr(module, "least_threshold"):
        monkeypatch.setattr(tuning.of(module.ops), "specialised_from", module.least_threshold())


def force_fused(bk, monkeypatch):
    """Fused kernels at every size, on the CPU too (the adapters' own thresholds)."""
    lower_thresholds(bk.module, monkeypatch, FUSED_ON_CPU=True, FUSED_MIN_SCORES=0)


def force_blocks(monkeypatch, block_size=2):
    """Every call without weights or dropout in blocks of block_size, the core's own
    (``multiattn.blockwise``; no framework kernel in its place), however small the scores.
    Returns the list of (block_size, query count, key count) of each call in blocks."""
    from multiattn import blockwise, specialise

    calls = []
    real = blockwise.forward

    def recorded(ops, bmap, queries, keys, values, masks, **kwargs):
        calls.append((bmap.block, ops.shape(queries)[-2], ops.shape(keys)[-2]))
        return real(ops, bmap, queries, keys, values, masks, **kwargs)

    monkeypatch.setattr(blockwise, "automatic_block_size", lambda ops, q, k, *args, **options: block_size)
    monkeypatch.setattr(blockwise, "forward", recorded)
    monkeypatch.setitem(specialise._ASK, "attend_past_memory", ())
    return calls
