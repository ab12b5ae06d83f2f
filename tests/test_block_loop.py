"""The one loop over the block map (``multiattn.blockwise``): under jax.jit and tf.function,
several masks at once (lengths, a boolean mask, causality, mask functions), 4-D with grouped
heads, forward and through gradients, against the float64 loops of tests/reference.py; the
compiled program does not grow with the length (the loop is the framework's, not unrolled);
elsewhere the same loop runs as a plain Python loop (numpy)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import multiattn
from multiattn import blockwise, mods
from multiattn.masks import Masks

from . import reference as ref
from .harness import harness
from .test_gradients import assert_gradients_close, central_differences
from .test_mods import _jitted, supported
from .tolerances import assert_close

B, H, KV, Q, K, D, BLOCK = 2, 4, 2, 11, 13, 3, 4
RNG = np.random.default_rng(39)
MASK = RNG.random((B, 1, Q, K)) < 0.8


def _every_third(b, h, q_idx, kv_idx):
    return (q_idx + kv_idx) % 3 != 0


CASES = {
    "lengths (B, Q), mask, causal, scale": dict(
        valid_lens=RNG.integers(0, K + 1, (B, Q)), attention_mask=MASK, causal=True, scale=0.3
    ),
    "lengths (B,), window and a user's mask_mod": dict(
        valid_lens=np.array([9, 13]), mask_mod=mods.and_masks(mods.sliding_window(5), _every_third)
    ),
}
REFERENCE_MASKS = {  # the reference's, of Python ints
    "lengths (B,), window and a user's mask_mod": lambda b, h, i, j: 0 <= i - j < 5 and (i + j) % 3 != 0
}
# the backends whose loop primitives a compiler sees (``Ops.loop_primitives``), each run where
# it is under test
COMPILED = [pytest.param(name, marks=pytest.mark.backend(name)) for name in ("jax", "tensorflow")]


def _inputs(seed, b=B, h=H, kv=KV, q=Q, k=K):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(b, h, q, D)), rng.normal(size=(b, kv, k, D)), rng.normal(size=(b, kv, k, 2))


def _call(bk, case, args, block_size=BLOCK):
    kw = dict(CASES[case])
    lens, mask = kw.pop("valid_lens"), kw.pop("attention_mask", None)
    return functools.partial(
        multiattn.dot_product_attention, valid_lens=bk.tensor(lens), block_size=block_size,
        attention_mask=None if mask is None else bk.tensor(mask), **kw,
    )  # fmt: skip


def _reference(case, q, k, v):
    kw = dict(CASES[case])
    kw.pop("mask_mod", None)
    return ref.heads_attention(q, k, v, kw.pop("valid_lens"), mask_fn=REFERENCE_MASKS.get(case), **kw)[0]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", COMPILED)
def test_the_compiled_loop_matches_the_reference(name, dtype, case):
    bk = harness(name)
    supported(bk, dtype)
    args = [bk.tensor(x, dtype) for x in _inputs(1)]
    want = _reference(case, *(bk.numpy(x).astype(np.float64) for x in args))
    assert_close(bk, _jitted(bk, _call(bk, case, args))(*args), want, dtype)


@functools.lru_cache(maxsize=None)
def _differences(case):
    inputs = dict(zip("qkv", _inputs(2)))
    fn = functools.partial(_reference, case)
    cotangent = np.random.default_rng(3).normal(size=fn(**inputs).shape)
    return inputs, cotangent, central_differences(fn, inputs, cotangent)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", COMPILED)
def test_the_compiled_loops_gradients_match_finite_differences(name, case):
    bk = harness(name)
    inputs, cotangent, want = _differences(case)
    tensors = [bk.tensor(x, "float64") for x in inputs.values()]
    attend = _call(bk, case, tensors)
    t_cotangent = bk.tensor(cotangent, "float64")
    grads = _jitted(bk, lambda *t: bk.module.vjp(attend, list(t), t_cotangent)[1])(*tensors)
    got = {n: np.asarray(bk.numpy(g), dtype=np.float64) for n, g in zip(inputs, grads)}
    assert_gradients_close(bk, got, want, "float64")


def _program_size(bk, fn, args):
    """The number of operations of fn's compiled program, at its top level."""
    if bk.name == "jax":
        import jax

        return len(jax.make_jaxpr(fn)(*args).eqns)
    import tensorflow as tf

    graph = tf.function(fn).get_concrete_function(*args).graph
    # zeros are a Const below 1,000 elements and a Fill above: the same operation
    return len([op for op in graph.get_operations() if op.type not in ("Const", "Fill")])


@pytest.mark.parametrize("name", COMPILED)
def test_the_compiled_program_does_not_grow_with_the_length(name):
    bk = harness(name)
    sizes = {}
    for n in (64, 256):  # 16 and 64 blocks a side
        args = [bk.tensor(x, "float32") for x in _inputs(4, q=n, k=n)]
        lens, mask = bk.tensor(np.array([n - 3, n])), bk.tensor(np.ones((B, 1, n, n), bool))
        ones = bk.tensor(np.ones((B, H, n, 2)), "float32")

        def attend(q, k, v, lens=lens, mask=mask):
            return multiattn.dot_product_attention(
                q, k, v, lens, attention_mask=mask, causal=True, mask_mod=_every_third, block_size=BLOCK
            )

        def gradients(q, k, v, cotangent=ones):
            return bk.module.vjp(attend, [q, k, v], cotangent)[1]

        sizes[n] = (_program_size(bk, attend, args), _program_size(bk, gradients, args))
    assert sizes[64] == sizes[256], f"operations of the program (forward, gradients) by length: {sizes}"


@pytest.mark.parametrize("case", list(CASES))
def test_eager_backends_run_the_same_loop_as_a_python_loop(case):
    """numpy's ``Ops`` keep the default ``loop``/``stacked``/``rows_at``: a plain loop."""
    from multiattn.backends import numpy as backend

    q, k, v = _inputs(5)
    kw = dict(CASES[case])
    masks = Masks(kw["valid_lens"], kw.get("attention_mask"), kw.get("causal", False), kw.get("mask_mod"))
    scale = kw.get("scale", D**-0.5)
    out, _ = blockwise.attention(backend.ops, q, k, v, masks, scale=scale, block_size=BLOCK)
    np.testing.assert_allclose(out, _reference(case, q, k, v), atol=1e-12)
