"""Row gather / scatter-add (the sparse all-to-all building blocks) on every device against
dsv_ext.reference, every dtype.

gather is a copy: bit-identical to the reference on both devices (rows out of range: zeros).
scatter-add accumulates in float32 (float64 for float64 input) and rounds once to src's dtype
(the CUDA kernel with atomics, in varying order). It meets the tolerance rule of
tests/helpers.py (the counterpart: index_add_ in the same accumulator type, rounded to src's
dtype) and beside it the derived bounds: CPU TOL of the dtype (float32 / float64 accumulate
natively over ~10 adds per row; half types accumulate in float32 and round once); CUDA: each
output element sums at most n inputs of magnitude <= m, error <= n * 2^-24 * n * m in fp32,
then one rounding to the src dtype: the dtype's half-ulp relative plus 1e-5 * max|ref| absolute
(float64: 1e-12 (1 + max|ref|)).
"""
import pytest
import torch

from helpers import (DEVICES, UNIT_ROUNDOFF, acc_dtype, assert_close, assert_pt_bound,
                     device_cases, gather_rows, gather_rows_ref, import_dsv_ext, need_backend,
                     scatter_add_rows, scatter_add_rows_pt, scatter_add_rows_ref)

dsv_ext = import_dsv_ext()

ALL = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def table(n, d, dtype, gen, pad, device="cpu"):
    """A [n, d] table; pad > 0: rows of a wider table (row stride d + pad, last dim contiguous,
    starting at column pad // 2)."""
    base = torch.randn(n, d + pad, generator=gen, dtype=torch.float64).to(device=device,
                                                                           dtype=dtype)
    return base[:, pad // 2:pad // 2 + d] if pad else base


# (N rows in src, D, M gathered rows, pad)
GATHER = {"cpu": [(50, 96, 77, 0), (50, 96, 77, 7)],
          "cuda": [(50, 128, 70, 0), (33, 7, 40, 3), (9, 1, 20, 5), (1000, 130, 3000, 2),
                   (64, 256, 1, 0)]}


@pytest.mark.parametrize("device,dtype,case", device_cases(
    {dev: (ALL, GATHER[dev]) for dev in GATHER}, lambda c: "N{}_D{}_M{}_pad{}".format(*c)))
def test_gather(device, dtype, case, gen):
    need_backend(device)
    N, D, M, pad = case
    src = table(N, D, dtype, gen, pad, device)
    index = torch.randint(0, N, (M,), generator=gen)  # repeats included
    if device == "cpu":
        got = dsv_ext.gather_rows(src, index)
        assert got.dtype == dtype and got.shape == (M, D) and got.is_contiguous()
        assert torch.equal(got, gather_rows_ref(src, index))  # a copy: bit-exact
    # the raw kernel zero-fills rows out of range
    index[::7] = torch.randint(-5, 0, index[::7].shape, generator=gen)
    index[3::11] = N + 2
    index = index.to(device)
    out = gather_rows(src, index)
    assert out.shape == (M, D) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, gather_rows_ref(src, index)), "gather differs"


def test_gather_raw_zero_fills_out_of_range(gen):
    need_backend("cpu")
    src = table(10, 16, torch.float32, gen, 7)
    index = torch.tensor([0, -1, 9, 10, 1000, 3])
    got = gather_rows(src, index)
    assert torch.equal(got, gather_rows_ref(src, index))
    assert torch.all(got[[1, 3, 4]] == 0)


# (M src rows, D, num_rows, pad, highest index + 1)
SCATTER = {"cpu": [(300, 80, 45, 0, 40), (300, 80, 45, 7, 40)],
           "cuda": [(100, 64, 30, 0, 30), (77, 5, 10, 3, 10), (500, 1, 7, 1, 7),
                    (2000, 132, 300, 0, 300), (10, 256, 1000, 4, 1000)]}


