"""PyTorch backend: the ops of torch tensors (layers: ``multiattn.layers.torch``)."""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, Optional

import numpy as np

from .._registry import framework_imports  # noqa: E402

with framework_imports("torch"):  # not installed: an error naming the install
    import torch
    from torch.nn import functional as F

from .. import _registry, blockwise, fast_paths, state, tuning
from .._machine import measured_faster
from ..adapter import Ops
from ..functional import bind

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")
DTYPE_NOTES: dict = {}

_HALF = (torch.float16, torch.bfloat16)


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "b"
    if dtype.is_complex:
        return "c"
    if dtype.is_floating_point:
        return "f"
    return "u" if dtype == torch.uint8 else "i"


_KINDS = {dtype: _kind(dtype) for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)}


class TorchOps(Ops):
    name = "torch"

    # a torch.Size (a tuple); a C method: no Python frame, and torch.compile traces it
    shape = staticmethod(torch.Tensor.size)

    def dtype_kind(self, x):
        # the checks read it on every call: a dict made once (torch.compile guards on one that grows)
        kind = _KINDS.get(x.dtype)
        return _kind(x.dtype) if kind is None else kind

    def zeros(self, shape, like):
        return torch.zeros(shape, dtype=like.dtype, device=like.device)

    def any(self, mask, axis):
        return mask.any(dim=axis, keepdim=True)

    def expand_dims(self, x, axis):
        return x.unsqueeze(axis)

    def broadcast_to(self, x, shape):
        return x.expand(shape)

    def matrix_transpose(self, x):
        return x.mT.contiguous()  # no copy where a swapped axis has size 1

    def concat(self, xs, axis):
        return torch.cat(xs, dim=axis)

    def matmul(self, a, b):
        # bmm skips matmul's shape dispatch, which dominates at toy sizes
        return torch.bmm(a, b) if a.dim() == 3 and b.dim() == 3 else torch.matmul(a, b)

    def matmul_t(self, a, b):
        return self.matmul(a, b.transpose(-1, -2))

    def scaled_matmul_t(self, a, b, scale):
        if a.dim() != 3:  # heads: (B, H, n, d) as one batch of B * H products
            batch = a.shape[:-2]
            a, b = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
            return self.scaled_matmul_t(a, b, scale).view(*batch, a.shape[-2], b.shape[-2])
        # the scale inside the GEMM (alpha): no pass over either operand; beta=0 ignores input
        return torch.baddbmm(_constant(0.0, a), a, b.mT, beta=0, alpha=scale)

    def tanh(self, x):
        return torch.tanh(x)

    def tanh_of_sum(self, a, b, buffers):
        return _activation_of_sum(torch.tanh, torch.Tensor.tanh_, a, b, buffers)

    def tanh_by_sigmoid(self, features):
        if torch.compiler.is_compiling() or torch.jit.is_tracing():  # compilers fuse their own way
            return False
        dtype, device = features.dtype, features.device
        # a fixed ramp, not random numbers: random ops are refused inside torch.func.vmap
        size = tuning.of(self).feature_block_elements
        ramp = lambda: torch.linspace(-4.0, 4.0, size, device=device).to(dtype)  # noqa: E731
        return measured_faster((dtype, device), torch.sigmoid, torch.tanh, ramp)

    def sigmoid_of_sum(self, a, b, buffers):
        return _activation_of_sum(torch.sigmoid, torch.Tensor.sigmoid_, a, b, buffers)

    def softmax(self, x):
        if x.dtype in _HALF:
            return torch.softmax(x, dim=-1, dtype=torch.float32).to(x.dtype)
        return torch.softmax(x, dim=-1)

    def safe_softmax(self, x):
        # the formula, -inf a cached tensor: torch wraps a Python float anew on every call
        minus_inf = _constant(-math.inf, x)
        if torch.is_grad_enabled() and (x.requires_grad or _transformed(x)):
            shown = x != minus_inf
            weights = self.softmax(torch.where(shown, x, _constant(_LOWEST[x.dtype], x)))
            return torch.where(shown, weights, _constant(0.0, x))
        # no backward to guard from a row of NaN (all -inf): fewer passes, 0 written in place
        weights = self.softmax(x) if x.dtype in _HALF else torch.softmax(x, -1)
        return weights.masked_fill_(x == minus_inf, 0.0)

    def _softmax_owned(self, x):
        # The weights take the scores' memory: no new (B, Q, K) tensor to page in.  CPU only
        # (its kernel reads each element before writing it; a test checks), not where
        # autograd needs x (out= has no backward), in half types (float32 math), or under a
        # compiler (which plans its own buffers).
        if (
            not x.is_cpu
            or x.dtype in _HALF
            or (x.requires_grad and torch.is_grad_enabled())
            or torch.compiler.is_compiling()
        ):
            return self.softmax(x)
        try:
            return torch.softmax(x, dim=-1, out=x)
        except RuntimeError:  # torch.func.vmap has no batching rule for out=
            return self.softmax(x)

    def _safe_softmax_owned(self, x):
        # a row of -inf gives NaN, then 0 where -inf was: fewer passes than the formula
        hidden = x == _constant(-math.inf, x)
        return self._softmax_owned(x).masked_fill_(hidden, 0.0)

    def length_mask(self, x, lens, axis=-1):
        n_keys = x.shape[axis]
        if (
            x.is_cpu
            and lens.is_cpu
            and lens.dim() == 1
            and lens.shape[0] * n_keys <= LENGTH_MASKS_MAX_ELEMENTS
            and not (_transformed(lens) or torch.compiler.is_compiling())
        ):  # a small mask made once per lengths (a model's layers share them): two ops fewer a call
            key = (n_keys, lens.dtype, *lens.tolist())
            mask = _LENGTH_MASKS.get(key)
            if mask is None:
                if len(_LENGTH_MASKS) > 256:
                    _LENGTH_MASKS.clear()
                with torch.inference_mode(False):  # kept: never an inference tensor autograd may not save
                    mask = _LENGTH_MASKS[key] = _positions(n_keys, None) < lens.view(-1, 1, 1)
            return mask
        if x.is_cpu:  # is_cpu first: reading .device builds a torch.device, costly at toy sizes
            device = None
            if not lens.is_cpu:
                lens = lens.cpu()
        else:
            device = x.device
            if lens.device != device:
                lens = lens.to(device)
        per_row = lens.view(-1, 1, 1) if lens.dim() == 1 else lens.unsqueeze(-1)
        return _positions(n_keys, device) < per_row

    def causal_mask(self, n_queries, n_keys, like):
        if torch.compiler.is_compiling():  # made in the graph: a cache read while traced is guarded on
            return torch.ones(n_queries, n_keys, dtype=torch.bool, device=like.device).tril()
        key = ("causal", n_queries, n_keys, None if like.is_cpu else like.device)
        mask = _POSITIONS.get(key)
        if mask is None:
            if len(_POSITIONS) > 256:
                _POSITIONS.clear()
            with torch.inference_mode(False):  # kept: never an inference tensor autograd may not save
                ones = torch.ones(n_queries, n_keys, dtype=torch.bool, device=like.device)
                mask = _POSITIONS[key] = ones.tril()
        return mask

    def logical_and(self, a, b):
        return a & b

    def split_heads(self, x, num_heads):
        batch, n, width = x.shape
        return x.reshape(batch, n, num_heads, width // num_heads).transpose(1, 2)

    def merge_heads(self, x):
        batch, heads, n, width = x.shape
        return x.transpose(1, 2).reshape(batch, n, heads * width)

    def reshape(self, x, shape):
        return x.reshape(tuple(shape))

    def where(self, mask, x, fill):
        return torch.where(mask, x, _constant(fill, x))

    def select(self, condition, x, y):
        return torch.where(condition, x, y)

    def call_mod(self, fn, args, like):
        # an int tensor times a Python float is in the default dtype: the call's, while fn runs
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        previous = torch.get_default_dtype()
        if dtype == previous:
            return fn(*args)
        torch.set_default_dtype(dtype)
        try:
            return fn(*args)
        finally:
            torch.set_default_dtype(previous)

    def positions(self, start, stop, like):
        return torch.arange(start, stop, device=like.device)

    def constant(self, values, like):
        return torch.as_tensor(values, device=like.device)

    def lowest(self, x):
        return _LOWEST[x.dtype]

    def cast(self, x, like):
        return x.to(like.dtype)

    def widen(self, x):
        return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x

    def exp(self, x):
        return torch.exp(x)

    def exp_minus(self, x, m, owned=False):
        # in place: no new block of scores (benchmarks/RESULTS.md); not where autograd, a
        # compiler or a transform records x
        if owned and not x.requires_grad and x.dtype == m.dtype and not _transformed(x):
            return x.sub_(m).exp_()
        return torch.exp(x - m)

    def log(self, x):
        return torch.log(x)

    def max(self, x, axis):
        return torch.amax(x, dim=axis, keepdim=True)

    def sum(self, x, axis):
        return torch.sum(x, dim=axis, keepdim=True)

    def maximum(self, a, b):
        return torch.clamp_min(a, b) if isinstance(b, float) else torch.maximum(a, b)

    def custom_gradient(self, forward, backward, tensors, constants=(), tangent=None):
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return forward(*tensors, *constants)
        if tangent is not None and _finite_on_host(tensors):  # autograd's own gradients are the rule's
            return forward(*tensors, *constants)
        # Dynamo traces no jvp method: compiled, the reverse mode alone
        function = _CustomGradient if tangent is None or torch.compiler.is_compiling() else _Linearised
        return function.apply(forward, backward, tangent, len(tensors), *tensors, *constants)

    def unrolls_loops(self, x):
        return torch.compiler.is_compiling()

    def host_count(self, value):
        # a count (a cache's length) as a 0-D int64 tensor on the CPU: torch.compile guards on
        # its dtype and shape, not on its value, and eagerly ``host_values`` reads it back
        return torch.scalar_tensor(value, dtype=torch.int64, device="cpu")

    def rows_at(self, x, start, size, axis=-2):
        if isinstance(start, int):
            return super().rows_at(x, start, size, axis)
        # a traced position (torch.compile): indices, not a slice (which would read the value back)
        at = torch.arange(size, device=x.device) + torch.as_tensor(start).to(x.device)
        return torch.index_select(x, axis, at)

    def write_rows(self, x, split, start, rows):
        if isinstance(split, int) and isinstance(start, int):
            return super().write_rows(x, split, start, rows)
        # traced positions (torch.compile): an index_put_ in place, as the slice assignment eagerly
        at = torch.arange(rows.shape[-2], device=x.device) + torch.as_tensor(start).to(x.device)
        split = torch.as_tensor(split).to(x.device).reshape(1)  # 1-D: a 0-D index is read back as an int
        index = (split,) + (slice(None),) * (x.dim() - 3) + (at,)
        x[index] = rows.movedim(-2, 0)  # the indices' axis first: apart from split, slices between
        return x

    def host_values(self, x):
        if x.device.type != "cpu" or torch.compiler.is_compiling() or _transformed(x):
            return None
        x = x.detach()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()  # numpy has no bfloat16

    # -- specialisations --------------------------------------------------------------------

    def attend_over_visible_keys(self, queries, keys, values, masks, scale, dropout, need_weights):
        if dropout is not None or not masks.one_length_per_sequence:
            return "not one length per sequence without dropout"
        if need_weights and _grouped(queries, keys):
            return "grouped heads' weights: the core's grouped products"
        # one sequence's products run below the batch's rate: they pay on large sequences only
        heads = queries.shape[1] if queries.dim() == 4 else 1
        if heads * queries.shape[-2] * keys.shape[-2] < VISIBLE_KEYS_MIN_SEQUENCE_SCORES:
            return "too few scores per sequence for the loop to pay"
        if queries.dtype not in _FULL or any(map(_transformed, (queries, keys, values, masks.valid_lens))):
            return "half types (float32 math) or a vmap/grad transform (no out=)"
        lengths = fast_paths.lengths_per_sequence(
            masks, lambda lens: _lengths_on_host(lens, queries, keys, values, recorded=not need_weights)
        )
        if isinstance(lengths, str):
            return lengths
        lengths = fast_paths.hiding_enough(lengths, keys.shape[-2], VISIBLE_KEYS_MAX_SHARE)
        if isinstance(lengths, str):
            return lengths
        # read on the host, as the lengths were (the padding never): the loop's softmax, and
        # SDPA's backward, would make NaN of them where the core's formula gives 0
        if not _finite_where_visible(queries, keys, values, lengths):
            return "a query or a visible key or value holds inf or NaN: the core's formula says what then"
        return functools.partial(
            self._attend_visible_keys, queries, keys, values, lengths, scale, need_weights
        )

    def row_windows(self, x, start, size, step, count):
        windows = x[..., start : start + (count - 1) * step + size, :].unfold(-2, size, step)
        return windows.movedim(-3, 0).transpose(-1, -2)  # a view: (count, ..., size, d)

    def joined_rows(self, x):
        # one copy at most: a concatenation of views with strides this odd is slow beside a busy process
        joined = x.movedim(0, -3)
        return joined.reshape(*joined.shape[:-3], -1, joined.shape[-1])

    def attend_by_flash_kernel(self, queries, keys, values, masks, scale, need_lse=False):
        # SDPA's flash kernel holds one block of scores at a time; its masked kernel all of them
        if need_lse:
            return _flash_with_lse(queries, keys, values, masks, scale)
        if _not_finite_under_autograd(queries, keys):
            return _not_finite_under_autograd(queries, keys)
        if masks.mask_mod is not None:  # small masked calls: each block of queries over its span
            if not queries.is_cpu or torch.compiler.is_compiling():
                return "a mask function's spans are planned on the host, eagerly (CPU tensors)"
            block = blockwise.automatic_block_size(self, queries, keys, mask_mod=masks.mask_mod)
            return functools.partial(
                fast_paths.attention_over_spans, self, _sdpa, queries, keys, values, masks, scale, block
            )
        if masks.none:
            return lambda: (_sdpa(queries, keys, values, None, scale), None)
        if masks.causal and masks.valid_lens is None and masks.attention_mask is None:
            if _parts_apply(queries, keys, values) and not _grouped(queries, keys):
                return lambda: (_causal_in_parts(self, queries, keys, values, scale), None)
            return lambda: (_sdpa(queries, keys, values, None, scale, is_causal=True), None)
        lens = masks.valid_lens
        if not masks.one_length_per_sequence or not lens.is_cpu or torch.compiler.is_compiling():
            return "a mask SDPA's flash kernel does not take (it takes none, causal, one length per sequence)"
        return lambda: (_flash_per_sequence(queries, keys, values, lens.tolist(), scale), None)

    def attend_fused(self, queries, keys, values, masks, scale, dropout, need_weights):
        declined = fast_paths.declines_fused(masks, dropout, need_weights)
        if declined:
            return declined
        if not fast_paths.at_least(queries.shape[:-1] + keys.shape[-2:-1], FUSED_MIN_SCORES):
            return "too few scores for SDPA's fixed cost"
        if _not_finite_under_autograd(queries, keys):
            return _not_finite_under_autograd(queries, keys)
        if masks.causal and masks.valid_lens is None and masks.attention_mask is None:
            # causality alone: SDPA's is_causal (top-left, as the core's), no mask made or read
            return lambda: (_sdpa(queries, keys, values, None, scale, is_causal=True), None)
        return functools.partial(fast_paths.fused_attention, self, _sdpa, queries, keys, values, masks, scale)

    def masked_softmax_writing_padding(self, scores, values, masks, owned):
        # on CPU the lengths are free to read, and a slice per sequence beats a masked pass
        if not masks.one_length_per_sequence:
            return "not one length per sequence"
        lengths = _sliceable_lengths(scores, masks.valid_lens)
        if lengths is None:
            return "too few scores per sequence, or the lengths are not readable on the host"
        return fast_paths.offer_writing_padding(
            self, scores, values, owned, lengths, copy=torch.clone, softmax=self._softmax_owned
        )

    def masked_softmax_in_scores_memory(self, scores, values, masks, owned):
        if scores.numel() < SMALL_ELEMENTS:
            return "small: the primitives' where and safe softmax cost less"
        if not scores.is_cpu or (scores.requires_grad and torch.is_grad_enabled()) or _transformed(scores):
            return "off the CPU, recorded by autograd or transformed (no out=)"
        if torch.compiler.is_compiling():
            return "the compiler plans its own buffers"
        return fast_paths.offer_in_scores_memory(
            self, scores, values, masks, owned, where=_masked_fill, safe_softmax=self._safe_softmax_owned
        )

    def _attend_visible_keys(self, queries, keys, values, lengths, scale, need_weights=True):
        if not need_weights:
            return _flash_per_sequence(queries, keys, values, lengths, scale), None
        # per sequence: its scores in one reused contiguous buffer, then copied into the
        # weights; 3-D inputs as 2-D products (MKL's own threading), which held up beside a
        # busy process where bmm and a strided softmax did not (benchmarks/RESULTS.md)
        gemm, product = (torch.addmm, torch.mm) if queries.dim() == 3 else (torch.baddbmm, torch.bmm)
        rows = queries.shape[1:-1]  # (Q,) or (H, Q)
        per_key = math.prod(rows)
        n_keys = keys.shape[-2]
        weights = queries.new_empty(*queries.shape[:-1], n_keys)
        out = queries.new_empty(*queries.shape[:-1], values.shape[-1])
        buffer = queries.new_empty(per_key * max(lengths))
        for b, n in enumerate(lengths):
            if n == 0:  # nothing visible: 0
                weights[b] = 0.0
                out[b] = 0.0
                continue
            scores = buffer[: per_key * n].view(*rows, n)
            gemm(scores, queries[b], keys[b, ..., :n, :].mT, beta=0, alpha=scale, out=scores)
            torch.softmax(scores, dim=-1, out=scores)
            product(scores, values[b, ..., :n, :], out=out[b])
            weights[b, ..., :n] = scores
            if n < n_keys:
                weights[b, ..., n:] = 0.0
        return out, weights


class _CustomGradient(torch.autograd.Function):
    """``Ops.custom_gradient``: forward saves its inputs and outputs, backward is the core's
    (written in torch's ops, so differentiable again); torch.func's transforms take it
    (setup_context, a generated vmap rule)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(forward, backward, tangent, n_tensors, *args):
        return tuple(forward(*args))

    @staticmethod
    def setup_context(ctx, inputs, outputs):
        _, backward, tangent, n_tensors, *args = inputs
        ctx.set_materialize_grads(False)  # an unused output's cotangent stays None
        ctx.backward, ctx.tangent, ctx.n_tensors, ctx.n_outputs = backward, tangent, n_tensors, len(outputs)
        ctx.save_for_backward(*args, *outputs)
        ctx.save_for_forward(*args)

    @staticmethod
    def backward(ctx, *cotangents):
        saved, n, n_out = ctx.saved_tensors, ctx.n_tensors, ctx.n_outputs
        args, outputs = saved[: len(saved) - n_out], saved[len(saved) - n_out :]
        grads = ctx.backward(args[:n], args[n:], outputs, cotangents)
        return (None, None, None, None, *grads) + (None,) * (len(args) - n)


class _Linearised(_CustomGradient):
    """``Ops.custom_gradient`` with a tangent rule: forward mode too (torch.func.jvp, hessian)."""

    @staticmethod
    def jvp(ctx, _forward, _backward, _tangent, _n, *tangents):
        args, n = ctx.saved_tensors, ctx.n_tensors
        given = tuple(torch.zeros_like(a) if t is None else t for a, t in zip(args[:n], tangents))
        return tuple(ctx.tangent(args[:n], args[n:], given))


def _grouped(queries, keys) -> bool:
    """Whether query heads share key heads (4-D, fewer key heads)."""
    return queries.dim() == 4 and keys.shape[1] != queries.shape[1]


def _sdpa(queries, keys, values, mask, scale, is_causal=False):
    """SDPA for the core's (B, [H,] n, d) inputs, mask None or boolean (B, [H|1,] 1|Q, K)."""
    if queries.dim() == 4:  # heads already; fewer key heads: grouped (query head i uses i // G)
        grouped = {"enable_gqa": True} if _grouped(queries, keys) else {}
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, is_causal=is_causal, **grouped
        )
    # a heads axis: with 4-D inputs SDPA takes its flash kernel on CPU too (3-D: its math path)
    out = F.scaled_dot_product_attention(
        queries.unsqueeze(1),
        keys.unsqueeze(1),
        values.unsqueeze(1),
        attn_mask=None if mask is None else mask.unsqueeze(1),
        scale=scale,
        is_causal=is_causal,
    )
    return out.squeeze(1)


