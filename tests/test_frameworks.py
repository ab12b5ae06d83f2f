"""Each framework's own idioms: modes, dropout, autodiff through the layers, graph/jit modes.

A test marked backend(name) runs whenever that backend is under test (see conftest).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import multiattn
from multiattn import tuning

from . import reference as ref
from .forcing import lower_thresholds

RNG = np.random.default_rng(3)
Q, K, V = RNG.normal(size=(2, 3, 4)), RNG.normal(size=(2, 6, 4)), RNG.normal(size=(2, 6, 2))
LENS = np.array([4, 6])
WEIGHTS = {"W_q": RNG.normal(size=(5, 4)), "W_k": RNG.normal(size=(5, 4)), "w_v": RNG.normal(size=(5,))}
WANT_DOT = ref.dot_product_attention(Q, K, V, LENS)[0]
WANT_ADD = ref.additive_attention(Q, K, V, LENS, WEIGHTS["W_q"], WEIGHTS["W_k"], WEIGHTS["w_v"])[0]


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=300
    )


# --- forward mode and second order (shared by the jax and torch tests) -------------------


def _keys_holding_minus_inf():
    """Positive queries, a key holding -inf (so hidden by its own scores), a direction (0 at the
    -inf entry) and a cotangent; and from the reference, with that key masked instead: the
    directional derivative of the output and the second one of sum(output * cotangent)."""
    rng = np.random.default_rng(5)
    q, k = np.abs(Q) + 0.1, K.copy()
    k[0, 1, 0] = -np.inf
    t_q, t_k, g = rng.normal(size=Q.shape), rng.normal(size=K.shape), rng.normal(size=(2, 3, 2))
    t_k[0, 1, 0] = 0.0
    visible = np.ones((2, 3, 6), bool)
    visible[0, :, 1] = False

    def out(step: float) -> np.ndarray:
        return ref.dot_product_attention(q + step * t_q, K + step * t_k, V, attention_mask=visible)[0]

    tangent = (out(1e-6) - out(-1e-6)) / 2e-6
    second = sum(np.sum(out(sign * 1e-4) * g) for sign in (1, -1)) - 2 * np.sum(out(0.0) * g)
    return (q, k, t_q, t_k, g), tangent, second / 1e-8


# --- numpy -------------------------------------------------------------------------------


@pytest.mark.backend("numpy")
def test_numpy_seeds_make_layers_reproducible():
    from multiattn.backends import numpy as m

    a, b = m.AdditiveAttention(4, 4, 5, seed=7), m.AdditiveAttention(4, 4, 5, seed=7)
    for key in WEIGHTS:
        np.testing.assert_array_equal(a.get_weights()[key], b.get_weights()[key])
    q, k, v = (x.astype("float32") for x in (Q, K, V))
    one, two = m.DotProductAttention(0.5, seed=1), m.DotProductAttention(0.5, seed=1)
    np.testing.assert_array_equal(one(q, k, v, LENS), two(q, k, v, LENS))  # same seed, same mask
    assert not np.allclose(one(q, k, v, LENS), one.eval()(q, k, v, LENS))  # dropout only in training
    np.testing.assert_allclose(one(q, k, v, LENS), WANT_DOT, rtol=1e-5, atol=1e-6)


# --- torch -------------------------------------------------------------------------------


@pytest.mark.backend("torch")
def test_torch_modules_train_eval_and_autograd():
    import torch

    from multiattn.backends import torch as m

    q, k, v = (torch.tensor(x, dtype=torch.float64) for x in (Q, K, V))
    lens = torch.tensor(LENS)
    layer = m.AdditiveAttention(4, 4, 5, dropout=0.5).double()
    assert isinstance(layer, torch.nn.Module) and layer.training
    layer.set_weights(WEIGHTS)
    # state_dict keys are d2l's, so d2l checkpoints load
    assert set(layer.state_dict()) == {"W_k.weight", "W_q.weight", "w_v.weight"}
    train_out = layer(q, k, v, lens)
    layer.eval()
    np.testing.assert_allclose(layer(q, k, v, lens).detach().numpy(), WANT_ADD, rtol=1e-10)
    assert not torch.allclose(train_out, layer(q, k, v, lens))
    layer(q, k, v, lens).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


@pytest.mark.backend("torch")
def test_torch_forward_mode_and_second_order_with_keys_holding_minus_inf():
    """torch.func.jvp, a Hessian-vector product by torch.func, and double backward (create_graph,
    as a gradient penalty uses) through a key holding -inf: finite, the reference's."""
    import torch

    (q, k, t_q, t_k, g), want_tangent, want_second = _keys_holding_minus_inf()
    q, k, t_q, t_k, g, v = (torch.tensor(x) for x in (q, k, t_q, t_k, g, V))

    def attend(q, k):
        return multiattn.dot_product_attention(q, k, v)

    def loss(q, k):
        return torch.sum(attend(q, k) * g)

    tangent = torch.func.jvp(attend, (q, k), (t_q, t_k))[1]
    np.testing.assert_allclose(tangent.numpy(), want_tangent, rtol=1e-6, atol=1e-8)
    d_grads = torch.func.jvp(torch.func.grad(loss, argnums=(0, 1)), (q, k), (t_q, t_k))[1]
    np.testing.assert_allclose(
        float(sum((d * t).sum() for d, t in zip(d_grads, (t_q, t_k)))), want_second, rtol=1e-5
    )
    q, k = q.requires_grad_(), k.requires_grad_()
    grads = torch.autograd.grad(loss(q, k), (q, k), create_graph=True)
    along = sum((d * t).sum() for d, t in zip(grads, (t_q, t_k)))
    twice = torch.autograd.grad(along, (q, k))
    assert all(bool(torch.isfinite(d).all()) for d in twice)
    np.testing.assert_allclose(
        float(sum((d * t).sum() for d, t in zip(twice, (t_q, t_k)))), want_second, rtol=1e-5
    )


