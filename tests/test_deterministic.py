"""Deterministic mode: bit-identical dq, dk, dv from run to run.

CPU: the backward is always deterministic (fixed thread count, fixed summation order), with
the flag or without, in both of its parallel modes (many (b, h) pairs: one pair per task;
few pairs: per-thread buffers reduced in a fixed order).
CUDA (skipped without a GPU): sparse_attention(..., deterministic=True) 10 times on the same
inputs gives bitwise the same gradients, for lists from topk_estimate, unsorted lists (sorted
by dsv_ext first), long sequences where the default path would split keys into ranges, and
group sizes that use either key-major tile; and the gradients match the default path and the
float64 reference within the bf16 bounds of tests/helpers.py (CUDA_TOL / CUDA_GTOL).
"""
import math

import pytest
import torch

import dsv_ext
from dsv_ext.config import DSVConfig
from dsv_ext.reference import make_qkv, random_index, sparse_attention_ref


def _grads(q, k, v, idx, cnt, G, dout, deterministic):
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = dsv_ext.sparse_attention(qq, kk, vv, idx, cnt, G, deterministic=deterministic)
    out.backward(dout)
    return out.detach(), qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("B,H", [(1, 1), (4, 3)])  # few pairs (per-thread buffers) / many pairs
@pytest.mark.parametrize("deterministic", [None, True])
def test_cpu_backward_bit_identical(B, H, deterministic):
    g = torch.Generator().manual_seed(3)
    S, D, G = 300, 32, 16
    q, k, v = make_qkv(B, S, H, D, torch.float32, generator=g)
    idx, cnt = random_index(B, H, S, G, 80, generator=g)
    dout = torch.randn(B, S, H, D, generator=g)
    first = _grads(q, k, v, idx, cnt, G, dout, deterministic)
    for _ in range(4):
        again = _grads(q, k, v, idx, cnt, G, dout, deterministic)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def test_flag_checks_and_config():
    q = torch.randn(1, 8, 1, 4)
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32)
    cnt = torch.ones(1, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="^deterministic:"):
        dsv_ext.sparse_attention(q, q, q, idx, cnt, 4, deterministic="yes")
    with pytest.raises(ValueError, match="^deterministic:"):
        DSVConfig(deterministic="yes")
    assert DSVConfig(deterministic=True).deterministic is True
    # the raw ops take the flag (schema default False): opcheck-style direct calls
    out, lse = torch.ops.dsv.sparse_attention_fwd(q, q, q, idx, cnt, 4, 0.5, True)
    dq, dk, dv = torch.ops.dsv.sparse_attention_bwd(torch.ones_like(out), q, q, q, out, lse, idx, cnt, 4, 0.5, True)
    assert dq.shape == q.shape


def test_opcheck_deterministic():
    g = torch.Generator().manual_seed(0)
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 24, 2, 8, torch.float64, generator=g))
    idx, cnt = random_index(1, 2, 24, 4, 6, generator=g)
    torch.library.opcheck(torch.ops.dsv.sparse_attention_fwd, (q, k, v, idx, cnt, 4, 0.3, True))


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or not dsv_ext.has_cuda_kernels(),
                               reason="needs a GPU and the CUDA kernels")

CUDA_CASES = [
    # S, H, D, G, kmax, lists
    (4096, 4, 128, 64, 512, "topk"),
    (4096, 4, 64, 32, 384, "topk"),
    (3000, 3, 128, 48, 300, "random"),   # partial last group, unsorted random lists
    (65536, 2, 128, 64, 2048, "topk"),   # long: the default path would use key ranges
    (2048, 2, 96, 128, 256, "topk"),
]


@needs_gpu
@pytest.mark.parametrize("S,H,D,G,kmax,lists", CUDA_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_backward_bit_identical_10_runs(S, H, D, G, kmax, lists, dtype):
    g = torch.Generator().manual_seed(11)
    B = 1
    q, k, v = (t.cuda() for t in make_qkv(B, S, H, D, dtype, generator=g))
    if lists == "topk":
        ql, kl = (torch.randn(B, S, H, 16, generator=g).to(dtype).cuda() for _ in range(2))
        cnt = torch.randint(kmax // 2, kmax + 1, (B, H), generator=g).to(torch.int32).cuda()
        idx = dsv_ext.topk_estimate(ql, kl, cnt, G, kmax)
    else:  # every list full and in random order: dsv_ext sorts them for the deterministic path
        idx, cnt = random_index(B, H, S, G, kmax, counts=kmax, generator=g)
        idx = idx.gather(-1, torch.rand(idx.shape, generator=g).argsort(dim=-1))
        idx, cnt = idx.cuda(), cnt.cuda()
    dout = torch.randn(B, S, H, D, generator=g).to(dtype).cuda()
    first = _grads(q, k, v, idx, cnt, G, dout, True)
    for run in range(9):
        again = _grads(q, k, v, idx, cnt, G, dout, True)
        for name, a, b in zip(("out", "dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"run {run + 2}: {name} differs from run 1"
    # same values as the default path, within bf16 / fp16 accumulation differences
    default = _grads(q, k, v, idx, cnt, G, dout, False)
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, default):
        err = (a.float() - b.float()).abs().max().item()
        bound = 2e-2 * max(1.0, b.float().abs().max().item())
        assert err <= bound, f"{name}: deterministic vs default differ by {err}"
    if S <= 4096:  # and the float64 reference (small shapes: the reference is dense)
        qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        ref = sparse_attention_ref(qr, kr, vr, idx, cnt, G, 1 / math.sqrt(D))
        ref.backward(dout.double())
        for name, a, r in (("out", first[0], ref), ("dq", first[1], qr.grad), ("dk", first[2], kr.grad),
                           ("dv", first[3], vr.grad)):
            err = (a.double() - r).abs().max().item()
            bound = (3e-2 if dtype == torch.bfloat16 else 8e-3) * max(1.0, r.abs().max().item())
            assert err <= bound, f"{name}: {err} vs float64 reference (bound {bound})"


@needs_gpu
def test_cuda_deterministic_head_dim_256_refused():
    q = torch.randn(1, 64, 1, 256, device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device="cuda")
    cnt = torch.ones(1, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^deterministic:"):
        dsv_ext.sparse_attention(q, q, q, idx, cnt, 64, deterministic=True)


def test_sorted_lists_keep_the_used_keys():
    """The list sort of the deterministic CUDA path (run here on CPU tensors): the same used keys
    (multiset, as the kernels count them), ascending, then -1; entries outside [0, S) dropped."""
    from dsv_ext.ops import _sorted_lists
    from dsv_ext.reference import key_multiplicity
    g = torch.Generator().manual_seed(0)
    idx, cnt = random_index(2, 3, 50, 8, 12, generator=g)
    idx[0, 0, 0, 0] = -1
    idx[1, 2, 3, 1] = 99
    s = _sorted_lists(idx, cnt, 50)
    assert torch.equal(key_multiplicity(idx, cnt, 50), key_multiplicity(s, cnt, 50))
    used = torch.arange(12) < cnt[:, :, None, None]
    v = torch.where(used & (s >= 0), s, torch.full_like(s, 10**6))
    assert (v[..., 1:] >= v[..., :-1]).all()
    assert ((s >= 0) | (s == -1)).all() and (s < 50).all()
