"""``KVCache`` and ``cached_attention``: a prefill then single-token steps over a cache,
contiguous (grown by doubling, visited in blocks) or paged, give at every step the rows of the
full causal attention of tests/reference.py's loops, on every backend; under ``jax.jit`` and
``tf.function`` a step compiles once for every length within the storage (``capacity=``, or a
pool of ``num_pages=``), pages of 16 give the contiguous answer bitwise, and a step past the
storage gives NaN, never a finite wrong answer."""

from __future__ import annotations

import numpy as np
import pytest

import multiattn
from multiattn import mods

from . import reference as ref
from .test_mods import supported
from .tolerances import assert_close

B, H, KV, D, PREFILL, STEPS = 2, 4, 2, 3, 5, 20
T = PREFILL + STEPS
SLOPES = mods.alibi_slopes(H)


def _full(bk, dtype, seed=0):
    rng = np.random.default_rng(seed)
    arrays = rng.normal(size=(B, H, T, D)), rng.normal(size=(B, KV, T, D)), rng.normal(size=(B, KV, T, 2))
    return [bk.numpy(bk.tensor(a, dtype)).astype(np.float64) for a in arrays]


def _cache(bk, dtype, **kw):
    return multiattn.KVCache(B, KV, D, like=bk.tensor(np.zeros(1), dtype), value_dim=2, **kw)


def _decode(bk, dtype, q, k, v, cache, steps=STEPS, **kw):
    """The outputs of a prefill of PREFILL positions, then ``steps`` single positions."""
    outs = []
    for lo, hi in [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, PREFILL + steps)]:
        args = [bk.tensor(x[:, :, lo:hi], dtype) for x in (q, k, v)]
        out, cache = multiattn.cached_attention(*args, cache, **kw)
        outs.append(np.asarray(bk.numpy(out), dtype=np.float64))
    return outs, cache


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_step_gives_the_rows_of_the_full_causal_call(bk, dtype, layout):
    supported(bk, dtype)
    q, k, v = _full(bk, dtype)
    want, _ = ref.heads_attention(q, k, v, causal=True)
    cache = _cache(bk, dtype, page_size=16 if layout == "paged" else None)
    outs, cache = _decode(bk, dtype, q, k, v, cache)
    assert cache.length == T
    rows = [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, T)]
    for (lo, hi), got in zip(rows, outs):
        assert_close(bk, bk.tensor(got, dtype), want[:, :, lo:hi], dtype)
    assert cache.capacity == (32 if layout == "paged" else 32)  # 2 pages of 16; doubled from 16


def test_with_a_window_and_alibi(bk, monkeypatch):
    """A window and ALiBi at absolute positions, every step the reference's row; pages of 16
    the contiguous answer bitwise; the splits wholly before the window are not visited."""
    q, k, v = _full(bk, "float32", seed=1)
    window = lambda b, h, i, j: 0 <= i - j < 4  # noqa: E731
    alibi = lambda s, b, h, i, j: s + SLOPES[h] * (j - i)  # noqa: E731
    want, _ = ref.heads_attention(q, k, v, mask_fn=window, score_fn=alibi)
    kw = dict(causal=False, mask_mod=mods.sliding_window(4), score_mod=mods.alibi(SLOPES))
    visited, state = [], multiattn.cache.Call.state

    def recorded(call, blocks):  # the first position attended by each step
        visited.append(blocks[0][0])
        return state(call, blocks)

    monkeypatch.setattr(multiattn.cache.Call, "state", recorded)
    found = {}
    for page_size in (None, 4, 16):
        visited.clear()
        outs, _ = _decode(bk, "float32", q, k, v, _cache(bk, "float32", page_size=page_size), **kw)
        assert_close(bk, bk.tensor(outs[0], "float32"), want[:, :, :PREFILL], "float32")
        for t, got in enumerate(outs[1:], start=PREFILL):
            assert_close(bk, bk.tensor(got, "float32"), want[:, :, t : t + 1], "float32")
        found[page_size] = outs
        if page_size is None:  # the last step, at 24, sees keys 21..24: the split 16..31 alone
            assert visited[-1] == 16
    for a, b in zip(found[16], found[None]):
        np.testing.assert_array_equal(a, b)


