"""Ring attention inside jax's ``shard_map``: the shards passed on by ``lax.ppermute`` over the
mesh axis; each step's block picked by the device's place on the axis (``lax.switch`` over the
places, so every block's positions are known when it is traced); differentiated by jax
(``ppermute``'s transpose sends the gradients back around the ring)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import state
from .._registry import get_backend
from ..distributed.ring import Ring, merge


def ring_attention(q, k, v, causal, valid_lens, mask_mod, score_mod, scale, layout, axis_name):
    world = lax.axis_size(axis_name)
    if k.shape[-2] != q.shape[-2] or v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"ring_attention: q, k and v must hold this device's shard, the same positions, got "
            f"q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if valid_lens is not None:
        valid_lens = jnp.asarray(valid_lens)
    ops = get_backend("jax").ops
    ring = Ring(
        ops, layout, [q.shape[-2]] * world, q.shape[0], causal, valid_lens, mask_mod, score_mod, scale
    )
    place = lax.axis_index(axis_name)
    to_next = [(r, (r + 1) % world) for r in range(world)]
    receives = [ring.transfers(r)[0] for r in range(world)]
    found = None
    for step in range(world):
        blocks = [_block(ring, r, ring.source(r, step)) for r in range(world)]
        if any(b is not None for b in blocks):
            shapes = jax.eval_shape(next(b for b in blocks if b is not None), q, k, v)
            empty = functools.partial(_nothing, shapes, axis_name)
            part = lax.switch(place, [empty if b is None else b for b in blocks], q, k, v)
            found = merge(ops, found, part)
        if step < world - 1 and any(r[step] for r in receives):
            k, v = lax.ppermute(k, axis_name, to_next), lax.ppermute(v, axis_name, to_next)
    if found is None:
        return jnp.zeros(q.shape[:-1] + (v.shape[-1],), q.dtype)
    return found[0]


def _block(ring: Ring, rank: int, source: int):
    """The block's state as a function of (q, k, v), None where no key of it may be seen."""
    if not ring.visits(rank, source):
        return None

    def block(q, k, v):
        part = ring.block(rank, source, q, k, v)
        if part is None:
            out = jnp.zeros(q.shape[:-1] + (v.shape[-1],), q.dtype)
            return out, out[..., 0] + state.NEG_INF
        return part

    return block


def _nothing(shapes, axis_name, *_):
    """The state of rows that see nothing (out 0, lse -inf), varying over the axis as the
    other places' blocks are."""
    out, lse = (jnp.full(s.shape, fill, s.dtype) for s, fill in zip(shapes, (0.0, -jnp.inf)))
    if hasattr(lax, "pcast"):
        out, lse = (lax.pcast(x, (axis_name,), to="varying") for x in (out, lse))
    return out, lse
