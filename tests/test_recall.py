"""Recall versus K (dsv_ext.recall) and the recall-targeted per-head K rule of the controller."""
import json
import math

import pytest
import torch

from dsv_ext import ops
from dsv_ext import reference as ref
from dsv_ext.modules.attention import SparseAttention
from dsv_ext.config import DSVConfig
from dsv_ext.control.controller import DSVController
from dsv_ext.recall import density_for_recall, k_for_recall, recall_curve


def curve_ref(q, k, wq, wk, rows, G, km, scale=None):
    """float64 brute force: per (b, h) mean over rows of the exact mass of the top-K keys ranked
    by the group-mean low-rank score, at K = km, 2 km, ... (capped at S)."""
    B, S, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q64, k64 = q.double(), k.double()
    q_lr = torch.einsum("bshd,hdr->bshr", q64, wq.double())
    k_lr = torch.einsum("bshd,hdr->bshr", k64, wk.double())
    scores = ref.topk_scores_ref(q_lr, k_lr, G)                       # [B, H, NG, S]
    nb = -(-S // km)
    out = torch.zeros(B, H, nb, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for r in rows.tolist():
                p = torch.softmax(scale * k64[b, :, h] @ q64[b, r, h], 0)
                order = scores[b, h, r // G].argsort(descending=True)
                cum = p[order].cumsum(0)
                for i in range(nb):
                    out[b, h, i] += cum[min((i + 1) * km, S) - 1]
    return out / rows.numel()


@pytest.mark.parametrize("S,G,km", [(76, 8, 16), (64, 4, 8)])
def test_recall_curve_matches_float64_reference(S, G, km):
    g = torch.Generator().manual_seed(S)
    B, H, D, r = 2, 3, 8, 4
    q, k = ref.make_qkv(B, S, H, D, generator=g, scale=1.5, n=2)
    wq = torch.randn(H, D, r, generator=g)
    wk = torch.randn(H, D, r, generator=g)
    rows = torch.arange(1, S, 3)
    want = curve_ref(q, k, wq, wk, rows, G, km)
    got = recall_curve(q, k, wq, wk, rows, G, km)
    assert got.shape == (B, H, -(-S // km)) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)  # float32 sums of <= S terms
    assert torch.all(got[..., 1:] >= got[..., :-1] - 1e-6)
    torch.testing.assert_close(got[..., -1], torch.ones(B, H), rtol=0, atol=1e-5)
    # chunking over rows (a tiny memory budget) gives the same numbers
    torch.testing.assert_close(recall_curve(q, k, wq, wk, rows, G, km, chunk_bytes=1), got, rtol=0, atol=1e-6)
    # max_rows subsamples evenly
    sub = recall_curve(q, k, wq, wk, rows, G, km, max_rows=5)
    torch.testing.assert_close(sub.double(), curve_ref(q, k, wq, wk, rows[::math.ceil(rows.numel() / 5)], G, km),
                               rtol=0, atol=2e-5)


def test_recall_curve_bad_input():
    q, k = ref.make_qkv(1, 16, 2, 4, n=2)
    w = torch.zeros(2, 4, 2)
    with pytest.raises(ValueError, match="^rows"):
        recall_curve(q, k, w, w, torch.tensor([16]), 4, 4)
    with pytest.raises(ValueError, match="^wq"):
        recall_curve(q, k, torch.zeros(3, 4, 2), w, torch.tensor([0]), 4, 4)
    with pytest.raises(ValueError, match="^group_size"):
        recall_curve(q, k, w, w, torch.tensor([0]), 0, 4)
    with pytest.raises(TypeError, match="^q"):
        recall_curve(None, k, w, w, torch.tensor([0]), 4, 4)
    with pytest.raises(ValueError, match="^recall_target"):
        DSVConfig(recall_target=0.0)
    with pytest.raises(ValueError, match="^k_rule"):
        DSVConfig(k_rule="mass")


def test_k_for_recall():
    assert k_for_recall([0.5, 0.9, 0.96, 1.0], 0.95, 60, 16) == 48
    assert k_for_recall([0.5, 0.9, 0.96, 1.0], 0.99, 60, 16) == 60  # capped at S
    assert k_for_recall([0.5, 0.9], 1.5, 32, 16) == 32
    assert density_for_recall(torch.tensor([0.96, 1.0]), 0.95, 64, 32) == 0.5


# ------------------------------------------------------------------------------------------------
# synthetic attention with a known answer: queries identical within each query group and an exact
# predictor (rank = head dim, identity projections), so the predicted lists are the exact top-K
# of every row; head 0 is peaked, head 1 uniform (q = 0: every key has mass 1/S)

S_K, G_K, KM, D_K, H_K = 256, 8, 16, 16, 2


def known_qk(seed=0, uniform=(1,)):
    g = torch.Generator().manual_seed(seed)
    qg = torch.randn(1, S_K // G_K, H_K, D_K, generator=g, dtype=torch.float64) * 2.0
    q = qg.repeat_interleave(G_K, dim=1)
    for h in uniform:
        q[:, :, h] = 0.0
    k = torch.randn(1, S_K, H_K, D_K, generator=g, dtype=torch.float64)
    return q.float(), k.float()


def needed_k(q, k, h, target):
    """float64 answer: smallest multiple of KM whose exact top-K mass, averaged over all rows,
    reaches target."""
    P = torch.softmax(q[0, :, h].double() @ k[0, :, h].double().T / math.sqrt(D_K), -1)
    cum = P.sort(-1, descending=True).values.cumsum(-1).mean(0)
    for K in range(KM, S_K + 1, KM):
        if cum[K - 1] >= target:
            return K, float(cum[K - 1])
    return S_K, 1.0


class Fixed(torch.nn.Module):
    def __init__(self, cfg, q, k):
        super().__init__()
        self.core = SparseAttention(H_K, D_K, config=cfg)
        with torch.no_grad():
            eye = torch.eye(D_K).expand(H_K, D_K, D_K)
            self.core.predictor.wq.copy_(eye)
            self.core.predictor.wk.copy_(eye)
        self.q, self.k = q, k
        self.v = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))

    def forward(self):
        return self.core(self.q, self.k, self.v)


def _kcfg(**kw):
    base = dict(rank=D_K, group_size=G_K, k_multiple=KM, min_density=0.0, row_sample_stride=4,
                profile_every=1, predictor_lr=0.0, finetune_lr=0.0, use_calibration=False,
                dispatch_threshold=0.0, force_stage2_step=2, switch_loss=0.0, recall_target=0.9)
    base.update(kw)
    return DSVConfig(**base)


def test_k_rule_meets_the_target_on_known_attention():
    q, k = known_qk()
    target = 0.9
    K0, c0 = needed_k(q, k, 0, target)
    assert KM <= K0 <= S_K // 2  # the peaked head needs few keys: a meaningful check
    # the curve reproduces the answer (all rows of a group are identical, so the sampled rows
    # average like all rows)
    eye = torch.eye(D_K).expand(H_K, D_K, D_K)
    curve = recall_curve(q, k, eye, eye, torch.arange(0, S_K, 4), G_K, KM).mean(0)
    assert k_for_recall(curve[0], target, S_K, KM) == K0
    assert abs(float(curve[0, K0 // KM - 1]) - c0) < 1e-5
    assert k_for_recall(curve[1], target, S_K, KM) == S_K * 15 // 16  # uniform: K/S >= 0.9 at 240/256
    # the real kernels at that K: the predicted index reaches the target on the sampled rows
    q_lr, k_lr = q.contiguous(), k.contiguous()
    counts = torch.tensor([[K0, S_K]], dtype=torch.int32)
    index = ops.topk_estimate(q_lr, k_lr, counts, G_K, S_K)
    rec = ops.profile_attention(q, k, torch.arange(0, S_K, 4, dtype=torch.int32), 0.9, index, counts, G_K).recall
    assert float(rec[0, 0]) >= target and abs(float(rec[0, 0]) - c0) < 1e-4

    # the controller: per-head K from the measurement; the uniform head (needs 0.94 > 0.5 of the
    # keys) attends to all keys; the block runs sparse (a head below target stays dense)
    model = Fixed(_kcfg(recall_target=target), q, k)
    ctl = DSVController(model)
    for _ in range(3):
        model()
        ctl.step()
    assert ctl.stage == 2
    core = model.core
    assert core.head_k == [K0, S_K] and core.kv_count.tolist() == [K0, S_K]
    assert ctl.head_density(0) == [K0 / S_K, 1.0]
    assert ctl.recall_density[0][0] == K0 / S_K and ctl.recall_density[0][1] > 0.5
    assert ctl.recall[0][0] >= target - 1e-6 and ctl.recall[0][1] >= 1.0 - 1e-5  # measured, real index
    assert core.use_sparse
    bs = ctl.block_stats()[0]
    assert bs["head_density"] == [K0 / S_K, 1.0] and bs["head_k"] == [K0, S_K]
    # the sparse output: exact for the uniform head (all keys), close for the peaked one
    out = model()
    dense = ref.dense_attention_ref(q, k, model.v)
    torch.testing.assert_close(out[:, :, 1].double(), dense[:, :, 1], rtol=0, atol=1e-5)
    # a higher target needs more keys; the theta rule ignores the measurement
    model2 = Fixed(_kcfg(recall_target=0.99, recall_max_density=1.0), q, k)
    ctl2 = DSVController(model2)
    for _ in range(3):
        model2()
        ctl2.step()
    assert model2.core.head_k[0] == needed_k(q, k, 0, 0.99)[0] > K0
    model3 = Fixed(_kcfg(k_rule="theta"), q, k)
    ctl3 = DSVController(model3)
    for _ in range(3):
        model3()
        ctl3.step()
    assert ctl3.recall_density == [None]
    assert model3.core.head_k == [DSVConfig(k_multiple=KM, min_density=0.0).head_k(s, S_K)
                                  for s in ctl3.sparsity_ema[0]]
    # state_dict round trip keeps the recall densities
    ctl4 = DSVController(Fixed(_kcfg(recall_target=target), q, k))
    ctl4.load_state_dict(ctl.state_dict())
    assert ctl4.recall_density == ctl.recall_density and ctl4.modules[0][1].head_k == [K0, S_K]


def test_heads_below_target_stay_dense():
    # both heads uniform: no K below S * target reaches it, so both attend to all keys and the
    # block stays dense even though the dispatcher's threshold (0) would take any sparsity
    q, k = known_qk(uniform=(0, 1))
    model = Fixed(_kcfg(), q, k)
    ctl = DSVController(model)
    for _ in range(3):
        model()
        ctl.step()
    assert ctl.stage == 2 and ctl.head_density(0) == [1.0, 1.0]
    assert not model.core.use_sparse and ctl.summary()["dsv/sparse_blocks"] == 0
    # a predictor that ranks keys backwards: the peaked head cannot reach the target within
    # recall_max_density and goes dense at the next profile
    q, k = known_qk()
    model = Fixed(_kcfg(), q, k)
    ctl = DSVController(model)
    for _ in range(3):
        model()
        ctl.step()
    assert model.core.use_sparse and model.core.head_k[0] < S_K
    with torch.no_grad():
        model.core.predictor.wk.neg_()
    model()
    ctl.step()
    assert ctl.head_density(0) == [1.0, 1.0] and not model.core.use_sparse


def test_measured_miss_doubles_the_density():
    q, k = known_qk()
    model = Fixed(_kcfg(), q, k)
    ctl = DSVController(model)
    model()
    ctl.step()
    d0 = ctl.recall_density[0][0]
    assert 0 < d0 <= 0.5
    # the next profile's curve says the same density, but the index measured at that K missed
    curve = recall_curve(q, k, model.core.predictor.wq, model.core.predictor.wk,
                         torch.arange(0, S_K, 4), G_K, KM).mean(0)
    ctl._update_recall_density([curve], {0: [0.9 - 0.021 - 0.01, 1.0]})
    assert ctl.recall_density[0][0] == pytest.approx(2 * d0)
    # within the tolerance: unchanged
    curve = recall_curve(q, k, model.core.predictor.wq, model.core.predictor.wk,
                         torch.arange(0, S_K, 4), G_K, KM).mean(0)
    ctl._update_recall_density([curve], {0: [0.9 - 0.019, 1.0]})
    assert ctl.recall_density[0][0] == pytest.approx(0.9 * 2 * d0 + 0.1 * d0)  # falls with the EMA


def test_dispatcher_weighs_the_recall_rules_density():
    from dsv_ext.control.dispatch import Dispatcher

    d = Dispatcher(DSVConfig(use_calibration=False, dispatch_threshold=0.8))
    # theta rule: the sparsity decides; recall rule: the K's the block runs with
    assert not d.decide([0.5, 0.5], 1024, 2, 64, "cpu")
    assert d.decide([0.5, 0.5], 1024, 2, 64, "cpu", density=[0.1, 0.2])
    assert not d.decide([0.95, 0.95], 1024, 2, 64, "cpu", density=[0.1, 1.0])
    assert d.plan([dict(sparsity=[0.5, 0.5], seq_len=1024, heads=2, head_dim=64, kmax=128, density=[0.1, 0.2])],
                  "cpu") == [True]


@pytest.mark.skipif(not torch.cuda.is_available() or not ops.has_cuda_kernels(),
                    reason="needs a GPU and the CUDA kernels")
def test_recall_curve_and_k_rule_on_cuda_bf16():
    """bf16 on the GPU (what the training forward hands the profiler): the curve matches the
    float64 reference of the bf16-rounded inputs to within the ranking changes bf16 scores make
    (atol 1e-2), and the CUDA index at the recall rule's K reaches the target to within 1e-2."""
    g = torch.Generator().manual_seed(3)
    B, S, H, D, r, G, km = 2, 1024, 4, 64, 16, 32, 64
    q, k = ref.make_qkv(B, S, H, D, generator=g, scale=1.5, n=2)
    wq = torch.randn(H, D, r, generator=g) * 0.3
    wk = wq + 0.05 * torch.randn(H, D, r, generator=g)
    qb, kb = q.to(torch.bfloat16), k.to(torch.bfloat16)
    rows = torch.arange(2, S, 16)
    want = curve_ref(qb.float(), kb.float(), wq, wk, rows, G, km)
    got = recall_curve(qb.cuda(), kb.cuda(), wq.cuda(), wk.cuda(), rows.cuda(), G, km)
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=1e-2)
    target = 0.9
    c = got.mean(0).cpu()
    ks = [k_for_recall(c[h], target, S, km) for h in range(H)]
    counts = torch.tensor([ks] * B, dtype=torch.int32, device="cuda")
    q_lr = torch.einsum("bshd,hdr->bshr", qb.cuda(), wq.cuda().to(torch.bfloat16)).contiguous()
    k_lr = torch.einsum("bshd,hdr->bshr", kb.cuda(), wk.cuda().to(torch.bfloat16)).contiguous()
    index = ops.topk_estimate(q_lr, k_lr, counts, G, max(ks))
    rec = ops.profile_attention(qb.cuda(), kb.cuda(), rows.cuda().int(), 0.9, index, counts, G).recall
    assert float(rec.mean(0).min()) >= target - 1e-2, (ks, rec)


class TwoBlocks(torch.nn.Module):
    """Two recall-rule blocks on the same attention (the controller's blocks 0 and 1)."""

    def __init__(self, cfg, q, k):
        super().__init__()
        self.a, self.b = Fixed(cfg, q, k), Fixed(cfg, q, k)

    def forward(self):
        return self.a() + self.b()


def test_block_recall_targets_raise_one_blocks_target():
    q, k = known_qk()
    K90, K99 = needed_k(q, k, 0, 0.9)[0], needed_k(q, k, 0, 0.99)[0]
    assert K99 > K90
    cfg = _kcfg(recall_target=0.9, recall_max_density=1.0, block_recall_targets={1: 0.99})
    assert cfg.recall_target_of(0) == 0.9 and cfg.recall_target_of(1) == 0.99
    model = TwoBlocks(cfg, q, k)
    ctl = DSVController(model)
    for _ in range(3):
        model()
        ctl.step()
    assert ctl.stage == 2
    assert model.a.core.head_k[0] == K90 and model.b.core.head_k[0] == K99
    # the measured recall of each block's index is held against that block's own target
    assert ctl.recall[0][0] >= 0.9 - 1e-6 and ctl.recall[1][0] >= 0.99 - 1e-6


def test_block_recall_targets_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^block_recall_targets: block 2: expected a value in \(0, 1\]"):
        DSVConfig(block_recall_targets={2: 1.5})
    with pytest.raises(ValueError, match="^block_recall_targets: expected block indices"):
        DSVConfig(block_recall_targets={-1: 0.9})
    with pytest.raises(ValueError, match="^block_recall_targets: expected block indices"):
        DSVConfig(block_recall_targets={True: 0.9})
    with pytest.raises(ValueError, match="^block_recall_targets: expected a mapping"):
        DSVConfig(block_recall_targets=[0.9])
    with pytest.raises(ValueError, match="^block_recall_targets: block 0: expected a value"):
        DSVConfig(block_recall_targets={0: "high"})
    # keys written back as strings (a JSON round trip) are block indices again
    cfg = DSVConfig.from_dict(json.loads(json.dumps(DSVConfig(block_recall_targets={3: 0.98}).to_dict())))
    assert cfg.block_recall_targets == {3: 0.98} and cfg.recall_target_of(3) == 0.98
    q, k = known_qk()
    with pytest.raises(ValueError, match="^config: block_recall_targets names block 5, but the model has 1"):
        DSVController(Fixed(_kcfg(block_recall_targets={5: 0.99}), q, k))
