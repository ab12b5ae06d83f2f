"""torch's fast paths against the float64 reference: on CPU at large sizes it writes only the
padding (one slice per sequence), and under no_grad the additive blocks share one buffer.
The same answers as the masked path, exactly 0 where masked, no NaN, gradients intact."""

from __future__ import annotations

import numpy as np
import pytest

from multiattn import tuning

from . import reference as ref
from .forcing import lower_thresholds
from .tolerances import tolerance

pytestmark = pytest.mark.backend("torch")


def _module():
    from multiattn.backends import torch as m

    return m


@pytest.fixture
def taken(monkeypatch):
    """Every size takes the slice path; the list records whether it was offered, each call."""
    m = _module()
    answers: list = []
    real = m.TorchOps.masked_softmax_writing_padding

    def spy(self, scores, values, masks, owned):
        offer = real(self, scores, values, masks, owned)
        answers.append(not isinstance(offer, str))
        return offer

    # slices, and the softmax writes into the scores
    lower_thresholds(m, monkeypatch, SLICE_MIN_SEQUENCE_ELEMENTS=0, SMALL_ELEMENTS=0)
    monkeypatch.setattr(m.TorchOps, "masked_softmax_writing_padding", spy)
    return answers


def _tensors(dtype, *arrays):
    import torch

    return [torch.tensor(a).to(getattr(torch, dtype)) for a in arrays]


LENS = np.array([0, -2, 3, 7, 50])  # fully masked, negative, partial, the whole row, over-long


