"""Weight converters between ``MultiHeadAttention`` and each framework's own multi-head layer.

Framework-free (numpy only): for every native layer, its parameters as numpy arrays by
attribute path (``"out_proj.weight"``, ``"query_dense.kernel"``, ...) to and from the
canonical dict (W_q, W_k, W_v (h, in), W_o (h, h), b_q, b_k, b_v, b_o (h,): y = W x + b;
W_k, W_v, b_k, b_v with num_kv_heads * h / num_heads rows under grouped-query attention)
and the sizes, with the checks of what the other side cannot express (a ``ValueError``
naming the size and what the other side needs).  The framework modules only read and write
the arrays (``MultiHeadAttention.from_native`` / ``to_native``); docs/converters.md has
the table of layouts.

* ``<fw>_from(arrays, ...) -> (Config, canonical weights)``: arrays maps each path of
  ``<FW>_PATHS`` to a numpy array, or None where the native layer has no such parameter.
* ``<fw>_to(config, weights) -> (constructor kwargs, arrays)``: the native layer's
  constructor arguments and its parameters by path, in the native layout.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from .. import validation

Arrays = Dict[str, np.ndarray]
NAMES = "qkvo"


class Config(NamedTuple):
    """The sizes and rates of a multiattn MultiHeadAttention, as its constructor takes them."""

    num_hiddens: int
    num_heads: int
    query_size: int
    key_size: int
    value_size: int
    bias: bool
    dropout: float
    num_kv_heads: Optional[int] = None  # None: num_heads, one key/value head per query head

    def kwargs(self) -> Dict[str, Any]:
        return dict(self._asdict())

    @property
    def kv_heads(self) -> int:
        """The key/value heads (num_kv_heads, or num_heads where it is None)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def kv_hiddens(self) -> int:
        """The rows of W_k and W_v: kv_heads heads of num_hiddens / num_heads."""
        return validation.kv_hiddens(self.num_hiddens, self.num_heads, self.kv_heads)


def config(layer: Any, dropout: float) -> Config:
    """The Config of a multiattn MultiHeadAttention (its dropout rate as its framework keeps it)."""
    return Config(
        layer.num_hiddens, layer.num_heads, layer.query_size, layer.key_size, layer.value_size,
        bool(layer.bias), float(dropout), getattr(layer, "num_kv_heads", None),
    )  # fmt: skip


def _check_heads(where: str, num_hiddens: int, num_heads: int) -> None:
    if num_hiddens % num_heads:
        raise ValueError(f"{where}: num_hiddens={num_hiddens} is not divisible by num_heads={num_heads}")


def _needs(native: str, what: str, **sizes: Any) -> ValueError:
    """ValueError '<native> needs <what>; this layer has a=1, b=2'."""
    have = ", ".join(f"{k}={v}" for k, v in sizes.items())
    return ValueError(f"{native} needs {what}; this layer has {have}")


def _cannot(native: str, what: str, need: str) -> ValueError:
    """ValueError '<native> with <what> cannot be expressed: multiattn's MultiHeadAttention <need>'."""
    return ValueError(f"{native} with {what} cannot be expressed: multiattn's MultiHeadAttention {need}")


def _check_not_grouped(native: str, cfg: Config, instead: str = "") -> None:
    """The native layers with one key/value head per query head refuse grouped-query attention."""
    if cfg.kv_heads != cfg.num_heads:
        raise ValueError(
            f"grouped-query attention (num_kv_heads={cfg.kv_heads} != num_heads={cfg.num_heads}) cannot "
            f"be expressed by {native}: it has one key and value head per query head, it needs "
            f"num_kv_heads == num_heads{instead}"
        )


def _shape(where: str, path: str, array: Optional[np.ndarray], shape: Tuple[int, ...]) -> np.ndarray:
    if array is None:
        raise ValueError(f"{where} has no parameter {path}")
    array = np.asarray(array)
    if array.shape != tuple(shape):
        raise ValueError(f"{where}: {path} has shape {array.shape}, expected {tuple(shape)}")
    return array


