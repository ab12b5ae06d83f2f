"""The two float64 references agree under lengths, boolean/integer masks, causal masks and
multi-head attention (d2l 11.5), and the analytic gradients of multiattn/reference.py match
central finite differences.  Plain numpy: no backend is involved."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from multiattn import reference as lib

from . import reference as ref

B, QUERY_SIZE, KEY_SIZE, VALUE_SIZE, HIDDEN = 3, 3, 4, 2, 4
NAN = float("nan")


def _rng(*names) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(names).encode()))


def _bool_mask(rng, shape, masked_rows=()):
    mask = rng.random(shape) < 0.7
    for row in masked_rows:
        mask[row] = False  # a row with nothing visible
    return mask


# name -> builder(rng, num_heads) -> (Q, K, mask keyword arguments); masks of rank <= 3
CASES = {
    "no mask": lambda rng, H: (3, 4, {}),
    "1-D lengths, 0 and over-long": lambda rng, H: (3, 4, {"valid_lens": np.array([0, 2.5, 7])}),
    "1-D integer lengths": lambda rng, H: (3, 4, {"valid_lens": np.array([4, 0, 1])}),
    "2-D lengths, negative and NaN": lambda rng, H: (
        3,
        4,
        {"valid_lens": np.array([[-1, 2, 4], [3, 0, 9], [1, NAN, 1.5]])},
    ),
    "bool mask, a row fully masked": lambda rng, H: (
        3,
        4,
        {"attention_mask": _bool_mask(rng, (B, 3, 4), [(1, 2)])},
    ),
    "integer 0/1 mask": lambda rng, H: (
        3,
        4,
        {"attention_mask": _bool_mask(rng, (B, 3, 4), [(0, 0)]).astype(np.int64)},
    ),
    "2-D (Q, K) mask": lambda rng, H: (3, 4, {"attention_mask": _bool_mask(rng, (3, 4), [1])}),
    "1-D (K,) mask": lambda rng, H: (3, 4, {"attention_mask": np.array([1, 0, 1, 1], dtype=np.int32)}),
    "(B, 1, K) padding mask": lambda rng, H: (3, 4, {"attention_mask": _bool_mask(rng, (B, 1, 4), [2])}),
    "causal, Q < K": lambda rng, H: (2, 5, {"causal": True}),
    "causal, Q > K": lambda rng, H: (5, 3, {"causal": True}),
    "lengths + mask + causal": lambda rng, H: (
        4,
        4,
        {
            "valid_lens": np.array([[2, 0, 3, 4], [-1, 4, 1, 2.5], [9, 9, 9, 9]]),
            "attention_mask": _bool_mask(rng, (B, 4, 4)),
            "causal": True,
        },
    ),
    "1-D lengths + 2-D integer mask + causal, Q > K": lambda rng, H: (
        5,
        3,
        {
            "valid_lens": np.array([2, 0, 9]),
            "attention_mask": _bool_mask(rng, (5, 3)).astype(np.int8),
            "causal": True,
        },
    ),
}

# masks over (B, H, Q, K): multi-head and 4-D masked_softmax only
CASES_4D = {
    "4-D (B, H, Q, K) mask": lambda rng, H: (
        3,
        4,
        {"attention_mask": _bool_mask(rng, (B, H, 3, 4), [(0, H - 1, 2), (2, 0, 0)])},
    ),
    "4-D (1, H, 1, K) mask": lambda rng, H: (3, 4, {"attention_mask": _bool_mask(rng, (1, H, 1, 4))}),
    "4-D mask + 2-D lengths + causal, Q > K": lambda rng, H: (
        4,
        3,
        {
            "valid_lens": np.array([[1, 2, 3, 0], [3, 3, 3, 3], [-2, 9, 1.5, 2]]),
            "attention_mask": _bool_mask(rng, (B, H, 4, 3), [(1, 0, 3)]),
            "causal": True,
        },
    ),
}

ALL_CASES = {**CASES, **CASES_4D}


def _case(name, num_heads=2):
    return ALL_CASES[name](_rng("mask", name, num_heads), num_heads)


def _attention_inputs(name, Q, K, function):
    rng = _rng("inputs", name, function)
    q_size = KEY_SIZE if function == "dot" else QUERY_SIZE
    return (
        rng.standard_normal((B, Q, q_size)),
        rng.standard_normal((B, K, KEY_SIZE)),
        rng.standard_normal((B, K, VALUE_SIZE)),
    )


def _additive_weights(name):
    rng = _rng("additive", name)
    return {
        "W_q": rng.standard_normal((HIDDEN, QUERY_SIZE)),
        "W_k": rng.standard_normal((HIDDEN, KEY_SIZE)),
        "w_v": rng.standard_normal(HIDDEN),
    }


def _mha_weights(name, biases):
    rng = _rng("mha", name, biases)
    weights = {
        "W_q": rng.standard_normal((HIDDEN, QUERY_SIZE)),
        "W_k": rng.standard_normal((HIDDEN, KEY_SIZE)),
        "W_v": rng.standard_normal((HIDDEN, VALUE_SIZE)),
        "W_o": rng.standard_normal((HIDDEN, HIDDEN)),
    }
    if biases:
        weights.update({f"b_{x}": rng.standard_normal(HIDDEN) for x in "qkvo"})
    return weights


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def _assert_weights_respect_visibility(weights, visible):
    """Invisible entries are exactly 0, visible rows sum to 1, rows with nothing visible are all 0."""
    assert np.all(weights[~visible] == 0.0)
    seen = visible.any(axis=-1)
    np.testing.assert_allclose(weights.sum(axis=-1)[seen], 1.0, rtol=1e-12)
    assert np.all(weights[~seen] == 0.0)


def _finite_differences(f, arrays: dict, eps=1e-6) -> dict:
    """Central differences of the scalar f(**arrays) with respect to every entry of every array."""
    grads = {}
    for name, array in arrays.items():
        grad = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            plus = {**arrays, name: array.copy()}
            minus = {**arrays, name: array.copy()}
            plus[name][index] += eps
            minus[name][index] -= eps
            grad[index] = (f(**plus) - f(**minus)) / (2 * eps)
        grads[name] = grad
    return grads


def _assert_grads_match(analytic: dict, numeric: dict):
    assert set(analytic) == set(numeric)
    for name, grad in numeric.items():
        assert analytic[name].shape == grad.shape, name
        scale = max(1.0, float(np.abs(grad).max()))
        np.testing.assert_allclose(analytic[name], grad, rtol=1e-6, atol=1e-7 * scale, err_msg=name)


# ---------------------------------------------------------------------------------------------------
# the visibility rule


def test_visibility_by_hand():
    # lengths: -1 and NaN show nothing, 2.5 shows j = 0, 1, 2, 10 shows everything
    lens = np.array([-1, NAN, 2.5, 10])
    got = lib.visibility((4, 1, 4), lens)
    want = np.array([[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], bool)[:, None, :]
    assert np.array_equal(got, want) and np.array_equal(ref.visible((4, 1, 4), lens), want)
    # causal is top-left aligned: query i sees keys j <= i, also when Q != K
    wide = np.array([[1, 0, 0, 0], [1, 1, 0, 0]], bool)
    tall = np.array([[1, 0], [1, 1], [1, 1]], bool)
    for shape, want in (((1, 2, 4), wide), ((1, 3, 2), tall)):
        assert np.array_equal(lib.visibility(shape, causal=True)[0], want)
        assert np.array_equal(ref.visible(shape, causal=True)[0], want)
    # an integer mask (nonzero may attend), lengths and causal all apply; 3-D masks are shared by heads
    mask = np.array([[[2, 0, 1], [1, 1, 0], [1, 1, 1]]])
    want = np.array([[1, 0, 0], [1, 1, 0], [1, 1, 0]], bool)
    for shape in ((1, 3, 3), (1, 2, 3, 3)):
        for rule in (lib.visibility, ref.visible):
            got = rule(shape, np.array([2]), mask, True)
            assert got.shape == shape and np.array_equal(
                got.reshape(-1, 3, 3), np.stack([want] * (got.size // 9))
            )
    # a 4-D mask is per head; 2-D lengths index batch and queries, shared by heads
    mask4 = np.ones((1, 2, 2, 3), bool)
    mask4[0, 1, 0] = False
    for rule in (lib.visibility, ref.visible):
        got = rule((1, 2, 2, 3), np.array([[1, 3]]), mask4)
        assert np.array_equal(got[0, 0], [[1, 0, 0], [1, 1, 1]]) and np.array_equal(
            got[0, 1], [[0, 0, 0], [1, 1, 1]]
        )


@pytest.mark.parametrize("heads", [None, 1, 2])
@pytest.mark.parametrize("name", list(ALL_CASES))
def test_the_visibility_rules_agree(name, heads):
    if heads is None and name in CASES_4D:
        heads = 3  # a 4-D mask needs a head axis
    Q, K, masks = _case(name, heads or 2)
    shape = (B, Q, K) if heads is None else (B, heads, Q, K)
    got, want = lib.visibility(shape, **masks), ref.visible(shape, **masks)
    assert got.shape == want.shape == shape and got.dtype == want.dtype == bool
    assert np.array_equal(got, want)
    if masks:  # every case masks something out, so a rule that ignored the masks would fail
        assert not want.all()


@pytest.mark.parametrize("seed", range(20))
def test_random_masks_agree(seed):
    rng = np.random.default_rng(seed)
    Q, K, H = (int(n) for n in rng.integers(1, 5, size=3))
    shape = (B, H, Q, K) if rng.random() < 0.5 else (B, Q, K)
    masks: dict = {"causal": bool(rng.random() < 0.5)}
    kind = rng.integers(3)
    if kind == 1:
        masks["valid_lens"] = rng.integers(-1, K + 2, size=B)
    elif kind == 2:
        masks["valid_lens"] = rng.uniform(-1, K + 1, size=(B, Q))
    rank = int(rng.integers(0, len(shape) + 1))
    if rank:
        # a 3-D mask means (B, Q, K) also against (B, H, Q, K); other ranks align from the right
        full = (B, Q, K) if rank == 3 else shape
        mask_shape = tuple(n if rng.random() < 0.7 else 1 for n in full[len(full) - rank :])
        masks["attention_mask"] = rng.integers(0, 2, size=mask_shape)
    assert np.array_equal(lib.visibility(shape, **masks), ref.visible(shape, **masks))


# ---------------------------------------------------------------------------------------------------
# the two references agree


@pytest.mark.parametrize("heads", [None, 2])
@pytest.mark.parametrize("name", list(ALL_CASES))
def test_masked_softmax_agrees(name, heads):
    if heads is None and name in CASES_4D:
        heads = 3
    Q, K, masks = _case(name, heads or 2)
    shape = (B, Q, K) if heads is None else (B, heads, Q, K)
    X = _rng("softmax", name, heads).standard_normal(shape) * 3
    got, want = lib.masked_softmax(X, **masks), ref.masked_softmax(X, **masks)
    _close(got, want)
    _close(lib.masked_softmax_case(X, cotangent=X, **masks)["weights"], want)
    _assert_weights_respect_visibility(got, ref.visible(shape, **masks))
    _assert_weights_respect_visibility(want, ref.visible(shape, **masks))


@pytest.mark.parametrize("name", list(CASES))
def test_dot_product_attention_agrees(name):
    Q, K, masks = _case(name)
    q, k, v = _attention_inputs(name, Q, K, "dot")
    got = lib.dot_product_attention(q, k, v, **masks)
    out, weights = ref.dot_product_attention(q, k, v, **masks)
    _close(got["out"], out)
    _close(got["weights"], weights)
    _assert_weights_respect_visibility(got["weights"], ref.visible((B, Q, K), **masks))


@pytest.mark.parametrize("name", list(CASES))
def test_additive_attention_agrees(name):
    Q, K, masks = _case(name)
    q, k, v = _attention_inputs(name, Q, K, "additive")
    w = _additive_weights(name)
    lens = masks.pop("valid_lens", None)
    got = lib.additive_attention(q, k, v, lens, w["W_q"], w["W_k"], w["w_v"], **masks)
    out, weights = ref.additive_attention(q, k, v, lens, w["W_q"], w["W_k"], w["w_v"], **masks)
    _close(got["out"], out)
    _close(got["weights"], weights)
    _assert_weights_respect_visibility(got["weights"], ref.visible((B, Q, K), lens, **masks))


@pytest.mark.parametrize("num_heads", [1, 2, 4])
@pytest.mark.parametrize("biases", [False, True], ids=["no biases", "biases"])
@pytest.mark.parametrize("name", list(ALL_CASES))
def test_multi_head_attention_agrees(name, biases, num_heads):
    Q, K, masks = _case(name, num_heads)
    q, k, v = _attention_inputs(name, Q, K, "mha")
    w = _mha_weights(name, biases)
    lens = masks.pop("valid_lens", None)
    got = lib.multi_head_attention(q, k, v, lens, w, num_heads, **masks)
    out, weights = ref.multi_head_attention(q, k, v, lens, w, num_heads, **masks)
    assert got["out"].shape == out.shape == (B, Q, HIDDEN)
    assert got["weights"].shape == weights.shape == (B, num_heads, Q, K)
    _close(got["out"], out)
    _close(got["weights"], weights)
    _assert_weights_respect_visibility(got["weights"], ref.visible((B, num_heads, Q, K), lens, **masks))


def test_one_head_with_identity_projections_is_dot_product_attention():
    # a check of the multi-head math against the single-head function, outside either loop reference
    rng = _rng("identity")
    q, k, v = (rng.standard_normal((B, n, HIDDEN)) for n in (3, 5, 5))
    eye = np.eye(HIDDEN)
    masks = {"valid_lens": np.array([2, 0, 5]), "attention_mask": _bool_mask(rng, (B, 3, 5)), "causal": True}
    lens = masks.pop("valid_lens")
    got = lib.multi_head_attention(
        q, k, v, lens, {"W_q": eye, "W_k": eye, "W_v": eye, "W_o": eye}, 1, **masks
    )
    want = lib.dot_product_attention(q, k, v, lens, **masks)
    _close(got["out"], want["out"])
    _close(got["weights"][:, 0], want["weights"])
    out, _ = ref.dot_product_attention(q, k, v, lens, **masks)
    _close(got["out"], out)


def test_heads_take_contiguous_column_groups():
    # head i attends with columns i*d .. (i+1)*d-1: zeroing head 0's query columns makes head 0 uniform
    rng = _rng("columns")
    q, k, v = (rng.standard_normal((B, n, HIDDEN)) for n in (3, 4, 4))
    W_q = np.eye(HIDDEN)
    W_q[:2] = 0.0
    eye = np.eye(HIDDEN)
    for function in (lib.multi_head_attention, ref.multi_head_attention):
        result = function(q, k, v, None, {"W_q": W_q, "W_k": eye, "W_v": eye, "W_o": eye}, 2)
        weights = result["weights"] if isinstance(result, dict) else result[1]
        _close(weights[:, 0], np.full((B, 3, 4), 0.25))
        assert np.abs(weights[:, 1] - 0.25).max() > 1e-3


def test_masks_that_show_everything_change_nothing():
    rng = _rng("everything")
    q, k, v = _attention_inputs("everything", 3, 4, "dot")
    plain = lib.dot_product_attention(q, k, v)
    for masks in (
        {"attention_mask": np.ones((B, 3, 4), bool)},
        {"valid_lens": np.full(B, 4)},
        {"valid_lens": rng.uniform(3.5, 9, size=(B, 3))},
    ):
        _close(lib.dot_product_attention(q, k, v, **masks)["out"], plain["out"])
    # the same visibility given as lengths or as a mask is the same attention
    lens = np.array([1, 3, 2])
    as_mask = np.arange(4)[None, None, :] < lens[:, None, None]
    _close(
        lib.dot_product_attention(q, k, v, lens)["out"],
        lib.dot_product_attention(q, k, v, attention_mask=np.broadcast_to(as_mask, (B, 3, 4)))["out"],
    )
    assert np.abs(lib.dot_product_attention(q, k, v, lens)["out"] - plain["out"]).max() > 1e-3


# ---------------------------------------------------------------------------------------------------
# fully masked rows


def test_fully_masked_rows_are_exactly_zero():
    rng = _rng("fully masked")
    Q, K, H = 3, 4, 2
    mask = _bool_mask(rng, (B, Q, K), [(0, 1), (2, 0)])
    lens = np.array([4, 4, 4])
    q, k, v = _attention_inputs("fully masked", Q, K, "dot")
    G = rng.standard_normal((B, Q, VALUE_SIZE))
    dot = lib.dot_product_attention(q, k, v, lens, G, attention_mask=mask)
    for row in ((0, 1), (2, 0)):
        assert np.all(dot["weights"][row] == 0.0) and np.all(dot["out"][row] == 0.0)
        assert np.all(dot["grads"]["queries"][row] == 0.0)
        assert np.all(ref.dot_product_attention(q, k, v, lens, mask)[1][row] == 0.0)
    q, k, v = _attention_inputs("fully masked", Q, K, "additive")
    w = _additive_weights("fully masked")
    add = lib.additive_attention(q, k, v, lens, w["W_q"], w["W_k"], w["w_v"], G, attention_mask=mask)
    for row in ((0, 1), (2, 0)):
        assert np.all(add["weights"][row] == 0.0) and np.all(add["out"][row] == 0.0)
        assert np.all(add["grads"]["queries"][row] == 0.0)
    # multi-head: a masked row contributes b_o only (0 without biases), and no query gradient
    q, k, v = _attention_inputs("fully masked", Q, K, "mha")
    G = rng.standard_normal((B, Q, HIDDEN))
    for biases in (False, True):
        w = _mha_weights("fully masked", biases)
        mha = lib.multi_head_attention(q, k, v, lens, w, H, G, attention_mask=mask)
        _, ref_weights = ref.multi_head_attention(q, k, v, lens, w, H, attention_mask=mask)
        for b, i in ((0, 1), (2, 0)):
            assert np.all(mha["weights"][b, :, i] == 0.0) and np.all(ref_weights[b, :, i] == 0.0)
            assert np.array_equal(mha["out"][b, i], w["b_o"] if biases else np.zeros(HIDDEN))
            assert np.all(mha["grads"]["queries"][b, i] == 0.0)
        assert np.abs(mha["out"][0, 0]).max() > 1e-3  # a visible row is not zero


# ---------------------------------------------------------------------------------------------------
# analytic gradients against central finite differences


@pytest.mark.parametrize("name", list(CASES))
def test_masked_softmax_gradient(name):
    Q, K, masks = _case(name)
    X = _rng("softmax grad", name).standard_normal((B, Q, K))
    G = _rng("softmax cotangent", name).standard_normal((B, Q, K))
    got = lib.masked_softmax_case(X, cotangent=G, **masks)["grads"]
    numeric = _finite_differences(lambda X: float(np.sum(lib.masked_softmax(X, **masks) * G)), {"X": X})
    _assert_grads_match(got, numeric)


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_masked_softmax_gradient_4d(name):
    Q, K, masks = _case(name, 2)
    X = _rng("softmax grad 4d", name).standard_normal((B, 2, Q, K))
    G = _rng("softmax cotangent 4d", name).standard_normal((B, 2, Q, K))
    lens = masks.pop("valid_lens", None)
    got = lib.masked_softmax_case(X, lens, G, **masks)["grads"]
    numeric = _finite_differences(lambda X: float(np.sum(lib.masked_softmax(X, lens, **masks) * G)), {"X": X})
    _assert_grads_match(got, numeric)


@pytest.mark.parametrize("name", list(CASES))
def test_dot_product_attention_gradient(name):
    Q, K, masks = _case(name)
    q, k, v = _attention_inputs(name, Q, K, "dot")
    G = _rng("dot cotangent", name).standard_normal((B, Q, VALUE_SIZE))
    lens = masks.pop("valid_lens", None)
    got = lib.dot_product_attention(q, k, v, lens, G, **masks)["grads"]

    def f(queries, keys, values):
        return float(np.sum(lib.dot_product_attention(queries, keys, values, lens, **masks)["out"] * G))

    _assert_grads_match(got, _finite_differences(f, {"queries": q, "keys": k, "values": v}))


@pytest.mark.parametrize("name", list(CASES))
def test_additive_attention_gradient(name):
    Q, K, masks = _case(name)
    q, k, v = _attention_inputs(name, Q, K, "additive")
    w = _additive_weights(name)
    G = _rng("additive cotangent", name).standard_normal((B, Q, VALUE_SIZE))
    lens = masks.pop("valid_lens", None)
    got = lib.additive_attention(q, k, v, lens, w["W_q"], w["W_k"], w["w_v"], G, **masks)["grads"]

    def f(queries, keys, values, W_q, W_k, w_v):
        out = lib.additive_attention(queries, keys, values, lens, W_q, W_k, w_v, **masks)["out"]
        return float(np.sum(out * G))

    _assert_grads_match(got, _finite_differences(f, {"queries": q, "keys": k, "values": v, **w}))


@pytest.mark.parametrize("num_heads", [1, 2])
@pytest.mark.parametrize("biases", [False, True], ids=["no biases", "biases"])
@pytest.mark.parametrize("name", list(ALL_CASES))
def test_multi_head_attention_gradient(name, biases, num_heads):
    Q, K, masks = _case(name, num_heads)
    q, k, v = _attention_inputs(name, Q, K, "mha")
    w = _mha_weights(name, biases)
    G = _rng("mha cotangent", name).standard_normal((B, Q, HIDDEN))
    lens = masks.pop("valid_lens", None)
    got = lib.multi_head_attention(q, k, v, lens, w, num_heads, G, **masks)["grads"]
    assert set(got) == {"queries", "keys", "values", *w}

    def f(queries, keys, values, **weights):
        out = lib.multi_head_attention(queries, keys, values, lens, weights, num_heads, **masks)["out"]
        return float(np.sum(out * G))

    _assert_grads_match(got, _finite_differences(f, {"queries": q, "keys": k, "values": v, **w}))


# ---------------------------------------------------------------------------------------------------
# compatibility and errors


def test_positional_calls_still_work():
    rng = _rng("positional")
    X = rng.standard_normal((B, 3, 4))
    lens = np.array([1, 0, 3])
    G = rng.standard_normal((B, 3, 4))
    case = lib.masked_softmax_case(X, lens, G)
    _close(case["out"], ref.masked_softmax(X, lens))
    assert case["grads"]["X"].shape == X.shape and np.all(case["grads"]["X"][1] == 0.0)
    q, k, v = _attention_inputs("positional", 3, 4, "dot")
    _close(lib.dot_product_attention(q, k, v, lens)["out"], ref.dot_product_attention(q, k, v, lens)[0])
    # an unmasked softmax still takes any rank
    Y = rng.standard_normal((2, 2, 2, 2, 3))
    _close(lib.masked_softmax(Y), ref.masked_softmax(Y))
    np.testing.assert_allclose(ref.masked_softmax(Y).sum(axis=-1), 1.0, rtol=1e-12)


def test_multi_head_attention_refuses_bad_weights():
    q, k, v = _attention_inputs("errors", 3, 4, "mha")
    w = _mha_weights("errors", True)
    with pytest.raises(ValueError, match="divisible"):
        lib.multi_head_attention(q, k, v, None, w, 3)
    with pytest.raises(ValueError, match="all of"):
        lib.multi_head_attention(q, k, v, None, {n: a for n, a in w.items() if n != "b_v"}, 2)
    with pytest.raises(ValueError, match="needs weights"):
        lib.multi_head_attention(q, k, v, None, {n: a for n, a in w.items() if n != "W_o"}, 2)
    with pytest.raises(ValueError):  # a mask that does not broadcast is refused by both rules
        lib.visibility((B, 3, 4), attention_mask=np.ones((5, 4), bool))
    with pytest.raises(ValueError):
        ref.visible((B, 3, 4), attention_mask=np.ones((5, 4), bool))
    assert math.isfinite(lib.multi_head_attention(q, k, v, None, w, 2)["out"].sum())
