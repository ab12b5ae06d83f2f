"""Ring attention over ``torch.distributed``: the shards exchanged by point-to-point sends and
receives (gloo on CPU, NCCL on GPUs), the next shard's exchange started before the current
block is computed; the backward a custom autograd function that recomputes each block's state
and passes dk, dv around the ring with the shard they belong to."""

from __future__ import annotations

import datetime
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import state
from .._registry import get_backend
from . import Ring, merge

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LAYOUTS = ("contiguous", "zigzag")


class Exchange:
    """This rank's place in the group and its exchanges with its neighbours, each bounded by
    the timeout."""

    def __init__(self, group: Any, timeout: Optional[float]) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ring_attention on torch needs torch.distributed initialised first "
                "(torch.distributed.init_process_group, e.g. under torchrun)"
            )
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        self.group, self.timeout = group, None if timeout is None else datetime.timedelta(seconds=timeout)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        place = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self.next, self.previous = place((self.rank + 1) % self.world), place((self.rank - 1) % self.world)

    def wait(self, works: List[Any], what: str) -> None:
        try:
            for work in works:
                work.wait() if self.timeout is None else work.wait(self.timeout)
        except RuntimeError as error:
            raise RuntimeError(
                f"ring_attention: rank {self.rank} of {self.world}: {what} failed or timed out "
                f"(timeout {self.timeout}); another rank may have failed or called with other "
                f"arguments: {error}"
            ) from error

    def start(self, send: Sequence[torch.Tensor], receive: Sequence[torch.Tensor]) -> List[Any]:
        """Sends to the next rank and receives from the previous one, started."""
        ops = [dist.P2POp(dist.isend, x.contiguous(), self.next, self.group) for x in send]
        ops += [dist.P2POp(dist.irecv, x, self.previous, self.group) for x in receive]
        return dist.batch_isend_irecv(ops) if ops else []

    def agree(self, q, k, v, valid_lens, layout: str, causal: bool) -> List[int]:
        """Every rank's shard length, after checking that every rank called alike: the same
        error on every rank where not."""
        described = [q.dim(), *q.shape[:-2], q.shape[-1], *k.shape[:-2], k.shape[-1], v.shape[-1]]
        mine = [k.shape[-2], len(described), *described, _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1]
        mine += [_LAYOUTS.index(layout), int(causal), valid_lens is None]
        local = torch.tensor(mine + [0] * (16 - len(mine)), dtype=torch.int64)
        found = [torch.zeros_like(local) for _ in range(self.world)]
        self.wait([dist.all_gather(found, local, group=self.group, async_op=True)], "the shapes' check")
        rows = [f.tolist() for f in found]
        differ = [r for r in range(self.world) if rows[r][1:] != rows[0][1:]]
        if differ:
            raise ValueError(
                f"ring_attention: every rank must call with the same batch, heads, widths, dtype, layout, "
                f"causal and valid_lens given or not; ranks {differ} differ from rank 0 "
                f"(q {tuple(q.shape)}, k {tuple(k.shape)} here)"
            )
        return [r[0] for r in rows]


def ring_attention(q, k, v, causal, valid_lens, mask_mod, score_mod, scale, layout, group, timeout):
    exchange = Exchange(group, timeout)
    if k.shape[-2] != q.shape[-2] or v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"ring_attention: q, k and v must hold this rank's shard, the same positions, got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    sizes = exchange.agree(q, k, v, valid_lens, layout, causal)
    if valid_lens is not None:
        valid_lens = torch.as_tensor(valid_lens, device=q.device)
    ops = get_backend("torch").ops
    ring = Ring(ops, layout, sizes, q.shape[0], causal, valid_lens, mask_mod, score_mod, scale)
    return _RingAttention.apply(q, k, v, ring, exchange)


def _shaped(x: torch.Tensor, positions: int) -> torch.Tensor:
    return x.new_empty(tuple(x.shape[:-2]) + (positions, x.shape[-1]))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, exchange: Exchange):
        rank, world, ops = exchange.rank, exchange.world, ring.ops
        receive, send = ring.transfers(rank)
        held, found = (k, v), None
        for step in range(world):
            works, incoming = [], held
            if step < world - 1 and (receive[step] or send[step]):
                positions = ring.sizes[ring.source(rank, step + 1)]
                incoming = tuple(_shaped(x, positions) for x in held) if receive[step] else held
                works = exchange.start(held if send[step] else (), incoming if receive[step] else ())
            found = merge(ops, found, ring.block(rank, ring.source(rank, step), q, *held))
            exchange.wait(works, f"the exchange of step {step}")
            if step < world - 1 and not receive[step]:
                break  # no later step of this rank sees any key
            held = incoming
        if found is None:
            out = q.new_zeros(tuple(q.shape[:-1]) + (v.shape[-1],))
            found = out, out[..., 0] + state.NEG_INF
        out, lse = found
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.exchange = ring, exchange
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, exchange = ctx.ring, ctx.exchange
        rank, world = exchange.rank, exchange.world
        d_q, held = torch.zeros_like(q), (k, v, torch.zeros_like(k), torch.zeros_like(v))
        # w_s = exp(lse_s - lse): each block's weight in the output (0 where lse is -inf)
        lse = torch.where(lse == state.NEG_INF, 0.0, lse)
        for step in range(world):
            works, incoming = [], held[:2]
            if step < world - 1:  # the next keys and values travel while this block is computed
                positions = ring.sizes[ring.source(rank, step + 1)]
                incoming = tuple(_shaped(x, positions) for x in held[:2])
                works = exchange.start(held[:2], incoming)
            grads = _block_gradients(ring, rank, ring.source(rank, step), q, held[0], held[1], d_out, out, lse)
            d_k, d_v = held[2:]
            if grads is not None:
                d_q, d_k, d_v = d_q + grads[0], d_k + grads[1], d_v + grads[2]
            # dk, dv go with their shard: after the last step, home to the rank that owns it
            gradients = tuple(torch.empty_like(x) for x in (incoming if step < world - 1 else (k, v)))
            works += exchange.start((d_k, d_v), gradients)
            exchange.wait(works, f"the backward's exchange of step {step}")
            held = incoming + gradients
        return d_q, held[2], held[3], None, None


def _block_gradients(ring, rank, source, q, k, v, d_out, out, lse):
    """(dq, dk, dv) of one block: its state recomputed, differentiated with the cotangents of
    its out and lse in the merged output (w dO, and w <dO, o_s - O> for the lse)."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        part = ring.block(rank, source, *leaves)
        if part is None:
            return None
        o_s, lse_s = part
        w = torch.where(lse_s == state.NEG_INF, 0.0, torch.exp(lse_s - lse))
        d_lse = w * (d_out * (o_s.detach() - out)).sum(-1)
        found = torch.autograd.grad((o_s, lse_s), leaves, (w[..., None] * d_out, d_lse), allow_unused=True)
        return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, found))