# SDPA's CPU flash kernel with its log-sum-exp (the kernel F.scaled_dot_product_attention runs)
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _parts_apply(queries, keys, values):
    """Whether causal attention may run in blocks of queries (``_causal_in_parts``): fewer
    sequences x heads than threads (more, and SDPA's causal kernel is faster alone), square, on
    the CPU, in full precision, not differentiated (the kernel's lse has no gradient) nor
    compiled."""
    tensors = (queries, keys, values)
    return (
        _FLASH_WITH_LSE is not None
        and math.prod(queries.shape[:-2]) < torch.get_num_threads()
        and queries.shape[-2] == keys.shape[-2] >= 2
        and all(x.is_cpu and x.dtype in _FULL for x in tensors)
        and not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors))
        and not torch.compiler.is_compiling()
    )


def _flash_with_lse(queries, keys, values, masks, scale):
    """The offer of (output, lse) by SDPA's CPU flash kernel: no mask or causal alone."""
    if not (masks.none or (masks.causal and masks.valid_lens is None and masks.attention_mask is None)):
        return "a mask the flash kernel with its lse does not take (it takes none, causal)"
    declined = flash_with_lse_declines(queries, keys, values)
    return declined or functools.partial(flash_with_lse, queries, keys, values, masks.causal, scale)