def _all_or_no_biases(where: str, biases: Mapping[str, Optional[np.ndarray]]) -> bool:
    """Whether the native layer has biases: all of them (True) or none (False), else ValueError."""
    present = [path for path, b in biases.items() if b is not None]
    if present and len(present) != len(biases):
        absent = [path for path, b in biases.items() if b is None]
        raise _cannot(
            where, f"biases on {', '.join(present)} but none on {', '.join(absent)}",
            "has biases on all of q, k, v and o (bias=True) or on none (bias=False)",
        )  # fmt: skip
    return bool(present)


def _canonical(W: Mapping[str, np.ndarray], b: Mapping[str, Optional[np.ndarray]], bias: bool) -> Arrays:
    out = {f"W_{n}": np.array(W[n]) for n in NAMES}
    if bias:
        out.update({f"b_{n}": np.array(b[n]).reshape(-1) for n in NAMES})
    return out


def _weights(cfg: Config, weights: Mapping[str, Any]) -> Arrays:
    shapes = validation.multi_head_weight_shapes(
        cfg.num_hiddens, cfg.query_size, cfg.key_size, cfg.value_size, cfg.bias, cfg.kv_hiddens
    )
    return {name: _shape("the canonical weights", name, weights.get(name), s) for name, s in shapes.items()}


def _rate(where: str, dropout: Any) -> float:
    rate = float(dropout or 0.0)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{where} has dropout {dropout!r}, multiattn needs a probability in [0, 1)")
    return rate


# ---------------------------------------------------------------- torch.nn.MultiheadAttention
TORCH = "torch.nn.MultiheadAttention"
# packed in_proj_weight when kdim == vdim == embed_dim, else q_proj_weight, k_proj_weight, v_proj_weight
TORCH_PATHS = (
    "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
    "out_proj.weight", "out_proj.bias", "bias_k", "bias_v",
)  # fmt: skip


def torch_from(
    arrays: Mapping[str, Optional[np.ndarray]], *, embed_dim: int, num_heads: int, kdim: int, vdim: int,
    dropout: float, add_zero_attn: bool,
) -> Tuple[Config, Arrays]:  # fmt: skip
    if arrays.get("bias_k") is not None or arrays.get("bias_v") is not None:
        raise _cannot(TORCH, "add_bias_kv=True", "has no learned extra key and value (bias_k, bias_v)")
    if add_zero_attn:
        raise _cannot(TORCH, "add_zero_attn=True", "has no extra all-zero key and value")
    h = embed_dim
    _check_heads(TORCH, h, num_heads)
    if arrays.get("in_proj_weight") is not None:
        packed = _shape(TORCH, "in_proj_weight", arrays["in_proj_weight"], (3 * h, h))
        W = dict(zip("qkv", np.split(packed, 3)))
    else:
        W = {
            n: _shape(TORCH, f"{n}_proj_weight", arrays.get(f"{n}_proj_weight"), (h, size))
            for n, size in zip("qkv", (h, kdim, vdim))
        }
    W["o"] = _shape(TORCH, "out_proj.weight", arrays.get("out_proj.weight"), (h, h))
    bias = _all_or_no_biases(
        TORCH, {"in_proj_bias": arrays.get("in_proj_bias"), "out_proj.bias": arrays.get("out_proj.bias")}
    )
    b: Dict[str, Optional[np.ndarray]] = {}
    if bias:
        b = dict(zip("qkv", np.split(_shape(TORCH, "in_proj_bias", arrays["in_proj_bias"], (3 * h,)), 3)))
        b["o"] = _shape(TORCH, "out_proj.bias", arrays["out_proj.bias"], (h,))
    cfg = Config(h, num_heads, h, kdim, vdim, bias, _rate(TORCH, dropout))
    return cfg, _canonical(W, b, bias)


def _check_embed_dim(framework: str, cfg: Config) -> None:
    """torch's and paddle's layers have one width, embed_dim, for queries, projections, output."""
    if cfg.query_size != cfg.num_hiddens:
        raise _needs(
            framework, "query_size == num_hiddens (embed_dim: its query width is its projection and "
            "output width)", query_size=cfg.query_size, num_hiddens=cfg.num_hiddens,
        )  # fmt: skip


