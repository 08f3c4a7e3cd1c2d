"""CPU tests of topk_estimate against torch.topk on the same low-rank group scores."""
import pytest
import torch

import dsv_ext
from dsv_ext.reference import make_qkv, topk_ref, topk_scores_ref

from conftest import poison


def _check_lists(got, q_lr, k_lr, cnt, G, kmax, exact=True):
    """Structure (sorted ascending, distinct, in range, -1 padding) and content: the kept keys'
    scores equal the top-K scores (as multisets, within 1e-12 relative: both sides compute the
    scores in float64 from the same input values, so only summation order differs; this allows
    exact ties to go either way). With `exact`, also the identical lists of torch.topk."""
    B, S, H, _ = q_lr.shape
    NG = -(-S // G)
    assert got.dtype == torch.int32 and got.shape == (B, H, NG, kmax) and got.is_contiguous()
    scores = topk_scores_ref(q_lr, k_lr, G)  # [B, H, NG, S] float64
    for b in range(B):
        for h in range(H):
            K = min(max(int(cnt[b, h]), 0), kmax, S)
            lists = got[b, h].to(torch.int64)
            assert torch.all(lists[:, K:] == -1), "padding after the count must be -1"
            if K == 0:
                continue
            kept = lists[:, :K]
            assert torch.all((kept >= 0) & (kept < S)), "kept positions out of range"
            assert torch.all(kept[:, 1:] > kept[:, :-1]), "lists must be strictly ascending"
            best = torch.topk(scores[b, h], K, dim=-1).values
            mine = torch.gather(scores[b, h], 1, kept).sort(dim=-1, descending=True).values
            torch.testing.assert_close(mine, best, atol=1e-12 * best.abs().max().item(),
                                       rtol=1e-12)
    if exact:
        assert torch.equal(got, topk_ref(q_lr, k_lr, cnt, G, kmax))


# (B, S, H, r, G, kmax)
SHAPES = [
    (2, 45, 3, 16, 8, 12),
    (1, 100, 2, 16, 32, 100),   # kmax = S
    (2, 61, 2, 8, 7, 30),
    (3, 20, 1, 4, 64, 5),       # one partial group
]


@pytest.mark.parametrize("layout", ["packed", "bhsd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_H{}_r{}_G{}_K{}".format(*s))
def test_matches_torch_topk(shape, dtype, layout, gen):
    B, S, H, R, G, KM = shape
    q_lr, k_lr = make_qkv(B, S, H, R, dtype, layout=layout, generator=gen, n=2)
    cnt = torch.randint(0, KM + 1, (B, H), generator=gen).to(torch.int32)
    cnt.view(-1)[0] = KM  # the full length at least once
    poison()
    got = dsv_ext.topk_estimate(q_lr, k_lr, cnt, G, kmax=KM)
    # random continuous inputs: no ties, so the lists must be torch.topk's exactly
    _check_lists(got, q_lr, k_lr, cnt, G, KM, exact=True)


def test_default_kmax_is_max_count(gen):
    q_lr, k_lr = make_qkv(2, 33, 2, 16, torch.float32, generator=gen, n=2)
    cnt = torch.tensor([[3, 9], [0, 5]], dtype=torch.int32)
    got = dsv_ext.topk_estimate(q_lr, k_lr, cnt, 4)
    assert got.shape == (2, 2, 9, 9)
    _check_lists(got, q_lr, k_lr, cnt, 4, 9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype, gen):
    """Half inputs are widened exactly to float32, so the scores are those of the float64
    reference on the same (rounded) values; low-precision inputs make ties possible, hence the
    multiset comparison."""
    q_lr, k_lr = make_qkv(2, 50, 2, 16, dtype, layout="packed", generator=gen, n=2)
    cnt = torch.tensor([[10, 3], [7, 10]], dtype=torch.int32)
    got = dsv_ext.topk_estimate(q_lr, k_lr, cnt, 8, kmax=10)
    _check_lists(got, q_lr, k_lr, cnt, 8, 10, exact=False)


def test_ties_go_to_lower_position(gen):
    """Integer scores with many exact ties: the kept keys are the first K of a stable
    descending sort (equal scores -> lower position first)."""
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


def test_raw_op_clamps_counts(gen):
    """The raw kernel clamps counts to [0, kmax] (and never keeps more than S keys)."""
    q_lr, k_lr = make_qkv(1, 12, 2, 4, torch.float64, generator=gen, n=2)
    cnt = torch.tensor([[-4, 50]], dtype=torch.int32)
    got = torch.ops.dsv.topk_estimate(q_lr, k_lr, cnt, 3, 12)
    assert torch.all(got[0, 0] == -1)
    assert torch.equal(got[0, 1], torch.arange(12, dtype=torch.int32).expand(4, 12))
