"""Every mask of a call as one value, made once and reused by every layer of a model:
FlexAttention's ``BlockMask`` (``create_block_mask``), on every framework.

A ``BlockMask`` holds the masks, normalised (a mask function that implies causality drops
``causal``; lengths that hide no key are dropped), and, per block size, the block map: for each
query block the key blocks to visit, those that need a mask and those that need none
(``blockwise.BlockMap``), computed on the first call that needs them and kept.
``block_mask=bm`` on a call gives what passing the same masks gives.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from . import validation
from .masks import Masks

Tensor = Any


class AuxOutput(NamedTuple):
    """What ``flex_attention(..., return_aux=...)`` returns beside the output, as torch's."""

    lse: Optional[Tensor] = None


class BlockMask:
    """The masks of calls with ``batch`` sequences of ``q_len`` queries over ``kv_len`` keys on
    one backend (``multiattn.create_block_mask``), and their block maps once computed."""

    def __init__(
        self, ops: Any, masks: Masks, batch: Optional[int], q_len: int, kv_len: int,
        block_size: Optional[int], heads: Optional[int] = None,
    ) -> None:  # fmt: skip
        self.ops, self.masks, self.block_size, self.heads = ops, masks, block_size, heads
        self.shape = (batch, q_len, kv_len)  # batch None: any
        self.maps: dict = {}  # (block side, heads, evaluated) -> blockwise.BlockMap

    @property
    def valid_lens(self) -> Tensor:
        return self.masks.valid_lens

    @property
    def attention_mask(self) -> Tensor:
        return self.masks.attention_mask

    @property
    def causal(self) -> bool:
        return self.masks.causal

    @property
    def mask_mod(self) -> Any:
        return self.masks.mask_mod

    def block_map(self, block: int, like: Tensor = None) -> Any:
        """The ``blockwise.BlockMap`` of this mask in blocks of side block, computed once for
        each number of heads of like (the queries, on which a mask function's blocks are
        evaluated to be classified; None: the framework's loop, traced, its blocks padded)."""
        shape = None if like is None else self.ops.shape(like)
        key = (block, None if shape is None or len(shape) == 3 else shape[1], like is None)
        found = self.maps.get(key)
        if found is None:
            from .blockwise import BlockMap

            sizes = (self.shape[1], self.shape[2], block)
            found = self.maps[key] = BlockMap(self.ops, self.masks, *sizes, like=like, padded=like is None)
        return found

    def __repr__(self) -> str:
        batch, q_len, kv_len = self.shape
        parts = [f"batch={batch}", f"q_len={q_len}", f"kv_len={kv_len}"]
        if self.masks.valid_lens is not None:
            parts.append(f"valid_lens of shape {tuple(self.ops.shape(self.masks.valid_lens))}")
        if self.masks.attention_mask is not None:
            parts.append(f"attention_mask of shape {tuple(self.ops.shape(self.masks.attention_mask))}")
        if self.masks.causal:
            parts.append("causal=True")
        if self.masks.mask_mod is not None:
            parts.append(f"mask_mod={self.masks.mask_mod!r}")
        if self.heads is not None:
            parts.insert(1, f"heads={self.heads}")
        backend = "unbound" if self.ops is None else repr(self.ops.name)
        return f"BlockMask({', '.join(parts)}, block_size={self.block_size}, backend={backend})"


def _size(arg: str, size: Any, none_ok: bool = False) -> Optional[int]:
    if size is None and none_ok:
        return None
    if isinstance(size, bool) or not hasattr(size, "__index__") or size < 1:
        raise ValueError(
            f"create_block_mask's {arg} must be a positive int{' or None' if none_ok else ''}, got {size!r}"
        )
    return size.__index__()


def flex_sizes(B, H, Q_LEN, KV_LEN, BLOCK_SIZE, batch, q_len, kv_len, block_size) -> tuple:
    """(batch, heads, q_len, kv_len, block_size) of ``create_block_mask``, given in
    FlexAttention's names (positional) or multiattn's (keywords), checked."""
    found = []
    for (flex, flex_value), (mine, value) in (
        (("B", B), ("batch", batch)), (("Q_LEN", Q_LEN), ("q_len", q_len)),
        (("KV_LEN", KV_LEN), ("kv_len", kv_len)), (("BLOCK_SIZE", BLOCK_SIZE), ("block_size", block_size)),
    ):  # fmt: skip
        if flex_value is not None and value is not None:
            raise TypeError(
                f"create_block_mask got both {flex}={flex_value!r} and {mine}={value!r}; pass one"
            )
        found.append((mine, value) if flex_value is None else (flex, flex_value))
    (batch_arg, batch), (q_arg, q_len), (kv_arg, kv_len), (_, block) = found
    if q_len is None or kv_len is None:
        raise TypeError(
            "create_block_mask needs the lengths: create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN) or "
            "q_len= and kv_len="
        )
    if isinstance(block, tuple):  # FlexAttention's (q block, kv block): one side here
        if len(block) != 2 or block[0] != block[1]:
            raise ValueError(f"BLOCK_SIZE must be an int or a pair of one int (square blocks), got {block!r}")
        block = block[0]
    return (
        _size(batch_arg, batch, none_ok=True), _size("H", H, none_ok=True), _size(q_arg, q_len),
        _size(kv_arg, kv_len), validation.check_block_size(block, False),
    )  # fmt: skip