def torch_to(cfg: Config, weights: Mapping[str, Any]) -> Tuple[Dict[str, Any], Arrays]:
    h = cfg.num_hiddens
    _check_not_grouped(TORCH, cfg)
    _check_embed_dim(TORCH, cfg)
    w = _weights(cfg, weights)
    kwargs = dict(
        embed_dim=h, num_heads=cfg.num_heads, dropout=cfg.dropout, bias=cfg.bias,
        kdim=cfg.key_size, vdim=cfg.value_size,
    )  # fmt: skip
    if cfg.key_size == cfg.value_size == h:  # torch packs the three projections then
        arrays = {"in_proj_weight": np.concatenate([w["W_q"], w["W_k"], w["W_v"]])}
    else:
        arrays = {f"{n}_proj_weight": w[f"W_{n}"] for n in "qkv"}
    arrays["out_proj.weight"] = w["W_o"]
    if cfg.bias:
        arrays["in_proj_bias"] = np.concatenate([w["b_q"], w["b_k"], w["b_v"]])
        arrays["out_proj.bias"] = w["b_o"]
    return kwargs, arrays


# ------------------------------------------------ keras.layers.MultiHeadAttention (EinsumDense)
KERAS = "keras.layers.MultiHeadAttention"
# kernels (in, heads, head_dim), output kernel (heads, head_dim, out); biases (heads, head_dim), (out,)
KERAS_DENSE = {"q": "query_dense", "k": "key_dense", "v": "value_dense", "o": "output_dense"}
KERAS_PATHS = tuple(f"{d}.{p}" for d in KERAS_DENSE.values() for p in ("kernel", "bias"))


def _from_einsum_dense(
    where: str, denses: Mapping[str, str], arrays: Mapping[str, Optional[np.ndarray]], H: int, Hkv: int,
    d: int, dropout: float, output: tuple,
) -> Tuple[Config, Arrays]:  # fmt: skip
    """The Config and canonical weights of a Keras attention layer of EinsumDense projections
    (``MultiHeadAttention``: Hkv = H; ``GroupQueryAttention``): kernels (in, heads, d), the
    output's (H, d, h), biases (heads, d) and (h,).  output: (what an output kernel of another
    width is, given its shape; what the layer needs instead)."""
    h = H * d
    kernels = {n: arrays.get(f"{dense}.kernel") for n, dense in denses.items()}
    if any(k is None for k in kernels.values()):
        raise ValueError(f"{where} is not built: call it once or build() it with the input shapes first")
    W = {}
    for n, heads in zip("qkv", (H, Hkv, Hkv)):
        kernel = np.asarray(kernels[n])
        path = f"{denses[n]}.kernel"
        W[n] = _shape(where, path, kernel, (kernel.shape[0], heads, d)).reshape(-1, heads * d).T
    out = np.asarray(kernels["o"])
    if out.ndim != 3 or out.shape[2] != h:
        raise _cannot(where, output[0](out.shape), output[1])
    W["o"] = _shape(where, f"{denses['o']}.kernel", out, (H, d, h)).reshape(h, h).T
    bias = _all_or_no_biases(
        where, {f"{dense}.bias": arrays.get(f"{dense}.bias") for dense in denses.values()}
    )
    b = {}
    if bias:
        for n, dense in denses.items():
            shape = {"q": (H, d), "k": (Hkv, d), "v": (Hkv, d), "o": (h,)}[n]
            b[n] = _shape(where, f"{dense}.bias", arrays[f"{dense}.bias"], shape)
    kv_heads = Hkv if where == KERAS_GQA else None  # as each layer's own constructor says it
    cfg = Config(
        h, H, W["q"].shape[1], W["k"].shape[1], W["v"].shape[1], bias, _rate(where, dropout), kv_heads
    )
    return cfg, _canonical(W, b, bias)


