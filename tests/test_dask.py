"""Past one machine: the functional API on dask arrays (through the Array API backend), lazily,
chunked along the batch, computed on a dask.distributed cluster of two worker processes; and
along the keys (multiattn.sharding): a partial (output, lse) per key chunk, merged exactly by a
tree reduction, on workers whose memory is far below the scores, and past a killed worker."""

from __future__ import annotations

import numpy as np
import pytest

import multiattn

from . import reference as ref

pytestmark = pytest.mark.backend("array_api")


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            yield client


def test_chunked_attention_on_a_cluster_equals_the_reference(client):
    import dask.array as da

    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(8, 5, 4)), rng.normal(size=(8, 7, 4)), rng.normal(size=(8, 7, 3))
    lens, lens_2d = rng.integers(-1, 9, size=8), rng.integers(-1, 9, size=(8, 5))
    W = {"W_q": rng.normal(size=(6, 4)), "W_k": rng.normal(size=(6, 4)), "w_v": rng.normal(size=(6,))}
    chunked = [da.from_array(x, chunks=(2,) + x.shape[1:]) for x in (q, k, v)]
    assert len(client.scheduler_info()["workers"]) == 2
    for n in (lens, lens_2d):
        dn = da.from_array(n, chunks=(2,) + n.shape[1:])
        out, weights = multiattn.dot_product_attention(*chunked, dn, return_weights=True)
        assert isinstance(out, da.Array) and out.chunks[0] == (2, 2, 2, 2)  # lazy, still chunked
        want_out, want_weights = ref.dot_product_attention(q, k, v, n)
        np.testing.assert_allclose(out.compute(), want_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(weights.compute(), want_weights, rtol=1e-12, atol=1e-12)
        got = multiattn.additive_attention(*chunked, dn, **{name: da.from_array(w) for name, w in W.items()})
        want = ref.additive_attention(q, k, v, n, W["W_q"], W["W_k"], W["w_v"])[0]
        np.testing.assert_allclose(got.compute(), want, rtol=1e-12, atol=1e-12)


def test_the_keys_axis_may_be_chunked_too(client):
    # the softmax then reduces across chunks (more traffic than chunking the batch alone)
    import dask.array as da

    rng = np.random.default_rng(1)
    q, k, v, n = (
        rng.normal(size=(4, 3, 4)),
        rng.normal(size=(4, 9, 4)),
        rng.normal(size=(4, 9, 2)),
        [2, 9, 0, 5],
    )
    out = multiattn.dot_product_attention(
        da.from_array(q, chunks=(2, 3, 4)), da.from_array(k, chunks=(2, 4, 4)),
        da.from_array(v, chunks=(2, 4, 2)), da.from_array(np.array(n), chunks=2),
    )  # fmt: skip
    np.testing.assert_allclose(out.compute(), ref.dot_product_attention(q, k, v, np.array(n))[0], rtol=1e-12)


def test_a_key_chunk_is_one_task_whatever_the_block_size():
    """dot_product_attention on dask arrays: each (query chunk, key chunk) one task giving its
    partial state, a tree merging them; the graph is a few tasks per chunk, inputs included."""
    import dask.array as da

    keys = da.random.default_rng(0).standard_normal((1, 4096, 8), chunks=(1, 256, 8))  # 16 chunks
    queries = da.random.default_rng(1).standard_normal((1, 512, 8), chunks=(1, 256, 8))
    out, lse = multiattn.dot_product_attention(
        queries, keys, keys, da.from_array(np.array([3000])), return_lse=True, block_size=64
    )
    tasks = dict(da.Array.__dask_graph__(out)) | dict(da.Array.__dask_graph__(lse))
    partials = [key for key in tasks if "attention-of-a-key-chunk" in str(key)]
    assert len(partials) == 2 * 16, "one task per (query chunk, key chunk), not per block"
    assert len(tasks) <= 8 * 16, f"{len(tasks)} tasks for 16 key chunks"


@pytest.mark.parametrize("mask", ["causal+lengths", "lengths per query", "window", "document+score"])
def test_masks_and_mods_cross_the_chunk_boundaries_exactly(client, mask):
    """Batch, queries and keys chunked (4-D, grouped heads): causality, lengths, a sliding window
    and documents at each chunk's absolute positions, and a score function seeing them,
    against the float64 reference; output and lse."""
    import dask.array as da

    from multiattn import mods

    rng = np.random.default_rng(7)
    B, H, H_kv, N, d = 4, 2, 1, 20, 3
    q, k, v = (
        rng.normal(size=(B, H, N, d)),
        rng.normal(size=(B, H_kv, N, d)),
        rng.normal(size=(B, H_kv, N, 2)),
    )
    ids = np.sort(rng.integers(0, 4, size=(B, N)), axis=1)
    kwargs, want_kwargs = {}, {}
    if mask == "causal+lengths":
        lens = np.array([20, 7, 0, 13])
        kwargs, want_kwargs = dict(causal=True), dict(causal=True, valid_lens=lens)
    elif mask == "lengths per query":
        lens = rng.integers(0, N + 2, size=(B, N))
        want_kwargs = dict(valid_lens=lens)
    elif mask == "window":
        lens = None
        kwargs = dict(mask_mod=mods.sliding_window(5))
        want_kwargs = dict(mask_fn=lambda b, h, i, j: 0 <= i - j < 5)
    else:
        lens = None
        kwargs = dict(
            mask_mod=mods.document(ids),
            score_mod=lambda s, b, h, q_idx, kv_idx: s - 0.1 * abs(q_idx - kv_idx),
        )
        want_kwargs = dict(
            mask_fn=lambda b, h, i, j: ids[b, i] == ids[b, j],
            score_fn=lambda s, b, h, i, j: s - 0.1 * abs(i - j),
        )
    chunked = [da.from_array(x, chunks=(2, x.shape[1], 8, x.shape[-1])) for x in (q,)] + [
        da.from_array(x, chunks=(2, x.shape[1], 6, x.shape[-1])) for x in (k, v)
    ]
    lens_t = None if lens is None else da.from_array(lens, chunks=(2,) + lens.shape[1:])
    out, lse = multiattn.dot_product_attention(*chunked, lens_t, return_lse=True, **kwargs)
    got, got_lse = results(client.compute([out, lse]))
    want, weights = ref.heads_attention(q, k, v, **want_kwargs)
    np.testing.assert_allclose(got, want, atol=1e-12)
    fn = want_kwargs.get("mask_fn")
    if fn is None:  # lengths and causality as a mask function for heads_lse
        shown = ref.visible((B, N, N), lens, None, kwargs.get("causal", False))
        fn = lambda b, h, i, j: shown[b, i, j]  # noqa: E731
    want_lse = ref.heads_lse(q, k, mask_fn=fn, score_fn=want_kwargs.get("score_fn"))
    np.testing.assert_allclose(got_lse, want_lse, atol=1e-12)


# -- past one machine along the keys: multiattn.sharding -----------------------------------------

MEMORY_LIMIT = 256 * 2**20  # per worker; a worker process starts at about 65 MiB


def attention_in_pieces(q, k, v, lens=None, causal=False, rows=32):
    """(output, lse) in float64, a few query rows at a time (independent of multiattn); the
    keys past a sequence's length, or past a causal block's last query, are not read."""
    (B, Q, d), K = q.shape, k.shape[1]
    out, lse = np.zeros((B, Q, v.shape[2])), np.full((B, Q), -np.inf)
    for b in range(B):
        n = K
        if lens is not None and lens.ndim == 1 and not np.isnan(lens[b]):
            n = int(np.clip(np.ceil(lens[b]), 0, K))
        for i0 in range(0, Q, rows):
            i = np.arange(i0, min(i0 + rows, Q))
            j = np.arange(min(n, i[-1] + 1) if causal else n)
            seen = np.ones((len(i), len(j)), bool)
            if lens is not None:
                seen &= j < (lens[b] if lens.ndim == 1 else lens[b, i][:, None])  # NaN: hidden
            if causal:
                seen &= j <= i[:, None]
            s = np.where(seen, q[b, i] @ k[b, : len(j)].T / np.sqrt(d), -np.inf)
            top = s.max(-1, keepdims=True, initial=-np.inf)
            top = np.where(np.isfinite(top), top, 0.0)
            p = np.exp(s - top)
            total = p.sum(-1, keepdims=True)
            out[b, i] = p @ v[b, : len(j)] / np.where(total > 0, total, 1.0)
            with np.errstate(divide="ignore"):  # log 0 = -inf: nothing visible
                lse[b, i] = (top + np.log(total))[:, 0]
    return out, lse


@pytest.fixture(scope="module")
def limited_client():
    from distributed import Client, LocalCluster

    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, memory_limit=MEMORY_LIMIT
    ) as cluster:
        with Client(cluster) as client:
            yield client


@pytest.fixture(scope="module")
def long_keys():
    """B=2 sequences of K=2**18 keys, in 16 chunks of 16384, made chunk by chunk on the workers
    (the same numbers here): 2 GiB of float64 scores, eight times a worker's memory limit."""
    import dask
    import dask.array as da

    B, Q, K, d = 2, 512, 2**18, 16
    rng = da.random.default_rng(0)
    q = rng.standard_normal((B, Q, d), chunks=(B, Q, d))
    k, v = (rng.standard_normal((B, K, d), chunks=(B, 16384, d)) for _ in range(2))
    lens = np.array([K - 1234, 70001])
    assert B * Q * K * 8 >= 8 * MEMORY_LIMIT
    want = attention_in_pieces(*dask.compute(q, k, v, scheduler="synchronous"), lens)
    return (q, k, v, lens), want


def test_the_pieces_reference_is_the_loop_reference():
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(3, 6, 4)), rng.normal(size=(3, 9, 4)), rng.normal(size=(3, 9, 2))
    lens = rng.integers(-1, 11, size=(3, 6)).astype(float)
    lens[0, 1] = np.nan
    for n, causal in ((None, True), (lens, False), (lens, True), (lens[:, 0], True)):
        out, lse = attention_in_pieces(q, k, v, n, causal, rows=4)
        np.testing.assert_allclose(out, ref.dot_product_attention(q, k, v, n, causal=causal)[0], atol=1e-12)
        s = np.where(ref.visible((3, 6, 9), n, None, causal), q @ k.transpose(0, 2, 1) / 2, -np.inf)
        with np.errstate(divide="ignore"):
            np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-12)


def test_key_chunks_equal_the_loop_reference(client):
    import dask.array as da

    from multiattn.sharding import attention_over_key_chunks

    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(3, 7, 4)), rng.normal(size=(3, 23, 4)), rng.normal(size=(3, 23, 3))
    lens = rng.integers(-2, 26, size=(3, 7)).astype(float)
    lens[0, 2], lens[1, 3] = np.nan, np.inf
    finite = np.nan_to_num(lens, posinf=99)
    cases, lazy = [], []
    for n in (None, finite[:, 0].astype(np.int64), lens.astype(np.float32), finite.astype(np.uint8)):
        for causal in (False, True):
            for dtype in (np.float64,) if n is None or n.dtype != np.float32 else (np.float64, np.float32):
                chunked = ((q, (2, 4, 4)), (k, (3, 5, 4)), (v, (1, 5, 3)))  # values: another batch split
                x = [da.from_array(t.astype(dtype), chunks=c) for t, c in chunked]
                dn = None if n is None else da.from_array(n, chunks=2)
                out, lse = attention_over_key_chunks(*x, dn, causal=causal, split_every=2)
                assert out.chunks == ((2, 1), (4, 3), (3,)) and out.dtype == lse.dtype == dtype  # lazy
                cases.append((n, causal, dtype))
                lazy.append((out, lse))
    done = results(client.compute([x for pair in lazy for x in pair]))
    for (n, causal, dtype), got, got_lse in zip(cases, done[::2], done[1::2]):
        tol = 1e-12 if dtype == np.float64 else 2e-6
        want, want_lse = attention_in_pieces(q, k, v, n, causal)
        np.testing.assert_allclose(got, ref.dot_product_attention(q, k, v, n, causal=causal)[0], atol=tol)
        np.testing.assert_allclose(got_lse, want_lse, rtol=tol, atol=tol)


def test_four_d_grouped_calls_on_a_cluster_equal_the_reference(client):
    """dask arrays in 4-D (B, H, Q, d) over (B, H_kv, K, .): the functions chunked along the
    batch, and the key chunks merged by lse."""
    import dask.array as da

    from multiattn.sharding import attention_over_key_chunks

    rng = np.random.default_rng(4)
    q, k, v = rng.normal(size=(4, 4, 5, 3)), rng.normal(size=(4, 2, 11, 3)), rng.normal(size=(4, 2, 11, 2))
    lens = np.array([11, 6, 0, 9])
    want, _ = ref.heads_attention(q, k, v, lens, causal=True)
    batch = [da.from_array(x, chunks=(2,) + x.shape[1:]) for x in (q, k, v)]
    out = multiattn.dot_product_attention(*batch, da.from_array(lens, chunks=2), causal=True)
    keys = [da.from_array(q, chunks=(2, 4, 5, 3))] + [
        da.from_array(x, chunks=(2, 2, 4, x.shape[-1])) for x in (k, v)
    ]
    chunked, lse = attention_over_key_chunks(*keys, da.from_array(lens, chunks=2), causal=True, split_every=2)
    assert chunked.shape == (4, 4, 5, 2) and lse.shape == (4, 4, 5)
    got, got_chunked = client.compute([out, chunked], sync=True)
    np.testing.assert_allclose(got, want, atol=1e-12)
    np.testing.assert_allclose(got_chunked, want, atol=1e-12)


def test_key_chunks_merge_in_a_tree_of_depth_log_split_every():
    import dask.array as da

    from multiattn.sharding import attention_over_key_chunks

    keys = da.ones((1, 64, 2), chunks=(1, 1, 2))
    for split_every, levels in ((4, [16, 4, 1]), (2, [32, 16, 8, 4, 2, 1]), (8, [8, 1]), (64, [1])):
        out, _ = attention_over_key_chunks(da.ones((1, 4, 2)), keys, keys, split_every=split_every)
        layers = out.dask.layers.items()
        merges = [len(layer) for name, layer in layers if "-partial-" in name or "-aggregate-" in name]
        assert sorted(merges, reverse=True) == levels


def test_key_chunks_name_the_argument_at_fault():
    import dask.array as da

    from multiattn.sharding import attention_over_key_chunks

    q, k, v = da.ones((2, 3, 4)), da.ones((2, 8, 4), chunks=(2, 4, 4)), da.ones((2, 8, 5), chunks=(2, 4, 5))
    cases = [
        (dict(values=da.ones((2, 8, 5), chunks=(2, 2, 5))), ValueError, "keys and values must have the same"),
        (dict(values=da.ones((2, 7, 5))), ValueError, "values must have shape"),
        (dict(keys=da.ones((2, 8, 3), chunks=(2, 4, 3))), ValueError, "keys must have shape"),
        (dict(queries=da.ones((2, 3))), ValueError, "queries must be 3-D"),
        (dict(valid_lens=da.ones(3)), ValueError, "valid_lens must have shape"),
        (dict(valid_lens=da.ones(2, dtype=bool)), TypeError, "valid_lens must have an integer or float"),
        (dict(queries=da.ones((2, 3, 4), dtype=int)), TypeError, "queries"),
        (dict(split_every=1), ValueError, "split_every"),
        (dict(causal="yes"), TypeError, "causal"),
        (dict(block_size=0), ValueError, "block_size"),
    ]
    for change, error, message in cases:
        args = {"queries": q, "keys": k, "values": v, "valid_lens": None, **change}
        with pytest.raises(error, match=message):
            attention_over_key_chunks(**args)


def results(futures, timeout=120):
    """The futures' results, or a TimeoutError (a paused worker would hang the test)."""
    return [future.result(timeout=timeout) for future in futures]


def _pids(client):
    import os

    return client.run(os.getpid)


def test_long_keys_on_workers_whose_memory_is_far_below_the_scores(limited_client, long_keys):
    from multiattn.sharding import attention_over_key_chunks

    (q, k, v, lens), (want, want_lse) = long_keys
    workers = limited_client.scheduler_info()["workers"]
    assert len(workers) == 2 and all(w["memory_limit"] == MEMORY_LIMIT for w in workers.values())
    pids = _pids(limited_client)
    out, lse = attention_over_key_chunks(q, k, v, lens, block_size=512)
    got, got_lse = results(limited_client.compute([out, lse]))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-12, atol=1e-12)
    assert _pids(limited_client) == pids  # no worker passed its limit (the nanny would restart it)
    peaks = limited_client.run(lambda dask_worker: max(dask_worker.monitor.quantities["memory"]))
    assert max(peaks.values()) < MEMORY_LIMIT


def test_causal_long_sequence_with_per_query_lengths_under_the_memory_limit(limited_client):
    import dask
    import dask.array as da

    from multiattn.sharding import attention_over_key_chunks

    Q = K = 8192  # 512 MiB of float64 scores, in 4 x 8 (query chunk, key chunk) tasks
    rng = da.random.default_rng(4)
    q = rng.standard_normal((1, Q, 8), chunks=(1, 2048, 8))
    k, v = (rng.standard_normal((1, K, 8), chunks=(1, 1024, 8)) for _ in range(2))
    lens = np.random.default_rng(5).integers(0, K + 100, size=(1, Q))
    lazy_lens = da.from_array(lens, chunks=(1, 2048))
    out, lse = attention_over_key_chunks(q, k, v, lazy_lens, causal=True, block_size=256)
    got, got_lse = results(limited_client.compute([out, lse]))
    want, want_lse = attention_in_pieces(*dask.compute(q, k, v, scheduler="synchronous"), lens, causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-12, atol=1e-12)


def test_a_worker_killed_mid_computation_leaves_the_result_exact(long_keys):
    import os
    import signal
    import time

    import dask.array as da
    from distributed import Client, LocalCluster

    (q, k, v, lens), (want, want_lse) = long_keys
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, memory_limit=MEMORY_LIMIT
    ) as cluster, Client(cluster) as client:  # fmt: skip
        pids = _pids(client)
        lazy_lens = da.from_array(lens)  # the user's call: one task per key chunk, as above
        out, lse = multiattn.dot_product_attention(q, k, v, lazy_lens, return_lse=True, block_size=512)
        futures = client.compute([out, lse])
        deadline, victim = time.monotonic() + 60, None
        while victim is None:  # the first worker to hold a finished key chunk's partial
            assert time.monotonic() < deadline, "no partial finished within 60 s"
            for address, keys in client.has_what().items():
                if any("attention-of-a-key-chunk" in str(key) for key in keys):
                    victim = address
            time.sleep(0.01)
        os.kill(pids[victim], signal.SIGKILL)  # its partials, and the tasks it was running, are lost
        assert not any(f.done() for f in futures), "the computation ended before the kill"
        got, got_lse = results(futures)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got_lse, want_lse, rtol=1e-12, atol=1e-12)
        assert victim not in client.scheduler_info()["workers"]  # the nanny started a new one
