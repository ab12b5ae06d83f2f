"""``torch.compile(fn, fullgraph=True)`` of multiattn's torch calls (issue 48): one graph, no
graph break, no recompile on a second call with new data of the same shapes, and the values
of the float64 reference (tests/reference.py) to 1e-10.  Dynamo's "eager" backend (a
CompileCounter) for the structure, "aot_eager" where gradients are taken, inductor once."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest

import multiattn
from multiattn import mods

from . import reference as ref

torch = pytest.importorskip("torch")
from torch._dynamo.testing import CompileCounter  # noqa: E402

from multiattn.backends import torch as mt  # noqa: E402

pytestmark = pytest.mark.backend("torch")

SMALL = (2, 2, 6, 4)  # below every specialisation's threshold: the core's formula
FUSED = (1, 4, 128, 2)  # past torch's FUSED_MIN_SCORES: the specialisations are asked
TOL = 1e-10


def user_score(s, b, h, q_idx, kv_idx):
    return s + 0.1 * (q_idx - kv_idx)


def in_window(b, h, i, j):
    return 0 <= i - j < 4


WINDOW = mods.sliding_window(4)


def _qkv(seed, shape):
    rng = np.random.default_rng(seed)
    return tuple(torch.from_numpy(rng.normal(size=shape)) for _ in range(3))


def _lens(seed, shape):
    return torch.from_numpy(np.random.default_rng(seed).integers(1, shape[2] + 1, size=shape[0]))


def _mask(seed, shape):
    mask = np.random.default_rng(seed).random((shape[0], 1, shape[2], shape[2])) < 0.7
    mask[..., 0] = True  # every row sees a key (the row rule has tests of its own)
    return torch.from_numpy(mask)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


# torch 2.13's Dynamo warns so on tracing any autograd.Function (it makes one itself)
TORCH_FUNCTION_WARNING = "<class 'torch.autograd.function.Function'> should not be instantiated"


def compiled_twice(fn, first, second, backend=None):
    """fn compiled with fullgraph=True and called on two argument tuples of the same shapes:
    the results, with one frame compiled (a recompile raises) and no graph break counted."""
    counter = CompileCounter()
    compiled = torch.compile(fn, backend=backend or counter, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True), warnings.catch_warnings():
        warnings.simplefilter("error")  # a Dynamo warning (a builtin it skips) fails the test
        warnings.filterwarnings("ignore", TORCH_FUNCTION_WARNING, DeprecationWarning)
        results = compiled(*first), compiled(*second)
    if backend is None:
        assert counter.frame_count == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    return results


def _reference(q, k, v, **kwargs):
    return ref.heads_attention(*(x.detach().numpy() for x in (q, k, v)), **kwargs)[0]


def _close(got, want):
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=TOL, atol=TOL)


# name: (the call, its extra tensors made from (seed, shape), the reference's keywords of them)
CASES = {
    "causal": (
        lambda q, k, v: multiattn.dot_product_attention(q, k, v, causal=True),
        lambda seed, shape: (),
        lambda: dict(causal=True),
    ),
    "lengths": (
        lambda q, k, v, lens: multiattn.dot_product_attention(q, k, v, lens),
        lambda seed, shape: (_lens(seed, shape),),
        lambda lens: dict(valid_lens=lens.numpy()),
    ),
    "attention_mask": (
        lambda q, k, v, mask: multiattn.dot_product_attention(q, k, v, attention_mask=mask),
        lambda seed, shape: (_mask(seed, shape),),
        lambda mask: dict(attention_mask=mask.numpy()),
    ),
    "lengths, mask and causal": (
        lambda q, k, v, lens, mask: multiattn.dot_product_attention(
            q, k, v, lens, attention_mask=mask, causal=True
        ),
        lambda seed, shape: (_lens(seed, shape), _mask(seed, shape)),
        lambda lens, mask: dict(valid_lens=lens.numpy(), attention_mask=mask.numpy(), causal=True),
    ),
    "mask_mod": (
        lambda q, k, v: multiattn.dot_product_attention(q, k, v, mask_mod=WINDOW),
        lambda seed, shape: (),
        lambda: dict(mask_fn=in_window),
    ),
    "score_mod": (
        lambda q, k, v: multiattn.dot_product_attention(q, k, v, score_mod=user_score, causal=True),
        lambda seed, shape: (),
        lambda: dict(score_fn=user_score, causal=True),
    ),
    "mods made in the compiled function": (
        lambda q, k, v: multiattn.dot_product_attention(
            q,
            k,
            v,
            score_mod=lambda s, b, h, q_idx, kv_idx: s + 0.1 * (q_idx - kv_idx),
            mask_mod=mods.sliding_window(4),
        ),  # fmt: skip
        lambda seed, shape: (),
        lambda: dict(score_fn=user_score, mask_fn=in_window),
    ),
}


@pytest.mark.parametrize("shape", [SMALL, FUSED], ids=["small", "fused sizes"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_4d_call_compiles_as_one_graph_once_with_the_reference_values(case, shape):
    fn, extra, want = CASES[case]
    args = [(*_qkv(seed, shape), *extra(seed, shape)) for seed in (1, 2)]
    for got, call in zip(compiled_twice(fn, *args), args):
        _close(got, _reference(*call[:3], **want(*call[3:])))


def test_a_3d_call_with_lengths_causality_and_mods_compiles_as_one_graph_once():
    def fn(q, k, v, lens):
        return multiattn.dot_product_attention(
            q, k, v, lens, causal=True, mask_mod=WINDOW, score_mod=user_score
        )

    shape = (SMALL[0], 1, SMALL[2], SMALL[3])  # 3-D calls are 4-D ones of one head (h = 0)
    args = [(*(x[:, 0] for x in _qkv(seed, shape)), _lens(seed, shape)) for seed in (1, 2)]
    for got, (q, k, v, lens) in zip(compiled_twice(fn, *args), args):
        want = _reference(q[:, None], k[:, None], v[:, None], valid_lens=lens.numpy(), causal=True,
                          mask_fn=in_window, score_fn=user_score)  # fmt: skip
        _close(got, want[:, 0])


def test_a_block_mask_made_outside_and_flex_attention_compile_as_one_graph_once():
    q = _qkv(0, SMALL)[0]
    block_mask = multiattn.create_block_mask(WINDOW, batch=SMALL[0], q_len=SMALL[2], kv_len=SMALL[2], like=q)

    def fn(q, k, v):
        out = multiattn.dot_product_attention(q, k, v, block_mask=block_mask, score_mod=user_score)
        flex, lse = multiattn.flex_attention(q, k, v, user_score, block_mask, return_lse=True)
        return out, flex, lse

    args = [_qkv(seed, SMALL) for seed in (1, 2)]
    for (out, flex, lse), call in zip(compiled_twice(fn, *args), args):
        want = _reference(*call, mask_fn=in_window, score_fn=user_score)
        _close(out, want)
        _close(flex, want)
        np_args = (x.numpy() for x in call[:2])
        _close(lse, ref.heads_lse(*np_args, mask_fn=in_window, score_fn=user_score))


BLOCKED = (2, 2, 10, 4)  # 10 positions in blocks of 4: three query blocks, the last one short


def test_a_call_in_blocks_of_4_compiles_as_one_graph_once():
    """block_size=4: the host's plan of blocks (its caches of Python state not read or filled
    while traced, else a recompile) with causality, lengths and a mask function."""

    def fn(q, k, v, lens):
        return multiattn.dot_product_attention(q, k, v, lens, causal=True, mask_mod=WINDOW, block_size=4)

    args = [(*_qkv(seed, BLOCKED), _lens(seed, BLOCKED)) for seed in (1, 2)]
    for got, (q, k, v, lens) in zip(compiled_twice(fn, *args), args):
        _close(got, _reference(q, k, v, valid_lens=lens.numpy(), causal=True, mask_fn=in_window))


def test_a_block_mask_in_blocks_of_4_compiles_as_one_graph_once():
    """A block mask made with block_size=4 outside: its map of shown blocks is not filled while traced."""
    q = _qkv(0, BLOCKED)[0]
    block_mask = multiattn.create_block_mask(
        WINDOW, batch=BLOCKED[0], q_len=BLOCKED[2], kv_len=BLOCKED[2], like=q, block_size=4
    )

    def fn(q, k, v):
        return multiattn.dot_product_attention(q, k, v, block_mask=block_mask)

    args = [_qkv(seed, BLOCKED) for seed in (1, 2)]
    for got, call in zip(compiled_twice(fn, *args), args):
        _close(got, _reference(*call, mask_fn=in_window))
    assert not block_mask.maps  # else a later compiled call is guarded on it


def test_a_call_past_the_scores_budget_compiles_as_one_graph_once(monkeypatch):
    """No block_size: the scores past the budget (made tiny here, and the blocks small) choose blocks."""
    from multiattn import blockwise

    for name, value in (("SCORES_BUDGET_BYTES", 64), ("MIN_BLOCK", 4), ("MAX_BLOCK", 4)):
        monkeypatch.setattr(blockwise, name, value)
    sides = []
    original = blockwise.forward
    monkeypatch.setattr(blockwise, "forward", lambda *a, **kw: sides.append(a[1].block) or original(*a, **kw))

    def fn(q, k, v, lens):
        return multiattn.dot_product_attention(q, k, v, lens, causal=True)

    args = [(*_qkv(seed, BLOCKED), _lens(seed, BLOCKED)) for seed in (1, 2)]
    fn(*args[0])
    assert sides == [4]  # eagerly too, the call runs in blocks of 4
    monkeypatch.setattr(blockwise, "forward", original)
    for got, (q, k, v, lens) in zip(compiled_twice(fn, *args), args):
        _close(got, _reference(q, k, v, valid_lens=lens.numpy(), causal=True))


def _weights(seed, hiddens, bias):
    rng = np.random.default_rng(seed)
    names = ("W_q", "W_k", "W_v", "W_o") + (("b_q", "b_k", "b_v", "b_o") if bias else ())
    return {n: rng.normal(size=(hiddens, hiddens) if n[0] == "W" else (hiddens,)) for n in names}


def _sequences(seed, batch=2, n=6, hiddens=8):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, n + 1, size=batch)
    return (
        *(torch.from_numpy(rng.normal(size=(batch, n, hiddens))) for _ in range(3)),
        torch.from_numpy(lens),
    )


def test_multi_head_attention_and_the_torch_layer_compile_as_one_graph_once():
    weights = _weights(3, 8, bias=True)
    tensors = {n: torch.from_numpy(w) for n, w in weights.items()}
    layer = mt.MultiHeadAttention(8, 2, bias=True, dtype=torch.float64).eval()
    with torch.no_grad():
        for n in ("q", "k", "v", "o"):
            getattr(layer, "W_" + n).weight.copy_(tensors["W_" + n])
            getattr(layer, "W_" + n).bias.copy_(tensors["b_" + n])

    def fn(q, k, v, lens):
        out = multiattn.multi_head_attention(q, k, v, lens, weights=tensors, num_heads=2, causal=True)
        return out, layer(q, k, v, lens, causal=True)

    args = [_sequences(seed) for seed in (1, 2)]
    for (out, layer_out), call in zip(compiled_twice(fn, *args), args):
        numpy_args = [x.numpy() for x in call]
        want = ref.multi_head_attention(*numpy_args, weights=weights, num_heads=2, causal=True)[0]
        _close(out, want)
        _close(layer_out, want)
    weights_back = layer.attention_weights  # the layer keeps its weights (need_weights=True)
    assert weights_back is not None and weights_back.shape == (2, 2, 6, 6)


@pytest.mark.parametrize("shape", [SMALL, FUSED], ids=["small", "fused sizes"])
def test_gradients_through_a_compiled_causal_call_are_the_eager_calls(shape):
    """aot_eager: AOTAutograd traces the backward as well; the eager call's gradients are the
    reference's (tests/test_gradients.py)."""
    args = [tuple(x.requires_grad_(True) for x in _qkv(seed, shape)) for seed in (1, 2)]

    def fn(q, k, v, lens):
        return multiattn.dot_product_attention(q, k, v, lens, causal=True)

    lens = [_lens(seed, shape) for seed in (1, 2)]
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    cotangent = torch.from_numpy(np.random.default_rng(5).normal(size=shape[:-1] + (shape[-1],)))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for call, n in zip(args, lens):
            got = torch.autograd.grad(compiled(*call, n), call, cotangent)
            want = torch.autograd.grad(fn(*call, n), call, cotangent)
            for g, w in zip(got, want):
                _close(g, w.numpy())
    assert not torch._dynamo.utils.counters["graph_break"]