def _poisoned_padding(poison, seed):
    """(q, k, v, lens, reference output, reference weights): the reference from clean inputs,
    then poison written into the keys and values past each length (float64)."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(3, 4, 4)), rng.normal(size=(3, 6, 4)), rng.normal(size=(3, 6, 3))
    lens = np.array([2, 0, 5])
    want_out, want = ref.dot_product_attention(q, k, v, lens)
    for b, n in enumerate(lens):
        k[b, n:], v[b, n:] = poison, poison
    return q, k, v, lens, want_out, want


def _no_finite_visible_score(poison, seed, lens=(3, 4)):
    """float64 (q, k, v) tensors and lengths where query 0 of each sequence has no finite
    visible score (poison * negative keys: -inf, or NaN)."""
    import torch

    q = np.zeros((2, 2, 2))
    q[:, 0, 0] = poison
    q[:, 1] = 1.0
    k = -np.abs(np.random.default_rng(seed).normal(size=(2, 5, 2))) - 0.5
    v = np.random.default_rng(seed + 1).normal(size=(2, 5, 3))
    return _tensors("float64", q, k, v) + [torch.tensor(lens)]


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["dot", "additive"])
def test_slices_match_the_reference(taken, kind, dtype):
    import torch

    m = _module()
    rng = np.random.default_rng(11)
    B, Q, K = len(LENS), 3, 7
    q, k, v = rng.normal(size=(B, Q, 4)), rng.normal(size=(B, K, 4)), rng.normal(size=(B, K, 2))
    weights = {"W_q": rng.normal(size=(5, 4)), "W_k": rng.normal(size=(5, 4)), "w_v": rng.normal(size=(5,))}
    q, k, v = _tensors(dtype, q, k, v)
    lens = torch.tensor(LENS)
    rounded = [t.double().numpy() for t in (q, k, v)]
    if kind == "dot":
        out, got = m.dot_product_attention(q, k, v, lens, return_weights=True)
        want_out, want = ref.dot_product_attention(*rounded, LENS)
    else:
        W = _tensors(dtype, weights["W_q"], weights["W_k"], weights["w_v"])
        out, got = m.additive_attention(q, k, v, lens, W_q=W[0], W_k=W[1], w_v=W[2], return_weights=True)
        want_out, want = ref.additive_attention(*rounded, LENS, *(w.double().numpy() for w in W))
    assert taken and all(taken), "the slice path did not run"
    got, out = got.double().numpy(), out.double().numpy()
    tol = tolerance("torch", dtype)
    np.testing.assert_allclose(got, want, atol=tol * 4)
    np.testing.assert_allclose(out, want_out, atol=tol * 4 * max(1.0, np.abs(want_out).max()))
    for b, n in enumerate(LENS):
        assert np.all(got[b, :, max(n, 0) :] == 0.0)  # exactly, not tiny


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_slices_keep_padding_out_of_the_outputs(taken, poison):
    import torch

    m = _module()
    q, k, v, lens, want_out, want = _poisoned_padding(poison, seed=12)
    out, got = m.dot_product_attention(*_tensors("float64", q, k, v), torch.tensor(lens), return_weights=True)
    assert taken and all(taken)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("poison", [np.inf, np.nan])
def test_rows_without_a_finite_visible_score_match_the_masked_path(taken, monkeypatch, poison):
    # visible scores all -inf: every masked weight equals 1/#masked after the softmax,
    # so the uniform shortcut must notice and zero them, as the masked path does;
    # a NaN query: NaN where the math says, exact zeros in the padding, on both paths

    m = _module()
    args = _no_finite_visible_score(poison, seed=13)
    sliced = [t.numpy() for t in m.dot_product_attention(*args, return_weights=True)]
    assert taken and all(taken)
    lower_thresholds(m, monkeypatch, SLICE_MIN_SEQUENCE_ELEMENTS=1 << 40)
    masked = [t.numpy() for t in m.dot_product_attention(*args, return_weights=True)]
    assert taken[-1] is False  # the second call took the masked path
    for a, b in zip(sliced, masked):
        np.testing.assert_array_equal(a, b)  # NaN in the same places, zeros in the same places
    assert np.all(sliced[1][0, 0, 3:] == 0)
    assert np.isnan(sliced[1][0, 0, :3]).all() == np.isnan(poison)


def test_a_row_of_minus_inf_without_padding_declines_the_slices(taken):
    """Sequence 1 shows all 5 keys and its query 0's scores are all -inf: no padding keeps its
    maximum finite, so the slices decline and the formula gives the row weights 0."""
    m = _module()
    out, weights = m.dot_product_attention(*_no_finite_visible_score(np.inf, 13, (3, 5)), return_weights=True)
    assert taken == [False]
    assert (weights[:, 0].numpy() == 0).all() and (out[:, 0].numpy() == 0).all()
    assert np.isfinite(weights.numpy()).all()


def test_the_default_threshold_slices_at_benchmark_sizes_only():
    import torch

    m = _module()
    rng = np.random.default_rng(15)
    q, k, v = rng.normal(size=(2, 256, 8)), rng.normal(size=(2, 256, 8)), rng.normal(size=(2, 256, 3))
    lens = np.array([100, 256])
    assert m._sliceable_lengths(torch.zeros(2, 256, 256), torch.tensor(lens)) == [100, 256]
    assert m._sliceable_lengths(torch.zeros(2, 3, 5), torch.tensor(lens)) is None
    with torch.no_grad():
        out, weights = m.dot_product_attention(
            *_tensors("float32", q, k, v), torch.tensor(lens), return_weights=True
        )
    want_out, want = ref.dot_product_attention(q, k, v, lens)
    np.testing.assert_allclose(out.numpy(), want_out, atol=1e-5)
    np.testing.assert_allclose(weights.numpy(), want, atol=1e-6)
    assert np.all(weights.numpy()[0, :, 100:] == 0.0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_softmax_writes_into_the_scores_only_where_nothing_needs_them(dtype):
    import torch

    m = _module()
    x = torch.randn(4, 64, 64, dtype=getattr(torch, dtype)) * 5
    x[0, 0, :] = -torch.inf  # all -inf: NaN, as torch.softmax gives
    x[1, 1, 3] = torch.inf
    want = torch.softmax(x, dim=-1)
    owned = x.clone()
    got = m.ops._softmax_owned(owned)
    assert got.data_ptr() == owned.data_ptr()  # no new (B, Q, K) tensor
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)

    # autograd needs the scores (softmax's backward keeps its output): a new tensor
    leaf = x.clone().requires_grad_()
    scores = leaf * 1.0
    got = m.ops._softmax_owned(scores)
    assert got.data_ptr() != scores.data_ptr()
    cotangent = torch.randn_like(x)
    (got * cotangent).nansum().backward()
    expected = leaf.detach().clone().requires_grad_()
    (torch.softmax(expected, dim=-1) * cotangent).nansum().backward()
    torch.testing.assert_close(leaf.grad, expected.grad, equal_nan=True)


def test_half_softmax_keeps_its_float32_math():
    import torch

    m = _module()
    x = torch.randn(4, 64, 64, dtype=torch.bfloat16) * 5
    got = m.ops._softmax_owned(x.clone())
    torch.testing.assert_close(got, torch.softmax(x.float(), dim=-1).bfloat16(), rtol=0, atol=0)


def test_no_slices_where_the_lengths_cannot_be_read_or_autograd_needs_the_weights():
    import torch

    m = _module()
    big = torch.zeros(2, 256, 256)
    lens = torch.tensor([10, 300])
    assert m._sliceable_lengths(big.clone().requires_grad_(), lens) is None  # softmax backward
    assert m._sliceable_lengths(big, lens[:, None].expand(2, 256)) is None  # per-query lengths
    with torch.no_grad():
        assert m._sliceable_lengths(big.clone().requires_grad_(), lens) == [10, 300]


def test_float_lengths_on_the_slice_path_round_like_the_mask(taken):
    # j < 2.5 keeps 0, 1, 2; NaN keeps nothing; huge and negative are clipped
    import torch

    m = _module()
    rng = np.random.default_rng(21)
    lens = np.array([2.5, np.nan, 1e30, -0.5, 0.2])
    q, k, v = rng.normal(size=(5, 3, 4)), rng.normal(size=(5, 6, 4)), rng.normal(size=(5, 6, 2))
    out, got = m.dot_product_attention(*_tensors("float64", q, k, v), torch.tensor(lens), return_weights=True)
    assert taken and all(taken)
    want_out, want = ref.dot_product_attention(q, k, v, lens)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-12, atol=1e-12)
    assert [np.count_nonzero(got[b, 0]) for b in range(5)] == [3, 0, 6, 0, 1]


def test_torch_func_vmap_and_grad_at_slice_sizes():
    # under vmap the lengths have no host data (the mask path runs); under grad, autograd does
    import torch
    from torch.func import grad, vmap

    m = _module()
    rng = np.random.default_rng(16)
    q, k, v = (torch.tensor(rng.normal(size=s)) for s in [(2, 256, 8), (2, 256, 8), (2, 256, 3)])
    lens = torch.tensor([100, 256])
    want = ref.dot_product_attention(q.numpy(), k.numpy(), v.numpy(), lens.numpy())[0]

    def one(q, k, v, n):
        return m.dot_product_attention(q[None], k[None], v[None], n[None], return_weights=True)[0][0]

    np.testing.assert_allclose(vmap(one)(q, k, v, lens).numpy(), want, rtol=1e-10, atol=1e-12)
    loss = lambda q: m.dot_product_attention(q, k, v, lens, return_weights=True)[0].sum()  # noqa: E731
    leaf = q.clone().requires_grad_()
    loss(leaf).backward()
    np.testing.assert_allclose(grad(loss)(q).numpy(), leaf.grad.numpy(), rtol=1e-10)


def _additive_case(rng):
    q, k, v = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 7, 4)), rng.normal(size=(2, 7, 2))
    W = [rng.normal(size=(5, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5,))]
    return q, k, v, np.array([3, 0]), W


@pytest.fixture(params=["tanh", "sigmoid"])
def tiny_blocks(monkeypatch, request):
    # 2 x 5 x 7 = 70 features per query: one query a block, the last block as small as the others;
    # the features as tanh(z) or 2 sigmoid(2z) - 1, whatever this CPU's calibration says
    monkeypatch.setattr(tuning.of(_module().ops), "feature_block_elements", 70)
    monkeypatch.setattr(_module().ops, "tanh_by_sigmoid", lambda features: request.param == "sigmoid")


def test_additive_blocks_sharing_a_buffer_under_no_grad(tiny_blocks):
    import torch

    m = _module()
    q, k, v, lens, W = _additive_case(np.random.default_rng(17))
    want_out, want = ref.additive_attention(q, k, v, lens, *W)
    with torch.no_grad():
        out, got = m.additive_attention(
            *(torch.tensor(a) for a in (q, k, v, lens)),
            **dict(zip(("W_q", "W_k", "w_v"), (torch.tensor(w) for w in W))),
            return_weights=True,
        )
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


def test_additive_blocks_keep_what_the_backward_needs(tiny_blocks):
    # w_v alone needs a gradient: the product with w_v keeps every block's features, so they
    # must not share memory (an in-place reuse made this backward fail)
    import torch

    m = _module()
    q, k, v, lens, W = _additive_case(np.random.default_rng(18))
    G = np.random.default_rng(19).normal(size=(2, 3, 2))
    w_v = torch.tensor(W[2], requires_grad=True)
    out = m.additive_attention(
        *(torch.tensor(a) for a in (q, k, v, lens)), W_q=torch.tensor(W[0]), W_k=torch.tensor(W[1]), w_v=w_v
    )
    (out * torch.tensor(G)).sum().backward()
    step, want = 1e-6, np.zeros(5)
    for i in range(5):
        for sign in (1, -1):
            shifted = W[2].copy()
            shifted[i] += sign * step
            want[i] += sign * np.sum(ref.additive_attention(q, k, v, lens, W[0], W[1], shifted)[0] * G)
    np.testing.assert_allclose(w_v.grad.numpy(), want / (2 * step), rtol=1e-6, atol=1e-8)


def test_additive_blocks_under_vmap_and_no_grad(tiny_blocks):
    import torch
    from torch.func import vmap

    m = _module()
    q, k, v, lens, W = _additive_case(np.random.default_rng(20))
    Wt = [torch.tensor(w) for w in W]

    def one(q, k, v, n):
        return m.additive_attention(q[None], k[None], v[None], n[None], W_q=Wt[0], W_k=Wt[1], w_v=Wt[2])[0]

    with torch.no_grad():
        got = vmap(one)(*(torch.tensor(a) for a in (q, k, v, lens)))
    np.testing.assert_allclose(got.numpy(), ref.additive_attention(q, k, v, lens, *W)[0], rtol=1e-12)


def test_the_sigmoid_calibration_runs_under_vmap_and_no_grad(monkeypatch):
    # the first additive call of a process may come inside torch.func.vmap, which refuses random ops
    import torch
    from torch.func import vmap

    from multiattn import _machine

    m = _module()
    monkeypatch.setattr(_machine, "_MEASURED", {})
    monkeypatch.setattr(tuning.of(m.ops), "feature_block_elements", 70)
    q, k, v, lens, W = _additive_case(np.random.default_rng(21))
    Wt = [torch.tensor(w) for w in W]

    def one(q, k, v, n):
        return m.additive_attention(q[None], k[None], v[None], n[None], W_q=Wt[0], W_k=Wt[1], w_v=Wt[2])[0]

    with torch.no_grad():
        got = vmap(one)(*(torch.tensor(a) for a in (q, k, v, lens)))
    assert _machine._MEASURED, "the calibration did not run"
    np.testing.assert_allclose(got.numpy(), ref.additive_attention(q, k, v, lens, *W)[0], rtol=1e-12)


# --- each sequence over its visible keys -----------------------------------------------------


@pytest.fixture
def visible(monkeypatch):
    """Every size takes the visible-keys path; the list records each call's lengths and
    whether it wanted the weights."""
    m = _module()
    calls: list = []
    real = m.TorchOps._attend_visible_keys

    def spy(self, queries, keys, values, lengths, scale, need_weights):
        calls.append((list(lengths), need_weights))
        return real(self, queries, keys, values, lengths, scale, need_weights)

    lower_thresholds(m, monkeypatch, VISIBLE_KEYS_MIN_SEQUENCE_SCORES=0)
    monkeypatch.setattr(m, "VISIBLE_KEYS_MAX_SHARE", 1.0)
    monkeypatch.setattr(m.TorchOps, "_attend_visible_keys", spy)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_visible_keys_match_the_reference(visible, dtype):
    import torch

    m = _module()
    rng = np.random.default_rng(31)
    B, Q, K = len(LENS), 3, 7
    q, k, v = rng.normal(size=(B, Q, 4)), rng.normal(size=(B, K, 4)), rng.normal(size=(B, K, 2))
    tq, tk, tv = _tensors(dtype, q, k, v)
    rounded = [t.double().numpy() for t in (tq, tk, tv)]
    want_out, want = ref.dot_product_attention(*rounded, LENS)
    with torch.no_grad():
        out, got = m.dot_product_attention(tq, tk, tv, torch.tensor(LENS), return_weights=True)
        fast = m.dot_product_attention(tq, tk, tv, torch.tensor(LENS))
    assert visible == [([0, 0, 3, 7, 7], True), ([0, 0, 3, 7, 7], False)], "not run, or lengths misread"
    assert got.dtype == out.dtype == tq.dtype
    tol = tolerance("torch", dtype)
    np.testing.assert_allclose(got.double().numpy(), want, atol=tol * 4)
    for result in (out, fast):
        np.testing.assert_allclose(result.double().numpy(), want_out, atol=tol * 4)
    for b, n in enumerate(LENS):
        assert np.all(got.numpy()[b, :, max(n, 0) :] == 0.0)  # exactly, not tiny


def test_visible_keys_per_head_match_the_reference(visible):
    # multi-head attention: (B, H, Q, K) scores, one length per sequence shared by its heads
    import torch

    m = _module()
    rng = np.random.default_rng(32)
    B, Q, K, h, heads = len(LENS), 3, 7, 8, 2
    q, k, v = rng.normal(size=(B, Q, 5)), rng.normal(size=(B, K, 6)), rng.normal(size=(B, K, 4))
    weights = {
        name: rng.normal(size=(h, width)) for name, width in (("W_q", 5), ("W_k", 6), ("W_v", 4), ("W_o", h))
    }
    want_out, want = ref.multi_head_attention(q, k, v, LENS, weights, heads)
    args = (*_tensors("float64", q, k, v), torch.tensor(LENS))
    kwargs = dict(weights={n: torch.tensor(w) for n, w in weights.items()}, num_heads=heads)
    with torch.no_grad():
        out, got = m.multi_head_attention(*args, **kwargs, return_weights=True)
        fast = m.multi_head_attention(*args, **kwargs)
    assert visible == [([0, 0, 3, 7, 7], True), ([0, 0, 3, 7, 7], False)]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    for result in (out, fast):
        np.testing.assert_allclose(result.numpy(), want_out, rtol=1e-12, atol=1e-12)


def test_visible_keys_take_strided_inputs(visible):
    # views with a transposed layout (as after a split into heads): the products and SDPA read
    # them as they are, with and without the weights
    import torch

    m = _module()
    rng = np.random.default_rng(35)
    B, Q, K = len(LENS), 3, 7
    q, k, v = rng.normal(size=(B, Q, 4)), rng.normal(size=(B, K, 4)), rng.normal(size=(B, K, 2))
    want_out, want = ref.dot_product_attention(q, k, v, LENS)
    views = [torch.tensor(np.ascontiguousarray(x.transpose(1, 0, 2))).transpose(0, 1) for x in (q, k, v)]
    assert not any(t.is_contiguous() for t in views)
    with torch.no_grad():
        out, got = m.dot_product_attention(*views, torch.tensor(LENS), return_weights=True)
        fast = m.dot_product_attention(*views, torch.tensor(LENS))
    assert [need for _, need in visible] == [True, False]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    for result in (out, fast):
        np.testing.assert_allclose(result.numpy(), want_out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_visible_keys_never_read_the_padding(visible, poison):
    import torch

    m = _module()
    q, k, v, lens, want_out, want = _poisoned_padding(poison, seed=33)
    args = (*_tensors("float64", q, k, v), torch.tensor(lens))
    with torch.no_grad():
        out, got = m.dot_product_attention(*args, return_weights=True)
        fast = m.dot_product_attention(*args)
    assert [need for _, need in visible] == [True, False]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    for result in (out, fast):
        np.testing.assert_allclose(result.numpy(), want_out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("poison", [np.inf, np.nan])
def test_rows_without_a_finite_visible_score_fall_back_to_the_math(visible, monkeypatch, poison):
    # visible scores all -inf: the math gives exact zeros where the loop's softmax gives NaN;
    # a query is not finite, so the specialisation declines (read before running) and the
    # core answers
    import torch

    from multiattn import core, specialise
    from multiattn.masks import Masks

    m = _module()
    args = _no_finite_visible_score(poison, seed=34)
    with torch.no_grad():
        got = m.dot_product_attention(*args, return_weights=True)
        fast = m.dot_product_attention(*args)
        with specialise.primitives_only():
            want = core.dot_product_attention(m.ops, *args[:3], Masks(args[3]))
    assert visible == []  # declined: never run
    for a, b in zip(got, want):  # not taken: core's answer
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # without weights likewise the core's answer; a row of -inf scores where no key is masked
    # (sequence 1) is 0, the row rule (docs/errors.md)
    fast, want_out = fast.numpy(), want[0].numpy()
    if poison == np.inf:
        assert (want_out[1, 0] == 0).all() and (fast[1, 0] == 0).all()
    np.testing.assert_allclose(fast, want_out, rtol=1e-12, atol=1e-12)


def _offers_visible_keys(q, k, v, lens):
    from multiattn.masks import Masks

    return not isinstance(_module().ops.attend_over_visible_keys(q, k, v, Masks(lens), 1.0, None, True), str)


def test_visible_keys_only_where_the_loop_pays_and_nothing_forbids_it():
    import torch

    q, k, v = torch.zeros(2, 512, 8), torch.zeros(2, 512, 8), torch.zeros(2, 512, 3)
    lens = torch.tensor([100, 512])
    with torch.no_grad():
        assert _offers_visible_keys(q, k, v, lens)  # 256K scores per sequence
        assert not _offers_visible_keys(q[:, :4], k[:, :4], v[:, :4], lens)  # 16 per sequence
        assert not _offers_visible_keys(q.half(), k.half(), v.half(), lens)  # float32 math
        assert not _offers_visible_keys(q, k, v, lens[:, None].expand(2, 512))  # per query
        assert not _offers_visible_keys(
            q, k, v, torch.tensor([500, 512])
        )  # hides 1% of the keys: not worth it
    assert not _offers_visible_keys(q.clone().requires_grad_(), k, v, lens)  # out= has no backward
    with torch.no_grad():
        # torch.func.vmap wraps its tensors and refuses out=: declined, the other paths run
        declined = torch.func.vmap(lambda x: torch.tensor(not _offers_visible_keys(x, k, v, lens)))
        assert declined(q[None].expand(2, -1, -1, -1)).all()
        keys_only = torch.func.vmap(lambda y: torch.tensor(not _offers_visible_keys(q, y, v, lens)))
        assert keys_only(k[None].expand(2, -1, -1, -1)).all()
        lens_only = torch.func.vmap(lambda n: torch.tensor(not _offers_visible_keys(q, k, v, n)))
        assert lens_only(lens[None].expand(2, -1)).all()


def test_the_default_protocol_declines_the_visible_keys_path():
    import torch

    from multiattn.adapter import Ops
    from multiattn.masks import Masks

    m = _module()
    big = torch.zeros(2, 512, 8)
    assert isinstance(
        Ops.attend_over_visible_keys(m.ops, big, big, big, Masks(torch.tensor([1, 2])), 1.0, None, True), str
    )


# -- mask functions: each block of queries over its span of keys, by SDPA ---------------------


@pytest.fixture
def spans(monkeypatch):
    """Blocks of 3 past the budget, and the list of the calls that took the spans."""
    from multiattn import blockwise, fast_paths

    taken: list = []
    real = fast_paths.attention_over_spans
    monkeypatch.setattr(blockwise, "automatic_block_size", lambda ops, q, k, *args, **options: 3)
    monkeypatch.setattr(fast_paths, "attention_over_spans", lambda *a: taken.append(a[-1]) or real(*a))
    return taken


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [False, True], ids=["alone", "lengths"])
@pytest.mark.parametrize(
    "name", ["sliding_window", "prefix_lm_per_sequence", "document", "and_masks", "or_masks"]
)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_mask_functions_over_their_spans_match_the_reference(spans, dtype, name, lengths, causal):
    """Values (rows that see nothing: 0) and gradients (finite differences of the float64
    reference), with NaN in the values of hidden keys past the lengths."""
    import torch

    import multiattn

    from .harness import harness
    from .test_gradients import assert_gradients_close
    from .test_mods import LENS, B, D, K, Q, mod_cases

    mask_mod, mask_fn, _, _ = mod_cases(harness("torch"))[name]
    fn = mask_fn if not causal else (lambda b, h, i, j: mask_fn(b, h, i, j) and j <= i)
    rng = np.random.default_rng(len(name))
    q, k, v = (rng.normal(size=(B, n, D)) for n in (Q, K, K))
    lens = LENS if lengths else None

    def reference(q, k, v):
        mask = ref.function_mask((B, Q, K), fn)
        return ref.dot_product_attention(q, k, v, lens, attention_mask=mask)[0]

    poisoned = v.copy()
    if lengths:
        poisoned[1, LENS[1] :] = np.nan
    args = [torch.tensor(x, dtype=getattr(torch, dtype), requires_grad=True) for x in (q, k, poisoned)]
    t_lens = None if lens is None else torch.tensor(lens)
    out = multiattn.dot_product_attention(*args, t_lens, mask_mod=mask_mod, causal=causal)
    assert spans == [3], "the spans were taken"
    want = reference(q, k, v)
    tol = tolerance("torch", dtype)
    np.testing.assert_allclose(out.detach().double().numpy(), want, rtol=tol, atol=tol)
    if lengths:
        assert not out[0].detach().any(), "the first sequence sees nothing: 0"
        return  # NaN values: the finite differences below are of clean inputs
    cotangent = rng.normal(size=out.shape)
    out.backward(torch.tensor(cotangent, dtype=out.dtype))
    got = {n: a.grad.double().numpy() for n, a in zip("qkv", args)}
    assert_gradients_close(harness("torch"), got, _finite_differences(reference, (q, k, v), cotangent), dtype)


def _finite_differences(reference, qkv, cotangent, step=1e-6):
    """The gradients of sum(reference(q, k, v) * cotangent) by central differences, by name."""
    grads = {}
    for at, x in enumerate(qkv):
        grad = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            for sign in (1, -1):
                shifted = [a.copy() for a in qkv]
                shifted[at][idx] += sign * step
                grad[idx] += sign * float(np.sum(reference(*shifted) * cotangent))
        grads["qkv"[at]] = grad / (2 * step)
    return grads


def _sdpa_calls(monkeypatch, block):
    """Blocks of block queries for the spans, and the list of SDPA's calls (their queries' shapes)."""
    import torch.nn.functional as F

    from multiattn import blockwise

    monkeypatch.setattr(blockwise, "automatic_block_size", lambda ops, q, k, *args, **options: block)
    made, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **kw: made.append(a[0].shape) or real(*a, **kw)
    )
    return made


def _per_head_reference(q, k, v, mask_fn):
    """The float64 reference for (B, [H,] n, d) inputs, a query head i using key head i // groups."""
    if q.ndim == 3:
        return ref.dot_product_attention(
            q, k, v, attention_mask=ref.function_mask(q.shape[:2] + k.shape[1:2], mask_fn)
        )[0]
    groups = q.shape[1] // k.shape[1]
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    for h in range(q.shape[1]):
        out[:, h] = _per_head_reference(q[:, h], k[:, h // groups], v[:, h // groups], mask_fn)
    return out


@pytest.mark.parametrize(
    "shape, kv_heads, calls",
    [((2, 30, 4), None, 2), ((1, 4, 30, 4), 2, 2), ((2, 2, 30, 4), 2, 10)],
    ids=["3-D", "one sequence of grouped heads", "two sequences of heads"],
)
def test_a_windows_spans_alike_run_as_one_sdpa_call_where_views_hold_them(
    monkeypatch, shape, kv_heads, calls
):
    """Blocks of 3 queries, a window of 3: the first block's span (3 keys), then nine alike (6
    keys, one mask, keys 3 apart) in one call on strided views, where one tensor holds them (3-D,
    or one sequence); else a call each.  Values as the float64 reference's."""
    import torch

    from multiattn import core, mods
    from multiattn.backends import torch as m
    from multiattn.masks import Masks

    made = _sdpa_calls(monkeypatch, 3)
    rng = np.random.default_rng(len(shape))
    q = rng.normal(size=shape)
    kv_shape = shape if kv_heads is None else shape[:1] + (kv_heads,) + shape[2:]
    k, v = rng.normal(size=kv_shape), rng.normal(size=kv_shape)
    tensors = (torch.tensor(x) for x in (q, k, v))  # 4-D: the core's call, as multi-head attention makes it
    masks = Masks(mask_mod=mods.sliding_window(3))
    out = core.dot_product_attention(m.ops, *tensors, masks, need_weights=False)[0]
    assert len(made) == calls, made
    want = _per_head_reference(q, k, v, lambda b, h, i, j: 0 <= i - j < 3)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-12, atol=1e-12)


def test_documents_blocks_merge_and_documents_alike_run_as_one_call(monkeypatch):
    """Documents of 9, 9 and 12 tokens, blocks of 3: each document's blocks see its keys whole
    (one span of the document's length); the two of 9 in one call, the one of 12 in another."""
    import torch

    import multiattn
    from multiattn import mods

    made = _sdpa_calls(monkeypatch, 3)
    ids = np.repeat([0, 1, 2], [9, 9, 12])[None]
    q, k, v = (np.random.default_rng(5).normal(size=(1, 30, 4)) for _ in range(3))
    out = multiattn.dot_product_attention(*(torch.tensor(x) for x in (q, k, v)), mask_mod=mods.document(ids))
    assert [tuple(s) for s in made] == [(2, 1, 9, 4), (1, 1, 12, 4)]
    want = _per_head_reference(q, k, v, lambda b, h, i, j: ids[0, i] == ids[0, j])
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-12, atol=1e-12)


