"""CPU tests of the row gather / scatter-add helpers (the sparse all-to-all building blocks)."""
import pytest
import torch

import dsv_ext
from dsv_ext.reference import gather_rows_ref, scatter_add_rows_ref

from conftest import assert_close, poison

ALL = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _table(n, d, dtype, gen, strided):
    """A [n, d] table; strided: rows of a wider table (row stride > d, last dim contiguous)."""
    base = torch.randn(n, d + (7 if strided else 0), generator=gen, dtype=torch.float64)
    return base.to(dtype)[:, 3:3 + d] if strided else base.to(dtype)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", ALL)
def test_gather(dtype, strided, gen):
    src = _table(50, 96, dtype, gen, strided)
    index = torch.randint(0, 50, (77,), generator=gen)  # repeats included
    poison()
    got = dsv_ext.gather_rows(src, index)
    assert got.dtype == dtype and got.shape == (77, 96) and got.is_contiguous()
    assert torch.equal(got, gather_rows_ref(src, index))  # a copy: bit-exact


def test_gather_raw_zero_fills_out_of_range(gen):
    src = _table(10, 16, torch.float32, gen, True)
    index = torch.tensor([0, -1, 9, 10, 1000, 3])
    got = torch.ops.dsv.gather_rows(src, index)
    assert torch.equal(got, gather_rows_ref(src, index))
    assert torch.all(got[[1, 3, 4]] == 0)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", ALL)
def test_scatter_add(dtype, strided, gen):
    src = _table(300, 80, dtype, gen, strided)
    index = torch.randint(0, 40, (300,), generator=gen)  # many duplicates
    poison()
    got = dsv_ext.scatter_add_rows(src, index, 45)
    assert got.dtype == dtype and got.shape == (45, 80)
    want = scatter_add_rows_ref(src, index, 45)
    # float32 / float64 accumulate natively (~10 adds per row); half types accumulate in
    # float32 and round once to the output dtype
    assert_close(got, want, dtype, "scatter_add")
    assert torch.all(got[40:] == 0)  # rows never indexed stay zero


def test_scatter_add_large_parallel(gen):
    """Big enough for the OpenMP path (count * dim > 65536), duplicates across threads."""
    src = _table(3000, 130, torch.float32, gen, False)
    index = torch.randint(0, 64, (3000,), generator=gen)
    got = dsv_ext.scatter_add_rows(src, index, 64)
    # ~47 float32 adds per element of O(1) values: error well under 2e-5 * sqrt(47) relative
    torch.testing.assert_close(got.double(), scatter_add_rows_ref(src, index, 64),
                               atol=1e-4, rtol=1e-4)


def test_scatter_add_raw_skips_out_of_range(gen):
    src = _table(6, 8, torch.float64, gen, False)
    index = torch.tensor([0, -1, 2, 5, 99, 0])
    got = torch.ops.dsv.scatter_add_rows(src, index, 5)
    assert_close(got, scatter_add_rows_ref(src, index, 5), torch.float64, "scatter_add")


def test_gradients_are_each_other(gen):
    src = _table(12, 5, torch.float64, gen, True).requires_grad_(True)
    index = torch.tensor([3, 3, 0, 11, 7])
    assert torch.autograd.gradcheck(lambda s: dsv_ext.gather_rows(s, index), (src,))
    rows = _table(5, 5, torch.float64, gen, False).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: dsv_ext.scatter_add_rows(s, index, 12), (rows,))
