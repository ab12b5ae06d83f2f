"""Ring attention over ``torch.distributed``: the keys and values sent on in blocks by
point-to-point sends and receives (gloo on CPU, NCCL on GPUs), the next block's receive started
before the current block is computed; the backward a custom autograd function that recomputes
each block's state and passes dk, dv around the ring with the block they belong to."""

from __future__ import annotations

import datetime
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import state
from .._registry import get_backend
from ..distributed.ring import LAYOUTS, Ring
from .torch import flash_with_lse, flash_with_lse_declines

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
        self.sent: List[Any] = []

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

    def send(self, tensors: Sequence[torch.Tensor], tag: int) -> None:
        """Sends to the next rank, started; waited for at ``wait_for_sends`` (the next rank receives
        them a step later).  Row by row (a sequence's head): a block of a shard's rows is
        sent from the shard's memory, not a copy."""
        rows = _rows(tensors)
        for i, x in enumerate(rows):
            self.sent.append((dist.isend(x, self.next, self.group, _wrapped(tag * len(rows) + i)), x))

    def receive(self, buffers: Sequence[torch.Tensor], tag: int) -> List[Any]:
        """Receives from the previous rank into buffers (contiguous), started."""
        rows = _rows(buffers)
        return [
            dist.irecv(x, self.previous, self.group, _wrapped(tag * len(rows) + i))
            for i, x in enumerate(rows)
        ]

    def wait_for_sends(self) -> None:
        sent, self.sent = self.sent, []
        self.wait([work for work, _ in sent], "a send to the next rank")

    def agree(self, q, k, v, valid_lens, layout: str, causal: bool) -> List[int]:
        """Every rank's shard length, after checking that every rank called alike: the same
        error on every rank where not."""
        described = [q.dim(), *q.shape[:-2], q.shape[-1], *k.shape[:-2], k.shape[-1], v.shape[-1]]
        mine = [k.shape[-2], len(described), *described, _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1]
        mine += [LAYOUTS.index(layout), int(causal), valid_lens is None]
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
    ring = Ring(ops, layout, sizes, q.shape[0], causal, valid_lens, mask_mod, score_mod, scale, _flash)
    return _RingAttention.apply(q, k, v, ring, exchange)