def test_inductor_compiles_a_causal_call_to_sdpa_with_the_reference_values():
    """The one inductor compilation: float32 through SDPA's causal kernel (``attend_fused``)."""
    from torch._inductor.compile_fx import compile_fx

    q, k, v = (x.float() for x in _qkv(4, FUSED))
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    fn = torch.compile(lambda q, k, v: multiattn.dot_product_attention(q, k, v, causal=True), backend=keep)
    got = fn(q, k, v)
    np.testing.assert_allclose(got.numpy(), _reference(q, k, v, causal=True), rtol=1e-5, atol=1e-5)
    (graph,) = graphs
    calls = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert calls == [torch._C._nn.scaled_dot_product_attention]


def test_a_fresh_process_compiles_its_first_call_with_fullgraph():
    """The first multiattn call of a process, inside torch.compile: the torch backend is loaded
    while Dynamo traces (a static import), no graph break."""
    code = (
        "import torch, multiattn\n"
        "from multiattn.flex import create_block_mask, flex_attention\n"
        "bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 6, 6)\n"
        "fn = torch.compile(lambda q: (multiattn.dot_product_attention(q, q, q, causal=True),\n"
        "                              flex_attention(q, q, q, block_mask=bm)),\n"
        "                   backend='eager', fullgraph=True)\n"
        "a, b = fn(torch.ones(1, 2, 6, 4))\n"
        "print(float((a - b).abs().max()))\n"
    )
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "0.0"