def test_gradients_through_spans_run_as_one_call_match_finite_differences(monkeypatch):
    import torch

    import multiattn
    from multiattn import mods

    from .harness import harness
    from .test_gradients import assert_gradients_close

    made = _sdpa_calls(monkeypatch, 3)
    rng = np.random.default_rng(11)
    q, k, v = (rng.normal(size=(1, 12, 2)) for _ in range(3))
    window = lambda b, h, i, j: 0 <= i - j < 3  # noqa: E731
    args = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = multiattn.dot_product_attention(*args, mask_mod=mods.sliding_window(3))
    assert len(made) == 2, made  # the first block, then three alike
    cotangent = rng.normal(size=out.shape)
    out.backward(torch.tensor(cotangent))
    want = _finite_differences(lambda *qkv: _per_head_reference(*qkv, window), (q, k, v), cotangent)
    got = {n: a.grad.numpy() for n, a in zip("qkv", args)}
    assert_gradients_close(harness("torch"), got, want, "float64")


# -- grouped heads past the budget: SDPA with enable_gqa ----------------------------------------


@pytest.mark.parametrize("path", ["blocks", "whole"])
@pytest.mark.parametrize("case", ["none", "causal", "lengths", "sliding_window"])
@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["grouped", "multi-query"])
def test_grouped_heads_by_sdpa_match_the_reference(monkeypatch, num_kv_heads, case, path):
    """Values and gradients (finite differences of the float64 reference) with the key and
    value heads shared, SDPA told so (enable_gqa), never repeated: past the budget (blocks)
    and below it (the whole call, as SDPA takes it at sizes where its cost pays)."""
    import torch
    import torch.nn.functional as F

    import multiattn
    from multiattn import blockwise

    from .harness import harness
    from .test_gradients import assert_gradients_close
    from .test_grouped_heads import CASES, HEADS, _finite_differences, _inputs, _reference

    monkeypatch.setitem(CASES, "causal", dict(causal=True))
    if path == "blocks":
        monkeypatch.setattr(blockwise, "automatic_block_size", lambda ops, q, k, *args, **options: 2)
    else:
        lower_thresholds(_module(), monkeypatch, FUSED_MIN_SCORES=0, VISIBLE_KEYS_MIN_SEQUENCE_SCORES=0)
    calls, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw)
    )
    kw = {n: torch.tensor(x) if n == "valid_lens" else x for n, x in CASES[case].items()}
    inputs, weights = _inputs(num_kv_heads, seed=num_kv_heads)
    args = [torch.tensor(x, dtype=torch.float64) for x in inputs]
    t_weights = {n: torch.tensor(w, dtype=torch.float64) for n, w in weights.items()}
    options = dict(num_heads=HEADS, num_kv_heads=num_kv_heads, **kw)
    got = multiattn.multi_head_attention(*args, weights=t_weights, **options)
    assert calls and all(call.get("enable_gqa") for call in calls), "SDPA, its key heads shared"
    np.testing.assert_allclose(
        got.numpy(), _reference(inputs, weights, num_kv_heads, case)[0], rtol=1e-10, atol=1e-10
    )
    inputs, weights, cotangent, want = _finite_differences(num_kv_heads, case)
    fixed = {n: torch.tensor(w, dtype=torch.float64) for n, w in weights.items() if n != "W_k"}
    tensors = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (*inputs, weights["W_k"])]
    out = multiattn.multi_head_attention(*tensors[:3], weights={**fixed, "W_k": tensors[3]}, **options)
    out.backward(torch.tensor(cotangent))
    assert_gradients_close(
        harness("torch"), {n: t.grad.numpy() for n, t in zip(want, tensors)}, want, "float64"
    )