def keras_from(
    arrays: Mapping[str, Optional[np.ndarray]], *, num_heads: int, key_dim: int, value_dim: int,
    dropout: float, output_shape: Any, attention_axes: Any, use_gate: bool, sliding_window: Any,
) -> Tuple[Config, Arrays]:  # fmt: skip
    H, d = num_heads, key_dim
    h = H * d
    if value_dim != key_dim:
        raise _cannot(
            KERAS, f"value_dim={value_dim} != key_dim={key_dim}",
            "projects values to num_hiddens = num_heads * key_dim (value_dim == key_dim)",
        )  # fmt: skip
    if use_gate:
        raise _cannot(KERAS, "use_gate=True", "has no gate projection")
    if sliding_window is not None:
        raise _cannot(
            KERAS, f"sliding_window={sliding_window}", "has no sliding window (pass it as attention_mask)"
        )
    if attention_axes is not None and tuple(attention_axes) not in ((1,), (-2,)):
        raise _cannot(KERAS, f"attention_axes={attention_axes}", "attends over axis 1 of (batch, seq, dim)")
    output = (
        lambda shape: f"output_shape={output_shape} (output kernel {shape})",
        f"has output width num_hiddens = num_heads * key_dim = {h}: pass output_shape={h}",
    )
    return _from_einsum_dense(KERAS, KERAS_DENSE, arrays, H, H, d, dropout, output)


def keras_to(cfg: Config, weights: Mapping[str, Any]) -> Tuple[Dict[str, Any], Arrays, Dict[str, tuple]]:
    """(constructor kwargs, arrays, build shapes: query_shape, value_shape, key_shape)."""
    _check_not_grouped(KERAS, cfg, f" (to_native() gives a {KERAS_GQA} for a grouped layer)")
    h, H = cfg.num_hiddens, cfg.num_heads
    d = h // H
    w = _weights(cfg, weights)
    kwargs = dict(
        num_heads=H, key_dim=d, value_dim=d, dropout=cfg.dropout, use_bias=cfg.bias,
        output_shape=None if cfg.query_size == h else (h,),  # Keras' default: the query width
    )  # fmt: skip
    return (kwargs, *_to_einsum_dense(KERAS_DENSE, cfg, w, H))


def _to_einsum_dense(denses: Mapping[str, str], cfg: Config, w: Arrays, Hkv: int) -> Tuple[Arrays, Dict]:
    """(arrays, build shapes) of Keras' EinsumDense attention layers, with Hkv key/value heads."""
    h, H = cfg.num_hiddens, cfg.num_heads
    d = h // H
    heads = dict(zip("qkv", (H, Hkv, Hkv)))
    arrays = {f"{denses[n]}.kernel": w[f"W_{n}"].T.reshape(-1, heads[n], d) for n in "qkv"}
    arrays[f"{denses['o']}.kernel"] = w["W_o"].T.reshape(H, d, h)
    if cfg.bias:
        arrays.update({f"{denses[n]}.bias": w[f"b_{n}"].reshape(heads[n], d) for n in "qkv"})
        arrays[f"{denses['o']}.bias"] = w["b_o"]
    build = dict(
        query_shape=(None, None, cfg.query_size), value_shape=(None, None, cfg.value_size),
        key_shape=(None, None, cfg.key_size),
    )  # fmt: skip
    return {k: np.ascontiguousarray(v) for k, v in arrays.items()}, build


# ------------------------------------ keras.layers.GroupQueryAttention (EinsumDense, grouped-query)
KERAS_GQA = "keras.layers.GroupQueryAttention"
# kernels (in, query or key/value heads, head_dim), output kernel (query heads, head_dim, query width);
# biases (heads, head_dim), (query width,); query head i uses key/value head i // groups (ops.repeat)
KERAS_GQA_DENSE = {"q": "_query_dense", "k": "_key_dense", "v": "_value_dense", "o": "_output_dense"}
KERAS_GQA_PATHS = tuple(f"{d}.{p}" for d in KERAS_GQA_DENSE.values() for p in ("kernel", "bias"))