@pytest.mark.backend("torch")
def test_torch_compile(monkeypatch):
    import torch

    from multiattn.backends import torch as m

    lower_thresholds(m, monkeypatch, FUSED_MIN_SCORES=0)  # SDPA under compile, even this small

    args = [torch.tensor(x) for x in (Q, K, V)] + [torch.tensor(LENS)]
    layer = m.AdditiveAttention(4, 4, 5).double().eval()
    layer.set_weights(WEIGHTS)
    compiled = torch.compile(layer)  # inductor: a real compilation on the CPU
    np.testing.assert_allclose(compiled(*args).detach().numpy(), WANT_ADD, rtol=1e-10)
    fast = torch.compile(m.DotProductAttention(need_weights=False).eval(), backend="aot_eager")
    np.testing.assert_allclose(fast(*args).numpy(), WANT_DOT, rtol=1e-10)


@pytest.mark.backend("torch")
def test_torch_sdpa_only_above_its_size_threshold(monkeypatch):
    import torch
    from torch.nn import functional as F

    from multiattn.backends import torch as m

    calls = []
    kernel = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    args = [torch.tensor(x) for x in (Q, K, V)] + [torch.tensor(LENS)]
    for threshold, runs in ((m.FUSED_MIN_SCORES, False), (Q.shape[0] * Q.shape[1] * K.shape[1], True)):
        lower_thresholds(m, monkeypatch, FUSED_MIN_SCORES=threshold)
        calls.clear()
        np.testing.assert_allclose(m.dot_product_attention(*args).numpy(), WANT_DOT, rtol=1e-10)
        assert bool(calls) == runs


