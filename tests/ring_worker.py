"""Ring attention run across processes for tests/test_distributed.py (spawned processes need
a file with a __main__ guard):

    python tests/ring_worker.py torch WORLD OUT_DIR          # every case, each rank's errors
    python tests/ring_worker.py fault KIND OUT_DIR           # a misuse or fault, what each rank raised
    python tests/ring_worker.py jax OUT_DIR                  # 4 CPU devices in shard_map

Each rank (or the jax process) writes a JSON file to OUT_DIR: per case, the largest difference
of its rows (forward, dq, dk, dv) from the single-process call in float64, from the float64
reference of tests/reference.py where it has the masks, and whether a row that sees nothing
gave 0 with finite gradients."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

B, H, KV, N, D = 2, 8, 2, 24, 8
DOCUMENTS = [[0] * 7 + [1] * 10 + [2] * 7, [0] * 13 + [1] * 11]


def cases(mods, tensor):
    """name -> (keywords, whether tests/reference.py has the masks), the issue's list."""
    return {
        "none": ({}, True),
        "causal": ({"causal": True}, True),
        # 17 ends in the last rank's shard, 5 in the first's; the second's rows see nothing past 0
        "lengths": ({"valid_lens": tensor([17, 5])}, True),
        "nothing_visible": ({"valid_lens": tensor([0, 11]), "causal": True}, True),
        "sliding_window": ({"mask_mod": mods.sliding_window(5)}, False),
        "document": ({"mask_mod": mods.document(tensor(DOCUMENTS))}, False),
        "alibi": ({"score_mod": mods.alibi(mods.alibi_slopes(H)), "causal": True}, False),
        "softcap": ({"score_mod": mods.softcap(1.5), "valid_lens": tensor([20, 9])}, False),
    }


def inputs(rng):
    q, k, v, d_out = (rng.normal(size=s) for s in [(B, H, N, D), (B, KV, N, D), (B, KV, N, D), (B, H, N, D)])
    return q, k, v, d_out