def _rows(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each tensor's (positions, width) matrices, one per sequence and head: views where the
    tensor is a block of a contiguous shard's positions."""
    rows = []
    for x in tensors:
        rows += [m if m.is_contiguous() else m.contiguous() for m in x.reshape(-1, *x.shape[-2:]).unbind(0)]
    return rows


def _tag(ring: Ring, source: int, block: int, home: bool = False) -> int:
    """The messages of a block of source's keys (home: its gradients' last hop, to source)."""
    return (source * len(ring.key_blocks(0)) + block) * 2 + home


def _wrapped(tag: int) -> int:
    return tag % (1 << 30)  # a C int; messages between two ranks are also matched in order


def _new(x: torch.Tensor, positions: int) -> torch.Tensor:
    return x.new_empty(tuple(x.shape[:-2]) + (positions, x.shape[-1]))


class _RingAttention(torch.autograd.Function):
    """The keys and values travel in blocks (``Ring.key_blocks``): a rank receives the next
    block while it computes the current one, passes each on once it is used, and holds a few
    blocks beside its own shard, not a second shard (where it passes nothing on)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, exchange: Exchange):
        rank, world, ops = exchange.rank, exchange.world, ring.ops
        receive, send = ring.transfers(rank)
        steps = [0] + [s + 1 for s in range(world - 1) if all(receive[: s + 1])]
        sequence = [
            (s, j, block) for s in steps for j, block in enumerate(ring.key_blocks(ring.source(rank, s)))
        ]
        out = q.new_zeros(tuple(q.shape[:-1]) + (v.shape[-1],))
        lse = torch.full(q.shape[:-1], state.NEG_INF, dtype=_lse_dtype(q), device=q.device)

        def fetch(item):  # (tensors, receives pending)
            step, j, (at, size, _) = item
            if step == 0:
                return (k[..., at : at + size, :], v[..., at : at + size, :]), []
            buffers = (_new(k, size), _new(v, size))
            return buffers, exchange.receive(buffers, _tag(ring, ring.source(rank, step), j))

        current = fetch(sequence[0])
        for i, (step, j, block) in enumerate(sequence):
            following = fetch(sequence[i + 1]) if i + 1 < len(sequence) else None
            exchange.wait(current[1], f"receiving step {step}'s keys")
            tensors = current[0]
            if step < world - 1 and send[step]:
                exchange.send(tensors, _tag(ring, ring.source(rank, step), j))
            for row, part in ring.pieces(rank, q, *tensors, [(0, block[1], block[2])]):
                rows = slice(row, row + part[0].shape[-2])
                merged = state.combine(ops, [(out[..., rows, :], lse[..., rows]), part])
                out[..., rows, :], lse[..., rows] = merged  # in place: the shard's output held once
            current = following
        exchange.wait_for_sends()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.exchange = ring, exchange
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, exchange = ctx.ring, ctx.exchange
        rank, world = exchange.rank, exchange.world
        # w_s = exp(lse_s - lse): each block's weight in the output (0 where lse is -inf)
        lse = torch.where(lse == state.NEG_INF, 0.0, lse)
        d_q, d_k, d_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        sequence = [
            (s, j, block)
            for s in range(world)
            for j, block in enumerate(ring.key_blocks(ring.source(rank, s)))
        ]

        def fetch(item):  # each block travels with its dk, dv so far
            step, j, (at, size, _) = item
            if step == 0:
                kv = (k[..., at : at + size, :], v[..., at : at + size, :])
                return kv + tuple(torch.zeros_like(x) for x in kv), []
            buffers = (_new(k, size), _new(v, size), _new(k, size), _new(v, size))
            return buffers, exchange.receive(buffers, _tag(ring, ring.source(rank, step), j))

        current = fetch(sequence[0])
        for i, (step, j, block) in enumerate(sequence):
            following = fetch(sequence[i + 1]) if i + 1 < len(sequence) else None
            exchange.wait(current[1], f"receiving step {step}'s keys in the backward")
            k_b, v_b, dk_b, dv_b = current[0]
            grads = _block_gradients(ring, rank, q, k_b, v_b, block, d_out, out, lse)
            if grads is not None:
                d_q, dk_b, dv_b = d_q + grads[0], dk_b + grads[1], dv_b + grads[2]
            source = ring.source(rank, step)
            if step < world - 1:
                exchange.send((k_b, v_b, dk_b, dv_b), _tag(ring, source, j))
            else:  # the last hop: home to the rank that owns these keys
                exchange.send((dk_b, dv_b), _tag(ring, source, j, home=True))
            current = following
        for j, (at, size, _) in enumerate(ring.key_blocks(rank)):
            buffers = (d_k[..., at : at + size, :], d_v[..., at : at + size, :])
            received = (torch.empty_like(buffers[0]), torch.empty_like(buffers[1]))
            exchange.wait(
                exchange.receive(received, _tag(ring, rank, j, home=True)), "receiving the gradients"
            )
            buffers[0].copy_(received[0])
            buffers[1].copy_(received[1])
        exchange.wait_for_sends()
        return d_q, d_k, d_v, None, None


def _flash(q, k, v, causal, scale):
    """(out, lse) of a block by SDPA's CPU flash kernel, else None (its lse has no gradient:
    not where autograd records)."""
    return None if flash_with_lse_declines(q, k, v) else flash_with_lse(q, k, v, causal, scale)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _block_gradients(ring, rank, q, k, v, block, d_out, out, lse):
    """(dq, dk, dv) of one block of keys, None where no query sees it: each chunk's state
    recomputed and differentiated with the cotangents of its out and lse in the merged output
    (w dO, and w <dO, o_s - O> for the lse, w = exp(lse_s - lse))."""
    found = None
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        for row, (o_s, lse_s) in ring.pieces(rank, *leaves, [(0, block[1], block[2])]):
            rows = slice(row, row + o_s.shape[-2])
            w = torch.where(lse_s == state.NEG_INF, 0.0, torch.exp(lse_s - lse[..., rows]))
            d_o = d_out[..., rows, :]
            d_lse = w * (d_o * (o_s.detach() - out[..., rows, :])).sum(-1)
            grads = torch.autograd.grad((o_s, lse_s), leaves, (w[..., None] * d_o, d_lse), allow_unused=True)
            grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]
            found = grads if found is None else [a + b for a, b in zip(found, grads)]
    return found
