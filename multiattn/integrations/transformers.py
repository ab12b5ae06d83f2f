"""multiattn as an attention implementation of Hugging Face transformers.

    import multiattn.integrations.transformers as mt
    mt.register()                       # once per process; name="multiattn" by default
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="multiattn")
    model.set_attn_implementation("multiattn")   # or switch a loaded model

``register`` adds :func:`attention_forward` to transformers' ``AttentionInterface`` and
transformers' own boolean mask maker (``masking_utils.sdpa_mask``) to its
``AttentionMaskInterface`` under the same name: a model looks its mask maker up by the
attention's name, and without one it passes no mask at all (padding and sliding windows lost).

transformers and torch are imported when ``register`` (or the attention) is first called,
so importing this module costs nothing; ``pip install "multiattn[transformers]"`` installs them.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

INSTALL_HINT = 'pip install ".[transformers]" (or pip install "multiattn[transformers]")'

# Keywords transformers' attention layers pass that would change the result if ignored.
_UNSUPPORTED = {
    "position_bias": "an additive position bias (T5-style)",
    "s_aux": "attention sinks (gpt-oss)",
    "sinks": "attention sinks",
    "head_mask": "a mask of heads",
}


def _transformers() -> Any:
    """transformers, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            f"multiattn.integrations.transformers needs transformers (and torch), which are not "
            f"installed ({err}); install them with: {INSTALL_HINT}"
        ) from err
    return transformers


def register(name: str = "multiattn") -> str:
    """Registers multiattn's attention and its mask maker with transformers under ``name``, so
    that ``attn_implementation=name`` (``from_pretrained``, ``from_config``,
    ``set_attn_implementation``) runs every attention layer through
    ``multiattn.dot_product_attention``.  Returns ``name``; registering again is harmless."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register: name must be a non-empty str, got {name!r}")
    if name in ("eager", "sdpa", "flex_attention") or name.startswith(("flash_attention", "paged|")):
        raise ValueError(f"register: name must not replace transformers' own {name!r}; pick another one")
    _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    # sdpa's mask: a boolean (B, 1, Q, K), True where a query may attend (multiattn's polarity), or
    # None where the mask is purely causal; attention_forward reads None as sdpa does.
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _boolean_mask(attention_mask: Any, torch: Any) -> Any:
    """A 4-D mask as booleans (True: may attend): an additive float mask must hold only 0
    (attend) and values at or below half the dtype's minimum (hidden), as transformers' own."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if not attention_mask.is_floating_point():
        raise TypeError(
            f"attention_mask: expected a boolean mask (True: may attend) or an additive float mask, "
            f"got dtype {attention_mask.dtype}"
        )
    hidden = attention_mask <= torch.finfo(attention_mask.dtype).min / 2
    if not bool(((attention_mask == 0) | hidden).all()):
        raise ValueError(
            "attention_mask: expected an additive mask of 0 (attend) and large negative values "
            "(hide), got other values (a bias); multiattn takes biases as score_mod="
        )
    return ~hidden


def attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs: Any,
) -> Tuple[Any, Any]:
    """transformers' attention function contract: query (B, H, Q, d), key and value
    (B, H_kv, K, d) with H_kv dividing H; returns (output (B, Q, H, d), the weights
    (B, H, Q, K) where ``output_attentions=True`` was asked for, else None).  The mask is
    what ``sdpa_mask`` made (boolean, True: may attend) or None: causal where there is more
    than one query (sdpa's top-left alignment, as sdpa_mask returns None only where it is
    right), nothing hidden for one query (a decoding step sees its whole cache)."""
    import torch

    from .. import dot_product_attention, mods

    for keyword, what in _UNSUPPORTED.items():
        if kwargs.get(keyword) is not None:
            raise NotImplementedError(
                f"attention_forward: {keyword}= ({what}) is not supported by multiattn's "
                f"transformers integration; got a {type(kwargs[keyword]).__name__}"
            )
    if dropout:
        raise NotImplementedError(
            f"attention_forward: dropout must be 0 (multiattn has no attention dropout), got {dropout}; "
            "call model.eval() or set the config's attention_dropout to 0"
        )
    # sliding_window needs no handling: sdpa_mask has put the window into the mask already.
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    n_queries = query.shape[2]
    if attention_mask is not None:
        mask = _boolean_mask(attention_mask, torch)
        causal = False
    else:
        mask = None
        causal = bool(is_causal) and n_queries > 1
    # the weights (B, H, Q, K) only when asked for: without them the scores never exist whole
    weights = bool(kwargs.get("output_attentions", False))
    result = dot_product_attention(
        query,
        key,
        value,
        attention_mask=mask,
        causal=causal,
        scale=scaling,
        score_mod=None if softcap is None else mods.softcap(softcap),
        return_weights=weights,
    )
    out, attn_weights = result if weights else (result, None)
    return out.transpose(1, 2).contiguous(), attn_weights
