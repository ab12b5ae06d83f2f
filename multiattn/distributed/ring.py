"""Ring attention's plan and blocks, the same for every framework (the exchange and the
gradient are the framework's: ``backends.torch_ring``, ``backends.jax_ring``).

Layouts (``shard``, ``unshard``): ``"contiguous"`` (rank r holds the r-th run of positions;
the runs may differ in length) and ``"zigzag"`` (of 2P equal chunks, rank r holds chunk r then
chunk 2P-1-r: every rank computes about as many causal scores).  Blocks that the masks hide
wholly are not computed, and a shard no later step of a rank needs is not waited on."""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Sequence, Tuple

from .. import mods, state
from .._registry import framework_of, get_backend

Tensor = Any
Segment = Tuple[int, int]  # (first global position, positions)
Block = Tuple[int, int, int]  # keys (start in the shard, size, first global position)
LAYOUTS = ("contiguous", "zigzag")
# query rows (and keys, where a mask hides some) per call: its output and merge are held beside
# the shard's; keys per block that travels (fewer merges than blocks of ROWS)
ROWS, KEYS = 512, 2048


def segments(layout: str, rank: int, sizes: Sequence[int]) -> List[Segment]:
    """The runs of global positions that rank holds, in its shard's order: sizes, each rank's
    shard length (zigzag: equal and even)."""
    check_layout(layout)
    if layout == "contiguous":
        return [(int(sum(sizes[:rank])), int(sizes[rank]))]
    world, chunk = len(sizes), sizes[rank] // 2
    return [(rank * chunk, chunk), ((2 * world - 1 - rank) * chunk, chunk)]


def check_layout(layout: Any) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def check_sizes(layout: str, sizes: Sequence[int]) -> None:
    """ValueError where the shards' lengths do not fit the layout (zigzag: equal and even)."""
    if layout == "zigzag" and (len(set(sizes)) != 1 or sizes[0] % 2):
        raise ValueError(
            f"layout='zigzag' needs every rank's shard to hold the same even number of positions "
            f"(2 chunks of N / 2P), got shard lengths {list(sizes)}"
        )