def keras_gqa_from(
    arrays: Mapping[str, Optional[np.ndarray]], *, head_dim: int, num_query_heads: int,
    num_key_value_heads: int, dropout: float, use_gate: bool, sliding_window: Any,
) -> Tuple[Config, Arrays]:  # fmt: skip
    H, Hkv, d = num_query_heads, num_key_value_heads, head_dim
    h = H * d
    if use_gate:
        raise _cannot(KERAS_GQA, "use_gate=True", "has no gate projection")
    if sliding_window is not None:
        raise _cannot(
            KERAS_GQA, f"sliding_window={sliding_window}", "has no sliding window (pass it as attention_mask)"
        )
    output = (
        lambda shape: f"query width {shape[-1]} (its output width; output kernel {shape})",
        f"has output width num_hiddens = num_query_heads * head_dim = {h}",
    )
    return _from_einsum_dense(KERAS_GQA, KERAS_GQA_DENSE, arrays, H, Hkv, d, dropout, output)


def keras_gqa_to(cfg: Config, weights: Mapping[str, Any]) -> Tuple[Dict[str, Any], Arrays, Dict[str, tuple]]:
    """(constructor kwargs, arrays, build shapes: query_shape, value_shape, key_shape)."""
    h, H, Hkv = cfg.num_hiddens, cfg.num_heads, cfg.kv_heads
    d = h // H
    if cfg.query_size != h:
        raise _needs(
            KERAS_GQA, "query_size == num_hiddens (its output width is its query width)",
            query_size=cfg.query_size, num_hiddens=h,
        )  # fmt: skip
    w = _weights(cfg, weights)
    kwargs = dict(
        head_dim=d, num_query_heads=H, num_key_value_heads=Hkv, dropout=cfg.dropout, use_bias=cfg.bias
    )
    return (kwargs, *_to_einsum_dense(KERAS_GQA_DENSE, cfg, w, Hkv))


# --------------------------------------------------- flax.nnx.MultiHeadAttention (LinearGeneral)
FLAX = "flax.nnx.MultiHeadAttention"
# kernels (in, heads, head_dim) (key, value: num_kv_heads heads), out kernel (heads, head_dim, out);
# biases (heads, head_dim), (out,); query head i uses key/value head i // (num_heads / num_kv_heads)
FLAX_LINEAR = {"q": "query", "k": "key", "v": "value", "o": "out"}
FLAX_PATHS = tuple(f"{m}.{p}" for m in FLAX_LINEAR.values() for p in ("kernel", "bias"))


def flax_from(
    arrays: Mapping[str, Optional[np.ndarray]], *, num_heads: int, num_kv_heads: int, in_features: Any,
    qkv_features: int, out_features: int, in_kv_features: Any, dropout_rate: float, normalize_qk: bool,
    default_attention_fn: bool,
) -> Tuple[Config, Arrays]:  # fmt: skip
    H, h = num_heads, qkv_features
    _check_heads(FLAX, h, H)
    d = h // H
    Hkv = num_kv_heads
    if normalize_qk:
        raise _cannot(FLAX, "normalize_qk=True", "has no layer norm of the projected queries and keys")
    if not default_attention_fn:
        raise _cannot(FLAX, "a custom attention_fn", "computes scaled dot-product attention")
    if out_features != h:
        raise _cannot(
            FLAX, f"out_features={out_features} != qkv_features={h}",
            "has output width num_hiddens (out_features == qkv_features)",
        )  # fmt: skip
    if not isinstance(in_features, int) or not isinstance(in_kv_features, int):
        raise _cannot(FLAX, "tuple in_features", "projects the last axis only")
    W = {
        n: _shape(FLAX, f"{FLAX_LINEAR[n]}.kernel", arrays.get(f"{FLAX_LINEAR[n]}.kernel"), (size, heads, d))
        .reshape(size, heads * d)
        .T
        for n, size, heads in zip("qkv", (in_features, in_kv_features, in_kv_features), (H, Hkv, Hkv))
    }
    W["o"] = _shape(FLAX, "out.kernel", arrays.get("out.kernel"), (H, d, h)).reshape(h, h).T
    bias = _all_or_no_biases(FLAX, {f"{m}.bias": arrays.get(f"{m}.bias") for m in FLAX_LINEAR.values()})
    b = {}
    if bias:
        for n, m in FLAX_LINEAR.items():
            shape = {"q": (H, d), "k": (Hkv, d), "v": (Hkv, d), "o": (h,)}[n]
            b[n] = _shape(FLAX, f"{m}.bias", arrays[f"{m}.bias"], shape)
    cfg = Config(h, H, in_features, in_kv_features, in_kv_features, bias, _rate(FLAX, dropout_rate), Hkv)
    return cfg, _canonical(W, b, bias)


