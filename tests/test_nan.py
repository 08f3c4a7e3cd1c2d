"""NaN in means NaN out: sparse attention whose lists hold every key is dense attention, so on
the same input (with NaN / inf planted in q, k or v) its output and gradients must equal
torch.nn.functional.scaled_dot_product_attention's, NaN pattern included. CPU in float64 (and
float32), CUDA in bf16 (skipped without a GPU). Rows with an empty list stay 0.
"""
import pytest
import torch
import torch.nn.functional as F

import dsv_ext

NAN, INF = float("nan"), float("inf")


def _dense_lists(B, S, H, G, device):
    NG = -(-S // G)
    idx = torch.arange(S, dtype=torch.int32, device=device).expand(B, H, NG, S).contiguous()
    cnt = torch.full((B, H), S, dtype=torch.int32, device=device)
    return idx, cnt


def _run(q, k, v, idx, cnt, G, dout):
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = dsv_ext.sparse_attention(qq, kk, vv, idx, cnt, G)
    out.backward(dout)
    return out, qq.grad, kk.grad, vv.grad


def _sdpa(q, k, v, dout):
    qq, kk, vv = (t.detach().double().cpu().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qq, kk, vv)
    out.backward(dout.double().cpu().transpose(1, 2))
    return tuple(t.transpose(1, 2) for t in (out, qq.grad, kk.grad, vv.grad))


def _compare(got, want, tol):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        g = g.double().cpu()
        assert torch.equal(torch.isnan(g), torch.isnan(w)), f"{name}: NaN pattern differs from SDPA"
        fin = ~torch.isnan(w)
        assert torch.equal(torch.isinf(g[fin]), torch.isinf(w[fin])), f"{name}: inf pattern differs"
        ok = fin & torch.isfinite(w)
        err = (g[ok] - w[ok]).abs().max().item() if ok.any() else 0.0
        assert err <= tol * max(1.0, w[ok].abs().max().item() if ok.any() else 1.0), f"{name}: {err}"


CASES = [("k", NAN), ("q", NAN), ("v", NAN), ("k", INF), ("q", -INF), ("k", -INF)]


def _inputs(dtype, device, where, val, seed):
    g = torch.Generator().manual_seed(seed)
    B, S, H, D = 2, 24, 2, 64 if device == "cuda" else 8
    q, k, v, dout = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(4))
    t = {"q": q, "k": k, "v": v}[where]
    t[0, 5, 1, 3] = val
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, dout)]


@pytest.mark.parametrize("where,val", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_nan_matches_sdpa_cpu(where, val, dtype):
    q, k, v, dout = _inputs(dtype, "cpu", where, val, 0)
    idx, cnt = _dense_lists(2, 24, 2, 8, "cpu")
    _compare(_run(q, k, v, idx, cnt, 8, dout), _sdpa(q, k, v, dout), 1e-9 if dtype == torch.float64 else 1e-4)


def test_empty_list_stays_zero_next_to_nan():
    q, k, v, dout = _inputs(torch.float64, "cpu", "k", NAN, 1)
    idx, cnt = _dense_lists(2, 24, 2, 8, "cpu")
    cnt[1, 0] = 0
    out, dq, dk, dv = _run(q, k, v, idx, cnt, 8, dout)
    for t in (out, dq, dk, dv):
        assert torch.equal(t[1, :, 0], torch.zeros_like(t[1, :, 0]))
    assert torch.isnan(out[0, :, 1]).all()  # every row of (0, 1) lists the NaN key


@pytest.mark.skipif(not torch.cuda.is_available() or not dsv_ext.has_cuda_kernels(),
                    reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("where,val", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_nan_matches_sdpa_cuda(where, val, dtype, deterministic):
    q, k, v, dout = _inputs(dtype, "cuda", where, val, 0)
    idx, cnt = _dense_lists(2, 24, 2, 8, "cuda")
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = dsv_ext.sparse_attention(qq, kk, vv, idx, cnt, 8, deterministic=deterministic)
    out.backward(dout)
    _compare((out, qq.grad, kk.grad, vv.grad), _sdpa(q, k, v, dout), 3e-2 if dtype == torch.bfloat16 else 1e-2)
