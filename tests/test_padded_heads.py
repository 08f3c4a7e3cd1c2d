"""Head dims the CUDA attention kernels are not compiled for run zero-padded (dsv_ext.ops:
_run_head_dim, _PaddedHeads). Here on the CPU: the rule that picks the padded size (with the
wgmma kernels on and off), the error for heads above 256, and the padded path itself, forced on
the CPU kernels (which take any head dim), against the unpadded op and the float64 reference,
forward and backward, NaN included. The same path on the GPU: test_sparse_attention_cuda.py,
test_padded_head_dims."""
import pytest
import torch

from helpers import check_public_attention, counts_for, import_dsv_ext, index_lists, make_qkv, need_ops

dsv_ext = import_dsv_ext()
ops = pytest.importorskip("dsv_ext.ops")  # the extension loads (CI builds it)


@pytest.mark.parametrize("wgmma,want", [
    (True, {32: 64, 48: 64, 64: 64, 72: 128, 80: 128, 96: 128, 112: 128, 128: 128, 160: 256, 256: 256}),
    (False, {32: 64, 48: 64, 64: 64, 72: 96, 80: 96, 96: 96, 112: 128, 128: 128, 160: 256, 256: 256}),
])
def test_cuda_head_dim_rule(monkeypatch, wgmma, want):
    """The compiled sizes 64 / 96 / 128 / 256 or the next one up; with the wgmma kernels (64 and
    128 only) every head between 64 and 128 runs at 128."""
    monkeypatch.setattr(ops, "_wgmma_on", lambda index: wgmma)
    assert {d: ops._cuda_head_dim(0, d) for d in want} == want


def test_head_dims_the_kernels_do_not_take():
    assert ops._run_head_dim(torch.device("cpu"), 72) == 72  # the CPU kernels take any
    assert ops._run_head_dim(torch.device("cuda", 0), 64) == 64  # no device query needed
    with pytest.raises(ValueError, match=r"^q: the CUDA attention kernels take head_dim <= 256, got 300"):
        ops._run_head_dim(torch.device("cuda", 0), 300)


def _lists(B, S, H, G, gen):
    KM = S // 3
    cnt = counts_for(B, H, KM, gen, zero=True, one=True)
    return index_lists(B, H, S, G, KM, gen, counts=cnt, pad="random")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("D,dim", [(72, 128), (40, 64), (96, 128)])
def test_padded_path_matches_unpadded(monkeypatch, gen, dtype, D, dim):
    """The padded path (forced on the CPU kernels) gives the unpadded op's output and gradients
    (zero columns add exact zeros) and passes the float64 reference under the rule."""
    need_ops("cpu")
    B, S, H, G = 2, 45, 3, 8
    q, k, v = make_qkv(B, S, H, D, dtype=dtype, layout="packed", generator=gen)
    idx, cnt = _lists(B, S, H, G, gen)
    dout = torch.randn(B, S, H, D, generator=gen, dtype=dtype)
    want = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out_want = dsv_ext.sparse_attention(*want, idx, cnt, G)
    g_want = torch.autograd.grad(out_want, want, dout)
    monkeypatch.setattr(ops, "_run_head_dim", lambda device, head_dim: dim)
    got = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = dsv_ext.sparse_attention(*got, idx, cnt, G)
    assert out.shape == (B, S, H, D) and out.is_contiguous()
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, out_want, **tol)
    for a, b in zip(torch.autograd.grad(out, got, dout), g_want):
        assert a.shape == (B, S, H, D)
        torch.testing.assert_close(a, b, **tol)
    check_public_attention(q, k, v, idx, cnt, G, gen)


def test_padded_path_keeps_nan(monkeypatch, gen):
    """A NaN in a query row gives that row NaN output and gradients through the padded path too;
    the other groups stay finite."""
    need_ops("cpu")
    monkeypatch.setattr(ops, "_run_head_dim", lambda device, head_dim: 128)
    B, S, H, D, G = 1, 32, 1, 72, 8
    q, k, v = make_qkv(B, S, H, D, dtype=torch.float32, layout="packed", generator=gen)
    q = q.detach().clone()
    q[0, 3, 0, 5] = float("nan")
    idx, cnt = index_lists(B, H, S, G, 8, gen, counts=torch.full((B, H), 8, dtype=torch.int32))
    qg = q.requires_grad_(True)
    out = dsv_ext.sparse_attention(qg, k, v, idx, cnt, G)
    assert torch.isnan(out[0, 3]).all() and torch.isfinite(torch.cat([out[0, :3], out[0, 4:]])).all()
    (dq,) = torch.autograd.grad(out.sum(), (qg,))
    assert torch.isnan(dq[0, 3]).all()