def shard(x: Tensor, rank: int, world: int, layout: str = "contiguous", axis: int = -2) -> Tensor:
    """Rank's shard of x (its sequence along axis): contiguous, the rank-th of world equal runs
    (N a multiple of world); zigzag, chunks rank and 2 world - 1 - rank of 2 world (N a multiple
    of 2 world)."""
    check_layout(layout)
    ops = get_backend(framework_of(x) or "numpy").ops
    n = ops.shape(x)[axis]
    parts = world if layout == "contiguous" else 2 * world
    if not 0 <= rank < world or n % parts:
        raise ValueError(
            f"shard needs 0 <= rank < world and the sequence ({n} positions along axis {axis}) a multiple "
            f"of {parts} for layout={layout!r}, got rank={rank}, world={world}"
        )
    runs = segments(layout, rank, [n // world] * world)
    return ops.concat([_take(x, start, start + size, axis) for start, size in runs], axis)


def unshard(shards: Sequence[Tensor], layout: str = "contiguous", axis: int = -2) -> Tensor:
    """The whole sequence from every rank's shard, in rank order (``shard``'s inverse)."""
    check_layout(layout)
    ops = get_backend(framework_of(shards[0]) or "numpy").ops
    sizes = [ops.shape(x)[axis] for x in shards]
    check_sizes(layout, sizes)
    placed = []
    for rank, x in enumerate(shards):
        at = 0
        for start, size in segments(layout, rank, sizes):
            placed.append((start, _take(x, at, at + size, axis)))
            at += size
    return ops.concat([x for _, x in sorted(placed, key=lambda p: p[0])], axis)


def _take(x: Tensor, start: int, stop: int, axis: int) -> Tensor:
    index = [slice(None)] * len(x.shape)
    index[axis] = slice(start, stop)
    return x[tuple(index)]


class _Placed(mods.at_offset):
    """A mask function at a block's global positions; its arrays were checked against the whole
    sequence (``Ring``), not the block."""

    def check_sizes(self, batch, n_queries, n_keys):
        pass


class Ring:
    """One ring call's plan, the same on every rank: the shards' global positions, which
    (query shard, key shard) blocks some key is visible in, and the masks at those positions.
    attend(q, k, v, causal, scale): (out, lse) of a block without other masks from the
    framework's own kernel, or None (then ``dot_product_attention``)."""

    def __init__(
        self, ops, layout, sizes, batch, causal, valid_lens, mask_mod, score_mod, scale, attend=None
    ) -> None:  # fmt: skip
        if len(sizes) < 2:
            raise ValueError(
                f"ring_attention needs a ring of at least 2 ranks, got a group of {len(sizes)}: "
                "one process holding the whole sequence calls dot_product_attention"
            )
        check_sizes(layout, sizes)
        if valid_lens is not None and tuple(ops.shape(valid_lens)) != (batch,):
            raise ValueError(
                f"valid_lens must have shape ({batch},): each whole sequence's length, got "
                f"{tuple(ops.shape(valid_lens))}"
            )
        self.ops, self.layout, self.sizes, self.world = ops, layout, list(sizes), len(sizes)
        self.valid_lens, self.score_mod, self.scale, self.attend = valid_lens, score_mod, scale, attend
        parts = ([mods.causal_mask()] if causal else []) + ([] if mask_mod is None else [mask_mod])
        self.causal_only = causal and mask_mod is None
        self.mask = None if not parts else parts[0] if len(parts) == 1 else mods.and_masks(*parts)
        if self.mask is not None:
            self.mask = mods.as_mask_function(self.mask)
            total = sum(self.sizes)
            self.mask.check_sizes(batch, total, total)
            self._classify = self.mask.classifier(ops)  # what the host reads, read once
        self.runs = [segments(layout, r, self.sizes) for r in range(self.world)]

    def source(self, rank: int, step: int) -> int:
        """The rank whose keys rank holds at step (they travel to rank + 1 after each step)."""
        return (rank - step) % self.world

    def seen(self, q_run: Segment, k_run: Segment) -> Optional[Tuple[bool, bool]]:
        """(some key seen, every key seen) of a block of runs by the mask, None: not known."""
        if self.mask is None:
            return True, True
        return self._classify((q_run[0], q_run[0] + q_run[1], k_run[0], k_run[0] + k_run[1]))

    def visits(self, rank: int, source: int) -> bool:
        """Whether rank's queries may see any of source's keys."""
        return any((self.seen(q, k) or (True,))[0] for q in self.runs[rank] for k in self.runs[source])

    def transfers(self, rank: int) -> Tuple[List[bool], List[bool]]:
        """(receive, send) per step transition s -> s + 1 (s < world - 1) of rank: a shard is
        received where a later step of this rank needs it or must pass it on, sent where the
        next rank receives it."""
        world = self.world
        need = [[self.visits(r, self.source(r, s)) for s in range(world)] for r in range(world)]
        receive = [[False] * (world - 1) for _ in range(world)]
        for s in reversed(range(world - 1)):
            for r in range(world):
                passes_on = s + 1 < world - 1 and receive[(r + 1) % world][s + 1]
                receive[r][s] = any(need[r][s + 1 :]) or passes_on
        return receive[rank], receive[(rank + 1) % world]

    def key_blocks(self, source: int) -> List[Block]:
        """source's keys in blocks of at most KEYS: (start in its shard, size, first global
        position), the unit that travels (torch)."""
        found, row = [], 0
        for first, size in self.runs[source]:
            found += [(row + at, min(KEYS, size - at), first + at) for at in range(0, size, KEYS)]
            row += size
        return found

    def pieces(self, rank: int, q: Tensor, k: Tensor, v: Tensor, blocks: List[Block]) -> Iterator[tuple]:
        """(first row, state (out (B, [H,] rows, v), lse (B, [H,] rows))) of each chunk of at
        most ROWS of rank's query rows that sees some key of blocks (``key_blocks``, of k and
        v): a chunk's output, not the shard's, is held beside the merged one."""
        row = 0
        for q_run in self.runs[rank]:
            for start in range(0, q_run[1], ROWS):
                chunk = (q_run[0] + start, min(ROWS, q_run[1] - start))
                q_part = _take(q, row + start, row + start + chunk[1], -2)
                parts = [
                    self._attend(
                        q_part, _take(k, at, stop, -2), _take(v, at, stop, -2), chunk[0], first, seen
                    )
                    for at, stop, first, seen in self._key_ranges(chunk, blocks)
                ]
                if parts:
                    yield row + start, state.combine(self.ops, parts)
            row += q_run[1]

    def _key_ranges(self, chunk: Segment, blocks: List[Block]) -> Iterator[tuple]:
        """(start, stop in k, first global position, what the mask shows) of the blocks a
        chunk of queries may see: those seen whole and adjacent joined (one call), those
        hidden whole left out."""
        pending = None
        for at, size, first in _split(blocks):
            seen = self.seen(chunk, (first, size))
            joins = pending is not None and pending[1] == at and pending[2] + at - pending[0] == first
            if joins and seen == (True, True) and pending[3] == seen:
                pending = (pending[0], at + size, pending[2], seen)
                continue
            if pending is not None:
                yield pending
            pending = None if seen is not None and not seen[0] else (at, at + size, first, seen)
        if pending is not None:
            yield pending

    def block(self, rank: int, source: int, q: Tensor, k: Tensor, v: Tensor) -> Optional[state.State]:
        """The state (out (B, [H,] n, v), lse (B, [H,] n)) of rank's queries over source's keys;
        None where no key of it may be seen."""
        ops, n, found, at = self.ops, self.ops.shape(q)[-2], [], 0
        for row, part in self.pieces(rank, q, k, v, self.key_blocks(source)):
            if row > at:
                found.append(_nothing(ops, part, row - at))
            found.append(part)
            at = row + ops.shape(part[0])[-2]
        if not found:
            return None
        if at < n:
            found.append(_nothing(ops, found[-1], n - at))
        if len(found) == 1:
            return found[0]
        return ops.concat([o for o, _ in found], -2), ops.concat([lse for _, lse in found], -1)

    def _attend(self, q, k, v, q_at, k_at, seen) -> state.State:
        mask, causal = None if seen == (True, True) else self.mask, False
        if (
            mask is not None
            and self.causal_only
            and q_at == k_at
            and self.ops.shape(q)[-2] == self.ops.shape(k)[-2]
        ):
            mask, causal = None, True  # the diagonal: the call's own causal (a framework's kernel takes it)
        mask = None if mask is None else _Placed(mask, q_at, k_at)
        score_mod = None if self.score_mod is None else mods.score_at_offset(self.score_mod, q_at, k_at)
        lens = None
        if self.valid_lens is not None:  # the whole sequence's lengths, as this block's keys
            n_keys = self.ops.shape(k)[-2]
            lens = self.valid_lens - k_at
            lens = self.ops.select(lens < 0, 0, self.ops.select(lens > n_keys, n_keys, lens))
        if self.attend is not None and mask is None and score_mod is None and lens is None:
            found = self.attend(q, k, v, causal, self.scale)  # the framework's kernel, where it has one
            if found is not None:
                return found
        from .. import dot_product_attention

        return dot_product_attention(
            q, k, v, valid_lens=lens, causal=causal, mask_mod=mask, score_mod=score_mod, scale=self.scale,
            return_lse=True,
        )  # fmt: skip


def _split(blocks: List[Block]) -> Iterator[Block]:
    """The blocks in parts of at most ROWS keys (what a mask shows is found per part)."""
    for at, size, first in blocks:
        for start in range(0, size, ROWS):
            yield at + start, min(ROWS, size - start), first + start


def _nothing(ops, like: state.State, rows: int) -> state.State:
    """The state of rows that see nothing: out 0, lse -inf."""
    out, lse = like
    shape = tuple(ops.shape(out))[:-2] + (rows, ops.shape(out)[-1])
    zeros = ops.zeros(shape, out)
    return zeros, zeros[..., 0] + state.NEG_INF


def merge(ops, running: Optional[state.State], part: Optional[state.State]) -> Optional[state.State]:
    """running merged with one more block's state (either None: the other)."""
    if part is None or running is None:
        return running if part is None else part
    return state.combine(ops, [running, part])
