"""The core runs: every public call, functional and layer, on every backend, enters the core
function of its name (multiattn.core), with and without the weights, every kind of mask,
with dropout; and with every specialisation off it still gives the reference's answer."""

from __future__ import annotations

import numpy as np
import pytest

from multiattn import core, specialise

from . import reference as ref
from .tolerances import assert_close

ENTRIES = ("masked_softmax", "dot_product_attention", "additive_attention", "multi_head_attention")
MASK_KINDS = ["none", "lengths", "per_query_lengths", "attention_mask", "causal", "all"]
B, Q, K, D, V, HIDDENS, HEADS = 2, 3, 5, 4, 4, 4, 2


@pytest.fixture
def entered(monkeypatch):
    """The names of the core's entry functions called, in order (the real ones still run)."""
    calls: list = []
    for name in ENTRIES:
        real = getattr(core, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(core, name, spy)
    return calls


def _inputs(bk, kind, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, X = (rng.normal(size=s) for s in ((B, Q, D), (B, K, D), (B, K, V), (B, Q, K)))
    lens = {"lengths": np.array([2, 5]), "per_query_lengths": np.array([[1, 2, 3], [0, 4, 5]])}.get(kind)
    if kind == "all":
        lens = np.array([3, 4])
    masks: dict = {}
    if kind in ("attention_mask", "all"):
        masks["attention_mask"] = bk.tensor(rng.random((B, Q, K)) < 0.6)
    if kind in ("causal", "all"):
        masks["causal"] = True
    tensors = [bk.tensor(a, "float32") for a in (q, k, v, X)]
    return tensors, None if lens is None else bk.tensor(lens), masks


def _weights(bk, rng, shapes):
    return {name: bk.tensor(rng.uniform(-0.5, 0.5, shape), "float32") for name, shape in shapes.items()}


@pytest.mark.parametrize("return_weights", [True, False])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_every_functional_call_enters_the_core(bk, entered, kind, return_weights):
    m, rng = bk.module, np.random.default_rng(1)
    (q, k, v, X), lens, masks = _inputs(bk, kind)
    m.masked_softmax(X, lens, **masks)
    assert entered == ["masked_softmax"]
    entered.clear()
    m.dot_product_attention(q, k, v, lens, return_weights=return_weights, **masks)
    assert entered == ["dot_product_attention"]
    entered.clear()
    additive = _weights(bk, rng, {"W_q": (HIDDENS, D), "W_k": (HIDDENS, D), "w_v": (HIDDENS,)})
    m.additive_attention(q, k, v, lens, return_weights=return_weights, **additive, **masks)
    assert entered == ["additive_attention"]
    entered.clear()
    shapes = {f"W_{n}": (HIDDENS, D) for n in "qkvo"}
    m.multi_head_attention(
        q,
        k,
        v,
        lens,
        weights=_weights(bk, rng, shapes),
        num_heads=HEADS,
        return_weights=return_weights,
        **masks,
    )
    assert entered == ["multi_head_attention", "dot_product_attention"]  # the heads through the core's own


def _with_need_weights(layer, need_weights):
    if hasattr(layer, "need_weights"):
        layer.need_weights = need_weights
    return layer


@pytest.mark.layers
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_every_layer_call_enters_the_core(bk, entered, kind, mode, need_weights):
    (q, k, v, _), lens, masks = _inputs(bk, kind, seed=2)
    dropout = 0.5 if mode == "train" else 0.0
    layers = {
        "dot_product_attention": _with_need_weights(bk.dot(dropout), need_weights),
        "additive_attention": bk.additive(D, D, HIDDENS, dropout),
        "multi_head_attention": bk.multi_head(HIDDENS, HEADS, dropout, need_weights=need_weights),
    }
    for name, layer in layers.items():
        if mode == "train":
            layer = bk.train(layer)
        entered.clear()
        bk.call(layer, q, k, v, lens, **masks)
        assert entered == [name] + (["dot_product_attention"] if name == "multi_head_attention" else [])


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_primitives_only_gives_the_references_answers(bk, kind, dtype):
    """Every specialisation off: the core's formulas over the required primitives alone."""
    assert dtype in bk.dtypes  # float32 and float64 everywhere
    rng = np.random.default_rng(3)
    arrays = [rng.normal(size=s) for s in ((B, Q, D), (B, K, D), (B, K, V), (B, Q, K))]
    q, k, v, X = (bk.tensor(a, dtype) for a in arrays)
    a_q, a_k, a_v, a_X = (bk.numpy(t).astype(np.float64) for t in (q, k, v, X))
    (_, _, _, _), lens, masks = _inputs(bk, kind)
    np_lens = None if lens is None else bk.numpy(lens)
    np_masks = dict(masks)
    if "attention_mask" in masks:
        np_masks["attention_mask"] = bk.numpy(masks["attention_mask"])
    m = bk.module
    W = {
        "W_q": rng.normal(size=(HIDDENS, D)),
        "W_k": rng.normal(size=(HIDDENS, D)),
        "w_v": rng.normal(size=(HIDDENS,)),
    }
    W_t = {n: bk.tensor(w, dtype) for n, w in W.items()}
    W_r = {n: bk.numpy(w).astype(np.float64) for n, w in W_t.items()}
    with specialise.primitives_only(), specialise.explained() as decisions:
        got_sm = m.masked_softmax(X, lens, **masks)
        got_dot, got_dot_w = m.dot_product_attention(q, k, v, lens, return_weights=True, **masks)
        got_fast = m.dot_product_attention(q, k, v, lens, **masks)
        got_add, got_add_w = m.additive_attention(q, k, v, lens, **W_t, return_weights=True, **masks)
    assert decisions and all(outcome == specialise.OFF for *_, outcome in decisions)
    assert_close(bk, got_sm, ref.masked_softmax(a_X, np_lens, **np_masks), dtype)
    want, want_w = ref.dot_product_attention(a_q, a_k, a_v, np_lens, **np_masks)
    for got in (got_dot, got_fast):
        assert_close(bk, got, want, dtype)
    assert_close(bk, got_dot_w, want_w, dtype)
    want, want_w = ref.additive_attention(
        a_q, a_k, a_v, np_lens, W_r["W_q"], W_r["W_k"], W_r["w_v"], **np_masks
    )
    assert_close(bk, got_add, want, dtype)
    assert_close(bk, got_add_w, want_w, dtype)


@pytest.mark.parametrize("kind", ["none", "attention_mask", "causal"])
def test_a_small_call_without_lengths_reads_nothing_back_to_the_host(bk, kind, monkeypatch):
    """B = 2, Q = K = 7, 3-D and 4-D, with and without weights, a mask function too: the row
    rule is computed in the graph, so no tensor is read back (``Ops.host_values``, and on
    torch its own ways to the host), which on a device would be a synchronisation."""
    from multiattn import mods

    reads: list = []
    real = type(bk.module.ops).host_values
    monkeypatch.setattr(type(bk.module.ops), "host_values", lambda self, x: reads.append(x) or real(self, x))
    if bk.name == "torch":
        import torch

        for name in ("numpy", "tolist", "item", "__bool__", "__float__", "__int__"):
            real_read = getattr(torch.Tensor, name)
            record = lambda self, *a, _r=real_read, _n=name: reads.append(_n) or _r(self, *a)  # noqa: E731
            monkeypatch.setattr(torch.Tensor, name, record)
    rng = np.random.default_rng(4)
    m, n = bk.module, 7
    masks = {"causal": True} if kind == "causal" else {}
    if kind == "attention_mask":
        masks["attention_mask"] = bk.tensor(rng.random((2, n, n)) < 0.6)
    for shape in ((2, n, 4), (2, 3, n, 4)):
        q, k, v = (bk.tensor(rng.normal(size=shape), "float32") for _ in range(3))
        m.dot_product_attention(q, k, v, **masks)
        m.dot_product_attention(q, k, v, return_weights=True, **masks)
        m.dot_product_attention(q, k, v, mask_mod=mods.sliding_window(3), scale=0.5, **masks)
    m.masked_softmax(bk.tensor(rng.normal(size=(2, n, n)), "float32"), **masks)
    weights = _weights(bk, rng, {f"W_{p}": (HIDDENS, 4) for p in "qkvo"})
    q, k, v = (x[:, 0, ...] for x in (q, k, v))
    m.multi_head_attention(q, k, v, weights=weights, num_heads=HEADS, **masks)
    additive = _weights(bk, rng, {"W_q": (HIDDENS, 4), "W_k": (HIDDENS, 4), "w_v": (HIDDENS,)})
    m.additive_attention(q, k, v, **additive, return_weights=True, **masks)
    assert reads == [], f"read back to the host: {reads[:3]}"
