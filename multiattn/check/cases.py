"""The fixed, seeded cases of ``multiattn check`` and their tolerances.

Inputs are drawn in float64 and rounded to each case's dtype here, so every
backend receives exactly representable values and the float64 reference is
computed from the very numbers the backend sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np

from .. import reference

FUNCTIONS = (
    "masked_softmax", "dot_product", "additive", "multi_head", "grouped",
    "dot_product_4d", "masked_softmax_4d", "decoding",
)  # fmt: skip
# decoding, on the 4-D inputs, causal: query_offset (one per sequence: DECODING_OFFSETS); a
# KVCache holding the first CACHED positions, then each query a step with its key and value;
# the same with pages of PAGE_SIZE positions
DECODING_MASKS = ("offset", "steps", "paged")
DECODING_OFFSETS, CACHED, PAGE_SIZE = np.array([1, 2]), 2, 2
MASKS = ("none", "1d", "2d", "mask", "causal", "all")
# score and mask functions (``multiattn.mods``), ANDed with the masks of MOD_ARGS
MOD_MASKS = ("window", "document", "softcap")
DTYPES = ("float32", "float64", "float16", "bfloat16")
GRAD_DTYPES = ("float32", "float64")  # gradients are checked where they are meaningful
BATCH, QUERIES, KEYS, WIDTH, KEY_WIDTH, VALUE_WIDTH, HIDDENS = 2, 3, 5, 4, 3, 3, 6
MULTI_HEAD_HIDDENS, NUM_HEADS = 4, 2  # multi-head attention: 2 heads of 2 columns, with biases
# grouped-query attention: 4 query heads of 1 column sharing 2 key/value heads, with biases
# (num_hiddens = the query width, as Keras' GroupQueryAttention needs)
GROUPED_HIDDENS, GROUPED_HEADS, GROUPED_KV_HEADS = 4, 4, 2
# dot-product attention in 4-D, torch SDPA's layout: queries (B, 4, Q, d) over keys and values
# of 2 heads (grouped), the (B, Q, K) masks shared by the heads; masked_softmax of (B, 2, Q, K)
HEADS_4D, KV_HEADS_4D = 4, 2
# Lengths with a fully masked row, a negative and an over-long length.
LENGTHS = {"none": None, "1d": np.array([0, KEYS + 2]), "2d": np.array([[2, 0, KEYS + 2], [5, -1, 3]])}
# A boolean mask (True: may attend) with a fully masked row, alone and with lengths and causality.
MASK = np.array(
    [
        [[1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 1]],
        [[0, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]],
    ],
    dtype=bool,
)
MASK_ARGS = {
    "none": (None, None, False),
    "1d": (LENGTHS["1d"], None, False),
    "2d": (LENGTHS["2d"], None, False),
    "mask": (None, MASK, False),
    "causal": (None, None, True),
    "all": (LENGTHS["2d"], MASK, True),
}
MOD_ARGS = {
    "window": (None, None, False),  # sliding_window(WINDOW) alone
    "document": (LENGTHS["1d"], None, False),  # document(QUERY_IDS, KEY_IDS) and lengths
    "softcap": (None, MASK, True),  # softcap(SOFTCAP) before the mask and causality
}
# the keyword a function of check --against / --native takes each mod case's argument by
MOD_KEYWORDS = {"window": "window", "document": "documents", "softcap": "softcap"}
WINDOW, SOFTCAP = 2, 1.5
KEY_IDS = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])  # packed documents
QUERY_IDS = KEY_IDS[:, :QUERIES]


def mod_mask(mask: str) -> Optional[np.ndarray]:
    """The mask function of a mod case by its formula, (B, Q, K) booleans (None: no mask function);
    of a decoding case, causality for query i at position offset + i."""
    i, j = np.arange(QUERIES)[:, None], np.arange(KEYS)[None, :]
    if mask in DECODING_MASKS:
        offsets = DECODING_OFFSETS if mask == "offset" else np.full(BATCH, CACHED)
        return j[None] <= offsets[:, None, None] + i[None]
    if mask == "window":
        return np.broadcast_to((0 <= i - j) & (i - j < WINDOW), (BATCH, QUERIES, KEYS))
    if mask == "document":
        return QUERY_IDS[:, :, None] == KEY_IDS[:, None, :]
    return None


# Max abs error allowed, relative to max(1, largest reference magnitude).
TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "float16": 5e-3, "bfloat16": 4e-2}
# MLX's exp/softmax are float32-accurate even for float64 (documented).
BACKEND_TOLERANCE = {("mlx", "float64"): 1e-6}


def tolerance(backend: str, dtype: str, overrides: Optional[Dict[str, float]] = None) -> float:
    if overrides and dtype in overrides:
        return overrides[dtype]
    return BACKEND_TOLERANCE.get((backend, dtype), TOLERANCE[dtype])


def round_to(array: np.ndarray, dtype: str) -> np.ndarray:
    """The float64 values of ``array`` rounded to ``dtype`` (round to nearest even)."""
    if dtype == "bfloat16":
        bits = np.asarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.asarray(array).astype(dtype).astype(np.float64)


@dataclass
class Case:
    function: str
    mask: str
    dtype: str
    inputs: Dict[str, np.ndarray]  # name -> float64 values representable in dtype
    valid_lens: Optional[np.ndarray]
    cotangent: np.ndarray
    attention_mask: Optional[np.ndarray] = None
    causal: bool = False
    expected: Dict = field(default_factory=dict)  # the reference: out, weights, grads

    @property
    def softcap(self) -> Optional[float]:
        return SOFTCAP if self.mask == "softcap" else None

    @property
    def name(self) -> str:
        return f"{self.function}/{self.mask}/{self.dtype}"

    @property
    def wants_grads(self) -> bool:
        return self.dtype in GRAD_DTYPES


def make_cases(seed: int = 0, mods: bool = True) -> list:
    """Every function x mask x dtype, with the reference computed in float64; mods: with the
    score and mask functions' cases (MOD_MASKS)."""
    rng = np.random.default_rng(seed)
    raw = {
        "X": rng.normal(size=(BATCH, QUERIES, KEYS)) * 2,
        "queries": rng.normal(size=(BATCH, QUERIES, WIDTH)),
        "keys": rng.normal(size=(BATCH, KEYS, WIDTH)),
        "additive_keys": rng.normal(size=(BATCH, KEYS, KEY_WIDTH)),
        "values": rng.normal(size=(BATCH, KEYS, VALUE_WIDTH)),
        "W_q": rng.normal(size=(HIDDENS, WIDTH)) * 0.5,
        "W_k": rng.normal(size=(HIDDENS, KEY_WIDTH)) * 0.5,
        "w_v": rng.normal(size=(HIDDENS,)),
    }
    h = MULTI_HEAD_HIDDENS
    for name, width in (("W_q", WIDTH), ("W_k", KEY_WIDTH), ("W_v", VALUE_WIDTH), ("W_o", h)):
        raw["multi_head_" + name] = rng.normal(size=(h, width)) * 0.5
    for name in ("b_q", "b_k", "b_v", "b_o"):
        raw["multi_head_" + name] = rng.normal(size=(h,)) * 0.5
    cotangents = {
        "masked_softmax": rng.normal(size=(BATCH, QUERIES, KEYS)),
        "dot_product": rng.normal(size=(BATCH, QUERIES, VALUE_WIDTH)),
        "additive": rng.normal(size=(BATCH, QUERIES, VALUE_WIDTH)),
        "multi_head": rng.normal(size=(BATCH, QUERIES, MULTI_HEAD_HIDDENS)),
        "grouped": rng.normal(size=(BATCH, QUERIES, GROUPED_HIDDENS)),
    }
    # drawn last, so that the other functions' cases stay those of earlier versions
    h, kv = GROUPED_HIDDENS, GROUPED_HIDDENS // GROUPED_HEADS * GROUPED_KV_HEADS
    rows = {"q": h, "k": kv, "v": kv, "o": h}
    for n, width in zip("qkvo", (WIDTH, KEY_WIDTH, VALUE_WIDTH, h)):
        raw["grouped_W_" + n] = rng.normal(size=(rows[n], width)) * 0.5
        raw["grouped_b_" + n] = rng.normal(size=(rows[n],)) * 0.5
    # drawn last, so that the other functions' cases stay those of earlier versions
    raw["queries_4d"] = rng.normal(size=(BATCH, HEADS_4D, QUERIES, WIDTH))
    raw["keys_4d"] = rng.normal(size=(BATCH, KV_HEADS_4D, KEYS, WIDTH))
    raw["values_4d"] = rng.normal(size=(BATCH, KV_HEADS_4D, KEYS, VALUE_WIDTH))
    cotangents["dot_product_4d"] = rng.normal(size=(BATCH, HEADS_4D, QUERIES, VALUE_WIDTH))
    raw["X_4d"] = rng.normal(size=(BATCH, KV_HEADS_4D, QUERIES, KEYS)) * 2
    cotangents["masked_softmax_4d"] = rng.normal(size=(BATCH, KV_HEADS_4D, QUERIES, KEYS))
    names = {
        "masked_softmax": {"X": "X"},
        "masked_softmax_4d": {"X": "X_4d"},
        "dot_product_4d": {"queries": "queries_4d", "keys": "keys_4d", "values": "values_4d"},
        "decoding": {"queries": "queries_4d", "keys": "keys_4d", "values": "values_4d"},
        "dot_product": {"queries": "queries", "keys": "keys", "values": "values"},
        "additive": {
            "queries": "queries",
            "keys": "additive_keys",
            "values": "values",
            "W_q": "W_q",
            "W_k": "W_k",
            "w_v": "w_v",
        },
        "multi_head": {
            "queries": "queries",
            "keys": "additive_keys",
            "values": "values",
            **{n: "multi_head_" + n for n in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")},
        },
        "grouped": {
            "queries": "queries",
            "keys": "additive_keys",
            "values": "values",
            **{n: "grouped_" + n for n in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")},
        },
    }
    cotangents["decoding"] = cotangents["dot_product_4d"]
    cases = []
    for function in FUNCTIONS:
        for dtype in DTYPES:
            masks = DECODING_MASKS if function == "decoding" else MASKS + (MOD_MASKS if mods else ())
            for mask in masks:
                inputs = {arg: round_to(raw[src], dtype) for arg, src in names[function].items()}
                lens, attention_mask, causal = {**MASK_ARGS, **MOD_ARGS}.get(mask, (None, None, True))
                case = Case(function, mask, dtype, inputs, lens, cotangents[function], attention_mask, causal)
                case.expected = expected(case)
                cases.append(case)
    return cases


def mod_arguments(case: Case) -> dict:
    """A mod case's argument for a function that is not multiattn's: window=WINDOW (key j
    visible from query i iff 0 <= i - j < window), documents=(QUERY_IDS, KEY_IDS) (numpy ids),
    softcap=SOFTCAP (scores c tanh(s / c) before any mask); {} for the other cases."""
    value = {"window": WINDOW, "document": (QUERY_IDS, KEY_IDS), "softcap": SOFTCAP}.get(case.mask)
    return {} if value is None else {MOD_KEYWORDS[case.mask]: value}


def mod_keywords(case: Case) -> dict:
    """The score_mod / mask_mod keywords of a mod case ({} for the others)."""
    from .. import mods  # the package's, for the backends' calls (the reference uses mod_mask)

    if case.mask == "window":
        return {"mask_mod": mods.sliding_window(WINDOW)}
    if case.mask == "document":
        return {"mask_mod": mods.document(QUERY_IDS, KEY_IDS)}
    if case.mask == "softcap":
        return {"score_mod": mods.softcap(SOFTCAP)}
    return {}


def expected(case: Case) -> dict:
    args, attention_mask = case.inputs, case.attention_mask
    shown = mod_mask(case.mask)
    if shown is not None:  # the mask function ANDs with the others
        attention_mask = shown if attention_mask is None else shown & attention_mask
    causal = case.causal and case.function != "decoding"  # decoding: causality from the offsets
    masks = dict(attention_mask=attention_mask, causal=causal, softcap=case.softcap)
    if case.function in ("masked_softmax", "masked_softmax_4d"):
        return reference.masked_softmax_case(args["X"], case.valid_lens, case.cotangent, **masks)
    if case.function in ("dot_product", "dot_product_4d", "decoding"):
        return reference.dot_product_attention(
            args["queries"], args["keys"], args["values"], case.valid_lens, case.cotangent, **masks
        )
    if case.function in ("multi_head", "grouped"):
        weights = {name: value for name, value in args.items() if name not in ("queries", "keys", "values")}
        heads = (
            dict(num_heads=NUM_HEADS)
            if case.function == "multi_head"
            else dict(num_heads=GROUPED_HEADS, num_kv_heads=GROUPED_KV_HEADS)
        )
        return reference.multi_head_attention(
            args["queries"], args["keys"], args["values"], case.valid_lens, weights,
            cotangent=case.cotangent, **heads, **masks,
        )  # fmt: skip
    return reference.additive_attention(
        args["queries"], args["keys"], args["values"], case.valid_lens,
        args["W_q"], args["W_k"], args["w_v"], case.cotangent, **masks,
    )  # fmt: skip