def test_small_lengths_masks_kept_by_value_follow_lengths_changed_in_place():
    """A small call's lengths mask is kept by the lengths' values and reused: lengths changed in
    place between calls (through a numpy array sharing their memory: no version bump) give the
    new lengths' answer, and the kept mask is never written (float64 reference)."""
    import torch

    m = _module()
    rng = np.random.default_rng(11)
    q, k, v = (rng.normal(size=s) for s in ((2, 3, 4), (2, 6, 4), (2, 6, 5)))
    held = np.array([2, 6])
    lens = torch.from_numpy(held)
    for want_lens in ([2, 6], [6, 1], [0, 3], [2, 6]):
        held[:] = want_lens  # the same tensor, new values
        with torch.no_grad():
            out, weights = m.dot_product_attention(*_tensors("float64", q, k, v), lens, return_weights=True)
        want, want_w = ref.dot_product_attention(q, k, v, np.array(want_lens))
        np.testing.assert_allclose(weights.numpy(), want_w, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-12, atol=1e-12)
    for (n_keys, _, *kept_lens), mask in m._LENGTH_MASKS.items():  # each still its lengths' mask
        want_mask = np.arange(n_keys) < np.array(kept_lens)[:, None, None]
        np.testing.assert_array_equal(mask.numpy(), want_mask)


