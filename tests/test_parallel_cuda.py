"""Two-GPU tests of dsv_ext.parallel (NCCL): skipped unless two CUDA GPUs and the CUDA kernels
are present (CI has none; the device's two-GPU host runs them).

Each of 2 spawned ranks holds half of a bf16 sequence (S = 2 x 1024, 4 heads of 128, groups of
64, rank 16) and compares against the single-GPU result that it computes itself on the whole
sequence (dsv_ext.topk_estimate + sparse_attention, or the module without context parallelism):
HCP, SCP, the solver's plan and SparseAttention after dsv_ext.parallel.enable (stage 1 dense,
stage 2 sparse), forward and dq / dk / dv.

Tolerance: the CP paths run the same bf16 kernels on the same keys, but dK / dV are summed by
atomics in another order, the dense head runs SDPA instead of the sparse kernel over all keys,
and SCP's estimation averages repeated query rows (the group mean may round differently, which
can swap a key of equal score at the K-th place). Each element must be within 2e-2 x (the
tensor's largest magnitude + its own magnitude): a few bf16 ulps (2^-8 = 3.9e-3 relative).
"""

from __future__ import annotations

import copy
import datetime
import importlib
import json
import os
import random
import tempfile
import traceback

import pytest
import torch
import torch.multiprocessing as mp

SEED = int(os.environ.get("DSV_TEST_SEED", random.randrange(2**31)))
B, L, H, D, G, R = 1, 1024, 4, 128, 64, 16
TOL = 2e-2


def _have_two_gpus() -> bool:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return False
    try:
        import dsv_ext

        return dsv_ext.has_cuda_kernels()
    except Exception:  # noqa: BLE001
        return False


pytestmark = pytest.mark.skipif(not _have_two_gpus(), reason="needs two CUDA GPUs and the CUDA kernels")


def _inputs(dev):
    g = torch.Generator().manual_seed(SEED)
    S = 2 * L
    f = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(q=f(B, S, H, D), k=f(B, S, H, D), v=f(B, S, H, D), q_lr=f(B, S, H, R), k_lr=f(B, S, H, R),
             w=f(B, S, H, D))
    x = {k_: t.to(dev, torch.bfloat16) for k_, t in x.items()}
    counts = [S, S // 10, S // 5, S // 20]  # one dense head
    x["cnt"] = torch.tensor([counts], dtype=torch.int32, device=dev)
    return x


def _grads(fn, x, sl):
    q, k, v = (x[n][:, sl].clone().requires_grad_(True) for n in "qkv")
    out = fn(q, k, v)
    (out.float() * x["w"][:, sl].float()).sum().backward()
    return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad)]


def _err(a, b):
    """max of |a - b| / (TOL (max |b| + |b|)) over every element of every pair (<= 1 passes)."""
    return max(float(((x - y).abs() / (TOL * (y.abs().max() + y.abs()))).max()) for x, y in zip(a, b))


def _scenarios(rank, dev):
    import dsv_ext
    import dsv_ext.parallel as P
    from dsv_ext.config import DSVConfig

    x = _inputs(dev)
    S = 2 * L
    sl = slice(rank * L, (rank + 1) * L)
    full = slice(None)
    kmax = int(x["cnt"].max())

    def single(q, k, v):
        idx = dsv_ext.topk_estimate(x["q_lr"], x["k_lr"], x["cnt"], G, kmax=kmax)
        return dsv_ext.sparse_attention(q, k, v, idx, x["cnt"], G)

    ref = [t[:, sl] for t in _grads(single, x, full)]
    ql, kl = x["q_lr"][:, sl], x["k_lr"][:, sl]
    res = {}
    res["hcp"] = _err(_grads(lambda q, k, v: P.hcp_attention(q, k, v, ql, kl, x["cnt"], G), x, sl), ref)
    res["scp"] = _err(_grads(lambda q, k, v: P.scp_attention(q, k, v, ql, kl, x["cnt"], G), x, sl), ref)
    sp = [1.0 - c / S for c in x["cnt"][0].tolist()]
    plan = P.solve_plan(sp, 2, S, D, group_size=G, rank=R)
    res["plan"] = _err(_grads(lambda q, k, v: P.cp_attention(q, k, v, ql, kl, x["cnt"], G, plan), x, sl), ref)

    # the module path: stage 1 (dense) and stage 2 (sparse), against the same module unsharded
    torch.manual_seed(SEED + 1)
    cfg = DSVConfig(group_size=G, rank=R, k_multiple=G)
    base = dsv_ext.SparseAttention(H, D, config=cfg).to(dev)
    cpm = copy.deepcopy(base)
    P.enable(cpm)
    res["module_stage1"] = _err(_grads(cpm, x, sl), [t[:, sl] for t in _grads(base, x, full)])
    for m in (base, cpm):
        m.stage, m.use_sparse = 2, True
        m.set_density([1.0, 0.1, 0.2, 0.05], S)
    res["module_stage2"] = _err(_grads(cpm, x, sl), [t[:, sl] for t in _grads(base, x, full)])
    return res


def _worker(rank, world, init_file, out_dir, seed):
    import torch.distributed as dist

    global SEED
    SEED = seed  # the parent's (a spawned child draws its own at import)
    importlib.import_module("torch._dynamo")  # before init_process_group (docs/PARALLEL.md)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        try:
            res = _scenarios(rank, torch.device("cuda", rank))
        except Exception:  # noqa: BLE001 - reported by the test
            res = {"exception": traceback.format_exc()}
    finally:
        import dsv_ext.parallel as P

        P.clear_group_cache()
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def test_cp_on_two_gpus_matches_one_gpu():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), tmp, SEED), nprocs=2, join=True)
        out = []
        for r in range(2):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                out.append(json.load(f))
    for r, e in enumerate(out):
        assert "exception" not in e, f"rank {r} (DSV_TEST_SEED={SEED}):\n{e.get('exception')}"
        for key, v in e.items():
            assert v <= 1.0, f"rank {r} {key}: error {v:.2f} x the bf16 bound (DSV_TEST_SEED={SEED})"
