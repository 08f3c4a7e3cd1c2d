"""Key-block lists above the ops: DSVConfig.kv_block, the StepPlan field, SparseAttention with
kv_block 16 / 64 (keys in the queries' cube order, K converted to blocks) and with a granularity
per head against the float64 dense masked reference, the block recall it profiles, the
"auto" choice (dispatcher and controller, on synthetic attention where blocks meet the recall
target and where they do not), and context parallelism (HCP / SCP on 2 spawned gloo ranks)."""
import datetime
import functools
import importlib
import json
import math
import os
import tempfile
import traceback

import pytest
import torch
import torch.multiprocessing as mp

import dsv_ext
from dsv_ext.config import KV_BLOCKS, DSVConfig
from dsv_ext.control.controller import DSVController
from dsv_ext.control.dispatch import BLOCK_COST_RATIO, BLOCK_COST_RATIOS, Dispatcher, block_cost_ratio
from dsv_ext.grouping import cube_permutation
from dsv_ext.modules.attention import SparseAttention
from dsv_ext.modules.contract import StepPlan

from test_kv_block import block_multiplicity, masked_attention

GRID = (3, 5, 6)  # odd grid: partial cubes; S = 90 is a multiple of neither G nor the block size
S, H, D = 90, 3, 16


def _qkv(B=2, seed=0, S=S, H=H, D=D):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, dtype=torch.float64, generator=g).requires_grad_(True) for _ in range(3)]


def _grads(out, ins, seed=1):
    do = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, ins, do)


# ------------------------------------------------------------------------------------------------
# configuration and contract

@pytest.mark.parametrize("good", [1, 16, 64, "auto"])
def test_config_accepts(good, tmp_path):
    c = DSVConfig(kv_block=good)
    assert c.kv_block == good
    p = tmp_path / "c.yaml"
    p.write_text(f"kv_block: {good}\n")
    assert DSVConfig.from_yaml(str(p)).kv_block == good
    assert DSVConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("bad", [0, 2, 32, 128, True, "16", 16.0, None, "Auto"])
def test_config_rejects(bad):
    with pytest.raises(ValueError, match=r"^kv_block: expected one of \[1, 16, 64\] or 'auto'"):
        DSVConfig(kv_block=bad)


def test_config_auto_needs_recall_rule():
    with pytest.raises(ValueError, match=r"^kv_block: 'auto' .* needs k_rule='recall'"):
        DSVConfig(kv_block="auto", k_rule="theta")


def test_step_plan_kv_block():
    assert StepPlan(kv_block=[16, 1, 64]).kv_block == (16, 1, 64)
    for bad in ([], [2], [True], ["16"]):
        with pytest.raises(ValueError, match=r"^kv_block: "):
            StepPlan(kv_block=bad)
    m = SparseAttention(H, D)
    with pytest.raises(ValueError, match=r"^plan: kv_block has 2 values, expected 3"):
        m.plan_step(StepPlan(kv_block=(1, 16)))
    assert m.head_kv_block == (1, 1, 1)
    assert SparseAttention(H, D, config=DSVConfig(kv_block=64)).head_kv_block == (64, 64, 64)
    assert SparseAttention(H, D, config=DSVConfig(kv_block="auto")).head_kv_block == (1, 1, 1)


# ------------------------------------------------------------------------------------------------
# SparseAttention against the dense masked reference

def _module(kv_block, grid=GRID, density=(0.2, 0.45, 0.7), G=8, k_multiple=8):
    cfg = DSVConfig(group_size=G, k_multiple=k_multiple, kv_block=kv_block)
    m = SparseAttention(H, D, grid=grid, config=cfg).double()
    m.stage, m.use_sparse = 2, True
    m.set_density(list(density), S)
    return m


