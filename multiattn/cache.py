"""Decoding over cached keys and values: ``KVCache`` holds them, contiguous or in pages, and
``cached_attention`` appends a step's keys and values and attends its queries over every
position held.

Both layouts keep positions in splits of ``SPLIT`` (storage (splits, B, kv_heads, SPLIT,
width)).  Attention computes each split's state (``state``: its output and lse) for all the
splits of a block (the contiguous storage, or the pages made together: a pool, a prefill's) in
one batched product, then merges the splits' states (flash-decoding's split-K).  A split is
computed alike whatever the layout, the batch or the thread count: a paged cache whose pages
hold a multiple of SPLIT positions gives the contiguous cache's answer bitwise, and eagerly no
page is ever copied into another array (a compiled step reads pages made apart as one block, a
copy: a compiler's product of other shapes may round otherwise).

Under a compiler (jax.jit, tf.function, torch.compile) the storage is fixed: a step past it
stores nothing and gives NaN, never a wrong number (``KVCache``)."""

from __future__ import annotations

import copy
from typing import Any, Iterator, List, Optional, Tuple

from . import mods, state, validation
from ._registry import framework_of, get_backend
from .masks import Masks, block_visibility
from .validation import dtype_name

Tensor = Any
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
SPLIT = 16  # positions per split: fixed, so that every layout computes the same partials