def flash_with_lse_declines(*tensors) -> Optional[str]:
    """Why SDPA's CPU flash kernel with its lse cannot run on these tensors, or None."""
    if _FLASH_WITH_LSE is None or torch.compiler.is_compiling() or not all(x.is_cpu for x in tensors):
        return "no CPU flash kernel with its lse here (off the CPU, or compiled)"
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return "differentiated: the kernel's lse has no gradient"
    return None


def flash_with_lse(queries, keys, values, causal, scale):
    """(output, lse (B, [H,] Q)) by SDPA's CPU flash kernel (``flash_with_lse_declines``)."""
    heads = queries.dim() == 4
    tensors = (x if heads else x.unsqueeze(1) for x in (queries, keys, values))
    out, lse = _FLASH_WITH_LSE(*tensors, 0.0, causal, scale=scale)[:2]
    return (out, lse) if heads else (out.squeeze(1), lse.squeeze(1))


CAUSAL_PARTS = 4  # query blocks of a causal call on SDPA's flash kernel (benchmarks/RESULTS.md)


def _causal_in_parts(ops, queries, keys, values, scale):
    """Causal attention in CAUSAL_PARTS blocks of queries, each merged (state.combine) from
    the keys before it (no mask) and its own (causal): SDPA's causal flash kernel alone does
    not halve the time."""
    n = queries.shape[-2]
    bounds = sorted({n * i // CAUSAL_PARTS for i in range(CAUSAL_PARTS + 1)})
    outs = []
    for start, stop in zip(bounds, bounds[1:]):
        q = queries[..., start:stop, :]
        parts = [flash_with_lse(q, keys[..., start:stop, :], values[..., start:stop, :], True, scale)]
        if start:
            parts.append(flash_with_lse(q, keys[..., :start, :], values[..., :start, :], False, scale))
        outs.append(state.combine(ops, parts)[0])
    return torch.cat(outs, -2)


def _flash_per_sequence(queries, keys, values, lengths, scale):
    """SDPA per sequence on its visible keys (its flash kernel: no mask), joined, not written
    in place, so autograd follows."""
    outs = []
    for b, n in enumerate(lengths):
        q, k, v = (x[b : b + 1] for x in (queries, keys, values))
        if n <= 0:  # nothing visible: 0
            outs.append(q.new_zeros(*q.shape[:-1], v.shape[-1]))
            continue
        n = min(math.ceil(n), k.shape[-2])
        outs.append(_sdpa(q, k[..., :n, :], v[..., :n, :], None, scale))
    return torch.cat(outs)


# Below this many scores per sequence the loop over the sequences' visible keys costs more
# than its smaller products save; and it pays only where the lengths hide enough of the keys.
VISIBLE_KEYS_MIN_SEQUENCE_SCORES = 1 << 16
VISIBLE_KEYS_MAX_SHARE = 0.85
# Below this many scores SDPA's fixed cost exceeds the unfused math's on CPU.
FUSED_MIN_SCORES = 1 << 16
_FULL = (torch.float32, torch.float64)
# vmap and grad transforms wrap their tensors (and refuse out=); without the test: decline
_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda x: True)


def _transformed(x) -> bool:
    """Whether x may be wrapped by a transform: always under torch.compile, which cannot call
    the test and whose graphs must hold neither out= nor host reads."""
    return torch.compiler.is_compiling() or _wrapped(x)


# Below this many scores per sequence the per-slice Python and kernel cost (a few us per
# sequence) exceeds a masked pass over all of them.
SLICE_MIN_SEQUENCE_ELEMENTS = 1 << 15


def _sliceable_lengths(x: torch.Tensor, lens: torch.Tensor) -> Optional[list]:
    """The lengths as Python numbers where x's padding may be written slice by slice (large
    enough, and ``_lengths_on_host``); else None."""
    if x.numel() < SLICE_MIN_SEQUENCE_ELEMENTS * x.shape[0]:
        return None
    return _lengths_on_host(lens, x)


def _finite_on_host(tensors: tuple) -> bool:
    """Whether the tensors, eagerly on the CPU (where reading them costs no synchronisation),
    are all finite; False where they are not read."""
    if torch.compiler.is_compiling() or not all(t.is_cpu and not _transformed(t) for t in tensors):
        return False
    # one sum: finite only where every entry is (an overflow reads as not finite: the rule
    # then runs, as correct), for a third of isfinite's microseconds on small tensors
    return math.isfinite(sum(float(t.detach().sum()) for t in tensors))


def _finite_where_visible(queries, keys, values, lengths: list) -> bool:
    """Whether the queries and each sequence's visible keys and values are finite."""
    if not bool(torch.isfinite(queries).all()):
        return False
    return all(
        bool(torch.isfinite(x[b, ..., :n, :]).all()) for b, n in enumerate(lengths) for x in (keys, values)
    )


def _not_finite_under_autograd(queries: torch.Tensor, keys: torch.Tensor) -> Optional[str]:
    """Why SDPA may not take a recorded call: a query or key holding inf or NaN, whose hidden
    scores' dS of 0 its backward multiplies to NaN (the core's product takes finite factors,
    ``state.scores``).  Read eagerly on the CPU only: on a device or compiling, taken as finite."""
    tensors = (queries, keys)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return None
    if torch.compiler.is_compiling() or not all(t.is_cpu and not _transformed(t) for t in tensors):
        return None
    if _finite_on_host(tensors):
        return None
    return "a query or key holds inf or NaN under autograd: SDPA's backward would make NaN of it"


def _lengths_on_host(lens: torch.Tensor, *tensors: torch.Tensor, recorded: bool = False) -> Optional[list]:
    """lens as Python numbers where the host strategies may use them on these tensors: one
    length per sequence, all in host memory, no autograd on them unless ``recorded`` (the
    strategies that write into what they make, as softmax's backward needs its output, may
    not), nothing tracing or compiling (graphs must not bake the lengths in as constants);
    else None."""
    if not (
        lens.dim() == 1
        and lens.is_cpu
        and all(t.is_cpu for t in tensors)
        and (recorded or not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
    ):
        return None
    try:
        return lens.tolist()
    except RuntimeError:  # under torch.func.vmap the lengths are batched: no data to read
        return None


# Below this size the primitives' where and safe softmax cost less than filling in place.
SMALL_ELEMENTS = 1 << 14


def _masked_fill(mask: torch.Tensor, x: torch.Tensor, fill: float) -> torch.Tensor:
    """``Ops.where`` written into x."""
    return x.masked_fill_(~mask, fill)


_CONSTANTS: dict = {}


def _constant(value: float, like: torch.Tensor) -> torch.Tensor:
    """value as a cached 0-d tensor of like's dtype and device: torch.where takes one in
    half the time of a Python float, which it wraps into a new tensor on every call."""
    if torch.compiler.is_compiling():  # made in the graph: a cache read while traced is guarded on
        return torch.full((), value, dtype=like.dtype, device=like.device)
    key = (value, like.dtype) if like.is_cpu else (value, like.dtype, like.device)
    try:
        return _CONSTANTS[key]
    except KeyError:
        if len(_CONSTANTS) > 256:
            _CONSTANTS.clear()
        constant = _CONSTANTS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
        return constant


def _activation_of_sum(activation, in_place, a, b, buffers: list) -> torch.Tensor:
    """activation(a + b), written into the dead block kept in buffers where autograd allows."""
    if torch.is_grad_enabled():
        # the product with w_v may keep each block for its backward (even when a and
        # b need no gradient), so blocks share memory only under no_grad/inference_mode
        return activation(a + b)
    # one buffer for all blocks stays in cache and off the allocator
    dead = buffers.pop() if buffers else None
    features = None
    if dead is not None and dead.shape == _sum_shape(a, b):
        try:
            features = in_place(torch.add(a, b, out=dead))
        except RuntimeError:  # torch.func.vmap has no batching rule for out=
            pass
    if features is None:
        features = in_place(a + b)
    buffers.append(features)
    return features


def _sum_shape(a: torch.Tensor, b: torch.Tensor) -> Optional[tuple]:
    """The shape of a + b for same-rank a and b (torch.broadcast_shapes imports sympy)."""
    if a.dim() != b.dim():
        return None
    return tuple(x if y == 1 else y for x, y in zip(a.shape, b.shape))


_POSITIONS: dict = {}
# (keys, dtype, *lengths) -> the (B, 1, K) mask; at most 256 of at most this many elements
_LENGTH_MASKS: dict = {}
LENGTH_MASKS_MAX_ELEMENTS = 1 << 12
_LOWEST = {
    dtype: torch.finfo(dtype).min for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def _positions(n: int, device: Optional[torch.device]) -> torch.Tensor:
    """arange(n) on device (None: the CPU), cached: the mask is rebuilt on every call and
    the toy sizes are per-op bound."""
    if torch.compiler.is_compiling():  # made in the graph: a cache read while traced is guarded on
        return torch.arange(n, device="cpu" if device is None else device)
    key = (n, device)
    tensor = _POSITIONS.get(key)
    if tensor is None:
        if len(_POSITIONS) > 256:  # many distinct sizes: keep the cache small
            _POSITIONS.clear()
        tensor = _POSITIONS[key] = torch.arange(n, device="cpu" if device is None else device)
    return tensor


def least_threshold() -> int:
    """The fewest scores at which an offer of ``dot_product_attend`` or ``masked_softmax`` may
    run: torch's ``tuning.Tuning.specialised_from`` (tests that lower a threshold set it anew)."""
    return min(
        SMALL_ELEMENTS, SLICE_MIN_SEQUENCE_ELEMENTS, VISIBLE_KEYS_MIN_SEQUENCE_SCORES, FUSED_MIN_SCORES
    )


tuning.TUNING["torch"].specialised_from = least_threshold()
ops = TorchOps()
masked_softmax, dot_product_attention, additive_attention, multi_head_attention = bind(ops)
__getattr__ = _registry.layer_exports("torch")
# the registry knows torch's tensors and this module from import on: torch.compile traces its
# lookups, and a lookup that fills it while traced would be guarded on and recompile
for _tensor in (torch.empty(0), torch.nn.Parameter(torch.empty(0))):
    _registry.framework_of(_tensor)
_registry._loaded.setdefault("torch", sys.modules[__name__])


def vjp(fn, args, cotangent):
    """(fn(*args), gradients of sum(fn(*args) * cotangent) with respect to args)."""
    args = [a.detach().clone().requires_grad_(True) for a in args]
    out = fn(*args)
    grads = torch.autograd.grad(out, args, grad_outputs=cotangent, allow_unused=True)
    return out.detach(), [torch.zeros_like(a) if g is None else g for a, g in zip(args, grads)]


def from_numpy(array: Any, dtype: Optional[str] = None) -> torch.Tensor:
    """A new torch tensor with the values of ``array`` (cast to ``dtype``, e.g. "bfloat16")."""
    tensor = torch.from_numpy(np.array(array))
    return tensor if dtype is None else tensor.to(getattr(torch, dtype))


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy copy (bfloat16, which numpy lacks, comes back as float32)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return tensor.numpy().copy()