def test_paged_equals_contiguous_bitwise_whatever_the_batch(bk):
    """Both layouts attend splits of 16 positions merged by lse: pages of 16 give the contiguous
    answer bitwise in float32, at every step, and so does each sequence decoded alone (the
    answer does not depend on the batch); pages of 5 (one split each) equal it to rounding;
    all of them dot_product_attention's with query_offset to rounding."""
    q, k, v = _full(bk, "float32", seed=2)
    paged, _ = _decode(bk, "float32", q, k, v, _cache(bk, "float32", page_size=16))
    contiguous, _ = _decode(bk, "float32", q, k, v, _cache(bk, "float32", capacity=64))  # splits unused
    odd, _ = _decode(bk, "float32", q, k, v, _cache(bk, "float32", page_size=5))
    cache = multiattn.KVCache(1, KV, D, like=bk.tensor(np.zeros(1), "float32"), value_dim=2)
    alone, _ = _decode(bk, "float32", q[1:], k[1:], v[1:], cache)
    for t, (a, b, c, one) in enumerate(zip(paged, contiguous, odd, alone)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(one, b[1:])
        lo = 0 if t == 0 else PREFILL + t - 1
        hi = PREFILL + t
        args = [bk.tensor(x, "float32") for x in (q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi])]
        direct = multiattn.dot_product_attention(*args, causal=True, query_offset=lo)
        assert_close(bk, bk.tensor(b, "float32"), np.asarray(bk.numpy(direct), dtype=np.float64), "float32")
        assert_close(bk, bk.tensor(c, "float32"), b, "float32")


def test_a_paged_cache_holds_its_pages_only(bk):
    like = bk.tensor(np.zeros(1), "float32")
    cache = multiattn.KVCache(1, 2, 64, like=like, page_size=256)
    cache = cache.append(*(bk.tensor(np.ones((1, 2, 1000, 64)), "float32") for _ in range(2)))
    per_position = 2 * 2 * 64 * 4  # keys and values, 2 heads of 64 float32
    assert cache.length == 1000 and cache.nbytes <= 1.05 * 1024 * per_position
    contiguous = multiattn.KVCache(1, 2, 64, like=like)
    for _ in range(1000):
        contiguous = contiguous.append(*(bk.tensor(np.ones((1, 2, 1, 64)), "float32") for _ in range(2)))
    assert contiguous.capacity == 1024  # doubled from 16


@pytest.mark.parametrize("masks", ["causal", "window and alibi"])
def test_a_decoding_step_compiles_once_under_jax_jit(bk, masks):
    if bk.name != "jax":
        pytest.skip("jax.jit; the eager backends run the steps above")
    import jax

    q, k, v = _full(bk, "float32", seed=3)
    kw: dict = {}
    if masks == "causal":
        want, _ = ref.heads_attention(q, k, v, causal=True)
    else:
        window = lambda b, h, i, j: 0 <= i - j < 4  # noqa: E731
        alibi = lambda s, b, h, i, j: s + SLOPES[h] * (j - i)  # noqa: E731
        want, _ = ref.heads_attention(q, k, v, mask_fn=window, score_fn=alibi)
        kw = dict(causal=False, mask_mod=mods.sliding_window(4), score_mod=mods.alibi(SLOPES))
    traces = []

    @jax.jit
    def step(q, k, v, cache):
        traces.append(1)
        return multiattn.cached_attention(q, k, v, cache, **kw)

    cache = _cache(bk, "float32", capacity=32)
    first = [bk.tensor(x[:, :, :PREFILL], "float32") for x in (q, k, v)]
    _, cache = multiattn.cached_attention(*first, cache, **kw)  # the prefill, eagerly
    for t in range(PREFILL, T):
        out, cache = step(*(bk.tensor(x[:, :, t : t + 1], "float32") for x in (q, k, v)), cache)
        assert_close(bk, out, want[:, :, t : t + 1], "float32")
    assert len(traces) == 1
    assert int(cache.length) == T


def test_a_cache_copies_and_pickles_with_its_backend(bk):
    """copy.deepcopy gives an independent cache; pickle.loads(pickle.dumps(cache)) the same
    positions, on the same backend."""
    import copy
    import pickle

    q, k, v = _full(bk, "float32", seed=4)
    args = [bk.tensor(x[:, :, :PREFILL], "float32") for x in (q, k, v)]
    _, cache = multiattn.cached_attention(*args, _cache(bk, "float32"))
    twin = copy.deepcopy(cache)
    assert twin.ops is cache.ops and twin.length == cache.length == PREFILL
    step = [bk.tensor(x[:, :, PREFILL : PREFILL + 1], "float32") for x in (q, k, v)]
    want, grown = multiattn.cached_attention(*step, twin)
    assert grown.length == PREFILL + 1 and cache.length == PREFILL  # the original untouched
    loaded = pickle.loads(pickle.dumps(cache))
    assert loaded.ops is cache.ops and loaded.length == PREFILL
    got, _ = multiattn.cached_attention(*step, loaded)
    np.testing.assert_array_equal(bk.numpy(got), bk.numpy(want))


