"""Decoding over cached keys and values: ``KVCache`` holds them, contiguous or in pages, and
``cached_attention`` appends a step's keys and values and attends its queries over every
position held: contiguous storage in one ``dot_product_attention`` call over the positions
filled (its answer is that call's, bitwise), a paged cache page by page, each page attended
with ``return_lse`` and the pages merged by their log-sum-exp (``blockwise.combine``:
flash-decoding's split-K), never gathered into one array."""

from __future__ import annotations

import copy
from typing import Any, Iterator, List, Optional, Tuple

from . import blockwise, mods
from ._registry import framework_of, get_backend
from .validation import dtype_name

Tensor = Any
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


class KVCache:
    """Keys (B, kv_heads, positions, head_dim) and values (..., value_dim, default head_dim) of
    the positions so far, in the
    backend, dtype and device of ``like``: contiguous, grown by doubling from ``capacity``
    positions, or with ``page_size`` in pages of that many positions, one more when the last
    is full.  ``append`` adds positions after the others; ``length``: the positions held;
    ``nbytes``: the bytes of storage held.  On jax (whose arrays are values) ``append`` returns
    a new cache and leaves this one as it was, so a step runs under ``jax.jit``: make the cache
    with ``capacity=`` for every position the compiled steps will append (one compilation for
    every length up to it); elsewhere it writes into this one and returns it."""

    def __init__(
        self, batch: int, kv_heads: int, head_dim: int, *, like: Tensor, page_size: Optional[int] = None,
        capacity: int = 0, value_dim: Optional[int] = None,
    ) -> None:  # fmt: skip
        value_dim = head_dim if value_dim is None else value_dim
        sizes = dict(
            batch=batch, kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim, capacity=capacity
        )
        for arg, value in sizes.items():
            if not _is_int(value) or value < (arg != "capacity"):
                raise ValueError(f"{arg} must be an int >= {int(arg != 'capacity')}, got {value!r}")
        if page_size is not None and (not _is_int(page_size) or page_size < 1):
            raise ValueError(f"page_size must be an int >= 1 or None (contiguous), got {page_size!r}")
        name = framework_of(like)
        if name is None:
            raise TypeError(f"like must be a tensor of one of the backends, got {type(like).__name__}")
        self.ops = get_backend(name).ops
        if self.ops.dtype_kind(like) != "f":
            raise TypeError(f"like must have a floating dtype (the cache's), got {dtype_name(like)}")
        self.batch, self.kv_heads, self.head_dim, self.value_dim = batch, kv_heads, head_dim, value_dim
        self.page_size, self.dtype = page_size, dtype_name(like)
        self._like = self.ops.zeros((1,), like)  # dtype and device, without holding the caller's tensor
        self.length: Any = 0
        self.pages: List[Tuple[Tensor, Tensor]] = []  # contiguous: one "page" of the capacity
        if capacity and page_size is None:
            self.pages.append(self._zeros(capacity))

    # -- storage ---------------------------------------------------------------------------------

    def _zeros(self, positions: int) -> Tuple[Tensor, Tensor]:
        shape = (self.batch, self.kv_heads, positions)
        return tuple(
            self.ops.zeros(shape + (width,), self._like) for width in (self.head_dim, self.value_dim)
        )

    @property
    def capacity(self) -> int:
        """The positions the storage holds, filled or not."""
        return sum(self.ops.shape(k)[-2] for k, _ in self.pages)

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
        cache = copy.copy(self) if self.ops.functional_updates else self
        cache.pages, start, write = list(self.pages), _known(self.ops, self.length), self.ops.write_rows
        if not isinstance(start, int):  # traced (jax.jit): written where the length says
            if self.page_size is not None or not cache.pages:
                raise ValueError(
                    "a cache appended to under a compiler needs its storage already: a contiguous "
                    "cache made with capacity= (a paged cache adds pages on the host)"
                )
            k, v = cache.pages[0]
            cache.pages[0] = (write(k, start, keys), write(v, start, values))
        else:
            if start + n > cache.capacity:
                cache._grow(start + n)
            position = 0
            for index, (k, v) in enumerate(cache.pages):  # the pages the positions fall in
                size = self.ops.shape(k)[-2]
                lo, hi = max(start, position), min(start + n, position + size)
                if lo < hi:
                    rows = [x if hi - lo == n else x[..., lo - start : hi - start, :] for x in (keys, values)]
                    cache.pages[index] = (write(k, lo - position, rows[0]), write(v, lo - position, rows[1]))
                position += size
        cache.length = start + n
        return cache

    def _grow(self, needed: int) -> None:
        """Storage for ``needed`` positions: pages added, or the contiguous storage doubled."""
        if self.page_size is not None:
            while self.capacity < needed:
                self.pages.append(self._zeros(self.page_size))
            return
        capacity = max(self.capacity * 2, needed, 16)
        grown = self._zeros(capacity)
        if self.pages:
            old = self.pages[0]
            grown = tuple(self.ops.write_rows(g, 0, o[..., : self.length, :]) for g, o in zip(grown, old))
        self.pages = [grown]

    def _check(self, keys: Tensor, values: Tensor) -> int:
        shapes = []
        for arg, x, width in (("keys", keys, self.head_dim), ("values", values, self.value_dim)):
            if framework_of(x) != self.ops.name:
                raise TypeError(f"{arg} must be a {self.ops.name} tensor (the cache's), got {type(x)}")
            if dtype_name(x) != self.dtype:
                raise TypeError(f"{arg} must be {self.dtype} (the cache's dtype), got {dtype_name(x)}")
            shape = tuple(self.ops.shape(x))
            want = (self.batch, self.kv_heads, "n", width)
            if len(shape) != 4 or (shape[0], shape[1], "n", shape[3]) != want:
                raise ValueError(
                    f"{arg} must have shape {want} (batch, kv_heads, positions, width), got {shape}"
                )
            shapes.append(shape)
        if shapes[0][2] != shapes[1][2]:
            raise ValueError(
                f"keys and values must hold as many positions, got {shapes[0][2]}, {shapes[1][2]}"
            )
        return shapes[0][2]

    # -- the blocks attention visits ------------------------------------------------------------

    def blocks(self, length: Any) -> Iterator[Tuple[int, Tensor, Tensor, Any]]:
        """(start, keys, values, lengths or None) of the stored positions below ``length``: the
        contiguous storage as one block, a paged cache page by page; where length is traced,
        all of the storage, with the positions filled per sequence ((B,) ints) to hide the rest."""
        traced, position = not isinstance(length, int), 0
        for k, v in self.pages:
            if not traced and position >= length:
                return
            stop = self.ops.shape(k)[-2] if traced else min(self.ops.shape(k)[-2], length - position)
            lens = None
            if traced:  # (B,) copies of the positions filled in this block
                lens = self.ops.positions(0, self.batch, k) * 0 + (length - position)
            yield position, k[..., :stop, :], v[..., :stop, :], lens
            position += self.ops.shape(k)[-2]


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
    every cached key (H a multiple of kv_heads): ``dot_product_attention`` over the keys held
    with ``query_offset`` = the old length.  A prefill (n > 1) and a decoding step alike."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a multiattn.KVCache, got {type(cache).__name__}")
    dot_product_attention = get_backend(cache.ops.name).dot_product_attention  # the checks, the paths
    old = _known(cache.ops, cache.length)
    cache = cache.append(k_new, v_new)
    blocks = list(cache.blocks(cache.length))

    def attend(start: int, k: Tensor, v: Tensor, lens: Any, lse: bool) -> Any:
        shifted = {}  # the mods see absolute positions: keys from start, queries from old
        if mask_mod is not None:
            shifted["mask_mod"] = mods.at_offset(mask_mod, start, start)
        if score_mod is not None:
            shifted["score_mod"] = mods.score_at_offset(score_mod, start, start)
        return dot_product_attention(
            q, k, v, lens, causal=causal, scale=scale, return_lse=lse, query_offset=old - start, **shifted
        )

    if len(blocks) == 1:
        out = attend(*blocks[0], lse=False)
    else:
        out, _ = blockwise.combine(cache.ops, [attend(*block, lse=True) for block in blocks])
    return out, cache