DECODE = (2, 4, 2, 8, 20)  # batch, query heads, kv heads, head_dim, positions
PREFILL = 4


def _decoding(seed):
    batch, heads, kv_heads, dim, positions = DECODE
    rng = np.random.default_rng(seed)
    return tuple(
        torch.from_numpy(rng.normal(size=(batch, h, positions, dim))) for h in (heads, kv_heads, kv_heads)
    )


def _step(q, k, v, cache, **kwargs):
    return multiattn.cached_attention(q, k, v, cache, **kwargs)


def _prefilled(q, k, v, **layout):
    cache = multiattn.KVCache(DECODE[0], DECODE[2], DECODE[3], like=q, **layout)
    return _step(*(x[:, :, :PREFILL] for x in (q, k, v)), cache)[1]


LAYOUTS = {"contiguous": dict(capacity=32), "paged": dict(page_size=16, num_pages=2)}


@pytest.mark.parametrize("window", [None, 8], ids=["causal", "sliding window"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cached_attention_steps_compile_as_one_graph_once(layout, window):
    """Decoding steps past a split (and a page) boundary: one frame for every length (the
    length a 0-D tensor, written at a traced position), the eager steps' values."""
    q, k, v = _decoding(1)
    kwargs = {} if window is None else dict(mask_mod=mods.sliding_window(window))
    counter = CompileCounter()
    compiled = torch.compile(functools.partial(_step, **kwargs), backend=counter, fullgraph=True)
    cache, eager = (_prefilled(q, k, v, **LAYOUTS[layout]) for _ in range(2))
    outs = []
    with torch._dynamo.config.patch(error_on_recompile=True), warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", TORCH_FUNCTION_WARNING, DeprecationWarning)
        for t in range(PREFILL, DECODE[-1]):
            step = tuple(x[:, :, t : t + 1] for x in (q, k, v))
            out, cache = compiled(*step, cache)
            want, eager = _step(*step, eager, **kwargs)
            if window is None:  # the same splits, visited alike
                assert torch.equal(out, want), t
            else:  # eagerly the splits before the window are not visited
                _close(out, want.numpy())
            outs.append(out)
    assert counter.frame_count == 1 and not torch._dynamo.utils.counters["graph_break"]
    assert cache.length == eager.length == DECODE[-1]
    mask_fn = None if window is None else (lambda b, h, i, j: 0 <= i - j < window)
    _close(torch.cat(outs, 2), _reference(q, k, v, causal=True, mask_fn=mask_fn)[:, :, PREFILL:])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_compiled_step_past_the_storage_gives_nan_and_an_eager_one_grows(layout):
    q, k, v = _decoding(2)
    compiled = torch.compile(_step, backend=CompileCounter(), fullgraph=True)
    small = dict(capacity=16) if layout == "contiguous" else dict(page_size=16, num_pages=1)
    cache, eager = (_prefilled(q, k, v, **small) for _ in range(2))
    want = _reference(q, k, v, causal=True)
    for t in range(PREFILL, 18):
        step = tuple(x[:, :, t : t + 1] for x in (q, k, v))
        out, cache = compiled(*step, cache)
        if t < 16:
            _close(out, want[:, :, t : t + 1])
        else:  # nothing stored, and never a finite wrong answer
            assert torch.isnan(out).all(), t
        out, eager = _step(*step, eager)
        _close(out, want[:, :, t : t + 1])  # eagerly the storage grows
    assert cache.length == 18 and cache.capacity == 16 and eager.capacity >= 18
    with pytest.raises(ValueError, match="cache length 18 exceeds its capacity 16"):
        _step(*(x[:, :, 18:19] for x in (q, k, v)), cache)