def test_the_length_reads_as_an_int_and_loads_from_a_pickle_of_an_int(bk):
    """Eagerly ``length`` is an int on every backend (torch holds a 0-D tensor for
    torch.compile); a pickled state with a plain ``length`` (before it was a property) loads."""
    q, k, v = _full(bk, "float32", seed=5)
    args = [bk.tensor(x[:, :, :PREFILL], "float32") for x in (q, k, v)]
    _, cache = multiattn.cached_attention(*args, _cache(bk, "float32"))
    assert type(cache.length) is int and cache.length == PREFILL
    state = cache.__getstate__()
    del state["_length"], state["_host_length"]
    state["length"] = PREFILL
    old = object.__new__(type(cache))
    old.__setstate__(state)
    assert type(old.length) is int and old.length == PREFILL and old.ops is cache.ops


@pytest.mark.parametrize("bad, error, words", [
    ((B, KV, 1, D + 1), ValueError, r"keys must have shape \(2, 2, 'n', 3\)"),
    ((B, KV + 1, 1, D), ValueError, "keys must have shape"),
])  # fmt: skip
def test_bad_appends_are_refused_by_name(bk, bad, error, words):
    cache = _cache(bk, "float32")
    with pytest.raises(error, match=words):
        cache.append(bk.tensor(np.zeros(bad), "float32"), bk.tensor(np.zeros(bad), "float32"))
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        multiattn.KVCache(B, KV, D, like=bk.tensor(np.zeros(1), "float32"), page_size=0)


def _compiled(bk, counted=True):
    """cached_attention under the backend's compiler (itself, or counted: in a function that
    lists its traces), and that list."""
    traces: list = []

    def step(q, k, v, cache, causal=True, mask_mod=None, score_mod=None):
        traces.append(1)
        return multiattn.cached_attention(
            q, k, v, cache, causal=causal, mask_mod=mask_mod, score_mod=score_mod
        )

    if bk.name == "jax":
        import jax

        if not counted:
            return jax.jit(multiattn.cached_attention), traces
        return jax.jit(step, static_argnames=("causal", "mask_mod", "score_mod")), traces
    if bk.name == "tensorflow":
        import tensorflow as tf

        return tf.function(step if counted else multiattn.cached_attention), traces
    pytest.skip("jax.jit and tf.function; the eager backends run the steps above")


def _compiled_steps(bk, step, q, k, v, cache, **kw):
    """A prefill of PREFILL positions eagerly, then a compiled step per position."""
    args = [bk.tensor(x[:, :, :PREFILL], "float32") for x in (q, k, v)]
    out, cache = multiattn.cached_attention(*args, cache, **kw)
    outs = [np.asarray(bk.numpy(out), dtype=np.float64)]
    for t in range(PREFILL, T):
        out, cache = step(*(bk.tensor(x[:, :, t : t + 1], "float32") for x in (q, k, v)), cache, **kw)
        outs.append(np.asarray(bk.numpy(out), dtype=np.float64))
    return outs, cache


