"""Weight converters between MultiHeadAttention and each framework's own multi-head layer
(``MultiHeadAttention.from_native`` / ``to_native``, docs/converters.md).

Each framework's native layer, with random weights and biases, converted with from_native
gives the native layer's own outputs (its masks in its own polarity, on rows that are never
fully masked, where the frameworks disagree); to_native(from_native(x)) has exactly x's
parameters; from_native(m.to_native()) has exactly m's canonical weights; what one side
cannot express is a ValueError naming the size.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import multiattn

from .harness import harness

DOC = Path(__file__).resolve().parent.parent / "docs" / "converters.md"
B, NQ, NK = 2, 4, 5  # batch, queries, keys
LENS = np.array([3, 5])  # every row keeps a key: no fully masked rows
RTOL = 1e-5


def _uniform(rng, shape):
    return rng.uniform(-0.5, 0.5, shape).astype(np.float32)


def _masks(rng):
    """(lengths as a (B, K) mask, causal (Q, K), a random (B, Q, K)); True = may attend."""
    lens = np.arange(NK)[None, :] < LENS[:, None]
    causal = np.tril(np.ones((NQ, NK), dtype=bool))
    mask = rng.uniform(size=(B, NQ, NK)) < 0.6
    mask[..., 0] = True
    return lens, causal, mask


def _close(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float(np.abs(got - want).max())
    assert err <= RTOL * max(1.0, float(np.abs(want).max())), f"max difference {err:.3g}"


def _equal_params(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _random_canonical(rng, num_hiddens, query_size, key_size, value_size, bias):
    shapes = {
        "W_q": (num_hiddens, query_size), "W_k": (num_hiddens, key_size), "W_v": (num_hiddens, value_size),
        "W_o": (num_hiddens, num_hiddens),
    }  # fmt: skip
    if bias:
        shapes.update({f"b_{n}": (num_hiddens,) for n in "qkvo"})
    return {name: _uniform(rng, shape) for name, shape in shapes.items()}


# --- one adapter per framework: build a native layer, call it with its own masks, read its params


class Native:
    name: str
    # native constructor options -> the inputs' widths (query, key, value); two shapes per framework
    configs: dict
    # sizes of a multiattn layer that the native layer can express: (num_hiddens, heads, q, k, v)
    expressible: tuple

    @property
    def layer_class(self):
        return multiattn.get_backend(self.name).MultiHeadAttention

    def tensor(self, array):
        return multiattn.get_backend(self.name).from_numpy(np.asarray(array))

    def ours(self, layer, q, k, v, *, lens=None, mask=None, causal=False):
        h = harness(self.name)
        h.eval(layer)
        valid_lens = None if lens is None else self.tensor(LENS)
        attention_mask = None if mask is None else self.tensor(mask)
        out = h.call(
            layer, self.tensor(q), self.tensor(k), self.tensor(v), valid_lens,
            attention_mask=attention_mask, causal=causal,
        )  # fmt: skip
        return h.numpy(out)


class TorchNative(Native):
    name = "torch"
    configs = {
        "packed": (dict(embed_dim=8, num_heads=2), (8, 8, 8)),
        "kdim-vdim-seq-first": (dict(embed_dim=8, num_heads=2, kdim=6, vdim=7, batch_first=False), (8, 6, 7)),
    }
    expressible = (8, 2, 8, 6, 7)

    def build(self, rng, bias=True, dropout=0.0, **options):
        from torch import nn

        options = {"batch_first": True, **options}
        layer = nn.MultiheadAttention(bias=bias, dropout=dropout, **options)
        self.randomize(layer, rng)
        return layer.eval()

    def randomize(self, layer, rng):
        import torch

        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.from_numpy(_uniform(rng, tuple(p.shape))))

    def call(self, layer, q, k, v, *, lens=None, causal=None, mask=None):
        import torch

        t = [torch.from_numpy(x) for x in (q, k, v)]
        if not layer.batch_first:
            t = [x.transpose(0, 1) for x in t]
        kwargs = {}
        if lens is not None:
            kwargs["key_padding_mask"] = torch.from_numpy(~lens)  # True: padding
        if causal is not None:
            kwargs["attn_mask"] = torch.from_numpy(~causal)  # True: may NOT attend
        if mask is not None:  # (B * heads, Q, K), batch-major
            kwargs["attn_mask"] = torch.from_numpy(~mask).repeat_interleave(layer.num_heads, 0)
        out = layer(*t, need_weights=False, **kwargs)[0]
        return (out if layer.batch_first else out.transpose(0, 1)).detach().numpy()

    def params(self, layer):
        return {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}

    def native_rate(self, layer):
        return layer.dropout

    def our_rate(self, m):
        return m.dropout.p


class KerasNative(Native):
    name = "tensorflow"
    configs = {
        "output-shape": (dict(num_heads=2, key_dim=4, output_shape=8), (5, 6, 7)),
        "query-width": (dict(num_heads=4, key_dim=2), (8, 8, 3)),
    }
    expressible = (8, 2, 5, 6, 7)

    def build(self, rng, bias=True, dropout=0.0, widths=None, **options):
        import keras

        layer = keras.layers.MultiHeadAttention(use_bias=bias, dropout=dropout, **options)
        q, k, v = widths
        layer.build((None, None, q), (None, None, v), (None, None, k))
        self.randomize(layer, rng)
        return layer

    def randomize(self, layer, rng):
        for variable in layer.weights:
            variable.assign(_uniform(rng, tuple(variable.shape)))

    def call(self, layer, q, k, v, *, lens=None, causal=None, mask=None):
        kwargs = {}
        if lens is not None:
            kwargs["attention_mask"] = lens[:, None, :]  # True: may attend, as ours
        if causal is not None:
            kwargs["use_causal_mask"] = True  # top-left, as ours
        if mask is not None:
            kwargs["attention_mask"] = mask
        return np.asarray(layer(q, v, k, training=False, **kwargs))  # Keras: (query, value, key)

    def params(self, layer):
        # the path without the layer's own (unique) name: query/kernel, ...
        return {v.path.split("/", 1)[1]: np.asarray(v.numpy()) for v in layer.weights}

    def native_rate(self, layer):
        return layer.dropout

    def our_rate(self, m):
        return m.rate


class FlaxNative(Native):
    name = "jax"
    configs = {
        "cross": (
            dict(num_heads=2, in_features=5, qkv_features=8, out_features=8, in_kv_features=6),
            (5, 6, 6),
        ),
        "self": (dict(num_heads=4, in_features=8), (8, 8, 8)),
    }
    expressible = (8, 2, 5, 6, 6)

    def build(self, rng, bias=True, dropout=0.0, **options):
        from flax import nnx

        layer = nnx.MultiHeadAttention(
            use_bias=bias, dropout_rate=dropout, decode=False, deterministic=True, rngs=nnx.Rngs(0), **options
        )
        self.randomize(layer, rng)
        return layer

    def randomize(self, layer, rng):
        import jax.numpy as jnp

        for linear in (layer.query, layer.key, layer.value, layer.out):
            for variable in (linear.kernel, linear.bias):
                if variable is not None:
                    variable.set_value(jnp.asarray(_uniform(rng, tuple(variable.shape))))

    def call(self, layer, q, k, v, *, lens=None, causal=None, mask=None):
        m = None
        if lens is not None:
            m = lens[:, None, None, :]  # (B, heads, Q, K), True: may attend
        if causal is not None:
            m = causal[None, None]
        if mask is not None:
            m = mask[:, None]
        return np.asarray(layer(q, k, v, mask=m, deterministic=True))

    def params(self, layer):
        from flax import nnx

        return {
            ".".join(map(str, path)): np.asarray(value.get_value())
            for path, value in nnx.to_flat_state(nnx.state(layer, nnx.Param))
        }

    def native_rate(self, layer):
        return layer.dropout_rate

    def our_rate(self, m):
        return m.dropout.rate


class PaddleNative(Native):
    name = "paddle"
    configs = {
        "self": (dict(embed_dim=8, num_heads=2), (8, 8, 8)),
        "kdim-vdim": (dict(embed_dim=8, num_heads=4, kdim=6, vdim=7), (8, 6, 7)),
    }
    expressible = (8, 2, 8, 6, 7)

    def build(self, rng, bias=True, dropout=0.0, **options):
        from paddle import nn

        layer = nn.MultiHeadAttention(dropout=dropout, bias_attr=None if bias else False, **options)
        self.randomize(layer, rng)
        layer.eval()
        return layer

    def randomize(self, layer, rng):
        import paddle

        for p in layer.parameters():
            p.set_value(paddle.to_tensor(_uniform(rng, tuple(p.shape))))

    def call(self, layer, q, k, v, *, lens=None, causal=None, mask=None):
        import paddle

        m = None
        if lens is not None:
            m = lens[:, None, None, :]  # broadcast to (B, heads, Q, K); True: may attend
        if causal is not None:
            m = causal
        if mask is not None:
            m = mask[:, None]
        t = [paddle.to_tensor(x) for x in (q, k, v)]
        return layer(*t, attn_mask=None if m is None else paddle.to_tensor(m)).numpy()

    def params(self, layer):
        return {k: np.array(v.numpy()) for k, v in layer.state_dict().items()}

    def native_rate(self, layer):
        return layer.dropout

    def our_rate(self, m):
        return m.dropout.p


class MlxNative(Native):
    name = "mlx"
    configs = {
        "cross": (
            dict(dims=8, num_heads=2, query_input_dims=5, key_input_dims=6, value_input_dims=7),
            (5, 6, 7),
        ),
        "self": (dict(dims=8, num_heads=4), (8, 8, 8)),
    }
    expressible = (8, 2, 5, 6, 7)

    def build(self, rng, bias=True, dropout=0.0, **options):
        from mlx import nn

        assert dropout == 0.0  # mlx's layer has none
        layer = nn.MultiHeadAttention(bias=bias, **options)
        self.randomize(layer, rng)
        return layer.eval()

    def randomize(self, layer, rng):
        import mlx.core as mx
        from mlx.utils import tree_flatten

        flat = [
            (path, mx.array(_uniform(rng, tuple(a.shape)))) for path, a in tree_flatten(layer.parameters())
        ]
        layer.load_weights(flat)

    def call(self, layer, q, k, v, *, lens=None, causal=None, mask=None):
        import mlx.core as mx

        m = None
        if lens is not None:
            m = lens[:, None, None, :]  # boolean: True = may attend
        if causal is not None:
            m = causal  # explicit: mlx's mask="causal" is bottom-right aligned
        if mask is not None:
            m = mask[:, None]
        t = [mx.array(x) for x in (q, k, v)]
        return np.array(layer(*t, mask=None if m is None else mx.array(m)))

    def params(self, layer):
        from mlx.utils import tree_flatten

        return {k: np.array(v) for k, v in tree_flatten(layer.parameters())}

    def our_rate(self, m):
        return m._rate


NATIVES = {n.name: n() for n in (TorchNative, KerasNative, FlaxNative, PaddleNative, MlxNative)}


def _native_params(with_config: bool):
    out = []
    for name, native in NATIVES.items():
        for config in native.configs if with_config else [None]:
            values = (native, config) if with_config else (native,)
            out.append(
                pytest.param(*values, marks=pytest.mark.backend(name), id=f"{name}-{config or ''}".strip("-"))
            )
    return out


def _build(native, rng, config, **kwargs):
    options, widths = native.configs[config]
    if native.name == "tensorflow":
        kwargs["widths"] = widths
    return native.build(rng, **kwargs, **options), widths


def _inputs(rng, widths):
    q, k, v = widths
    return _uniform(rng, (B, NQ, q)), _uniform(rng, (B, NK, k)), _uniform(rng, (B, NK, v))


@pytest.mark.parametrize("case", ["lengths", "causal", "mask"])
@pytest.mark.parametrize("native, config", _native_params(True))
def test_from_native_gives_the_native_layers_outputs(native, config, case):
    rng = np.random.default_rng(0)
    layer, widths = _build(native, rng, config)
    q, k, v = _inputs(rng, widths)
    lens, causal, mask = _masks(rng)
    m = native.layer_class.from_native(layer)
    assert isinstance(m, native.layer_class) and m.bias
    assert (m.query_size, m.key_size, m.value_size) == widths
    if case == "lengths":
        want, got = native.call(layer, q, k, v, lens=lens), native.ours(m, q, k, v, lens=LENS)
    elif case == "causal":
        want, got = native.call(layer, q, k, v, causal=causal), native.ours(m, q, k, v, causal=True)
    else:
        want, got = native.call(layer, q, k, v, mask=mask), native.ours(m, q, k, v, mask=mask)
    assert got.shape == (B, NQ, m.num_hiddens)
    _close(got, want)
    unmasked = native.call(layer, q, k, v)
    assert np.abs(unmasked - want).max() > 1e-3  # the mask mattered


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("native, config", _native_params(True))
def test_to_native_of_from_native_has_the_same_parameters(native, config, bias):
    layer, _ = _build(native, np.random.default_rng(1), config, bias=bias)
    back = native.layer_class.from_native(layer).to_native()
    assert type(back) is type(layer)
    _equal_params(native.params(back), native.params(layer))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("native", _native_params(False))
def test_from_native_of_to_native_has_the_same_canonical_weights(native, bias):
    rng = np.random.default_rng(2)
    num_hiddens, heads, q, k, v = native.expressible
    weights = _random_canonical(rng, num_hiddens, q, k, v, bias)
    m = native.layer_class(num_hiddens, heads, bias=bias, query_size=q, key_size=k, value_size=v)
    m.set_weights(weights)
    layer = m.to_native()
    back = native.layer_class.from_native(layer)
    assert (back.num_hiddens, back.num_heads, back.query_size, back.key_size, back.value_size) == (
        num_hiddens, heads, q, k, v,
    )  # fmt: skip
    assert back.bias is bias
    got = back.get_weights()
    assert sorted(got) == sorted(weights)
    for name in weights:
        np.testing.assert_array_equal(got[name], weights[name], err_msg=name)
    # and the new native layer computes what m computes
    if native.name == "torch":
        layer.eval()
    x = _inputs(rng, (q, k, v))
    lens, _, _ = _masks(rng)
    _close(native.ours(m, *x, lens=LENS), native.call(layer, *x, lens=lens))


@pytest.mark.parametrize("native", [p for p in _native_params(False) if p.id != "mlx"])
def test_the_dropout_rate_is_carried_over(native):
    config = next(iter(native.configs))
    layer, _ = _build(native, np.random.default_rng(3), config, dropout=0.25)
    m = native.layer_class.from_native(layer)
    assert native.our_rate(m) == 0.25
    assert native.native_rate(m.to_native()) == 0.25


# --- what one side cannot express --------------------------------------------------------


@pytest.mark.backend("torch")
def test_torch_refusals():
    import torch
    from torch import nn

    from multiattn.backends.torch import MultiHeadAttention

    with pytest.raises(ValueError, match=r"needs query_size == num_hiddens .*query_size=5, num_hiddens=8"):
        MultiHeadAttention(8, 2, query_size=5).to_native()
    with pytest.raises(ValueError, match="add_bias_kv=True cannot be expressed"):
        MultiHeadAttention.from_native(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn=True cannot be expressed"):
        MultiHeadAttention.from_native(nn.MultiheadAttention(8, 2, add_zero_attn=True))
    partial = nn.MultiheadAttention(8, 2)
    partial.out_proj.bias = None
    with pytest.raises(ValueError, match="biases on in_proj_bias but none on out_proj.bias"):
        MultiHeadAttention.from_native(partial)
    with pytest.raises(TypeError, match="torch.nn.MultiheadAttention"):
        MultiHeadAttention.from_native(nn.Linear(8, 8))
    # a different dtype and the batch_first keyword
    layer = MultiHeadAttention(8, 2, bias=True, dtype=torch.float64).to_native(batch_first=False)
    assert layer.in_proj_weight.dtype == torch.float64 and layer.batch_first is False
    assert MultiHeadAttention.from_native(layer).W_q.weight.dtype == torch.float64


@pytest.mark.backend("tensorflow")
def test_keras_refusals():
    import keras

    from multiattn.backends.tensorflow import MultiHeadAttention

    def built(**kwargs):
        widths = kwargs.pop("widths", (8, 8, 8))
        layer = keras.layers.MultiHeadAttention(**kwargs)
        layer.build((None, None, widths[0]), (None, None, widths[2]), (None, None, widths[1]))
        return layer

    with pytest.raises(ValueError, match="value_dim=3 != key_dim=4 cannot be expressed"):
        MultiHeadAttention.from_native(built(num_heads=2, key_dim=4, value_dim=3))
    with pytest.raises(
        ValueError, match="output width num_hiddens = num_heads \\* key_dim = 8: pass output_shape=8"
    ):
        MultiHeadAttention.from_native(built(num_heads=2, key_dim=4, widths=(5, 8, 8)))
    with pytest.raises(ValueError, match=r"output_shape=\(2, 4\)"):
        MultiHeadAttention.from_native(built(num_heads=2, key_dim=4, output_shape=(2, 4)))
    with pytest.raises(ValueError, match="use_gate=True cannot be expressed"):
        MultiHeadAttention.from_native(built(num_heads=2, key_dim=4, use_gate=True))
    with pytest.raises(ValueError, match="sliding_window=2 cannot be expressed"):
        MultiHeadAttention.from_native(built(num_heads=2, key_dim=4, sliding_window=2))
    with pytest.raises(ValueError, match="is not built"):
        MultiHeadAttention.from_native(keras.layers.MultiHeadAttention(num_heads=2, key_dim=4))
    with pytest.raises(TypeError, match="keras.layers.MultiHeadAttention"):
        MultiHeadAttention.from_native(keras.layers.Dense(3))
    # float64 both ways
    layer = MultiHeadAttention(8, 2, dtype="float64").to_native()
    assert layer.query_dense.kernel.dtype == "float64"
    assert MultiHeadAttention.from_native(layer).W_q.dtype == "float64"


@pytest.mark.backend("jax")
def test_flax_refusals():
    from flax import nnx

    from multiattn.backends.jax import MultiHeadAttention

    def native(**kwargs):
        return nnx.MultiHeadAttention(decode=False, rngs=nnx.Rngs(0), **kwargs)

    with pytest.raises(ValueError, match=r"needs key_size == value_size .*key_size=6, value_size=7"):
        MultiHeadAttention(8, 2, key_size=6, value_size=7).to_native()
    with pytest.raises(ValueError, match="out_features=6 != qkv_features=8"):
        MultiHeadAttention.from_native(native(num_heads=2, in_features=8, out_features=6))
    with pytest.raises(ValueError, match="normalize_qk=True cannot be expressed"):
        MultiHeadAttention.from_native(native(num_heads=2, in_features=8, normalize_qk=True))
    with pytest.raises(ValueError, match="custom attention_fn"):
        MultiHeadAttention.from_native(native(num_heads=2, in_features=8, attention_fn=lambda *a, **k: a[2]))
    with pytest.raises(TypeError, match="flax.nnx.MultiHeadAttention"):
        MultiHeadAttention.from_native(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


@pytest.mark.backend("paddle")
def test_paddle_refusals():
    from paddle import nn

    from multiattn.backends.paddle import MultiHeadAttention

    with pytest.raises(ValueError, match=r"needs query_size == num_hiddens .*query_size=5, num_hiddens=8"):
        MultiHeadAttention(8, 2, query_size=5).to_native()
    partial = nn.MultiHeadAttention(8, 2)
    partial.out_proj.bias = None
    with pytest.raises(
        ValueError, match="biases on q_proj.bias, k_proj.bias, v_proj.bias but none on out_proj"
    ):
        MultiHeadAttention.from_native(partial)
    with pytest.raises(TypeError, match="paddle.nn.MultiHeadAttention"):
        MultiHeadAttention.from_native(nn.Linear(2, 2))
    layer = MultiHeadAttention(8, 2, bias=True)
    layer.to(dtype="float64")
    native = layer.to_native()
    assert str(native.q_proj.weight.dtype).endswith("float64")
    assert str(MultiHeadAttention.from_native(native).W_q.weight.dtype).endswith("float64")


@pytest.mark.backend("mlx")
def test_mlx_refusals():
    import mlx.core as mx
    from mlx import nn

    from multiattn.backends.mlx import MultiHeadAttention

    with pytest.raises(ValueError, match="value_dims=4 != dims=8 cannot be expressed"):
        MultiHeadAttention.from_native(nn.MultiHeadAttention(8, 2, value_dims=4))
    with pytest.raises(ValueError, match="value_output_dims=5 != dims=8 cannot be expressed"):
        MultiHeadAttention.from_native(nn.MultiHeadAttention(8, 2, value_output_dims=5))
    with pytest.raises(ValueError, match=r"needs dropout == 0 .*dropout=0.1"):
        MultiHeadAttention(8, 2, dropout=0.1).to_native()
    partial = nn.MultiHeadAttention(8, 2, bias=True)
    partial.out_proj.pop("bias")
    with pytest.raises(ValueError, match="but none on out_proj.bias"):
        MultiHeadAttention.from_native(partial)
    with pytest.raises(TypeError, match="mlx.nn.MultiHeadAttention"):
        MultiHeadAttention.from_native(nn.Linear(2, 2))
    layer = MultiHeadAttention(8, 2, bias=True)
    layer.set_dtype(mx.float16)
    assert layer.to_native().query_proj.weight.dtype == mx.float16


# --- porting between frameworks through the canonical weights ----------------------------


def _torch_native_and_inputs():
    from torch import nn

    rng = np.random.default_rng(4)
    layer = TorchNative().build(rng, embed_dim=8, num_heads=2, kdim=6, vdim=6)
    q, k, v = _uniform(rng, (B, NQ, 8)), _uniform(rng, (B, NK, 6)), _uniform(rng, (B, NK, 6))
    lens, _, _ = _masks(rng)
    want = TorchNative().call(layer, q, k, v, lens=lens)
    assert isinstance(layer, nn.MultiheadAttention)
    return layer, (q, k, v), lens, want


@pytest.mark.backend("torch")
@pytest.mark.backend("tensorflow")
def test_port_torch_to_keras_through_the_canonical_weights():
    from multiattn.backends.tensorflow import MultiHeadAttention as KerasMHA
    from multiattn.backends.torch import MultiHeadAttention as TorchMHA

    layer, (q, k, v), lens, want = _torch_native_and_inputs()
    weights = TorchMHA.from_native(layer).get_weights()
    ours = KerasMHA(8, 2, bias=True, query_size=8, key_size=6, value_size=6)
    ours.set_weights(weights)
    keras_layer = ours.to_native()
    _close(KerasNative().call(keras_layer, q, k, v, lens=lens), want)


@pytest.mark.backend("torch")
@pytest.mark.backend("jax")
def test_port_torch_to_flax_through_the_canonical_weights():
    from multiattn.backends.jax import MultiHeadAttention as FlaxMHA
    from multiattn.backends.torch import MultiHeadAttention as TorchMHA

    layer, (q, k, v), lens, want = _torch_native_and_inputs()
    weights = TorchMHA.from_native(layer).get_weights()
    ours = FlaxMHA(8, 2, bias=True, query_size=8, key_size=6, value_size=6)
    ours.set_weights(weights)
    _close(FlaxNative().call(ours.to_native(), q, k, v, lens=lens), want)


# --- docs/converters.md: its examples run and print what they promise ----------------------

NO_NATIVE_LAYER = ("numpy", "mxnet", "array_api")


def _doc_blocks() -> dict:
    return {
        m.group(1): m.group(0)[len("```python\n") : -3]
        for m in re.finditer(r"```python\n# backend: ([\w+]+).*?```", DOC.read_text(), re.S)
    }


def _run_block(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    differences = [float(x) for x in re.findall(r"max difference:? (\S+)", result.stdout)]
    assert differences and max(differences) < 1e-5, result.stdout
    assert "False" not in result.stdout and "True" in result.stdout, result.stdout
    return result.stdout


def test_the_converter_page_has_a_block_per_native_layer():
    assert sorted(_doc_blocks()) == sorted(
        ["torch", "tensorflow", "jax", "paddle", "mlx", "torch+tensorflow"]
    )
    text = DOC.read_text()
    assert all(name in text for name in ("numpy", "mxnet")), "the page says which backends have none"


def test_the_converter_examples_run(bk):
    """The page's block of bk's framework runs alone and prints differences below 1e-5 and True
    for its exact round trips; the backends without a native multi-head layer have no block."""
    blocks = _doc_blocks()
    if bk.name not in blocks:
        assert bk.name in NO_NATIVE_LAYER
        assert not hasattr(getattr(multiattn.get_backend(bk.name), "MultiHeadAttention", None), "from_native")
        return
    stdout = _run_block(blocks[bk.name])
    assert stdout.count("max difference") >= 1


@pytest.mark.backend("torch")
@pytest.mark.backend("tensorflow")
def test_the_converter_port_example_runs():
    stdout = _run_block(_doc_blocks()["torch+tensorflow"])
    assert "max difference" in stdout