def check_scatter(device, got, src, index, num_rows):
    dtype = src.dtype
    want = scatter_add_rows_ref(src, index, num_rows).cpu()
    assert got.dtype == dtype and got.shape == (num_rows, src.shape[1])
    pt = scatter_add_rows_pt(src, index, num_rows, acc_dtype(dtype)).to(dtype)
    assert_pt_bound("scatter_add", got, want, pt, dtype)
    if device == "cpu":
        assert_close(got, want, dtype, "scatter_add")
        return
    got = got.double().cpu()
    assert torch.isfinite(got).all()
    big = want.abs().max().item() if want.numel() else 0.0
    if dtype == torch.float64:
        tol = 1e-12 * (big + 1.0)
    else:
        tol = UNIT_ROUNDOFF[dtype] * want.abs() + 1e-5 * (big + 1e-30)
    err = (got - want).abs()
    assert (err <= tol).all(), f"scatter-add: max error {err.max().item():.3e}"


@pytest.mark.parametrize("device,dtype,case", device_cases(
    {dev: (ALL, SCATTER[dev]) for dev in SCATTER}, lambda c: "M{}_D{}_rows{}_pad{}".format(*c)))
def test_scatter_add(device, dtype, case, gen):
    need_backend(device)
    M, D, num_rows, pad, top = case
    src = table(M, D, dtype, gen, pad, device)
    index = torch.randint(0, top, (M,), generator=gen)  # many duplicates
    if device == "cpu":
        got = dsv_ext.scatter_add_rows(src, index, num_rows)
        check_scatter(device, got, src, index, num_rows)
        assert torch.all(got[top:] == 0)  # rows never indexed stay zero
    # the raw kernel skips rows out of range
    index[::5] = -1
    index[2::9] = num_rows
    index = index.to(device)
    got = scatter_add_rows(src, index, num_rows)
    check_scatter(device, got, src, index, num_rows)
    assert torch.all(got[top:] == 0)


def test_scatter_add_large_parallel(gen):
    """Big enough for the OpenMP path (count * dim > 65536), duplicates across threads."""
    need_backend("cpu")
    src = table(3000, 130, torch.float32, gen, 0)
    index = torch.randint(0, 64, (3000,), generator=gen)
    got = dsv_ext.scatter_add_rows(src, index, 64)
    want = scatter_add_rows_ref(src, index, 64)
    assert_pt_bound("scatter_add", got, want, scatter_add_rows_pt(src, index, 64), torch.float32)
    # ~47 float32 adds per element of O(1) values: error well under 2e-5 * sqrt(47) relative
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_scatter_add_raw_skips_out_of_range(gen):
    need_backend("cpu")
    src = table(6, 8, torch.float64, gen, 0)
    index = torch.tensor([0, -1, 2, 5, 99, 0])
    got = scatter_add_rows(src, index, 5)
    assert_close(got, scatter_add_rows_ref(src, index, 5), torch.float64, "scatter_add")


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_are_each_other(device, gen):
    """gather's gradient is a scatter-add and the reverse (float64 gradcheck on the CPU; on CUDA
    each backward against the other op's forward)."""
    need_backend(device)
    if device == "cpu":
        src = table(12, 5, torch.float64, gen, 7).requires_grad_(True)
        index = torch.tensor([3, 3, 0, 11, 7])
        assert torch.autograd.gradcheck(lambda s: dsv_ext.gather_rows(s, index), (src,))
        rows = table(5, 5, torch.float64, gen, 0).requires_grad_(True)
        assert torch.autograd.gradcheck(lambda s: dsv_ext.scatter_add_rows(s, index, 12), (rows,))
        return
    from helpers import need_ops
    need_ops(device)
    src = table(40, 64, torch.float32, gen, 0, device).requires_grad_(True)
    index = torch.randint(0, 40, (70,), generator=gen).to(device)
    g = torch.randn(70, 64, generator=gen).to(device)
    (gs,) = torch.autograd.grad(dsv_ext.gather_rows(src, index), (src,), g)
    torch.testing.assert_close(gs.double().cpu(),
                               scatter_add_rows_ref(g.cpu(), index.cpu(), 40), atol=1e-5,
                               rtol=1e-5)
    rows = table(70, 64, torch.float32, gen, 0, device).requires_grad_(True)
    g2 = torch.randn(40, 64, generator=gen).to(device)
    (gr,) = torch.autograd.grad(dsv_ext.scatter_add_rows(rows, index, 40), (rows,), g2)
    assert torch.equal(gr, gather_rows_ref(g2, index))