def test_compiled_steps_in_pages_of_16_equal_the_contiguous_cache_bitwise(bk):
    """Under jax.jit and tf.function a paged cache with a fixed pool of pages (num_pages=)
    and a contiguous one (capacity=) pass through the compiled step, with a window and ALiBi
    at absolute positions: one trace each, every step the reference's row, and pages of 16 the
    contiguous answer bitwise."""
    step, traces = _compiled(bk)
    q, k, v = _full(bk, "float32", seed=5)
    window = lambda b, h, i, j: 0 <= i - j < 4  # noqa: E731
    alibi = lambda s, b, h, i, j: s + SLOPES[h] * (j - i)  # noqa: E731
    want, _ = ref.heads_attention(q, k, v, mask_fn=window, score_fn=alibi)
    kw = dict(causal=False, mask_mod=mods.sliding_window(4), score_mod=mods.alibi(SLOPES))
    found = {}
    for layout, sizes in [("contiguous", dict(capacity=32)), ("paged", dict(page_size=16, num_pages=2))]:
        outs, cache = _compiled_steps(bk, step, q, k, v, _cache(bk, "float32", **sizes), **kw)
        assert int(cache.length) == T and cache.capacity == 32
        for t, got in enumerate(outs[1:], start=PREFILL):
            assert_close(bk, bk.tensor(got, "float32"), want[:, :, t : t + 1], "float32")
        found[layout] = outs
    assert len(traces) == 2  # one per layout, whatever the length
    for a, b in zip(found["paged"], found["contiguous"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "sizes", [dict(capacity=16), dict(page_size=16, num_pages=1), dict(page_size=8, num_pages=2)]
)
def test_a_compiled_step_past_the_storage_gives_nan_never_a_number(bk, sizes):
    """The storage holds 16 positions and the steps append 25: the steps within it give the
    reference's rows, every step past it NaN in every row (no finite wrong answer), and an
    eager append to that cache raises."""
    step, _ = _compiled(bk, counted=False)
    q, k, v = _full(bk, "float32", seed=6)
    want, _ = ref.heads_attention(q, k, v, causal=True)
    outs, cache = _compiled_steps(bk, step, q, k, v, _cache(bk, "float32", **sizes))
    assert int(cache.length) == T and cache.capacity == 16
    for t, got in enumerate(outs[1:], start=PREFILL):
        if t < 16:
            assert_close(bk, bk.tensor(got, "float32"), want[:, :, t : t + 1], "float32")
        else:
            assert np.isnan(got).all(), f"step {t}, past the capacity 16: {got}"
    with pytest.raises(ValueError, match="cache length 25 exceeds its capacity 16"):
        cache.append(*(bk.tensor(x[:, :, :1], "float32") for x in (k, v)))


def test_a_pool_of_pages_grows_eagerly(bk):
    """num_pages= makes the pages up front; eagerly a paged cache still adds pages past them."""
    q, k, v = _full(bk, "float32", seed=7)
    want, _ = ref.heads_attention(q, k, v, causal=True)
    cache = _cache(bk, "float32", page_size=8, num_pages=2)
    assert cache.capacity == 16 and cache.length == 0
    outs, cache = _decode(bk, "float32", q, k, v, cache, steps=12)  # to position 16: a third page
    assert cache.length == 17 and cache.capacity == 24
    assert_close(bk, bk.tensor(outs[-1], "float32"), want[:, :, 16:17], "float32")
    with pytest.raises(ValueError, match="num_pages is for a paged cache"):
        _cache(bk, "float32", num_pages=2)


@pytest.mark.parametrize(
    "sizes", [dict(capacity=32), dict(page_size=16, num_pages=2), dict(page_size=8, num_pages=4)]
)
def test_a_compiled_prefill_is_one_update_whatever_its_length(bk, sizes):
    """Under jax.jit and tf.function a prefill (n > 1 positions from a traced length) writes
    each page in one update: the rows of the reference for prefills that cross splits and
    pages, NaN for one that runs past the storage, and (jax) a program of the same size for
    3 positions as for 19."""
    step, _ = _compiled(bk, counted=False)
    q, k, v = _full(bk, "float32", seed=7)
    want, _ = ref.heads_attention(q, k, v, causal=True)
    for first, n in ((2, 3), (2, 19), (5, 11), (20, 5)):  # across splits and pages
        cache = _cache(bk, "float32", **sizes)
        args = [bk.tensor(x[:, :, :first], "float32") for x in (q, k, v)]
        _, cache = multiattn.cached_attention(*args, cache)
        args = [bk.tensor(x[:, :, first : first + n], "float32") for x in (q, k, v)]
        out, cache = step(*args, cache)
        assert int(cache.length) == first + n
        assert_close(bk, out, want[:, :, first : first + n], "float32")
    cache = _cache(bk, "float32", **sizes)
    args = [bk.tensor(np.concatenate([x] * 2, 2)[:, :, :40], "float32") for x in (q, k, v)]
    _, cache = multiattn.cached_attention(*(a[:, :, :1] for a in args), cache)
    out, cache = step(*(a[:, :, 1:] for a in args), cache)  # 40 positions in a storage of 32
    assert np.isnan(np.asarray(bk.numpy(out))).all()
    if bk.name == "jax":
        import jax

        def size(n):
            cache = _cache(bk, "float32", **sizes)
            _, cache = multiattn.cached_attention(*(a[:, :, :1] for a in args), cache)
            jaxpr = jax.make_jaxpr(multiattn.cached_attention)(*(a[:, :, 1 : 1 + n] for a in args), cache)
            return len(jaxpr.jaxpr.eqns)

        assert size(3) == size(19)


def test_pages_made_together_are_one_block(bk):
    """The pages one append needs (and num_pages='s pool) are one array, attended as one block
    of splits; pages added one at a time are one block each."""
    like = bk.tensor(np.zeros(1), "float32")
    rows = [bk.tensor(np.ones((1, 2, 100, 8)), "float32") for _ in range(2)]
    cache = multiattn.KVCache(1, 2, 8, like=like, page_size=16).append(*rows)
    assert cache.capacity == 112 and len(list(cache.blocks(cache.length))) == 1
    one = [bk.tensor(np.ones((1, 2, 16, 8)), "float32") for _ in range(2)]
    cache = cache.append(*one).append(*one)
    assert cache.capacity == 144 and len(list(cache.blocks(cache.length))) == 3
    pool = multiattn.KVCache(1, 2, 8, like=like, page_size=16, num_pages=8).append(*rows)
    assert pool.capacity == 128 and len(list(pool.blocks(pool.length))) == 1
