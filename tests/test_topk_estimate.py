"""topk_estimate on every device against the top-K of the float64 group-mean low-rank scores
(dsv_ext.reference; the selection check and its tolerance: helpers.check_topk).

Each test runs on "cpu" and "cuda" (skipped without a GPU): the CPU kernels in float32 / float64
(there the lists must be torch.topk's exactly: random continuous inputs have no ties), the CUDA
kernel in bfloat16 / float16. GPU-only cases (a long sequence, agreement with the CPU kernel) are
in test_topk_estimate_cuda.py. There is no PyTorch counterpart of a selection in the input
dtype, so the tolerance rule of tests/helpers.py does not apply: the bound is TOPK_TOL.
"""
import pytest
import torch

from helpers import (DEVICES, check_topk, device_cases, device_dtypes, lowrank, make_qkv,
                     import_dsv_ext, need_backend, need_ops, topk_estimate)

dsv_ext = import_dsv_ext()

DTYPES = {"cpu": [torch.float32, torch.float64], "cuda": [torch.bfloat16, torch.float16]}

# (B, S, H, r, G, counts, kmax, layout); counts None: random in [0, kmax] with kmax once
CASES = {
    "cpu": [(2, 45, 3, 16, 8, None, 12, "packed"),
            (2, 45, 3, 16, 8, None, 12, "bhsd"),
            (1, 100, 2, 16, 32, None, 100, "packed"),   # kmax = S
            (1, 100, 2, 16, 32, None, 100, "bhsd"),
            (2, 61, 2, 8, 7, None, 30, "packed"),
            (2, 61, 2, 8, 7, None, 30, "bhsd"),
            (3, 20, 1, 4, 64, None, 5, "packed"),       # one partial group
            (3, 20, 1, 4, 64, None, 5, "bhsd")],
    "cuda": [(1, 1000, 2, 16, 64, [100, 1000], 1000, "contiguous"),  # K = S, partial group
             (1, 777, 2, 16, 32, [64, 0], 80, "bhsd"),               # K = 0 head, strided
             (1, 530, 1, 8, 128, [200], 256, "padded"),              # rank 8, unaligned rows
             (1, 300, 2, 40, 64, [500, 77], 400, "contiguous"),      # count > S (clamped)
             (1, 256, 1, 64, 64, [64], 64, "padded"),                # rank 64
             (1, 4100, 2, 16, 64, [820, 410], 900, "contiguous")],   # K = 20% / 10% of S
}


def _case_id(c):
    B, S, H, r, G, counts, kmax, layout = c
    return f"B{B}_S{S}_H{H}_r{r}_G{G}_k{kmax / S:.2g}_{layout}"


@pytest.mark.parametrize("device,dtype,case", device_cases(
    {dev: (DTYPES[dev], CASES[dev]) for dev in DTYPES}, _case_id))
def test_matches_reference(device, dtype, case, gen):
    b = need_backend(device)
    B, S, H, r, G, counts, KM, layout = case
    if b == "ops":
        KM = min(KM, S)  # the registration rejects kmax > S; the raw kernel clamps
    q_lr, k_lr = lowrank(B, S, H, r, dtype, gen, layout, device)
    if counts is None:
        cnt = torch.randint(0, KM + 1, (B, H), generator=gen).to(torch.int32)
        cnt.view(-1)[0] = KM  # the full length at least once
    else:
        cnt = torch.tensor([counts], dtype=torch.int32)
    cnt = cnt.to(device)
    got = topk_estimate(q_lr, k_lr, cnt, G, KM)
    # random continuous inputs: no ties, so the CPU lists must be torch.topk's exactly
    check_topk(got, q_lr, k_lr, cnt, G, KM, exact="torch" if device == "cpu" else None)
    if device == "cpu":
        # the public op gives the raw op's lists
        assert torch.equal(dsv_ext.topk_estimate(q_lr, k_lr, cnt, G, kmax=KM), got)