@pytest.mark.backend("numpy")
def test_the_second_fill_skips_padding_already_zero_beside_a_full_length_sequence():
    # the batch's longest sequence has no padding, so its last column holds weights; the
    # others' padding is exactly 0 already and must not be written again (read-only here);
    # from SKIP_TEST_MIN_ELEMENTS weights (smaller ones are written without the test)
    from multiattn import fast_paths

    weights = np.full((3, fast_paths.SKIP_TEST_MIN_ELEMENTS // 8, 4), 0.25)
    weights[1, :, 2:] = weights[2, :, 1:] = 0.0
    weights.flags.writeable = False
    assert fast_paths.fill_by_slices(weights, [4, 2, 1], 0.0, uniform=True) is weights
    with pytest.raises(ValueError, match="read-only"):  # a sequence left to fill is written
        fast_paths.fill_by_slices(weights, [4, 2, 0], 0.0, uniform=True)


# --- tensorflow --------------------------------------------------------------------------


@pytest.mark.backend("tensorflow")
def test_tensorflow_tf_function_and_training_flag():
    import tensorflow as tf

    from multiattn.backends import tensorflow as m

    layer = m.AdditiveAttention(4, 4, 5, dropout=0.5, dtype="float64")
    layer.set_weights(WEIGHTS)
    args = [tf.constant(x) for x in (Q, K, V)] + [tf.constant(LENS)]

    @tf.function
    def infer(q, k, v, lens):
        return layer(q, k, v, lens, training=False)

    np.testing.assert_allclose(infer(*args).numpy(), WANT_ADD, rtol=1e-10)
    np.testing.assert_allclose(layer(*args).numpy(), WANT_ADD, rtol=1e-10)  # Keras default: inference
    assert not np.allclose(layer(*args, training=True).numpy(), WANT_ADD)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(*args, training=False))
    grads = tape.gradient(loss, layer.trainable_weights)
    assert len(grads) == 3 and all(g is not None for g in grads)


@pytest.mark.backend("tensorflow")
def test_tensorflow_graphs_with_unknown_dimensions():
    # every dimension unknown when traced: the weight products reshape by the runtime shape
    import tensorflow as tf

    from multiattn.backends import tensorflow as m

    weights = {name: tf.constant(w) for name, w in WEIGHTS.items()}
    unknown = tf.TensorSpec([None, None, None], tf.float64)
    spec = [unknown] * 3 + [tf.TensorSpec([None], tf.int64)]
    additive = tf.function(
        lambda q, k, v, n: m.additive_attention(q, k, v, n, **weights), input_signature=spec
    )
    args = [tf.constant(x) for x in (Q, K, V)] + [tf.constant(LENS)]
    np.testing.assert_allclose(additive(*args).numpy(), WANT_ADD, rtol=1e-10)
    # dot-product attention's scale 1/sqrt(width) is a constant of the graph: the width must be known
    width = tf.TensorSpec([None, None, 4], tf.float64)
    dot = tf.function(m.dot_product_attention, input_signature=[width, width, unknown, spec[3]])
    np.testing.assert_allclose(dot(*args).numpy(), WANT_DOT, rtol=1e-10)
    with pytest.raises(ValueError, match=r"queries must have a known width .* got shape \(\?, \?, \?\)"):
        tf.function(m.dot_product_attention, input_signature=spec)(*args)


@pytest.mark.backend("tensorflow")
def test_tensorflow_inside_keras_models():
    import keras

    from multiattn.backends import tensorflow as m

    q_in, k_in, v_in = keras.Input((3, 4)), keras.Input((6, 4)), keras.Input((6, 2))
    lens_in = keras.Input((), dtype="int32")
    out = m.DotProductAttention(dropout=0.1)(q_in, k_in, v_in, lens_in)
    model = keras.Model([q_in, k_in, v_in, lens_in], out)
    got = model.predict([x.astype("float32") for x in (Q, K, V)] + [LENS.astype("int32")], verbose=0)
    np.testing.assert_allclose(got, WANT_DOT, rtol=1e-5, atol=1e-6)

    layer = m.AdditiveAttention(4, 4, 5)
    layer.set_weights(WEIGHTS)
    keras_list = layer.get_weights(format="keras")
    assert [w.shape for w in keras_list] == [(4, 5), (4, 5), (5, 1)]  # Keras' (in, out) kernels
    other = m.AdditiveAttention(4, 4, 5)
    other.set_weights(keras_list)  # Keras' own list form
    np.testing.assert_allclose(other.get_weights()["W_q"], WEIGHTS["W_q"], rtol=1e-6)
    clone = m.AdditiveAttention.from_config(layer.get_config())
    assert (clone.key_size, clone.query_size, clone.num_hiddens, clone.rate) == (4, 4, 5, 0.0)


@pytest.mark.backend("tensorflow")
def test_keras_on_another_backend_is_a_clear_error():
    result = python(
        "import multiattn\ntry:\n    multiattn.get_backend('tensorflow')\n"
        "except ImportError as err:\n    print(err)\n",
        KERAS_BACKEND="jax",
    )
    assert result.returncode == 0, result.stderr
    assert (
        "KERAS_BACKEND='jax'" in result.stdout and "unset it or set KERAS_BACKEND=tensorflow" in result.stdout
    )


# --- jax ---------------------------------------------------------------------------------


@pytest.mark.backend("jax")
def test_jax_jit_grad_vmap():
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    q, k, v = (jnp.asarray(x) for x in (Q, K, V))
    lens = jnp.asarray(LENS)
    attend = jax.jit(multiattn.dot_product_attention)
    np.testing.assert_allclose(np.asarray(attend(q, k, v, lens)), WANT_DOT, rtol=1e-10)
    grad_q = jax.grad(lambda q: multiattn.dot_product_attention(q, k, v, lens).sum())(q)
    assert grad_q.shape == q.shape and bool(jnp.isfinite(grad_q).all())
    # vmap over an extra leading axis: each slice is an ordinary batch
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
    batched = jax.vmap(lambda q, k, v: multiattn.dot_product_attention(q, k, v, lens))(*stacked)
    np.testing.assert_allclose(np.asarray(batched[0]), WANT_DOT, rtol=1e-10)


@pytest.mark.backend("jax")
def test_jax_forward_mode_and_second_order_with_keys_holding_minus_inf():
    """jax.jvp and a Hessian-vector product through a key holding -inf (the scores' custom
    rule is a jvp, so forward mode and second order stay), eagerly and under jax.jit."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    (q, k, t_q, t_k, g), want_tangent, want_second = _keys_holding_minus_inf()
    q, k, t_q, t_k, g, v = map(jnp.asarray, (q, k, t_q, t_k, g, V))

    def attend(q, k):
        return multiattn.dot_product_attention(q, k, v)

    def second(q, k):  # t^T H t: the jvp of the gradient
        grads = jax.grad(lambda q, k: jnp.sum(attend(q, k) * g), argnums=(0, 1))
        d_grads = jax.jvp(grads, (q, k), (t_q, t_k))[1]
        return jnp.sum(d_grads[0] * t_q) + jnp.sum(d_grads[1] * t_k)

    tangent = lambda q, k: jax.jvp(attend, (q, k), (t_q, t_k))[1]  # noqa: E731
    for run in (lambda f: f, jax.jit):
        np.testing.assert_allclose(np.asarray(run(tangent)(q, k)), want_tangent, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(float(run(second)(q, k)), want_second, rtol=1e-5)


@pytest.mark.backend("jax")
def test_jax_fused_kernel_only_off_the_cpu(monkeypatch):
    # the matrix and the gradient tests force the kernel on; the default skips it on CPU
    import jax
    import jax.numpy as jnp

    from multiattn.backends import jax as m

    calls = []
    kernel = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    q, k, v = (jnp.asarray(x, dtype=jnp.float32) for x in (Q, K, V[..., :2].repeat(2, -1)))
    want = ref.dot_product_attention(np.asarray(q), np.asarray(k), np.asarray(v), LENS)[0]
    for forced, runs in ((False, jax.default_backend() != "cpu"), (True, True)):
        monkeypatch.setattr(m, "FUSED_ON_CPU", forced)
        calls.clear()
        out = m.dot_product_attention(q, k, v, jnp.asarray(LENS))
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
        assert bool(calls) == runs


@pytest.mark.backend("jax")
def test_jax_additive_blocks_under_jit_one_at_a_time(monkeypatch):
    # under jit the query blocks run in lax.map: the reference's values and gradients, a last
    # block shorter than the others, and XLA's temporary memory far below the features'
    import jax
    import jax.numpy as jnp

    from multiattn.backends import jax as m

    B, Q, K, h = 2, 300, 16, 32
    monkeypatch.setattr(tuning.of(m.ops), "feature_block_elements", B * h * K * 7)  # 7 queries
    rng = np.random.default_rng(22)
    q, k, v = rng.normal(size=(B, Q, 3)), rng.normal(size=(B, K, 5)), rng.normal(size=(B, K, 2))
    W = [rng.normal(size=(h, 3)) * 0.5, rng.normal(size=(h, 5)) * 0.5, rng.normal(size=(h,))]
    lens = np.array([120, 300])
    want = ref.additive_attention(q, k, v, lens, *W)[0]
    args = [jnp.asarray(a, dtype=jnp.float32) for a in (q, k, v, *W)] + [jnp.asarray(lens)]

    def forward(q, k, v, W_q, W_k, w_v, lens):
        return m.additive_attention(q, k, v, lens, W_q=W_q, W_k=W_k, w_v=w_v)

    def loss(*args):
        return forward(*args).sum()

    fn = jax.jit(forward)
    np.testing.assert_allclose(np.asarray(fn(*args)), want, rtol=1e-5, atol=1e-5)
    temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp < B * Q * K * h * 4 / 4, f"{temp} bytes of temporaries: the features were materialized"
    blocked = jax.jit(jax.grad(loss, argnums=(0, 5)))(*args)
    monkeypatch.setattr(tuning.of(m.ops), "feature_block_elements", B * Q * K * h)  # one block: no loop
    whole = jax.grad(loss, argnums=(0, 5))(*args)
    for a, b in zip(blocked, whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.backend("jax")
def test_jax_nnx_modules_jit_and_weights():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from multiattn.backends import jax as m

    jax.config.update("jax_enable_x64", True)
    layer = m.AdditiveAttention(4, 4, 5, dropout=0.5, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
    assert isinstance(layer, nnx.Module)
    layer.set_weights(WEIGHTS)
    args = [jnp.asarray(x) for x in (Q, K, V)] + [jnp.asarray(LENS)]
    train_out = layer(*args)
    layer.eval()

    @nnx.jit
    def infer(layer, q, k, v, lens):
        return layer(q, k, v, lens)

    np.testing.assert_allclose(np.asarray(infer(layer, *args)), WANT_ADD, rtol=1e-10)
    assert layer.attention_weights.shape == (2, 3, 6)  # readable after nnx.jit
    assert not np.allclose(np.asarray(train_out), WANT_ADD)  # dropout in train mode
    out, weights = jax.jit(lambda *a: m.DotProductAttention()(*a, return_weights=True))(*args)
    np.testing.assert_allclose(np.asarray(out), WANT_DOT, rtol=1e-10)
    assert weights.shape == (2, 3, 6)


@pytest.mark.backend("jax")
def test_jax_sharded_batch_on_a_one_device_mesh():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.config.update("jax_enable_x64", True)
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    shard = NamedSharding(mesh, PartitionSpec("batch"))
    args = [jax.device_put(jnp.asarray(x), shard) for x in (Q, K, V, LENS)]
    out = jax.jit(multiattn.dot_product_attention)(*args)
    np.testing.assert_allclose(np.asarray(out), WANT_DOT, rtol=1e-10)
    assert out.sharding.mesh.shape == {"batch": 1}


@pytest.mark.backend("jax")
def test_jax_float64_without_x64_is_an_error_not_a_silent_float32():
    result = python(
        "import numpy as np, multiattn\nm = multiattn.get_backend('jax')\n"
        "print(m.from_numpy(np.ones(2, 'float32')).dtype)\n"
        "try:\n    m.from_numpy(np.ones(2))\nexcept ValueError as err:\n    print(err)\n",
        JAX_ENABLE_X64="0",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("float32\n")
    assert "float64 needs jax_enable_x64" in result.stdout


# --- paddle ------------------------------------------------------------------------------


@pytest.mark.backend("paddle")
def test_paddle_dygraph_train_eval_and_grads():
    import paddle

    from multiattn.backends import paddle as m

    layer = m.AdditiveAttention(4, 4, 5, dropout=0.5)
    layer.to(dtype="float64")
    layer.set_weights(WEIGHTS)
    assert isinstance(layer, paddle.nn.Layer) and layer.training
    args = [paddle.to_tensor(x) for x in (Q, K, V)] + [paddle.to_tensor(LENS)]
    train_out = layer(*args)
    layer.eval()
    np.testing.assert_allclose(layer(*args).numpy(), WANT_ADD, rtol=1e-10)
    assert not np.allclose(train_out.numpy(), WANT_ADD)
    layer(*args).sum().backward()
    assert all(p.grad is not None for p in layer.parameters())
    assert layer.W_q.weight.shape == [4, 5]  # paddle's (in, out); canonical is (5, 4)


@pytest.mark.backend("paddle")
def test_paddle_jit_to_static():
    import paddle

    from multiattn.backends import paddle as m

    layer = m.AdditiveAttention(4, 4, 5)
    layer.to(dtype="float64")
    layer.set_weights(WEIGHTS)
    layer.eval()
    static = paddle.jit.to_static(layer, full_graph=True)
    args = [paddle.to_tensor(x) for x in (Q, K, V)] + [paddle.to_tensor(LENS)]
    np.testing.assert_allclose(static(*args).numpy(), WANT_ADD, rtol=1e-10)


@pytest.mark.backend("paddle")
def test_paddle_softmax_writes_into_the_scores_only_where_autograd_does_not_need_them():
    import paddle

    from multiattn.backends import paddle as m

    x = np.random.default_rng(3).normal(size=(2, 5, 7)) * 5
    want = paddle.nn.functional.softmax(paddle.to_tensor(x), axis=-1).numpy()
    owned = paddle.to_tensor(x)
    got = m.ops._softmax_owned(owned)
    assert got.data_ptr() == owned.data_ptr()
    np.testing.assert_array_equal(got.numpy(), want)

    leaf = paddle.to_tensor(x, stop_gradient=False)
    scores = leaf * 1.0
    got = m.ops._softmax_owned(scores)
    assert got.data_ptr() != scores.data_ptr()
    (got * paddle.to_tensor(x)).sum().backward()  # softmax's backward has its output
    s = want
    np.testing.assert_allclose(leaf.grad.numpy(), s * (x - (s * x).sum(-1, keepdims=True)), rtol=1e-10)


@pytest.mark.backend("paddle")
def test_paddle_half_precision_on_cpu_is_a_clear_error():
    from multiattn.backends import paddle as m

    x = m.from_numpy(np.ones((1, 2, 3)), "float16")
    with pytest.raises(
        TypeError, match="X is paddle.float16 on the CPU, but paddle's CPU build has no float16"
    ):
        m.masked_softmax(x)


@pytest.mark.backend("paddle")
def test_paddle_after_tensorflow_is_an_explained_error_not_a_segfault():
    code = (
        "import sys, types\n"
        "sys.modules['tensorflow'] = types.ModuleType('tensorflow')  # as if tensorflow were imported\n"
        "import multiattn\n"
        "try:\n    multiattn.get_backend('paddle')\n"
        "except ImportError as err:\n    print(err)\n"
        "print('paddle imported:', 'paddle' in sys.modules)\n"
    )
    result = python(code)
    assert result.returncode == 0, result.stderr
    assert "importing paddle after tensorflow crashes the process" in result.stdout
    assert "import paddle before tensorflow" in result.stdout and "another process" in result.stdout
    assert "paddle imported: False" in result.stdout


@pytest.mark.backend("paddle")
@pytest.mark.backend("tensorflow")
def test_paddle_first_then_tensorflow_works():
    code = (
        "import paddle, tensorflow, multiattn, numpy as np\n"
        "for name in ('paddle', 'tensorflow'):\n"
        "    m = multiattn.get_backend(name)\n"
        "    x = m.from_numpy(np.zeros((1, 1, 2)), 'float32')\n"
        "    print(name, float(m.to_numpy(m.masked_softmax(x)).sum()))\n"
    )
    result = python(code)
    assert result.returncode == 0, result.stderr
    assert "paddle 1.0" in result.stdout and "tensorflow 1.0" in result.stdout


# --- mlx ---------------------------------------------------------------------------------


@pytest.mark.backend("mlx")
def test_mlx_additive_blocks_evaluated_one_by_one_outside_transforms(monkeypatch):
    # eagerly each block's scores are evaluated as they are made (its features freed);
    # mx.compile and mx.vmap refuse eval, so there the blocks stay lazy: the same values
    # everywhere, and under mx.grad the gradients of the unblocked computation
    import mlx.core as mx

    from multiattn.backends import mlx as m

    rng = np.random.default_rng(23)
    q, k, v = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 7, 4)), rng.normal(size=(2, 7, 2))
    W = [rng.normal(size=(5, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5,))]
    lens = np.array([4, 7])
    want = ref.additive_attention(q, k, v, lens, *W)[0]
    args = [mx.array(a.astype(np.float32)) for a in (q, k, v, *W)] + [mx.array(lens)]
    evaluated = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (real_eval(*a), evaluated.append(1))[0])

    def forward(q, k, v, W_q, W_k, w_v, lens):
        return m.additive_attention(q, k, v, lens, W_q=W_q, W_k=W_k, w_v=w_v)

    monkeypatch.setattr(tuning.of(m.ops), "feature_block_elements", 2 * 5 * 7 * 2)  # 2 queries
    for fn, blocks in ((forward, 2), (mx.compile(forward), 0)):
        evaluated.clear()
        np.testing.assert_allclose(np.array(fn(*args)), want, rtol=1e-5, atol=1e-5)
        assert len(evaluated) == blocks
    batched = mx.vmap(
        lambda *a: forward(*(x[None] for x in a[:3]), *a[3:6], a[6][None])[0],
        in_axes=(0, 0, 0, None, None, None, 0),
    )(*args)
    np.testing.assert_allclose(np.array(batched), want, rtol=1e-5, atol=1e-5)
    grad = mx.grad(lambda *a: forward(*a).sum(), argnums=5)
    blocked = grad(*args)
    monkeypatch.setattr(tuning.of(m.ops), "feature_block_elements", 10**9)
    np.testing.assert_allclose(np.array(blocked), np.array(grad(*args)), rtol=1e-5, atol=1e-6)


@pytest.mark.backend("mlx")
def test_mlx_blocks_stay_lazy_only_in_the_thread_running_a_custom_vjp(monkeypatch):
    # a backward holds each array it evaluates to its end, so it settles nothing; a forward in
    # another thread meanwhile still evaluates its blocks one by one
    import threading

    import mlx.core as mx

    from multiattn.backends import mlx as m

    evaluated = []
    monkeypatch.setattr(mx, "eval", lambda *a: evaluated.append(threading.get_ident()))
    inside, other = threading.Event(), threading.Event()

    def backward(tensors, constants, outputs, cotangents):
        m.ops.settle(tensors[0])
        inside.set()
        assert other.wait(10)
        return tuple(mx.zeros_like(t) for t in tensors)

    def in_other_thread():
        assert inside.wait(10)
        m.ops.settle(mx.ones(3))
        other.set()

    worker = threading.Thread(target=in_other_thread)
    worker.start()
    x = mx.ones(3)
    grad = mx.grad(lambda x: m.ops.custom_gradient(lambda x: (x * 2,), backward, (x,))[0].sum())
    np.testing.assert_array_equal(np.array(grad(x)), [0, 0, 0])
    worker.join()
    assert evaluated == [worker.ident]


@pytest.mark.backend("mlx")
def test_mlx_modules_lazy_eval_and_value_and_grad():
    import mlx.core as mx
    import mlx.nn as nn

    from multiattn.backends import mlx as m

    assert m.from_numpy(Q).dtype == mx.float64  # not silently float32
    layer = m.AdditiveAttention(4, 4, 5, dropout=0.5)
    layer.set_dtype(mx.float64)
    layer.set_weights(WEIGHTS)
    args = [m.from_numpy(x) for x in (Q, K, V)] + [m.from_numpy(LENS)]
    assert layer.training
    train_out = layer(*args)
    layer.eval()
    out = layer(*args)
    mx.eval(out)
    np.testing.assert_allclose(np.array(out), WANT_ADD, rtol=1e-6)
    assert not np.allclose(np.array(train_out), WANT_ADD)
    loss_and_grad = nn.value_and_grad(layer, lambda *a: layer(*a).sum())
    _, grads = loss_and_grad(*args)
    assert set(grads) >= {"W_q", "W_k", "w_v"}


# --- mxnet -------------------------------------------------------------------------------


@pytest.mark.backend("mxnet")
def test_mxnet_gluon_dropout_only_in_autograd_training():
    from mxnet import autograd, gluon
    from mxnet import np as mnp

    from multiattn.backends import mxnet as m

    layer = m.AdditiveAttention(4, 4, 5, dropout=0.5)
    layer.cast("float64")
    layer.set_weights(WEIGHTS)
    assert isinstance(layer, gluon.nn.Block)
    args = [mnp.array(x, dtype=x.dtype) for x in (Q, K, V)] + [mnp.array(LENS)]
    np.testing.assert_allclose(layer(*args).asnumpy(), WANT_ADD, rtol=1e-10)
    with autograd.record():
        out = layer(*args)
        loss = out.sum()
    loss.backward()
    assert not np.allclose(out.asnumpy(), WANT_ADD)  # dropout while recording for training
    assert all(abs(p.grad()).sum() > 0 for p in layer.collect_params().values())


@pytest.mark.backend("mxnet")
def test_mxnet_softmax_writes_into_the_scores_only_while_autograd_does_not_record():
    from mxnet import autograd, npx
    from mxnet import np as mnp

    from multiattn.backends import mxnet as m

    x = np.random.default_rng(3).normal(size=(2, 5, 7)) * 5
    want = npx.softmax(mnp.array(x, dtype="float64"), axis=-1).asnumpy()
    owned = mnp.array(x, dtype="float64")
    got = m.ops._softmax_owned(owned)
    assert got is owned
    np.testing.assert_array_equal(got.asnumpy(), want)

    leaf = mnp.array(x, dtype="float64")
    leaf.attach_grad()
    with autograd.record():
        scores = leaf * 1.0
        got = m.ops._softmax_owned(scores)
        assert got is not scores
        loss = (got * mnp.array(x, dtype="float64")).sum()
    loss.backward()
    s = want
    np.testing.assert_allclose(leaf.grad.asnumpy(), s * (x - (s * x).sum(-1, keepdims=True)), rtol=1e-10)


@pytest.mark.backend("mxnet")
def test_mxnet_padding_fill_writes_only_into_the_cores_own_scores():
    from mxnet import np as mnp

    from multiattn.backends import mxnet as m

    x = np.random.default_rng(4).normal(size=(2, 3, 5))
    lens = mnp.array([2.0, 4.0])
    want = x.copy()
    want[0, :, 2:], want[1, :, 4:] = -7.0, -7.0

    own = mnp.array(x, dtype="float32")  # the core's own scores: written in place, no copy
    got = m.ops._fill_padding(own, [2, 4], -7.0)
    assert got is own
    np.testing.assert_allclose(own.asnumpy(), want, rtol=1e-6)

    callers = mnp.array(x, dtype="float32")  # the caller's X: masked_softmax leaves it alone
    weights = m.masked_softmax(callers, lens)
    np.testing.assert_allclose(callers.asnumpy(), x, rtol=1e-6)
    assert (weights.asnumpy()[0, :, 2:] == 0).all() and (weights.asnumpy()[1, :, 4:] == 0).all()