def _reference(m, q, k, v, grid, head_blocks):
    """The module's output from first principles: q, k, v into cube order, per head its
    granularity's lists (ceil(K / b) blocks of the cube-ordered keys, top-K by the library's
    tested topk_estimate), dense masked softmax in float64, back to the original order."""
    B = q.shape[0]
    G = m.config.group_size
    if grid is not None:
        perm, inv = cube_permutation(grid, m.config.cube, S)
    else:
        perm = inv = torch.arange(S)
    qp, kp, vp = (t[:, perm] for t in (q, k, v))
    outs = []
    for h in range(H):
        b, K = head_blocks[h], m.head_k[h]
        c = -(-K // b)
        cnt = torch.full((B, 1), c, dtype=torch.int32)
        q_lr = torch.einsum("bsd,dr->bsr", qp[:, :, h].detach(), m.predictor.wq[h].double())[:, :, None]
        k_lr = torch.einsum("bsd,dr->bsr", kp[:, :, h].detach(), m.predictor.wk[h].double())[:, :, None]
        idx = dsv_ext.topk_estimate(q_lr, k_lr, cnt, G, kmax=c, kv_block=b)
        mult = block_multiplicity(idx, cnt, S, b)
        o, _ = masked_attention(qp[:, :, h:h + 1], kp[:, :, h:h + 1], vp[:, :, h:h + 1], mult, G, 1 / math.sqrt(D))
        outs.append(o)
    return torch.cat(outs, 2)[:, inv]


@pytest.mark.parametrize("grid", [GRID, None], ids=["cube", "raster"])
@pytest.mark.parametrize("b", [16, 64])
def test_module_blocks_match_reference(b, grid):
    m = _module(b, grid)
    # per-head K in keys (density x S rounded up to k_multiple); the lists hold ceil(K / b) blocks
    assert m.head_k == [24, 48, 64] and m.kv_count.tolist() == [24, 48, 64]
    q, k, v = _qkv()
    out = m(q, k, v)
    want = _reference(m, q, k, v, grid, (b,) * H)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for a, r in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, r, rtol=1e-11, atol=1e-11)
    # the test can fail: token lists of the same K give another result
    assert not torch.allclose(_module(1, grid)(q, k, v), out, atol=1e-6)


def test_module_per_head_granularity():
    m = _module("auto")
    m.plan_step(StepPlan(stage=2, mode="sparse", density=m.plan.density, kv_block=(64, 1, 16)))
    assert m.head_kv_block == (64, 1, 16)
    q, k, v = _qkv(seed=3)
    out = m(q, k, v)
    want = _reference(m, q, k, v, GRID, (64, 1, 16))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for a, r in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, r, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("blocks", [(1, 1, 1), (64, 1, 16)], ids=["tokens", "per_head"])
def test_heads_with_all_keys_run_dense(blocks, monkeypatch):
    """A head whose K covers all S keys runs dense attention (dense_core on its heads alone),
    the others their sparse lists; output and gradients equal the float64 reference, where that
    head's full list is exact attention."""
    import dsv_ext.functional.attention as fa
    m = _module("auto" if blocks != (1, 1, 1) else 1, density=(0.2, 1.0, 0.45))
    if blocks != (1, 1, 1):
        m.plan_step(StepPlan(stage=2, mode="sparse", density=m.plan.density, kv_block=blocks))
    assert m.head_k[1] == S and m._head_groups(S)[0] == (0, (1,), S)
    dense_heads = []
    real = fa.dense_core
    monkeypatch.setattr(fa, "dense_core", lambda q, *a, **kw: dense_heads.append(q.shape[2]) or real(q, *a, **kw))
    q, k, v = _qkv(seed=4)
    out = m(q, k, v)
    assert dense_heads == [1]  # one dense call, for head 1 alone
    want = _reference(m, q, k, v, GRID, blocks)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for a, r in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, r, rtol=1e-11, atol=1e-11)
    # every head at K = S: the whole block is one dense call
    m.set_density([1.0, 1.0, 1.0], S)
    dense_heads.clear()
    torch.testing.assert_close(m(q, k, v), _reference(m, q, k, v, GRID, blocks), rtol=1e-12, atol=1e-12)


def test_module_index_reuse_with_blocks():
    m = _module(16).eval()
    m.set_index_refresh(2)
    q, k, v = (t.detach() for t in _qkv(seed=5))
    with torch.no_grad():
        a = m(q, k, v)
        b = m(q, k, v)  # the reused block index
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, _reference(m, q, k, v, GRID, (16,) * H), rtol=1e-12, atol=1e-12)