def flax_to(cfg: Config, weights: Mapping[str, Any]) -> Tuple[Dict[str, Any], Arrays]:
    h, H, Hkv = cfg.num_hiddens, cfg.num_heads, cfg.kv_heads
    d = h // H
    if cfg.key_size != cfg.value_size:
        raise _needs(
            FLAX, "key_size == value_size (in_kv_features is one size for keys and values)",
            key_size=cfg.key_size, value_size=cfg.value_size,
        )  # fmt: skip
    w = _weights(cfg, weights)
    kwargs = dict(
        num_heads=H, num_kv_heads=Hkv, in_features=cfg.query_size, qkv_features=h, out_features=h,
        in_kv_features=cfg.key_size, dropout_rate=cfg.dropout, use_bias=cfg.bias,
        broadcast_dropout=False,  # multiattn drops each weight independently
    )  # fmt: skip
    heads = {"q": H, "k": Hkv, "v": Hkv}
    arrays = {f"{FLAX_LINEAR[n]}.kernel": w[f"W_{n}"].T.reshape(-1, heads[n], d) for n in "qkv"}
    arrays["out.kernel"] = w["W_o"].T.reshape(H, d, h)
    if cfg.bias:
        arrays.update({f"{FLAX_LINEAR[n]}.bias": w[f"b_{n}"].reshape(heads[n], d) for n in "qkv"})
        arrays["out.bias"] = w["b_o"]
    return kwargs, {k: np.ascontiguousarray(v) for k, v in arrays.items()}


# ------------------------------------------------------ paddle.nn.MultiHeadAttention (Linear (in, out))
PADDLE = "paddle.nn.MultiHeadAttention"
PADDLE_LINEAR = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}
PADDLE_PATHS = tuple(f"{m}.{p}" for m in PADDLE_LINEAR.values() for p in ("weight", "bias"))


def paddle_from(
    arrays: Mapping[str, Optional[np.ndarray]], *, embed_dim: int, num_heads: int, kdim: int, vdim: int,
    dropout: float,
) -> Tuple[Config, Arrays]:  # fmt: skip
    h = embed_dim
    _check_heads(PADDLE, h, num_heads)
    W = {
        n: _shape(PADDLE, f"{PADDLE_LINEAR[n]}.weight", arrays.get(f"{PADDLE_LINEAR[n]}.weight"), (size, h)).T
        for n, size in zip(NAMES, (h, kdim, vdim, h))
    }
    biases = {f"{m}.bias": arrays.get(f"{m}.bias") for m in PADDLE_LINEAR.values()}
    bias = _all_or_no_biases(PADDLE, biases)
    b = (
        {n: _shape(PADDLE, f"{m}.bias", biases[f"{m}.bias"], (h,)) for n, m in PADDLE_LINEAR.items()}
        if bias
        else {}
    )
    cfg = Config(h, num_heads, h, kdim, vdim, bias, _rate(PADDLE, dropout))
    return cfg, _canonical(W, b, bias)


def paddle_to(cfg: Config, weights: Mapping[str, Any]) -> Tuple[Dict[str, Any], Arrays]:
    h = cfg.num_hiddens
    _check_not_grouped(PADDLE, cfg)
    _check_embed_dim(PADDLE, cfg)
    w = _weights(cfg, weights)
    kwargs = dict(
        embed_dim=h, num_heads=cfg.num_heads, dropout=cfg.dropout, kdim=cfg.key_size, vdim=cfg.value_size,
        bias_attr=None if cfg.bias else False,
    )  # fmt: skip
    arrays = {f"{m}.weight": np.ascontiguousarray(w[f"W_{n}"].T) for n, m in PADDLE_LINEAR.items()}
    if cfg.bias:
        arrays.update({f"{m}.bias": w[f"b_{n}"] for n, m in PADDLE_LINEAR.items()})
    return kwargs, arrays