def create(
    ops: Any,
    mask_mod: Any,
    batch: Optional[int],
    heads: Optional[int],
    q_len: int,
    kv_len: int,
    block_size: Optional[int],
    causal: Any,
    valid_lens: Tensor,
    attention_mask: Tensor,
) -> BlockMask:
    """``multiattn.create_block_mask`` on the backend of ops (None: bound by its first call),
    its masks checked."""
    if valid_lens is not None:
        if batch is None:
            batch = ops.shape(valid_lens)[0]
        validation.check_valid_lens(ops, valid_lens, batch, q_len)
    validation.check_causal(causal)
    mask = attention_mask
    if ops is not None:
        rank = 0 if attention_mask is None else len(ops.shape(attention_mask))
        scores = (batch, heads, q_len, kv_len) if rank == 4 else (batch, q_len, kv_len)
        mask = validation.check_attention_mask(ops, attention_mask, scores)
    _, masks = validation.with_mods(None, mask_mod, Masks(valid_lens, mask, causal), (batch, q_len, kv_len))
    if ops is not None:
        masks = masks.without_idle_lengths(ops, kv_len)
    return BlockMask(ops, masks, batch, q_len, kv_len, block_size, heads)


def check_flex_call(
    query: Tensor, key: Tensor, value: Tensor, enable_gqa: Any, return_lse: Any, kernel_options: Any,
    return_aux: Any,
) -> bool:  # fmt: skip
    """Whether a ``flex_attention`` call wants lse, after FlexAttention's checks: 4-D tensors,
    heads equal unless enable_gqa (then dividing)."""
    shapes = [tuple(getattr(x, "shape", ())) for x in (query, key, value)]
    if any(len(shape) != 4 for shape in shapes):
        raise ValueError(
            "flex_attention takes 4-D query, key and value (B, H, L, E), got shapes "
            + ", ".join(str(tuple(shape)) for shape in shapes)
        )
    validation.check_flag("enable_gqa", enable_gqa)
    validation.check_flag("return_lse", return_lse)
    hq, hkv = shapes[0][1], shapes[1][1]
    if hq is not None and hkv is not None:
        if not enable_gqa and int(hq) != int(hkv):
            raise ValueError(
                f"Expect query and key/value to have the same number of heads but got Hq={hq} and "
                f"Hkv={hkv}. Try setting enable_gqa=True for GQA."
            )
        if int(hq) % int(hkv):
            raise ValueError(
                f"Expect number of query heads to be a multiple of kv heads for GQA but got Hq={hq} "
                f"and Hkv={hkv}."
            )
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    if return_aux is None:
        return return_lse
    if getattr(return_aux, "max_scores", False):
        raise ValueError("return_aux asks for max_scores: flex_attention here gives lse only")
    return bool(getattr(return_aux, "lse", False))


def unpacked(
    block_mask: Any,
    ops: Any,
    queries: Tensor,
    keys: Tensor,
    valid_lens: Tensor,
    attention_mask: Tensor,
    causal: Any,
    mask_mod: Any,
    block_size: Any,
    weights: bool,
) -> tuple:
    """(valid_lens, attention_mask, causal, mask_mod, block_size) of a call: its own where
    block_mask is None, else the block mask's (its block size where the call gives none and
    wants no weights), after checking that the call gives no masks of its own and that its
    batch, queries and keys are the block mask's."""
    if block_mask is None:
        return valid_lens, attention_mask, causal, mask_mod, block_size
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            "block_mask must be a multiattn.create_block_mask(...) value, got "
            f"{type(block_mask).__module__}.{type(block_mask).__name__}"
        )
    given = dict(valid_lens=valid_lens, attention_mask=attention_mask, causal=causal, mask_mod=mask_mod)
    also = [name for name, value in given.items() if value is not None and value is not False]
    if also:
        raise ValueError(
            f"block_mask holds the call's masks: pass {', '.join(also)} to create_block_mask, not beside "
            "block_mask"
        )
    if block_mask.ops is None:  # made without a tensor: bound to its first call's framework
        block_mask.ops = ops
    if block_mask.ops.name != ops.name:
        raise TypeError(f"block_mask was made for {block_mask.ops.name} tensors, the call's are {ops.name}'s")
    q_shape, k_shape = ops.shape(queries), ops.shape(keys)
    call = (q_shape[0], q_shape[-2], k_shape[-2])
    if any(got is not None and want is not None and got != want for got, want in zip(call, block_mask.shape)):
        raise ValueError(
            f"block_mask was made for (batch, q_len, kv_len) = {block_mask.shape}, the call has {call}"
        )
    heads = q_shape[1] if len(q_shape) == 4 else None
    if block_mask.heads not in (None, 1, heads):
        raise ValueError(f"block_mask was made for H = {block_mask.heads} heads, the call has {heads}")
    masks = block_mask.masks
    size = block_mask.block_size if block_size is None and not weights else block_size
    return masks.valid_lens, masks.attention_mask, masks.causal, masks.mask_mod, size