def test_joint_text_keeps_token_lists():
    """Joint text+video calls keep token lists (the text keys are single keys): with the same
    predictors, exactly the output of kv_block 1."""
    n_text = 6
    q, k, v = _qkv(S=S + n_text, seed=7)
    m1, m16 = _module(1), _module(16)
    m16.predictor.load_state_dict(m1.predictor.state_dict())
    a, b = m1(q, k, v, n_text=n_text), m16(q, k, v, n_text=n_text)
    assert a.shape == q.shape and torch.equal(a, b)


def test_profile_measures_block_recall():
    """A profile step of a block module measures the recall of its block lists (profile_attention
    on the cube-ordered keys), not that of token lists."""
    m = _module(16)
    m.train()
    m.plan_step(StepPlan(stage=2, profile=True, mode="sparse", density=m.plan.density))
    q, k, v = (t.detach() for t in _qkv(B=1, seed=11))
    m(q, k, v)
    st = m.take_stats()
    perm, _ = cube_permutation(GRID, m.config.cube, S)
    qp, kp = q[:, perm], k[:, perm]
    cnt = torch.tensor([[-(-K // 16) for K in m.head_k]], dtype=torch.int32)
    q_lr, k_lr = m.predictor(qp, kp)
    idx = dsv_ext.topk_estimate(q_lr, k_lr, cnt, 8, kmax=int(cnt.max()), kv_block=16)
    rows = m.sampled_rows(S, q.device)
    want = dsv_ext.profile_attention(qp, kp, rows, m.config.theta, idx, cnt, 8, kv_block=16).recall
    torch.testing.assert_close(st.recall, want[0].float(), rtol=1e-6, atol=1e-6)
    tok = dsv_ext.profile_attention(qp, kp, rows, m.config.theta,
                                    dsv_ext.topk_estimate(q_lr, k_lr, m.kv_count.view(1, H), 8, kmax=m.kmax),
                                    m.kv_count.view(1, H), 8).recall
    assert not torch.allclose(st.recall, tok[0].float(), atol=1e-4)
    assert st.block_curves is None  # only "auto" measures every granularity


# ------------------------------------------------------------------------------------------------
# "auto": the dispatcher's choice and the controller

def test_choose_kv_block_without_table(monkeypatch):
    # the rule under fixed per-key cost ratios (the shipped ones are measured, PERF_LOG v14)
    for b, r in ((16, 0.75), (64, 0.5)):
        monkeypatch.setitem(BLOCK_COST_RATIO, b, r)
    d = Dispatcher(DSVConfig(use_calibration=False, recall_max_density=0.5))
    # head 0: every granularity reaches the target at 0.25 -> the cheapest per key (64)
    # head 1: blocks need 0.4 / 0.45 -> 0.45 * 0.5 < 0.4 * 0.75 < 0.3 -> 64
    # head 2: blocks need more than recall_max_density -> tokens
    # head 3: 16 is the cheapest here (0.25 * 0.75 < 0.4 * 0.5 = 0.2)
    # head 4: nothing reaches the target -> 1 (the head attends to all keys)
    dens = [[0.25, 0.3, 0.2, 0.2, 1.0], [0.25, 0.4, 0.9, 0.25, 1.0], [0.25, 0.45, 1.0, 0.4, 1.0]]
    assert d.choose_kv_block(dens, 4096, 5, 128, "cpu") == [64, 64, 1, 16, 1]
    with pytest.raises(ValueError, match=r"^densities: "):
        d.choose_kv_block(dens[:2], 4096, 5, 128, "cpu")


def test_choose_kv_block_with_the_measured_ratios():
    """The shipped per-key cost ratios (H200, 64k, density 0.1; dispatch.BLOCK_COST_RATIOS):
    16-key lists cost more per key than token lists (run expanded on CUDA), 64-key lists 1.12
    of them at G = 128 (whose token lists run the 128-row backward) and 0.85 at G = 64, chosen
    by the config's group size."""
    assert BLOCK_COST_RATIO == {1: 1.0, 16: 1.07, 64: 1.12} == BLOCK_COST_RATIOS[128]
    assert BLOCK_COST_RATIOS[64] == {1: 1.0, 16: 1.07, 64: 0.85}
    d = Dispatcher(DSVConfig(use_calibration=False, recall_max_density=0.9))
    # rows: the densities of token, 16-key and 64-key lists; columns: heads
    # head 0: the same density for tokens and 16 (0.3 < 0.321), 64 needs 0.5 (0.56) -> tokens
    # head 1: 16 needs fewer keys (0.2 * 1.07 = 0.214 < 0.3 < 0.47 * 1.12 = 0.526) -> 16
    # head 2: 64 needs 3/4 of the keys (0.3 * 1.12 = 0.336 < 0.4 < 0.428) -> 64
    dens = [[0.3, 0.3, 0.4], [0.3, 0.2, 0.4], [0.5, 0.47, 0.3]]
    assert d.choose_kv_block(dens, 4096, 3, 128, "cpu") == [1, 16, 64]
    # at G = 64 token lists cost more per key: head 0's 64-key lists (0.5 * 0.85 = 0.425) still
    # lose to its tokens (0.3), head 3's (0.33 * 0.85 = 0.2805) win over tokens at 0.3 (at G = 128
    # they would not: 0.3696)
    dens = [[0.3, 0.3, 0.4, 0.3], [0.3, 0.2, 0.4, 0.3], [0.5, 0.47, 0.3, 0.33]]
    d64 = Dispatcher(DSVConfig(use_calibration=False, recall_max_density=0.9, group_size=64))
    assert d64.choose_kv_block(dens, 4096, 4, 128, "cpu") == [1, 16, 64, 64]
    assert d.choose_kv_block(dens, 4096, 4, 128, "cpu") == [1, 16, 64, 1]
    # groups between and below the measured sizes take the table of the largest size below
    assert block_cost_ratio(64, 100) == 0.85 and block_cost_ratio(64, 32) == 0.85
    assert block_cost_ratio(64, 256) == 1.12


def test_choose_kv_block_uses_block_entries_of_the_table():
    def entry(kb, ms):
        e = {"device": "cpu", "dtype": "float32", "heads": 1, "head_dim": 16, "group_size": 32,
             "seq_len": 1024, "dense_ms": 10.0, "sparse_ms": {"0.5": ms, "0.9": ms / 5}}
        if kb != 1:
            e["kv_block"] = kb
        return e

    dens = [[0.3], [0.3], [0.3]]
    cfg = DSVConfig(recall_max_density=0.9, group_size=64)
    # a table with token entries only: blocks are costed at the group size's BLOCK_COST_RATIOS
    # of the token time (G = 64: 64-key lists cheaper per key than token lists)
    d = Dispatcher(cfg, table={"version": 1, "entries": [entry(1, 8.0)]})
    assert d.choose_kv_block(dens, 1024, 1, 16, "cpu", torch.float32) == [64]
    c1 = d.head_cost(0.3, 1, 1024, 16, "cpu", torch.float32)
    assert d.head_cost(0.3, 64, 1024, 16, "cpu", torch.float32) == pytest.approx(BLOCK_COST_RATIOS[64][64] * c1)
    # measured block entries take over: here 64-blocks are slow and 16-blocks fast
    d = Dispatcher(cfg, table={"version": 1, "entries": [entry(1, 8.0), entry(16, 4.0), entry(64, 20.0)]})
    assert d.choose_kv_block(dens, 1024, 1, 16, "cpu", torch.float32) == [16]
    # the token entries' lookup is unchanged by block entries
    assert d.predict_ms(1024, 1, 16, 0.5, "cpu", torch.float32)["sparse"] == pytest.approx(8.0)


def test_calibration_measures_block_entries(tmp_path, capsys):
    """python -m dsv_ext.control.dispatch --kv-blocks 1 16 times token and block lists: one entry
    per granularity (block entries carry kv_block), which the cost lookups then use."""
    from dsv_ext.control.dispatch import main
    path = str(tmp_path / "cal.json")
    args = ["--device", "cpu", "--seq-lens", "128", "--sparsities", "0.5", "0.9", "--heads", "2",
            "--head-dim", "16", "--repeats", "1", "--group-size", "16", "--out", path]
    assert main(args + ["--kv-blocks", "1", "16"]) == 0
    es = json.loads(open(path).read())["entries"]
    assert sorted(e.get("kv_block", 1) for e in es) == [1, 16]
    assert all(e["measured"].endswith("UTC") and e["torch"] == torch.__version__ and e["commit"] for e in es)
    assert "S=128 kv_block=16: dense" in capsys.readouterr().out
    d = Dispatcher(DSVConfig(group_size=16, calibration_path=path))
    blk = next(e for e in es if e.get("kv_block") == 16)
    got = d.predict_ms(128, 2, 16, 0.5, "cpu", torch.float32, kv_block=16)["sparse"]
    assert got == pytest.approx(blk["sparse_ms"]["0.5"])
    with pytest.raises(SystemExit):
        main(args + ["--kv-blocks", "32"])
    assert "--kv-blocks" in capsys.readouterr().err


def test_decide_weighs_block_heads():
    d = Dispatcher(DSVConfig(use_calibration=False, dispatch_threshold=0.8, group_size=64))
    # mean density 0.21: tokens stay dense (sparsity 0.79 < 0.8); as 64-blocks the cost is
    # 0.21 x 0.85 = 0.179 (>= 0.8 saved), as 16-blocks and tokens (0.225 + 0.21) / 2 = 0.217
    assert not d.decide([0.79, 0.79], 4096, 2, 128, "cpu", density=[0.21, 0.21])
    assert d.decide([0.79, 0.79], 4096, 2, 128, "cpu", density=[0.21, 0.21], kv_block=[64, 64])
    assert not d.decide([0.79, 0.79], 4096, 2, 128, "cpu", density=[0.21, 0.21], kv_block=[16, 1])


def test_memory_counts_cube_ordered_keys_of_block_heads():
    d = Dispatcher(DSVConfig(use_calibration=False))
    base = d.sparse_extra_bytes(1, 4096, 4, 128, 512)
    assert d.sparse_extra_bytes(1, 4096, 4, 128, 512, kv_block=[1, 1, 1, 1]) == base
    # two block heads keep their cube-ordered k and v (bf16) for the backward
    assert d.sparse_extra_bytes(1, 4096, 4, 128, 512, kv_block=[16, 64, 1, 1]) == base + 2 * 4096 * 2 * 128 * 2


def _synthetic(clustered: bool, B=1, S=256, H=2, D=16, c=6.0):
    """Queries of group g attend (almost all their mass) to the 64 keys of cluster g % 4: with
    ``clustered`` those are the contiguous positions 64 a .. 64 a + 63 (blocks reach the target
    with the same keys), else every 4th position (every block holds a quarter of them)."""
    q = torch.zeros(B, S, H, D)
    k = torch.zeros(B, S, H, D)
    for s in range(S):
        q[:, s, :, (s // 32) % 4] = c
        k[:, s, :, s // 64 if clustered else s % 4] = c
    v = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(0))
    return q, k, v


@pytest.mark.parametrize("clustered,want", [(True, 64), (False, 1)])
def test_auto_controller_chooses(clustered, want):
    Hx, Dx = 2, 16  # S = 256 (_synthetic)
    cfg = DSVConfig(kv_block="auto", rank=Dx, group_size=32, k_multiple=64, use_calibration=False,
                    row_sample_stride=4, recall_max_density=0.5, measure_recall=False)
    attn = SparseAttention(Hx, Dx, config=cfg)
    with torch.no_grad():  # exact predictors: low-rank scores = q . k
        attn.predictor.wq.copy_(torch.eye(Dx).expand(Hx, Dx, Dx))
        attn.predictor.wk.copy_(torch.eye(Dx).expand(Hx, Dx, Dx))
    model = torch.nn.Sequential(attn)
    ctl = DSVController(model, cfg)
    q, k, v = _synthetic(clustered)
    attn(q, k, v)  # a training forward: predictor step and profile (k_rule "recall": the curves)
    st = attn.peek_stats()
    assert st.block_curves is not None and st.block_curves.shape == (len(KV_BLOCKS), Hx, 4)
    torch.testing.assert_close(st.block_curves[0], st.recall_curve)
    ctl.step()
    assert ctl.kv_block_choice[0] == (want,) * Hx
    assert ctl.block_density[0][0] == [0.25] * Hx  # tokens: the 64 keys of the cluster
    assert attn.head_kv_block == (want,) * Hx
    assert ctl.recall_density[0] == [0.25] * Hx
    assert ctl.block_stats()[0]["kv_block"] == [want] * Hx
    # a checkpoint keeps the choice
    ctl2 = DSVController(torch.nn.Sequential(SparseAttention(Hx, Dx, config=cfg)), cfg)
    ctl2.load_state_dict(ctl.state_dict())
    assert ctl2.kv_block_choice == ctl.kv_block_choice and ctl2.block_density == ctl.block_density
    # stage 2 runs with the choice
    ctl.switch_to_stage2()
    attn.use_sparse = True
    out = attn(q, k, v)
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------------
# context parallelism on 2 spawned ranks

CP_L, CP_G, CP_D, CP_R, CP_H, CP_B = 32, 8, 8, 4, 3, 2


def _cp_inputs(world, seed):
    g = torch.Generator().manual_seed(seed)
    Sx = world * CP_L
    f = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    cnt = torch.tensor([[Sx, 20, 37], [Sx, 9, 50]], dtype=torch.int32)  # head 0 dense; K in keys
    return dict(q=f(CP_B, Sx, CP_H, CP_D), k=f(CP_B, Sx, CP_H, CP_D), v=f(CP_B, Sx, CP_H, CP_D),
                q_lr=f(CP_B, Sx, CP_H, CP_R), k_lr=f(CP_B, Sx, CP_H, CP_R), w=f(CP_B, Sx, CP_H, CP_D), cnt=cnt)


def _cp_reference(x, b):
    """Single process: dense heads by SDPA, the others with block lists of ceil(K / b) blocks."""
    Sx = x["q"].shape[1]
    q, k, v = (x[n].clone().requires_grad_(True) for n in "qkv")
    outs = []
    for h in range(CP_H):
        sl = slice(h, h + 1)
        cnt = x["cnt"][:, sl]
        if bool((cnt >= Sx).all()):
            outs.append(dsv_ext.reference.dense_attention_ref(q[:, :, sl], k[:, :, sl], v[:, :, sl]))
            continue
        cb = torch.div(cnt + b - 1, b, rounding_mode="floor").to(torch.int32)
        idx = dsv_ext.topk_estimate(x["q_lr"][:, :, sl], x["k_lr"][:, :, sl], cb, CP_G, kmax=int(cb.max()),
                                    kv_block=b)
        outs.append(dsv_ext.sparse_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], idx, cb, CP_G, kv_block=b))
    out = torch.cat(outs, 2)
    (out * x["w"]).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _cp_worker(rank, world, init_file, out_dir, seed):
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # before init_process_group (docs/PARALLEL.md)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    res = {}
    try:
        import dsv_ext.parallel as P

        for name, fn in (("hcp", P.hcp_attention), ("scp", P.scp_attention)):
            for b in (16, 64):
                key = f"{name}{b}"
                try:
                    x = _cp_inputs(world, seed)
                    sl = slice(rank * CP_L, (rank + 1) * CP_L)
                    q, k, v = (x[n][:, sl].clone().requires_grad_(True) for n in "qkv")
                    out = fn(q, k, v, x["q_lr"][:, sl], x["k_lr"][:, sl], x["cnt"], CP_G, kv_block=b)
                    (out * x["w"][:, sl]).sum().backward()
                    ref = _cp_reference(x, b)
                    res[key] = {n: float((a - r[:, sl]).abs().max())
                                for n, a, r in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref)}
                except Exception:  # noqa: BLE001 - reported by the test
                    res[key] = {"exception": traceback.format_exc()}
        try:  # a SparseAttention with kv_block 16 under dsv_ext.parallel.enable, stage 2
            import copy

            cfg = DSVConfig(group_size=CP_G, rank=CP_R, k_multiple=CP_G, min_density=0.0, kv_block=16)
            torch.manual_seed(seed + 5)  # the same predictor weights on every rank
            ref_m = SparseAttention(CP_H, CP_D, config=cfg, name="blk").double()
            cpm = copy.deepcopy(ref_m)
            P.enable(cpm)
            x = _cp_inputs(world, seed)
            Sx = world * CP_L
            sl = slice(rank * CP_L, (rank + 1) * CP_L)
            for m_ in (ref_m, cpm):
                m_.stage, m_.use_sparse = 2, True
                m_.set_density([1.0, 0.5, 0.25], Sx)
            got = []
            for m_, part in ((ref_m, slice(None)), (cpm, sl)):
                q, k, v = (x[n][:, part].clone().requires_grad_(True) for n in "qkv")
                out = m_(q, k, v)
                (out * x["w"][:, part]).sum().backward()
                got.append((out.detach(), q.grad, k.grad, v.grad))
            res["module16"] = {n: float((c - r[:, sl]).abs().max())
                               for n, r, c in zip(("out", "dq", "dk", "dv"), got[0], got[1])}
            # the module result is that of block lists (not token lists of the same K)
            tok = copy.deepcopy(ref_m)
            tok.config = DSVConfig(group_size=CP_G, rank=CP_R, k_multiple=CP_G, min_density=0.0)
            res["module16"]["vs_tokens"] = float((tok(*(x[n] for n in "qkv")) - got[0][0]).abs().max())
        except Exception:  # noqa: BLE001
            res["module16"] = {"exception": traceback.format_exc()}
        try:  # a bad kv_block is refused on every rank with a message naming it
            x = _cp_inputs(world, seed)
            sl = slice(rank * CP_L, (rank + 1) * CP_L)
            P.hcp_attention(x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], x["q_lr"][:, sl], x["k_lr"][:, sl],
                            x["cnt"], CP_G, kv_block=0)
            res["bad"] = "no error"
        except Exception as e:  # noqa: BLE001
            res["bad"] = str(e)
    finally:
        import dsv_ext.parallel as P

        P.clear_group_cache()
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


@functools.lru_cache(maxsize=None)
def _cp_results(world=2, seed=1234):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_cp_worker, args=(world, os.path.join(tmp, "init"), tmp, seed), nprocs=world, join=True)
        out = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                out.append(json.load(f))
    return out


@pytest.mark.parametrize("name", ["hcp16", "hcp64", "scp16", "scp64"])
def test_context_parallel_blocks_match_single_process(name):
    for r, res in enumerate(_cp_results()):
        e = res[name]
        assert "exception" not in e, f"rank {r}:\n{e.get('exception')}"
        for key in ("out", "dq", "dk", "dv"):
            assert e[key] <= 1e-10, f"{name}: rank {r} {key} max error {e[key]:.3e}"


def test_context_parallel_module_with_blocks():
    for r, res in enumerate(_cp_results()):
        e = res["module16"]
        assert "exception" not in e, f"rank {r}:\n{e.get('exception')}"
        for key in ("out", "dq", "dk", "dv"):
            assert e[key] <= 1e-10, f"module16: rank {r} {key} max error {e[key]:.3e}"
        assert e["vs_tokens"] > 1e-6


def test_context_parallel_bad_kv_block():
    for res in _cp_results():
        assert "kv_block: expected a positive int" in res["bad"]


# ------------------------------------------------------------------------------------------------
# torch.compile

@pytest.mark.parametrize("per_head", [False, True], ids=["one", "per_head"])
def test_blocks_compile_without_graph_breaks(per_head):
    """The block path (cube-ordered keys, block top-K, sparse attention with kv_block) is one
    graph, and a compiled forward + backward equals the eager one."""
    torch._dynamo.reset()
    m = _module("auto" if per_head else 16).float()
    if per_head:
        m.plan_step(StepPlan(stage=2, mode="sparse", density=m.plan.density, kv_block=(16, 64, 1)))
    q, k, v = (t.detach().float().requires_grad_(True) for t in _qkv(seed=9))
    ex = torch._dynamo.explain(m)(q, k, v)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    torch._dynamo.reset()
    mc = torch.compile(m, backend="aot_eager", fullgraph=True)
    o, oe = mc(q, k, v), m(q, k, v)
    torch.testing.assert_close(o, oe, rtol=1e-5, atol=1e-6)
    for a, b in zip(_grads(o, (q, k, v)), _grads(oe, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