@pytest.mark.parametrize("device,dtype", device_dtypes(DTYPES))
def test_default_kmax_is_max_count(device, dtype, gen):
    need_backend(device)
    need_ops(device)
    q_lr, k_lr = make_qkv(2, 33, 2, 16, dtype, generator=gen, n=2, device=device)
    cnt = torch.tensor([[3, 9], [0, 5]], dtype=torch.int32, device=device)
    got = dsv_ext.topk_estimate(q_lr, k_lr, cnt, 4)
    assert got.shape == (2, 2, 9, 9)
    check_topk(got, q_lr, k_lr, cnt, 4, 9, exact="torch" if device == "cpu" else None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype, gen):
    """Half inputs on the CPU are widened exactly, so the scores are those of the float64
    reference on the same (rounded) values; low-precision inputs make ties possible, hence no
    exact comparison with torch.topk."""
    need_backend("cpu")
    q_lr, k_lr = make_qkv(2, 50, 2, 16, dtype, layout="packed", generator=gen, n=2)
    cnt = torch.tensor([[10, 3], [7, 10]], dtype=torch.int32)
    got = dsv_ext.topk_estimate(q_lr, k_lr, cnt, 8, kmax=10)
    check_topk(got, q_lr, k_lr, cnt, 8, 10)


def test_ties_go_to_lower_position(gen):
    """Integer scores with many exact ties (rank 1): the kept keys are the first K of a stable
    descending sort (equal scores -> lower position first)."""
    need_backend("cpu")
    B, S, H, G, KM = 2, 40, 2, 5, 7
    q_lr = torch.ones(B, S, H, 1, dtype=torch.float64)
    k_lr = torch.randint(0, 4, (B, S, H, 1), generator=gen).to(torch.float64)
    cnt = torch.tensor([[7, 3], [1, 6]], dtype=torch.int32)
    got = dsv_ext.topk_estimate(q_lr, k_lr, cnt, G, kmax=KM)
    for b in range(B):
        for h in range(H):
            K = int(cnt[b, h])
            order = torch.sort(k_lr[b, :, h, 0], descending=True, stable=True).indices
            want = order[:K].sort().values.to(torch.int32)
            for g in range(-(-S // G)):
                assert torch.equal(got[b, h, g, :K], want)
                assert torch.all(got[b, h, g, K:] == -1)
    check_topk(got, q_lr, k_lr, cnt, G, KM, exact="stable")


@pytest.mark.parametrize("device,dtype", device_dtypes(DTYPES))
def test_ties_exact(device, dtype, gen):
    """Small-integer inputs: exact scores with many ties; the list must be the stable top-K."""
    need_backend(device)
    B, S, H, r, G = 2, 700, 2, 16, 64
    q = torch.randint(-2, 3, (B, S, H, r), generator=gen).to(dtype).to(device)
    k = torch.randint(-1, 2, (B, S, H, r), generator=gen).to(dtype).to(device)
    # the means of full groups (sum / 64) are exact; the partial last group (60 rows) would not
    # be, so its queries are zero: every score 0, a full tie, the list is the first K positions
    q[:, 640:] = 0
    cnt = torch.tensor([[70, 333], [1, 699]], dtype=torch.int32, device=device)
    out = topk_estimate(q, k, cnt, G, 400)
    check_topk(out, q, k, cnt, G, 400, exact="stable")


RAW = {"cpu": (torch.float64, 4), "cuda": (torch.bfloat16, 16)}


@pytest.mark.parametrize("device", DEVICES)
def test_raw_op_clamps_counts(device, gen):
    """The raw kernel clamps counts to [0, kmax] (and never keeps more than S keys)."""
    need_backend(device)
    dtype, r = RAW[device]
    q_lr, k_lr = make_qkv(1, 12, 2, r, dtype, generator=gen, n=2, device=device)
    cnt = torch.tensor([[-4, 50]], dtype=torch.int32, device=device)
    got = topk_estimate(q_lr, k_lr, cnt, 3, 12).cpu()
    assert torch.all(got[0, 0] == -1)
    assert torch.equal(got[0, 1], torch.arange(12, dtype=torch.int32).expand(4, 12))