def test_below_specialised_from_every_offer_declines():
    """torch's ``tuning.Tuning.specialised_from`` is the least of its offers' thresholds: scores just below
    it make every offer of the two steps it gates decline, so not asking them changes nothing."""
    import torch

    from multiattn import specialise
    from multiattn.masks import Masks

    m = _module()
    assert tuning.of(m.ops).specialised_from == m.least_threshold() > 1
    n_keys = tuning.of(m.ops).specialised_from - 1  # one query: that many scores
    q, k, v = (torch.randn(1, rows, 8) for rows in (1, n_keys, n_keys))
    for masks in (Masks(torch.tensor([n_keys // 4])), Masks()):
        for need_weights in (True, False):
            for name in specialise.ORDER["dot_product_attend"]:
                offer = getattr(m.ops, name)(q, k, v, masks, 0.5, None, need_weights)
                assert isinstance(offer, str), name
        for name in specialise.ORDER["masked_softmax"]:
            assert isinstance(getattr(m.ops, name)(torch.randn(1, 1, n_keys), v, masks, True), str), name
    assert not specialise.asks(m.ops, (1, 1, n_keys)) and specialise.asks(m.ops, (1, 1, n_keys + 1))


@pytest.mark.parametrize("masks", ["causal", "lengths"])
def test_masks_kept_from_inference_mode_serve_autograd_afterwards(masks):
    """The masks torch keeps between calls (causal, small lengths) made under
    ``torch.inference_mode()`` are ordinary tensors: a later call with autograd may save them
    for its backward (inference tensors may not be), and its gradients are the reference's."""
    import torch

    from .harness import harness
    from .test_gradients import assert_gradients_close, central_differences

    m = _module()
    m._LENGTH_MASKS.clear()
    m._POSITIONS.clear()
    rng = np.random.default_rng(17)
    inputs = {n: rng.normal(size=s) for n, s in (("q", (2, 3, 4)), ("k", (2, 5, 4)), ("v", (2, 5, 3)))}
    cotangent = rng.normal(size=(2, 3, 3))
    lens = np.array([2, 4])
    kw = dict(causal=True) if masks == "causal" else dict(valid_lens=lens)
    t_kw = dict(causal=True) if masks == "causal" else dict(valid_lens=torch.tensor(lens))
    with torch.inference_mode():
        m.dot_product_attention(*_tensors("float64", *inputs.values()), return_weights=True, **t_kw)
    tensors = [t.requires_grad_(True) for t in _tensors("float64", *inputs.values())]
    out, _ = m.dot_product_attention(*tensors, return_weights=True, **t_kw)
    out.backward(torch.tensor(cotangent))
    want = central_differences(lambda q, k, v: ref.dot_product_attention(q, k, v, **kw)[0], inputs, cotangent)
    got = {n: t.grad.numpy() for n, t in zip(inputs, tensors)}
    assert_gradients_close(harness("torch"), got, want, "float64")