# ------------------------------------------------------- mlx.nn.MultiHeadAttention (Linear (out, in))
MLX = "mlx.nn.MultiHeadAttention"
MLX_LINEAR = {"q": "query_proj", "k": "key_proj", "v": "value_proj", "o": "out_proj"}
MLX_PATHS = tuple(f"{m}.{p}" for m in MLX_LINEAR.values() for p in ("weight", "bias"))


def mlx_from(arrays: Mapping[str, Optional[np.ndarray]], *, num_heads: int) -> Tuple[Config, Arrays]:
    weights = {n: arrays.get(f"{m}.weight") for n, m in MLX_LINEAR.items()}
    missing = [f"{MLX_LINEAR[n]}.weight" for n, w in weights.items() if w is None]
    if missing:
        raise ValueError(f"{MLX} has no parameter {', '.join(missing)}")
    (h, q), (_, k) = np.shape(weights["q"]), np.shape(weights["k"])
    value_dims, v = np.shape(weights["v"])
    value_output_dims = np.shape(weights["o"])[0]
    if value_dims != h:
        raise _cannot(
            MLX, f"value_dims={value_dims} != dims={h}",
            "projects values to num_hiddens = dims (value_dims == dims)",
        )  # fmt: skip
    if value_output_dims != h:
        raise _cannot(
            MLX, f"value_output_dims={value_output_dims} != dims={h}",
            "has output width num_hiddens = dims (value_output_dims == dims)",
        )  # fmt: skip
    _check_heads(MLX, h, num_heads)
    W = {
        n: _shape(MLX, f"{MLX_LINEAR[n]}.weight", weights[n], (h, size))
        for n, size in zip(NAMES, (q, k, v, h))
    }
    biases = {f"{m}.bias": arrays.get(f"{m}.bias") for m in MLX_LINEAR.values()}
    bias = _all_or_no_biases(MLX, biases)
    b = (
        {n: _shape(MLX, f"{m}.bias", biases[f"{m}.bias"], (h,)) for n, m in MLX_LINEAR.items()}
        if bias
        else {}
    )
    return Config(h, num_heads, q, k, v, bias, 0.0), _canonical(W, b, bias)


def mlx_to(cfg: Config, weights: Mapping[str, Any]) -> Tuple[Dict[str, Any], Arrays]:
    _check_not_grouped(MLX, cfg)
    if cfg.dropout:
        raise _needs(
            MLX, "dropout == 0 (it has no dropout): build the multiattn layer with dropout=0.0 and "
            "set_weights(get_weights()) first", dropout=cfg.dropout,
        )  # fmt: skip
    h = cfg.num_hiddens
    w = _weights(cfg, weights)
    kwargs = dict(
        dims=h, num_heads=cfg.num_heads, query_input_dims=cfg.query_size, key_input_dims=cfg.key_size,
        value_input_dims=cfg.value_size, value_dims=h, value_output_dims=h, bias=cfg.bias,
    )  # fmt: skip
    arrays = {f"{m}.weight": w[f"W_{n}"] for n, m in MLX_LINEAR.items()}
    if cfg.bias:
        arrays.update({f"{m}.bias": w[f"b_{n}"] for n, m in MLX_LINEAR.items()})
    return kwargs, arrays


def read(get: Any, paths: Tuple[str, ...], to_numpy: Any) -> Dict[str, Optional[np.ndarray]]:
    """The native layer's parameters by path, numpy arrays, None where get(path) is None."""
    out = {}
    for path in paths:
        value = get(path)
        out[path] = None if value is None else np.asarray(to_numpy(value))
    return out


def attribute(obj: Any, path: str) -> Any:
    """obj.a.b for path "a.b"; None where an attribute is missing or None."""
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj
