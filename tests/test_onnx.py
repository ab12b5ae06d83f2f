"""ONNX export (``multiattn.onnx``): every framework's ``MultiHeadAttention`` as one ``Attention``
node between its projections, run by onnxruntime at sequence lengths the export never saw;
the functional call with each mask and score function against the float64 reference, in
onnxruntime and in onnx's reference evaluator, at opsets 23 and 24; a decoding model step by
step against ``cached_attention``."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import multiattn
from multiattn import mods

from . import reference

B, H, KV, D = 2, 4, 2, 4
TABLE = np.linspace(-0.5, 0.5, 2 * 9 * H).reshape(H, 2 * 9)  # a relative-position bias per head


def _session(model):
    import onnxruntime  # the onnx extra; a missing one fails here, never skips

    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _attention_nodes(model) -> int:
    return [node.op_type for node in model.graph.node].count("Attention")


@pytest.mark.layers
@pytest.mark.parametrize("kv_heads, bias, masks", [
    (None, False, {}), (None, True, {"causal": True}), (KV, False, {"lengths": True}),
    (KV, True, {"causal": True, "lengths": True}),
])  # fmt: skip
def test_each_frameworks_layer_exports_and_runs_at_other_lengths(bk, kv_heads, bias, masks, tmp_path):
    from multiattn.onnx import export

    layer = bk.multi_head(16, H, bias=bias, num_kv_heads=kv_heads, query_size=12, key_size=10, value_size=6)
    path = tmp_path / "mha.onnx"
    model = export(layer, path, **masks)
    assert _attention_nodes(model) == 1 and path.stat().st_size > 0
    session = _session(model)
    rng = np.random.default_rng(0)
    for n_queries, n_keys in ((3, 3), (11, 11)) if masks.get("causal") else ((3, 7), (11, 5)):
        x = {n: rng.normal(size=(B, s, w)).astype(np.float32) for n, s, w in (
            ("queries", n_queries, 12), ("keys", n_keys, 10), ("values", n_keys, 6))}  # fmt: skip
        lens = np.array([n_keys - 1, 2])
        feeds = dict(x, valid_lens=lens) if masks.get("lengths") else x
        given = [bk.tensor(x[n], "float32") for n in ("queries", "keys", "values")]
        lengths = bk.tensor(lens) if masks.get("lengths") else None
        want = bk.call(layer, *given, lengths, causal=masks.get("causal", False))
        got = session.run(None, feeds)[0]
        np.testing.assert_allclose(got, bk.numpy(want), atol=2e-5, rtol=0)


@pytest.mark.layers
@pytest.mark.parametrize("kind", ["dot", "additive"])
def test_each_frameworks_d2l_layers_export_and_run_at_other_lengths(bk, kind, tmp_path):
    """d2l's DotProductAttention (one Attention node, any widths) and AdditiveAttention (the
    formula's operations) with lengths and causality, against the layer's own call."""
    from multiattn.onnx import export

    layer = bk.dot() if kind == "dot" else bk.additive(10, 12, 8)
    model = export(layer, tmp_path / "d2l.onnx", causal=True, lengths=True)
    assert _attention_nodes(model) == (kind == "dot")
    session = _session(model)
    rng = np.random.default_rng(6)
    for n, width in ((3, 10), (7, 5)):  # the dot-product model takes any query width
        x = {name: rng.normal(size=(B, n, size)).astype(np.float32) for name, size in (
            ("queries", width if kind == "dot" else 12), ("keys", width if kind == "dot" else 10),
            ("values", 6))}  # fmt: skip
        lens = np.array([n - 1, 0])
        given = [bk.tensor(x[name], "float32") for name in ("queries", "keys", "values")]
        want = bk.call(layer, *given, bk.tensor(lens), causal=True)
        got = session.run(None, dict(x, valid_lens=lens))[0]
        np.testing.assert_allclose(got, bk.numpy(want), atol=2e-5, rtol=0)


@pytest.mark.layers
def test_a_layers_decoding_model_steps_as_its_call_with_a_cache(bk):
    from multiattn.onnx import export

    layer = bk.multi_head(16, H, bias=True, num_kv_heads=KV)
    session = _session(export(layer, cache=True, causal=True))
    x = np.random.default_rng(1).normal(size=(B, 8, 16)).astype(np.float32)
    cache = layer.new_cache(B, like=bk.tensor(x, "float32"))
    past = np.zeros((B, KV, 0, 16 // H), np.float32)
    feeds = {"past_key": past, "past_value": past}
    for lo, hi in [(0, 4)] + [(t, t + 1) for t in range(4, 8)]:
        part = x[:, lo:hi]
        want, cache = bk.call(layer, *(bk.tensor(part, "float32"),) * 3, causal=True, cache=cache)
        got, feeds["past_key"], feeds["past_value"] = session.run(
            None, dict(feeds, queries=part, keys=part, values=part)
        )
        np.testing.assert_allclose(got, bk.numpy(want), atol=2e-5, rtol=0)


def _user_score(score, b, h, q_idx, kv_idx):  # a float constant times the positions
    return score + 0.05 * (q_idx - kv_idx)


def _user_table(score, b, h, q_idx, kv_idx):  # a captured numpy table read at the positions
    return score + mods.take(TABLE, h, q_idx - kv_idx + 9)


def _user_capped(score, b, h, q_idx, kv_idx):  # neither a bias nor softcap alone
    return 2.0 * mods.tanh(score / 2.0) + 0.1 * h * (kv_idx - q_idx)


# name: (export keywords, the reference's keywords (mask_fn, score_fn, causal), queries, keys)
CASES = {
    "lengths": ({"lengths": True}, {}, 5, 7),
    "causal, fewer queries than keys": ({"causal": True}, {"causal": True}, 3, 7),
    "causal at query_offset 4": (
        {"causal": True, "query_offset": 4},
        {"mask_fn": lambda b, h, i, j: j <= i + 4},
        3,
        7,
    ),
    "boolean mask and lengths": ({"attention_mask": True, "lengths": True}, {}, 5, 7),
    "sliding_window": (
        {"mask_mod": mods.sliding_window(3)},
        {"mask_fn": lambda b, h, i, j: 0 <= i - j < 3},
        6,
        6,
    ),
    "document": ({"mask_mod": mods.document}, {"mask_fn": "documents"}, 6, 6),
    "alibi, causal": (
        {"score_mod": mods.alibi(mods.alibi_slopes(H)), "causal": True},
        {"score_fn": lambda s, b, h, i, j: s + mods.alibi_slopes(H)[h] * (j - i), "causal": True},
        5,
        5,
    ),
    "softcap, lengths": (
        {"score_mod": mods.softcap(0.7), "lengths": True},
        {"score_fn": lambda s, b, h, i, j: 0.7 * np.tanh(s / 0.7)},
        5,
        7,
    ),  # fmt: skip
    "user's float score, user's mask": (
        {"score_mod": _user_score, "mask_mod": lambda b, h, q, k: mods.logical_or(k <= q, (q - k) % 3 == 1)},
        {
            "score_fn": lambda s, b, h, i, j: s + 0.05 * (i - j),
            "mask_fn": lambda b, h, i, j: j <= i or (i - j) % 3 == 1,
        },
        5,
        7,
    ),
    "user's block-causal mask (//)": (
        {"mask_mod": lambda b, h, q, k: q // 2 >= k // 2},
        {"mask_fn": lambda b, h, i, j: i // 2 >= j // 2},
        5,
        7,
    ),
    "user's softcap with a bias, lengths (no Attention node)": (
        {"score_mod": _user_capped, "lengths": True, "causal": True},
        {"score_fn": lambda s, b, h, i, j: 2.0 * np.tanh(s / 2.0) + 0.1 * h * (j - i), "causal": True},
        5,
        7,
    ),
    "user's table": (
        {"score_mod": _user_table},
        {"score_fn": lambda s, b, h, i, j: s + TABLE[h, i - j + 9]},
        5,
        7,
    ),
}
_EXPECTED: dict = {}


@pytest.mark.backend("numpy")
@pytest.mark.parametrize("opset", [23, 24])
@pytest.mark.parametrize("case", list(CASES))
def test_exported_calls_match_the_float64_reference(case, opset):
    from onnx.reference import ReferenceEvaluator

    from multiattn.onnx import export_attention

    given, ref, n_queries, n_keys = CASES[case]
    model = export_attention(num_heads=H, num_kv_heads=KV, head_dim=D, opset=opset, **given)
    assert _attention_nodes(model) == ("no Attention node" not in case)
    rng = np.random.default_rng(len(case))
    feeds = {
        "queries": rng.normal(size=(B, H, n_queries, D)).astype(np.float32),
        "keys": rng.normal(size=(B, KV, n_keys, D)).astype(np.float32),
        "values": rng.normal(size=(B, KV, n_keys, D)).astype(np.float32),
    }
    ref = dict(ref)
    if given.get("lengths"):
        # a sequence with no key: its rows are 0; an over-long length: every key
        feeds["valid_lens"] = np.array([n_keys + 2 if case == "lengths" else n_keys - 2, 0])
        ref["valid_lens"] = feeds["valid_lens"]
    if given.get("attention_mask"):
        feeds["attention_mask"] = rng.random((B, n_queries, n_keys)) < 0.6
        ref["attention_mask"] = feeds["attention_mask"]
    if ref.get("mask_fn") == "documents":
        ids = np.array([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
        feeds["document_ids"], ref["mask_fn"] = ids, lambda b, h, i, j: ids[b, i] == ids[b, j]
    if case not in _EXPECTED:
        _EXPECTED[case] = reference.heads_attention(feeds["queries"], feeds["keys"], feeds["values"], **ref)[
            0
        ]
    want = _EXPECTED[case]
    got = _session(model).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    np.testing.assert_allclose(ReferenceEvaluator(model).run(None, feeds)[0], want, atol=2e-5, rtol=0)


@pytest.mark.backend("numpy")
def test_a_decoding_model_steps_as_cached_attention_after_a_prefill():
    from multiattn.onnx import export_attention

    session = _session(export_attention(num_heads=H, num_kv_heads=KV, head_dim=D, causal=True, cache=True))
    rng = np.random.default_rng(2)
    cache = multiattn.KVCache(B, KV, D, like=np.zeros(1, np.float32))
    past = np.zeros((B, KV, 0, D), np.float32)
    feeds = {"past_key": past, "past_value": past}
    for n in [6] + [1] * 20:  # a prefill, then 20 steps
        q, k, v = (rng.normal(size=(B, heads, n, D)).astype(np.float32) for heads in (H, KV, KV))
        want, cache = multiattn.cached_attention(q, k, v, cache, causal=True)
        got, feeds["past_key"], feeds["past_value"] = session.run(
            None, dict(feeds, queries=q, keys=k, values=v)
        )
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert feeds["past_key"].shape == (B, KV, 26, D)


@pytest.mark.backend("numpy")
def test_a_decoding_model_with_a_score_function_the_node_cannot_take():
    """The formula's graph with past keys and values: present_* as the node's, the steps as
    cached_attention's with the same function."""
    from multiattn.onnx import export_attention

    model = export_attention(num_heads=H, num_kv_heads=KV, head_dim=D, causal=True, cache=True,
                             score_mod=_user_capped)  # fmt: skip
    assert _attention_nodes(model) == 0
    session, rng = _session(model), np.random.default_rng(7)
    cache = multiattn.KVCache(B, KV, D, like=np.zeros(1, np.float32))
    past = np.zeros((B, KV, 0, D), np.float32)
    feeds = {"past_key": past, "past_value": past}
    for n in (4, 1, 1, 1):
        q, k, v = (rng.normal(size=(B, heads, n, D)).astype(np.float32) for heads in (H, KV, KV))
        want, cache = multiattn.cached_attention(q, k, v, cache, causal=True, score_mod=_user_capped)
        got, feeds["past_key"], feeds["past_value"] = session.run(
            None, dict(feeds, queries=q, keys=k, values=v)
        )
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.backend("numpy")
@pytest.mark.parametrize("opset", [23, 24])
def test_lengths_per_query_as_d2l_layers_take_them(opset):
    """valid_lens (batch, queries), as d2l's decoder passes them, for the three layers."""
    from multiattn.onnx import export

    numpy_layers = multiattn.backends.numpy
    layers = (numpy_layers.DotProductAttention(), numpy_layers.AdditiveAttention(8, 8, 6),
              numpy_layers.MultiHeadAttention(8, 2, num_kv_heads=1, seed=2))  # fmt: skip
    x = np.random.default_rng(9).normal(size=(B, 5, 8)).astype(np.float32)
    lens = np.array([[1, 2, 0, 5, 3], [4, 4, 4, 1, 0]])  # a row that sees nothing: 0
    for layer in layers:
        model = export(layer, lengths="per_query", causal=True, opset=opset)
        got = _session(model).run(None, {"queries": x, "keys": x, "values": x, "valid_lens": lens})[0]
        want = layer(x, x, x, lens, causal=True)
        np.testing.assert_allclose(got, want[0] if isinstance(want, tuple) else want, atol=2e-5, rtol=0)
    with pytest.raises(TypeError, match="lengths must be True, False or 'per_query', got 'yes'"):
        export(layers[0], lengths="yes")


@pytest.mark.backend("numpy")
def test_a_grouped_layer_with_a_score_function_the_node_cannot_take():
    """The formula's graph from a layer's projections (batch, n, heads * width): grouped heads,
    lengths and causality, then its decoding model step by step, as the layer's calls."""
    from multiattn.onnx import export

    layer = multiattn.backends.numpy.MultiHeadAttention(16, H, num_kv_heads=KV, bias=True, seed=1)
    rng = np.random.default_rng(8)
    x = rng.normal(size=(B, 6, 16)).astype(np.float32)
    lens = np.array([5, 0])
    got = _session(export(layer, score_mod=_user_capped, causal=True, lengths=True)).run(
        None, {"queries": x, "keys": x, "values": x, "valid_lens": lens}
    )[0]
    want = layer(x, x, x, lens, causal=True, score_mod=_user_capped)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    session = _session(export(layer, score_mod=_user_capped, causal=True, cache=True))
    cache = layer.new_cache(B, like=x)
    past = np.zeros((B, KV, 0, 16 // H), np.float32)
    feeds = {"past_key": past, "past_value": past}
    for lo, hi in [(0, 3), (3, 4), (4, 5)]:
        part = x[:, lo:hi]
        want, cache = layer(part, part, part, causal=True, cache=cache, score_mod=_user_capped)
        got, feeds["past_key"], feeds["past_value"] = session.run(
            None, dict(feeds, queries=part, keys=part, values=part)
        )
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.backend("numpy")
def test_a_decoding_step_with_documents_and_a_mask_over_the_past():
    """The mask and the document ids cover the past keys, then the new ones; the queries sit
    after the past (and multiattn's own call with query_offset takes the same ids)."""
    from multiattn.onnx import export_attention

    past, n = 4, 3
    model = export_attention(
        num_heads=H, num_kv_heads=1, head_dim=D, value_dim=3, causal=True, cache=True, attention_mask=True,
        mask_mod=mods.document,
    )  # fmt: skip
    rng = np.random.default_rng(5)
    q = rng.normal(size=(B, H, n, D)).astype(np.float32)
    k, pk = (rng.normal(size=(B, 1, m, D)).astype(np.float32) for m in (n, past))
    v, pv = (rng.normal(size=(B, 1, m, 3)).astype(np.float32) for m in (n, past))
    mask = rng.random((B, n, past + n)) < 0.8
    ids = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2]])
    feeds = dict(
        queries=q, keys=k, values=v, past_key=pk, past_value=pv, attention_mask=mask, document_ids=ids
    )
    keys, values = np.concatenate([pk, k], 2), np.concatenate([pv, v], 2)
    want = reference.heads_attention(
        q, keys, values, attention_mask=mask,
        mask_fn=lambda b, h, i, j: j <= past + i and ids[b, past + i] == ids[b, j],
    )[0]  # fmt: skip
    np.testing.assert_allclose(_session(model).run(None, feeds)[0], want, atol=2e-5, rtol=0)
    ours = multiattn.dot_product_attention(
        q.astype(float), keys.astype(float), values.astype(float), attention_mask=mask[:, None], causal=True,
        query_offset=past, mask_mod=mods.document(ids),
    )  # fmt: skip
    np.testing.assert_allclose(ours, want, atol=1e-12, rtol=0)


@pytest.mark.backend("numpy")
def test_what_the_node_cannot_take_is_refused_naming_the_argument():
    from multiattn.onnx import export, export_attention

    with pytest.raises(ValueError, match="opset must be one of"):
        export_attention(num_heads=H, head_dim=D, opset=22)
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads=4, got 3"):
        export_attention(num_heads=H, num_kv_heads=3, head_dim=D)
    with pytest.raises(ValueError, match="query_offset must be 0"):
        export_attention(num_heads=H, head_dim=D, cache=True, query_offset=3)
    with pytest.raises(TypeError, match="needs num_heads="):
        export({"W_q": np.eye(4)})
    with pytest.raises(TypeError, match="layer must be a multiattn MultiHeadAttention"):
        export(object())
    with pytest.raises(ValueError, match="cache=True is for MultiHeadAttention's decoding step, not "
                       "DotProductAttention"):  # fmt: skip
        export(multiattn.backends.numpy.DotProductAttention(), cache=True)
    with pytest.raises(TypeError, match="num_heads= and num_kv_heads= are for multi-head attention"):
        export({"W_q": np.eye(4), "W_k": np.eye(4), "w_v": np.ones(4)}, num_heads=2)


@pytest.mark.backend("numpy")
def test_multi_head_attention_exports_from_its_weights():
    from multiattn.onnx import export

    rng = np.random.default_rng(4)
    shapes = {"W_q": (16, 12), "W_k": (8, 10), "W_v": (8, 6), "W_o": (16, 16), "b_q": 16, "b_k": 8, "b_v": 8,
              "b_o": 16}  # fmt: skip
    weights = {name: rng.normal(size=shape) for name, shape in shapes.items()}
    session = _session(export(weights, num_heads=4, num_kv_heads=2, causal=True))
    q, kv = rng.normal(size=(B, 5, 12)), rng.normal(size=(B, 5, 10))
    v = rng.normal(size=(B, 5, 6))
    want = multiattn.multi_head_attention(q, kv, v, weights=weights, num_heads=4, num_kv_heads=2, causal=True)
    feeds = {"queries": q, "keys": kv, "values": v}
    got = session.run(None, {n: x.astype(np.float32) for n, x in feeds.items()})[0]
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)  # weights of size ~1: outputs of ~10


@pytest.mark.backend("numpy")
def test_a_float16_model_runs_in_float16():
    from multiattn.onnx import export

    layer = multiattn.backends.numpy.MultiHeadAttention(16, H, num_kv_heads=KV, seed=0)
    model = export(layer, causal=True, dtype="float16")
    x = np.random.default_rng(3).normal(size=(B, 6, 16))
    got = _session(model).run(None, {n: x.astype(np.float16) for n in ("queries", "keys", "values")})[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, layer(x, x, x, causal=True), atol=5e-3, rtol=0)


@pytest.mark.backend("numpy")
def test_check_native_onnxruntime_names_what_the_runtime_does():
    from multiattn.check import native

    summary = dict(native.summarize(native.run_framework("onnxruntime")))
    # float32 and float16 agree on every mask at opset 23; float64 is at float32's accuracy
    assert set(summary["onnxruntime Attention (opset 23)"].values()) == {native.FLOAT32_ACCURACY}
    assert "out of range" in summary["onnxruntime Attention (opset 24)"]["1d"]
    contrib = summary["onnxruntime MultiHeadAttention (com.microsoft)"]
    assert contrib["none"] == "agree" and contrib["mask"] == "fully masked rows: NaN output"
    grouped = summary["onnxruntime Attention (grouped heads)"]
    assert {grouped[m] for m in ("none", "1d", "2d", "mask", "causal", "all")} == {"agree"}


PAGE = Path(__file__).resolve().parent.parent / "docs" / "onnx.md"
PAGE_BLOCK = {"tensorflow": "backends.tensorflow", "jax": "backends.jax", "paddle": "backends.paddle",
              "numpy": "export_attention"}  # fmt: skip


def test_the_onnx_page_examples_print_what_their_comments_say(bk):
    """docs/onnx.md's examples: the Keras one in the tensorflow env, flax's in jax's, paddle's in
    paddle's, the decoding one in numpy's; each print's comment is its output."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 4
    mine = [block for block in blocks if bk.name in PAGE_BLOCK and PAGE_BLOCK[bk.name] in block]
    assert len(mine) == (bk.name in PAGE_BLOCK)
    for block in mine:
        result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300,
                                cwd=tempfile.mkdtemp())  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        said = [line.split("# ", 1)[1] for line in block.splitlines() if line.startswith("print(")]
        assert result.stdout.splitlines() == said
