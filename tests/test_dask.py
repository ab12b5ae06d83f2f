"""Past one machine: the functional API on dask arrays (through the Array API backend), lazily,
chunked along the batch, computed on a dask.distributed cluster of two worker processes."""

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