class KVCache:
    """Keys (B, kv_heads, positions, head_dim) and values (..., value_dim, default head_dim) of
    the positions so far, in the backend, dtype and device of ``like``: contiguous, grown by
    doubling from ``capacity`` positions, or with ``page_size`` in pages of that many
    positions, one more when the last is full (``num_pages``: that many made up front, a fixed
    pool for a compiler); the pages made together (the pool, the pages one append needs) are
    one array, attended as one block.  ``append`` adds positions after the others; ``length``: the
    positions held; ``capacity``: the positions the storage holds; ``nbytes``: its bytes.  On
    jax (whose arrays are values) ``append`` returns a new cache and leaves this one as it was;
    elsewhere it writes into this one and returns it.

    Under a compiler (``jax.jit``, ``tf.function``: the cache passes through as its tensors
    and its length; ``torch.compile``: a torch cache keeps its length as a 0-D tensor on the
    CPU, an input to the graph, and a compiled step returns a new cache) the storage cannot
    grow: make the cache with ``capacity=`` (contiguous) or ``num_pages=`` (paged) for every
    position the compiled steps will append (one compilation for every length up to it).  A
    compiled step that appends past the storage stores nothing and gives NaN in every row of
    its output, and so does every compiled step after it (the length, past the capacity, says
    so); appending to such a cache eagerly raises.  Eagerly the storage grows."""

    def __init__(
        self, batch: int, kv_heads: int, head_dim: int, *, like: Tensor, page_size: Optional[int] = None,
        capacity: int = 0, value_dim: Optional[int] = None, num_pages: int = 0,
    ) -> None:  # fmt: skip
        value_dim = head_dim if value_dim is None else value_dim
        sizes = dict(
            batch=batch, kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim, capacity=capacity,
            num_pages=num_pages,
        )  # fmt: skip
        for arg, value in sizes.items():
            least = int(arg not in ("capacity", "num_pages"))
            if not _is_int(value) or value < least:
                raise ValueError(f"{arg} must be an int >= {least}, got {value!r}")
        if page_size is not None and (not _is_int(page_size) or page_size < 1):
            raise ValueError(f"page_size must be an int >= 1 or None (contiguous), got {page_size!r}")
        if num_pages and page_size is None:
            raise ValueError(
                f"num_pages is for a paged cache (page_size=), got num_pages={num_pages} without it"
            )
        name = framework_of(like)
        if name is None:
            raise TypeError(f"like must be a tensor of one of the backends, got {type(like).__name__}")
        self.ops = get_backend(name).ops
        if self.ops.dtype_kind(like) != "f":
            raise TypeError(f"like must have a floating dtype (the cache's), got {dtype_name(like)}")
        self.batch, self.kv_heads, self.head_dim, self.value_dim = batch, kv_heads, head_dim, value_dim
        self.page_size, self.dtype = page_size, dtype_name(like)
        # a page of other sizes is one split (its answer then equals the contiguous one to rounding)
        self.split = SPLIT if page_size is None or page_size % SPLIT == 0 else page_size
        self._like = self.ops.zeros((1,), like)  # dtype and device, without holding the caller's tensor
        self.length = 0
        # (keys, values) of consecutive positions: the contiguous storage; pages made together
        # (a pool, a prefill's) as one, attended as one block: a step's cost is not one call per page
        self.storage: List[Tuple[Tensor, Tensor]] = []
        if capacity and page_size is None:
            self.storage.append(self._zeros(-(-capacity // SPLIT) * SPLIT))
        if num_pages:
            self.storage.append(self._zeros(page_size * num_pages))

    @property
    def length(self) -> Any:
        """The positions held: an int where the host can read it, else (traced) a 0-D tensor."""
        # the int set eagerly, cheap to read; never read while torch.compile traces (a guard on it)
        if not self.ops.unrolls_loops(self._like) and self._host_length is not None:
            return self._host_length
        return _known(self.ops, self._length)

    @length.setter
    def length(self, value: Any) -> None:
        # torch.compile specialises on a Python int it reads (a recompile every step): a 0-D tensor there
        if isinstance(value, int):
            self._host_length, self._length = value, self.ops.host_count(value)
        else:
            self._host_length, self._length = None, value

    # -- through a compiler: the static fields and the tensors ------------------------------------

    _STATIC = ("ops", "batch", "kv_heads", "head_dim", "value_dim", "page_size", "dtype", "split")

    def _flatten(self) -> Tuple[tuple, tuple]:
        """(static fields, tensors): the cache as a compiler traces it (the backends register
        it: jax's pytrees; tf.nest by ``__tf_flatten__``), its length a tensor (one trace for
        every length)."""
        length = self._length  # as it is: a jax array's value is not read back
        if isinstance(length, int):
            length = self.ops.constant(length, self._like)
        flat = tuple(x for pair in self.storage for x in pair)
        return tuple(getattr(self, f) for f in self._STATIC), flat + (length, self._like)

    @classmethod
    def _unflatten(cls, fields: tuple, tensors: tuple) -> "KVCache":
        cache = object.__new__(cls)
        cache.__dict__.update(zip(cls._STATIC, fields))
        *flat, cache.length, cache._like = tensors
        cache.storage = list(zip(flat[0::2], flat[1::2]))
        return cache

    def __tf_flatten__(self) -> Tuple[tuple, tuple]:  # tf.nest's protocol: tf.function takes and returns it
        return self._flatten()

    @classmethod
    def __tf_unflatten__(cls, fields: tuple, tensors: tuple) -> "KVCache":
        return cls._unflatten(fields, tensors)

    def __copy__(self) -> "KVCache":  # not through __getstate__: torch.compile traces this
        cache = object.__new__(type(self))
        cache.__dict__.update(self.__dict__)
        return cache

    def __getstate__(self) -> dict:  # the backend by name: copies and pickles share its ops
        return {**self.__dict__, "ops": self.ops.name}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        length = state.pop("length", None)  # pickled before the length was a property
        if "pages" in state:  # pickled before pages made together were one storage
            state["storage"] = state.pop("pages")
        self.__dict__.update(state, ops=get_backend(state["ops"]).ops)
        if length is not None:
            self.length = length

    # -- storage ---------------------------------------------------------------------------------

    def _zeros(self, positions: int) -> Tuple[Tensor, Tensor]:
        shape = (positions // self.split, self.batch, self.kv_heads, self.split)
        return tuple(
            self.ops.zeros(shape + (width,), self._like) for width in (self.head_dim, self.value_dim)
        )

    @property
    def capacity(self) -> int:
        """The positions the storage holds, filled or not."""
        return sum(self.ops.shape(k)[0] for k, _ in self.storage) * self.split

    @property
    def nbytes(self) -> int:
        """The bytes of the keys' and values' storage held (filled or not)."""
        width = self.head_dim + self.value_dim
        return self.batch * self.kv_heads * width * self.capacity * _ITEMSIZE[self.dtype]

    def __repr__(self) -> str:
        layout = "contiguous" if self.page_size is None else f"page_size={self.page_size}"
        return (
            f"KVCache({self.ops.name}, batch={self.batch}, kv_heads={self.kv_heads}, head_dim={self.head_dim}"
            f", {self.dtype}, {layout}, length={self.length}, capacity={self.capacity})"
        )

    def append(self, keys: Tensor, values: Tensor) -> "KVCache":
        """The cache holding keys and values (B, kv_heads, n, head_dim) after its positions."""
        n = self._check(keys, values)
        start = self.length
        # a compiler's input stays as it was (tf.function refuses a mutated argument)
        cache = copy.copy(self) if self.ops.functional_updates or not isinstance(start, int) else self
        cache.storage = list(self.storage)
        if not isinstance(start, int):  # traced (jax.jit, tf.function): into the storage it has
            if not cache.storage:
                raise ValueError(
                    "a cache appended to under a compiler needs its storage already: make it with "
                    "capacity= (contiguous) or num_pages= (paged), got capacity=0"
                )
            if n == 1:  # a decoding step: the split that holds it, in place
                cache._write_traced(start, keys, values)
            else:  # a prefill: one update per page, whatever n
                cache._write_span(start, keys, values)
        else:
            if start > cache.capacity:  # only a compiled step appends past the storage
                raise ValueError(
                    f"cache length {start} exceeds its capacity {cache.capacity}: compiled steps "
                    "appended past the storage (their outputs were NaN); make the cache with "
                    "capacity= or num_pages= for every position"
                )
            if start + n > cache.capacity:
                cache._grow(start + n)
            at = start
            while at < start + n:  # one write per split the positions fall in
                stop = min(start + n, (at // self.split + 1) * self.split)
                cache._write(at, *(x[..., at - start : stop - start, :] for x in (keys, values)))
                at = stop
        cache.length = start + n
        return cache

    def _write_traced(self, position: Any, keys: Tensor, values: Tensor) -> None:
        """One position (a traced scalar) written into the storage that holds it; into none
        where it is past the storage (the rows written there keep what they held)."""
        ops = self.ops
        for at, first, size, (k, v) in self._spans():
            within = position - first
            inside = ops.logical_and(within >= 0, within < size)
            within = ops.select(inside, within, 0)  # in range: a compiler's slices may not clamp
            split, offset = within // self.split, within % self.split
            written = []
            for x, rows in ((k, keys), (v, values)):
                held = ops.rows_at(ops.rows_at(x, split, 1, axis=0), offset, 1)[0]
                x_new = ops.write_rows(x, split, offset, ops.select(inside, rows, held))
                written.append(ops.reshape(x_new, ops.shape(x)))  # its static shape, where lost
            self.storage[at] = tuple(written)

    def _write_span(self, start: Any, keys: Tensor, values: Tensor) -> None:
        """n positions from a traced start in one update per storage: its rows one after
        another with n rows of margin on each side, the new rows written there at their place
        (into a margin where they fall outside it), the storage cut back out; past the
        storage, nothing stored."""
        ops, n = self.ops, self.ops.shape(keys)[-2]
        fits = start + n <= self.capacity
        for index, first, size, pair in self._spans():
            at = start - first + n  # clamped into the margins: a compiler's writes may not clamp
            at = ops.select(at < 0, at * 0, ops.select(at > size + n, at * 0 + size + n, at))
            written = []
            for x, rows in zip(pair, (keys, values)):
                flat = ops.joined_rows(x)  # (B, kv_heads, size, width)
                margin = ops.zeros(tuple(ops.shape(flat)[:-2]) + (n, ops.shape(flat)[-1]), x)
                padded = ops.expand_dims(ops.concat([margin, flat, margin], -2), 0)
                flat = ops.write_rows(padded, 0, at, rows)[0, ..., n : n + size, :]
                x_new = ops.row_windows(flat, 0, self.split, self.split, ops.shape(x)[0])
                written.append(ops.reshape(ops.select(fits, x_new, x), ops.shape(x)))
            self.storage[index] = tuple(written)

    def _spans(self) -> Iterator[Tuple[int, int, int, Tuple[Tensor, Tensor]]]:
        """(index, first position, positions, (keys, values)) of each storage, in order."""
        first = 0
        for index, pair in enumerate(self.storage):
            size = self.ops.shape(pair[0])[0] * self.split
            yield index, first, size, pair
            first += size

    def _write(self, position: int, keys: Tensor, values: Tensor) -> None:
        """Rows that fall in one split, written from ``position``."""
        for index, first, size, (k, v) in self._spans():
            if position < first + size:
                split, offset = divmod(position - first, self.split)
                write = self.ops.write_rows
                self.storage[index] = (write(k, split, offset, keys), write(v, split, offset, values))
                return

    def _grow(self, needed: int) -> None:
        """Storage for ``needed`` positions: the pages needed added as one, or the contiguous
        storage doubled."""
        if self.page_size is not None:
            self.storage.append(self._zeros(-(-(needed - self.capacity) // self.page_size) * self.page_size))
            return
        capacity = max(self.capacity * 2, -(-needed // SPLIT) * SPLIT, 16)
        more = self._zeros(capacity - self.capacity)
        old = self.storage[0] if self.storage else None
        self.storage = [more if old is None else tuple(self.ops.concat([o, m], 0) for o, m in zip(old, more))]

    def _check(self, keys: Tensor, values: Tensor) -> int:
        shapes = []
        for arg, x, width in (("keys", keys, self.head_dim), ("values", values, self.value_dim)):
            shapes.append(self._check_tensor(arg, x, self.kv_heads, width))
        if shapes[0][2] != shapes[1][2]:
            raise ValueError(
                f"keys and values must hold as many positions, got {shapes[0][2]}, {shapes[1][2]}"
            )
        return shapes[0][2]

    def _check_tensor(self, arg: str, x: Tensor, heads: Any, width: int) -> tuple:
        if framework_of(x) != self.ops.name:
            raise TypeError(f"{arg} must be a {self.ops.name} tensor (the cache's), got {type(x)}")
        if getattr(x, "dtype", None) != self._like.dtype and dtype_name(x) != self.dtype:
            raise TypeError(f"{arg} must be {self.dtype} (the cache's dtype), got {dtype_name(x)}")
        shape = tuple(self.ops.shape(x))
        want = (self.batch, heads, "n", width)
        if len(shape) != 4 or (shape[0], heads if heads == "H" else shape[1], "n", shape[3]) != want:
            raise ValueError(f"{arg} must have shape {want} (batch, heads, positions, width), got {shape}")
        return shape

    # -- the blocks attention visits ------------------------------------------------------------

    def blocks(self, length: Any, first: int = 0) -> Iterator[Tuple[int, Tensor, Tensor]]:
        """(first position, keys, values) of the storage's blocks of splits (splits, B, kv_heads,
        split, width) holding positions in [first, length): the contiguous storage as one block,
        a paged cache's pages made together as one (both from the split that holds ``first``); where length is
        traced, all of the storage as one block."""
        position, traced = 0, not isinstance(length, int)
        if traced and len(self.storage) > 1:  # a compiler's product of other shapes may round otherwise
            ks, vs = zip(*self.storage)
            yield 0, self.ops.concat(list(ks), 0), self.ops.concat(list(vs), 0)
            return
        for k, v in self.storage:
            splits = self.ops.shape(k)[0]
            if not traced and position >= length:
                return
            used = splits if traced else min(splits, -(-(length - position) // self.split))
            skip = 0 if traced else max(0, (first - position) // self.split)
            if skip < used:
                whole = skip == 0 and used == splits
                at = position + skip * self.split
                yield at, (k if whole else k[skip:used, ...]), (v if whole else v[skip:used, ...])
            position += splits * self.split


def _known(ops: Any, length: Any) -> Any:
    """length as an int where the host knows it (a jax array after a compiled step), else as it is."""
    if isinstance(length, int):
        return length
    host = ops.host_values(length)
    return length if host is None else int(host)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def cached_attention(
    q: Tensor, k_new: Tensor, v_new: Tensor, cache: KVCache, *, causal: bool = True, mask_mod: Any = None,
    score_mod: Any = None, scale: Any = None,
) -> Tuple[Tensor, KVCache]:  # fmt: skip
    """(out, cache): k_new, v_new (B, kv_heads, n, head_dim) appended to the cache, then q
    (B, H, n, head_dim), its rows at positions old length .. old length + n - 1, attends over
    every cached key (H a multiple of kv_heads; query head h reads kv head h // (H / kv_heads)):
    ``dot_product_attention`` over the keys held with ``query_offset`` = the old length, to
    rounding.  A prefill (n > 1) and a decoding step alike."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a multiattn.KVCache, got {type(cache).__name__}")
    ops = cache.ops
    validation.check_causal(causal)
    scale = validation.check_scale(scale)
    score_mod, masks = validation.with_mods(score_mod, mask_mod, Masks(causal=causal))
    n = cache._check(k_new, v_new)
    batch, heads, _, width = cache._check_tensor("q", q, "H", cache.head_dim)
    if heads % cache.kv_heads or cache.ops.shape(q)[2] != n:
        raise ValueError(
            f"q must have shape ({batch}, H, {n}, {width}) with H a multiple of kv_heads={cache.kv_heads} "
            f"and as many positions as k_new, got {tuple(ops.shape(q))}"
        )
    old = cache.length
    cache = cache.append(k_new, v_new)
    length = cache.length  # read once: on torch each read is one from a tensor
    groups = heads // cache.kv_heads
    q = q * (width**-0.5 if scale is None else scale)
    q = ops.reshape(q, (1, batch, cache.kv_heads, groups * n, width))  # each group's heads as rows
    call = Call(ops, q, batch, heads, groups, n, old, length, masks, score_mod)
    out, _ = call.state(list(cache.blocks(length, call.first_key())))
    if not isinstance(length, int):  # compiled: a step past the storage gives NaN, never a number
        out = ops.where(length <= cache.capacity, out, float("nan"))
    return ops.cast(ops.reshape(out, (batch, heads, n, cache.value_dim)), q), cache


class Call:
    """One ``cached_attention`` call: q (1, B, kv_heads, G n, d), scaled, its rows at positions
    from old; the masks and score function."""

    def __init__(self, ops, q, batch, heads, groups, n, old, length, masks, score_mod) -> None:
        self.ops, self.q, self.batch, self.heads, self.groups, self.n = ops, q, batch, heads, groups, n
        self.old, self.length, self.masks, self.score_mod = old, length, masks, score_mod

    def first_key(self) -> int:
        """The first key any row may see, where the mask function says (a window's): the
        splits before it are not visited (at least the last split is)."""
        found = None
        if self.masks.mask_mod is not None and isinstance(self.old, int):
            found = self.masks.mask_mod.key_range(self.old, self.old + self.n)
        return 0 if found is None else max(0, min(found[0], self.length - 1))

    def state(self, blocks: List[Tuple[int, Tensor, Tensor]]) -> Tuple[Tensor, Tensor]:
        """The state (out, lse) (1, B, kv_heads, G n, dv | 1) over the blocks of consecutive
        splits [(first position, keys, values (splits, B, kv_heads, S, .))]: each split's
        state, merged.  The scores of every block at once: the passes over them run once, only
        the products run per block (a page)."""
        ops, at = self.ops, blocks[0][0]
        scores = [self._scores(k) for _, k, _ in blocks]
        scores = scores[0] if len(scores) == 1 else ops.concat(scores, 0)
        splits, _, kv_heads, _, _, size = ops.shape(scores)
        if self.score_mod is not None:
            scores = self._score_mod(scores, at)
        visible = self._visible(at, splits, size, scores)
        top, p, total = state.block_weights(ops, scores, visible, owned=self.score_mod is None)
        five = (splits, self.batch, kv_heads, self.groups * self.n)  # the heads' rows as one
        top, total = ops.reshape(top, five + (1,)), ops.reshape(total, five + (1,))
        p = ops.reshape(p, five + (size,))
        weighted, start = [], 0
        for _, _, v in blocks:
            count = ops.shape(v)[0]
            weighted.append(state.pooled(ops, p if len(blocks) == 1 else p[start : start + count, ...], v))
            start += count
        weighted = weighted[0] if len(weighted) == 1 else ops.concat(weighted, 0)
        return state.merge_many(ops, top, total, weighted, 0)

    def _scores(self, k: Tensor) -> Tensor:
        """The scores (splits, B, kv_heads, G, n, S) of q against keys k (splits, B, kv_heads, S, d)."""
        ops, q = self.ops, self.q
        splits, _, kv_heads, size, _ = ops.shape(k)
        scores = ops.widen(ops.matmul_t(ops.broadcast_to(q, (splits,) + tuple(ops.shape(q))[1:]), k))
        return ops.reshape(scores, (splits, self.batch, kv_heads, self.groups, self.n, size))

    def _visible(self, at: int, splits: int, size: int, like: Tensor) -> Optional[Tensor]:
        """Which keys of the block each row sees (6-D, broadcastable), None where it sees all:
        the storage past the positions held, causality (a single row sees every key held), the
        mask function, as any block's (``masks.block_visibility``)."""
        keys = splits * size
        past = not isinstance(self.length, int) or at + keys > self.length
        visible = block_visibility(
            self.ops, like, self.old, at, self.n, keys, rank=4, causal=self.masks.causal and self.n > 1,
            mask_mod=self.masks.mask_mod, heads=self.heads, batch=self.batch,
            limits=(None, self.length if past else None),
        )  # fmt: skip
        return None if visible is None else self._in_splits(visible, splits, size)

    def _block(self, at: int, keys: int) -> Any:
        if isinstance(self.old, int):
            return (self.old, self.old + self.n, at, at + keys)
        return mods.TracedBlock(self.old, at, (self.n, keys))

    def _in_splits(self, x: Tensor, splits: int, size: int) -> Tensor:
        """x (b, h, n, keys) (b, h, n or keys: those or 1) as (splits, b, kv_heads or 1, G or 1, n, S)."""
        ops = self.ops
        b, h, n, keys = ops.shape(x)
        if b == h == n == 1:  # the keys alone (a decoding step's storage): split in place
            return ops.reshape(x, (keys // size if keys > 1 else 1, 1, 1, 1, 1, size if keys > 1 else 1))
        if keys == 1:
            x = ops.expand_dims(x, 0)
        else:  # the keys' splits to the front: (splits, b, h, n, S)
            x = ops.matrix_transpose(ops.row_windows(ops.matrix_transpose(x), 0, size, size, splits))
        heads = (self.heads // self.groups, self.groups) if h == self.heads else (1, 1)
        return ops.reshape(x, (ops.shape(x)[0], b) + heads + (n, ops.shape(x)[-1]))

    def _score_mod(self, scores: Tensor, at: int) -> Tensor:
        """score_mod on scores (splits, B, kv_heads, G, n, S), in the layout it takes (B, H, n, keys)."""
        ops = self.ops
        splits, size = ops.shape(scores)[0], ops.shape(scores)[-1]
        heads = ops.reshape(scores, (splits, self.batch, self.heads, self.n, size))
        flat = ops.matrix_transpose(ops.joined_rows(ops.matrix_transpose(heads)))  # (B, H, n, keys)
        flat = mods.apply_score_mod(ops, self.score_mod, flat, self._block(at, splits * size), self.batch)
        return self._in_splits(flat, splits, size)