def reference_rows(keywords, q, k, v):
    """tests/reference.py's float64 loops, head by head (query head h reads kv head h // 4)."""
    from tests import reference

    lens = keywords.get("valid_lens")
    lens = None if lens is None else np.asarray(lens)
    out = np.zeros(q.shape)
    for h in range(H):
        out[:, h] = reference.dot_product_attention(
            q[:, h], k[:, h // (H // KV)], v[:, h // (H // KV)], valid_lens=lens,
            causal=keywords.get("causal", False),
        )[0]  # fmt: skip
    return out


def torch_rank(rank, world, port, out_dir):
    import torch
    import torch.distributed as dist

    import multiattn
    from multiattn import mods
    from multiattn.distributed import ring_attention, shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if world == 3:  # calls of 3 rows, keys travelling in blocks of 5 (shards of 8): several, one short
        import multiattn.distributed.ring

        multiattn.distributed.ring.ROWS, multiattn.distributed.ring.KEYS = 3, 5
    found = {}
    for name, (keywords, has_reference) in cases(mods, torch.tensor).items():
        for layout in ("contiguous", "zigzag"):
            arrays = inputs(np.random.default_rng(len(name)))
            q, k, v, d_out = (torch.tensor(x, requires_grad=True) for x in arrays)
            whole = multiattn.dot_product_attention(q, k, v, **keywords)
            expected = [whole, *torch.autograd.grad(whole, (q, k, v), d_out)]
            local = [shard(x.detach(), rank, world, layout).requires_grad_() for x in (q, k, v)]
            out = ring_attention(*local, layout=layout, timeout=60, **keywords)
            got = [out, *torch.autograd.grad(out, local, shard(d_out, rank, world, layout))]
            errors = [
                float((g - shard(e, rank, world, layout)).detach().abs().max()) for g, e in zip(got, expected)
            ]
            row = {"errors": errors, "finite": all(bool(torch.isfinite(g).all()) for g in got)}
            if has_reference:
                want = torch.tensor(reference_rows(keywords, *arrays[:3]))
                row["reference"] = float((out.detach() - shard(want, rank, world, layout)).abs().max())
            if name == "nothing_visible":
                row["zero_rows"] = float(got[0][0].abs().max())
            found[f"{name}/{layout}"] = row
    # 3-D (no heads)
    q, k, v = (torch.tensor(x[:, 0], requires_grad=True) for x in inputs(np.random.default_rng(1))[:3])
    whole = multiattn.dot_product_attention(q, k, v, causal=True)
    out = ring_attention(*(shard(x.detach(), rank, world) for x in (q, k, v)), causal=True)
    found["three_d/contiguous"] = {
        "errors": [float((out - shard(whole, rank, world)).abs().max())],
        "finite": True,
    }
    Path(out_dir, f"torch_{world}_{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def fault_rank(rank, world, port, kind, out_dir):
    import torch
    import torch.distributed as dist

    from multiattn.distributed import ring_attention

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(rank)
    n, d, layout = 6, 8, "contiguous"
    if kind == "zigzag_unequal":
        n, layout = (4, 6)[rank % 2], "zigzag"
    if kind == "mismatch":
        d = 8 if rank == 0 else 16
    if kind == "dead" and rank == 1:
        os._exit(0)
    if kind == "absent" and rank == 1:
        time.sleep(8)  # alive but never calls
        os._exit(0)
    q, k, v = (torch.randn(1, 2, n, d) for _ in range(3))
    start, raised = time.perf_counter(), None
    try:
        ring_attention(q, k, v, causal=True, layout=layout, timeout=3)
    except Exception as error:  # noqa: BLE001  (what was raised is the result)
        raised = f"{type(error).__name__}: {error}"
    result = {"raised": raised, "seconds": time.perf_counter() - start}
    Path(out_dir, f"fault_{kind}_{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a group whose peer is gone cannot be destroyed cleanly


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jax_cases(out_dir):
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    from multiattn import mods

    world = 4
    mesh = jax.make_mesh((world,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    picked = cases(mods, jnp.asarray)
    # each compile costs seconds: the masks two at a time where they are independent
    runs = {
        "none/contiguous": picked["none"][0],
        "causal/zigzag": picked["causal"][0],
        "causal+lengths/contiguous": {**picked["causal"][0], "valid_lens": jnp.asarray([0, 20])},
        "sliding_window+alibi/zigzag": {**picked["sliding_window"][0], **picked["alibi"][0]},
        "document+softcap/contiguous": {**picked["document"][0], **picked["softcap"][0]},
    }
    found = {key: _jax_case(mesh, world, key, keywords) for key, keywords in runs.items()}
    Path(out_dir, "jax.json").write_text(json.dumps(found))


def _jax_case(mesh, world, key, keywords):
    """One case: the ring in shard_map (forward and gradients, jitted) against the single call."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import multiattn
    from multiattn.distributed import ring_attention, shard, unshard

    layout, size, spec = key.split("/")[1], N // world, P(None, None, "sp")
    q, k, v, d_out = (jnp.asarray(x) for x in inputs(np.random.default_rng(len(key))))
    ring = jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, axis_name="sp", layout=layout, **keywords),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
    )  # fmt: skip

    def call(q, k, v):  # the whole sequence in, the whole out
        ordered = (jnp.concatenate([shard(x, r, world, layout) for r in range(world)], -2) for x in (q, k, v))
        out = ring(*ordered)
        return unshard([out[..., r * size : (r + 1) * size, :] for r in range(world)], layout)

    def single(q, k, v):
        return multiattn.dot_product_attention(q, k, v, **keywords)

    def loss(f):
        def value(q, k, v):
            out = f(q, k, v)
            return (out * d_out).sum(), out

        return jax.value_and_grad(value, (0, 1, 2), has_aux=True)

    (_, want), want_grads = loss(single)(q, k, v)
    (_, got), grads = jax.jit(loss(call))(q, k, v)
    errors = [float(jnp.abs(a - b).max()) for a, b in zip((got, *grads), (want, *want_grads))]
    row = {"errors": errors, "finite": all(bool(jnp.isfinite(g).all()) for g in (got, *grads))}
    if key.startswith("causal+lengths"):
        row["zero_rows"] = float(jnp.abs(got[0]).max())
    return row


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "torch":
        import torch.multiprocessing as mp

        world = int(sys.argv[2])
        mp.spawn(torch_rank, args=(world, free_port(), sys.argv[3]), nprocs=world)
    elif mode == "fault":
        import torch.multiprocessing as mp

        kind = sys.argv[2]
        world = 1 if kind == "alone" else 2
        mp.spawn(fault_rank, args=(world, free_port(), kind, sys.argv[3]), nprocs=world)
    else:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        jax_cases(sys.argv[2])
