"""SparseAttention / DSVAttention (dsv_ext.modules.attention): stage 1 == SDPA, stage 2 == references,
predictor side tasks leave the model graph alone, torch.compile and bf16 autocast."""
import math
import os

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import dsv_ext
from dsv_ext import reference as ref
from dsv_ext.functional.attention import dense_core, sparse_core
from dsv_ext.modules.attention import DSVAttention, DenseAttention, SparseAttention
from dsv_ext.config import DSVConfig
from dsv_ext.grouping import cube_permutation

GRID = (3, 5, 6)          # odd grid: partial cubes, S = 90 not a multiple of G
S = 90
H, D = 2, 16


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _qkv(B=2, dtype=torch.float64, seed=None, requires_grad=True):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(1 << 30, ())))
    return [torch.randn(B, S, H, D, dtype=dtype, generator=g).requires_grad_(requires_grad) for _ in range(3)]


def _grads(out, ins, seed=0):
    do = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed)).to(out.device)
    return torch.autograd.grad(out, ins, do)


def _stage2(m: SparseAttention, density):
    m.stage, m.use_sparse = 2, True
    m.set_density(density, S)
    return m


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_stage1_equals_sdpa(dtype):
    m = SparseAttention(H, D, grid=GRID).to(dtype)
    q, k, v = _qkv(dtype=dtype)
    out = m(q, k, v)
    want = _sdpa(q, k, v)
    assert torch.equal(out, want)  # stage 1 *is* SDPA
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out.double(), ref.dense_attention_ref(q, k, v), rtol=tol, atol=tol)
    for a, b in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        assert torch.equal(a, b)


def test_stage2_full_k_equals_dense_float64():
    cfg = DSVConfig(group_size=8)  # 90 = 11 full groups + a partial one; k_multiple 64 -> capped at S
    m = _stage2(SparseAttention(H, D, grid=GRID, config=cfg).double(), [1.0, 1.0])
    assert m.head_k == [S, S] and m.kmax == S and m.kv_count.tolist() == [S, S]
    q, k, v = _qkv()
    out = m(q, k, v)
    want = ref.dense_attention_ref(q, k, v)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_stage2_matches_reference_sparse_attention():
    cfg = DSVConfig(group_size=8, k_multiple=8, min_density=0.02)
    m = _stage2(SparseAttention(H, D, grid=GRID, config=cfg).double(), [0.25, 0.6])
    # K = ceil(density * S) rounded up to 8: 23 -> 24, 54 -> 56
    assert m.head_k == [24, 56] and m.kmax == 56
    q, k, v = _qkv()
    out = m(q, k, v)
    perm, inv = cube_permutation(GRID, cfg.cube, S)
    qp = q.detach()[:, perm]
    q_lr = torch.einsum("bshd,hdr->bshr", qp, m.predictor.wq.double())
    k_lr = torch.einsum("bshd,hdr->bshr", k.detach(), m.predictor.wk.double())
    counts = torch.tensor([[24, 56]] * 2, dtype=torch.int32)
    index = ref.topk_ref(q_lr, k_lr, counts, 8, 56)
    want = ref.sparse_attention_ref(q[:, perm], k, v, index, counts, 8)[:, inv]
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    # a different sparsity changes the result (the test can fail)
    m.set_density([0.1, 0.1], S)
    assert not torch.allclose(m(q, k, v), out)


def test_stage2_without_grid_groups_raster_order():
    cfg = DSVConfig(group_size=16, k_multiple=16)
    m = _stage2(SparseAttention(H, D, grid=None, config=cfg).double(), [0.5, 0.5])
    q, k, v = _qkv()
    out = m(q, k, v)
    q_lr = torch.einsum("bshd,hdr->bshr", q.detach(), m.predictor.wq.double())
    k_lr = torch.einsum("bshd,hdr->bshr", k.detach(), m.predictor.wk.double())
    counts = torch.full((2, H), 48, dtype=torch.int32)
    want = ref.sparse_attention_ref(q, k, v, ref.topk_ref(q_lr, k_lr, counts, 16, 48), counts, 16)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_defaults_are_g128_cubes_and_partial_groups_work(gen):
    """The defaults are G = 128 in 4x4x4 cubes; a grid of 2 frames (partial edge cubes: 2x4x4 and
    smaller) and sequences that are not a multiple of G, or shorter than it, run stage 2 as the
    float64 reference with the module's own index, and the side tasks run on them."""
    cfg = DSVConfig(k_multiple=8)
    assert (DSVConfig().group_size, DSVConfig().cube) == (128, (4, 4, 4))
    assert (cfg.group_size, cfg.cube) == (128, (4, 4, 4))
    G = cfg.group_size
    for grid in ((2, 8, 10), (2, 8, 8), (1, 4, 6)):  # S = 160 (128 + 32), 128 (one group), 24 (< G)
        Sg = grid[0] * grid[1] * grid[2]
        perm, inv = cube_permutation(grid, cfg.cube, Sg)
        # fewer than 4 frames: the 4x4x4 cubes are cut to the frames there are, which is the
        # order of the 2x4x4 cubes; every token once
        assert torch.equal(perm, cube_permutation(grid, (2, 4, 4), Sg)[0])
        assert torch.equal(perm.sort().values, torch.arange(Sg))
        m = SparseAttention(H, D, grid=grid, config=cfg).double()
        m.stage, m.use_sparse = 2, True
        m.set_density([0.3, 0.7], Sg)
        Ks = [min(Sg, -(-math.ceil(d * Sg - 1e-9) // 8) * 8) for d in (0.3, 0.7)]
        assert m.head_k == Ks
        q, k, v = (torch.randn(2, Sg, H, D, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(3))
        out = m(q, k, v)
        qp = q.detach()[:, perm]
        q_lr = torch.einsum("bshd,hdr->bshr", qp, m.predictor.wq.double())
        k_lr = torch.einsum("bshd,hdr->bshr", k.detach(), m.predictor.wk.double())
        counts = torch.tensor([Ks] * 2, dtype=torch.int32)
        index = ref.topk_ref(q_lr, k_lr, counts, G, max(Ks))
        assert index.shape[2] == -(-Sg // G)  # the last group is partial unless G divides S
        want = ref.sparse_attention_ref(q[:, perm], k, v, index, counts, G)[:, inv]
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
        if Sg > 32:  # the test can fail: groups of 32 select other keys
            idx32 = ref.topk_ref(q_lr, k_lr, counts, 32, max(Ks))
            assert not torch.allclose(ref.sparse_attention_ref(q[:, perm], k, v, idx32, counts, 32)[:, inv], want)
        # predictor step and profiling (stage 1) on the same grid
        m.stage = 1
        m.train().plan_step(replace(m.plan, train=True, profile=True, row_offset=1))
        torch.testing.assert_close(m(q, k, v), _sdpa(q, k, v), rtol=0, atol=0)
        st = m.take_stats()
        assert st.grads is not None and all(torch.isfinite(x).all() for x in st.grads)
        assert torch.isfinite(st.loss).all() and torch.isfinite(st.sparsity).all()


def test_side_tasks_train_predictor_without_touching_the_model_graph():
    cfg = DSVConfig(group_size=8, row_sample_stride=4)
    m = SparseAttention(H, D, grid=GRID, config=cfg).double().train()
    q, k, v = _qkv()
    plain = m(q, k, v)
    g_plain = _grads(plain, (q, k, v))
    m.plan_step(replace(m.plan, train=True, profile=True, row_offset=3))
    out = m(q, k, v)
    assert torch.equal(out, plain)
    for a, b in zip(_grads(out, (q, k, v)), g_plain):
        assert torch.equal(a, b)
    assert m.predictor.wq.grad is None and m.predictor.wk.grad is None
    assert not m.predictor.wq.requires_grad
    st = m.take_stats()
    gq, gk = st.grads
    loss, sp, rec = st.loss, st.sparsity, st.recall
    assert m.take_stats().grads is None
    # the sampled rows are positions of the cube-ordered queries (what the query groups see)
    rows = torch.arange(3, S, 4)
    perm, _ = cube_permutation(GRID, cfg.cube, S)
    qc = q.detach()[:, perm]
    wq = m.predictor.wq.detach().double().requires_grad_()
    wk = m.predictor.wk.detach().double().requires_grad_()
    q_lr = torch.einsum("bshd,hdr->bshr", qc, wq)
    k_lr = torch.einsum("bshd,hdr->bshr", k.detach(), wk)
    lref = ref.predictor_loss_ref(qc, k, q_lr, k_lr, rows)
    eq, ek = torch.autograd.grad(lref.mean(0).sum(), (wq, wk))
    torch.testing.assert_close(gq, eq, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gk, ek, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(loss.double(), lref.mean(0), rtol=1e-6, atol=1e-7)
    want_sp = ref.profile_ref(qc, k, rows, 0.9).sparsity.mean(0)
    torch.testing.assert_close(sp.double(), want_sp, rtol=1e-6, atol=1e-6)
    assert rec is None  # no sparsity estimate yet -> no recall
    # eval mode: no side work even when armed
    m.eval()
    m(q, k, v)
    assert m.take_stats().grads is None


def test_profile_of_heads_at_every_key_needs_no_lists(monkeypatch):
    """A block whose heads all take K = S measures recall 1 without estimating lists (the lists
    would hold every key); its sparsity is the profiler's, and NaN in q gives NaN recall too."""
    import dsv_ext.ops

    cfg = DSVConfig(group_size=8, row_sample_stride=4)
    m = SparseAttention(H, D, grid=GRID, config=cfg).double().train()
    q, k, v = _qkv()
    rows = torch.arange(3, S, 4)
    perm, _ = cube_permutation(GRID, cfg.cube, S)
    m.plan_step(replace(m.plan, profile=True, row_offset=3, density=(1.0,) * H, seq_len=S))

    def no_lists(*a, **kw):
        raise AssertionError("topk_estimate called for heads at K = S")

    monkeypatch.setattr(dsv_ext.ops, "topk_estimate", no_lists)
    m(q, k, v)
    assert m.head_k == [S] * H
    st = m.take_stats()
    torch.testing.assert_close(st.recall.double(), torch.ones(H, dtype=torch.float64), rtol=0, atol=0)
    want_sp = ref.profile_ref(q.detach()[:, perm], k, rows, 0.9).sparsity.mean(0)
    torch.testing.assert_close(st.sparsity.double(), want_sp, rtol=1e-6, atol=1e-6)
    # one head of K < S: the lists are estimated again
    m.plan_step(replace(m.plan, density=(1.0,) * (H - 1) + (0.5,)))
    with pytest.raises(AssertionError, match="topk_estimate called"):
        m(q, k, v)
    m.take_stats()
    m.plan_step(replace(m.plan, density=(1.0,) * H))
    qn = q.detach().clone()
    qn[0, perm[3]] = float("nan")  # sampled row 3 of batch 0
    m(qn, k, v)
    assert torch.isnan(m.take_stats().recall).all()


def test_dsv_attention_layer_matches_manual():
    torch.manual_seed(0)
    dim = 24

    def rot(q, k):  # any callable (q, k) -> (q, k) on [B, S, H, D]
        return q.flip(-1) * 0.5, k * 2.0

    layer = DSVAttention(dim, 3, head_dim=8, qk_norm=True, rotary=rot, grid=GRID).double()
    x = torch.randn(2, S, dim, dtype=torch.float64)
    y = layer(x)
    q, k, v = layer.qkv(x).view(2, S, 3, 3, 8).unbind(2)
    q, k = rot(layer.q_norm(q), layer.k_norm(k))
    want = layer.proj(_sdpa(q, k, v).reshape(2, S, 24))
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    assert isinstance(layer.attn_core, SparseAttention) and isinstance(layer.q_norm, torch.nn.RMSNorm)
    # a rotary passed to forward overrides the constructor's
    y2 = layer(x, rotary=lambda q, k: (q, k))
    assert not torch.allclose(y2, y)


def test_dense_attention_core():
    q, k, v = _qkv(dtype=torch.float32)
    assert torch.equal(DenseAttention(H, D)(q, k, v), _sdpa(q, k, v))


def test_bad_inputs_name_the_argument():
    m = SparseAttention(H, D, grid=GRID)
    q, k, v = _qkv(dtype=torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="^q:"):
        m(q[..., :8], k, v)
    with pytest.raises(ValueError, match="^k, v:"):
        m(q, k[:, :10], v[:, :10])
    with pytest.raises(TypeError, match="^v:"):
        m(q, k, v.numpy())
    with pytest.raises(ValueError, match="^grid"):
        m.set_grid((0, 1, 1))
    with pytest.raises(ValueError, match="^num_heads"):
        SparseAttention(0, D)
    with pytest.raises(ValueError, match="^density"):
        m.set_density([0.5])
    _stage2(m, [0.5, 0.5])
    with pytest.raises(ValueError, match="^grid"):
        m(q, k, v, grid=(4, 5, 6))  # 120 tokens > S


# ------------------------------------------------------------------------------------------------
# torch.compile and autocast

def test_core_functions_have_no_graph_breaks():
    torch._dynamo.reset()
    q, k, v = _qkv(dtype=torch.float32, requires_grad=False)
    wq, wk = torch.randn(H, D, 16), torch.randn(H, D, 16)
    perm, inv = cube_permutation(GRID, (2, 4, 4), S)
    counts = torch.tensor([64, 32], dtype=torch.int32)
    ex = torch._dynamo.explain(sparse_core)(q, k, v, wq, wk, perm, inv, counts, 64, 8, None)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    ex = torch._dynamo.explain(dense_core)(q, k, v, None, "auto")
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    # a whole DSVAttention layer in stage 2 (steps without predictor work) is one graph too;
    # an armed step breaks only around the eager predictor/profiler call
    model = _tiny_model(DSVConfig(group_size=8, k_multiple=8))
    core = _stage2(model[0].attn_core, [0.4, 0.7])
    x = torch.randn(2, S, 32)
    ex = torch._dynamo.explain(model)(x)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    torch._dynamo.reset()
    core.plan_step(replace(core.plan, train=True))
    ex = torch._dynamo.explain(model)(x)
    assert ex.break_reasons and all("_side_tasks" in str(r.reason) for r in ex.break_reasons)
    core.take_stats()


def _tiny_model(cfg):
    torch.manual_seed(0)
    return torch.nn.Sequential(DSVAttention(32, H, grid=GRID, config=cfg, qk_norm=True))


def test_training_step_under_torch_compile():
    """A stage-2 (sparse) training step of a compiled model equals the eager one; the core runs
    as one graph (fullgraph=True) through the fake kernels and the registered autograd."""
    backend = os.environ.get("DSV_TEST_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    cfg = DSVConfig(group_size=8, k_multiple=8)
    model = _tiny_model(cfg)
    core = model[0].attn_core
    _stage2(core, [0.4, 0.7])
    x = torch.randn(2, S, 32)

    def step(fn):
        model.zero_grad(set_to_none=True)
        y = fn(x)
        y.square().mean().backward()
        return y.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    y0, g0 = step(model)
    # the whole core as one graph: fullgraph=True raises on any break
    core_c = torch.compile(sparse_core, backend=backend, fullgraph=True)
    perm, inv = cube_permutation(GRID, cfg.cube, S)
    q, k, v = (t.requires_grad_() for t in torch.randn(3, 2, S, H, D).unbind(0))
    o = core_c(q, k, v, core.predictor.wq, core.predictor.wk, perm, inv, core.kv_count, core.kmax, 8, None)
    oe = sparse_core(q, k, v, core.predictor.wq, core.predictor.wk, perm, inv, core.kv_count, core.kmax, 8, None)
    torch.testing.assert_close(o, oe, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(o.sum(), q)[0], torch.autograd.grad(oe.sum(), q)[0],
                               rtol=1e-5, atol=1e-6)
    # the compiled model (with predictor training + profiling armed: they run eagerly)
    core.train()
    core.plan_step(replace(core.plan, train=True, profile=True))
    y1, g1 = step(torch.compile(model, backend=backend))
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    st = core.take_stats()
    assert st.grads is not None and st.sparsity is not None


@pytest.mark.parametrize("stage,density", [(1, None), (2, 1.0), (2, 0.5)])
def test_training_step_under_bf16_autocast(stage, density):
    """bf16 autocast step vs float32. With K < S the bf16 top-K may pick other keys near the
    cut-off than float32, so closeness is checked where the selection cannot differ (stage 1,
    and stage 2 with K = S); the K < S run must still be finite, bf16, and train."""
    cfg = DSVConfig(group_size=8, k_multiple=8)
    model = _tiny_model(cfg)
    core = model[0].attn_core
    if stage == 2:
        _stage2(core, [density, density])
    core.plan_step(replace(core.plan, train=True, profile=True))
    x = torch.randn(2, S, 32)
    y32 = model(x).detach()
    core.take_stats()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
        loss = y.float().square().mean()
    loss.backward()
    assert y.dtype == torch.bfloat16
    # bf16 has an 8-bit mantissa: a few ulps of 2^-8 on O(1) values
    if density != 0.5:
        torch.testing.assert_close(y.float(), y32, rtol=0.05, atol=0.03)
    else:
        assert torch.isfinite(y).all() and (y.float() - y32).abs().mean() < 0.03
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    st = core.take_stats()
    g, loss_h, sp = st.grads, st.loss, st.sparsity
    assert g is not None and all(torch.isfinite(t).all() for t in g)
    assert torch.isfinite(loss_h).all() and ((sp >= 0) & (sp <= 1)).all()


# ------------------------------------------------------------------------------------------------
# GPU (skipped without CUDA or without the CUDA kernels)

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and dsv_ext.has_cuda_kernels()),
                                reason="needs a GPU and the CUDA kernels")
CGRID = (3, 10, 10)  # S = 300: partial cubes (3 frames < 4) and a partial last group (300 = 2 x 128 + 44)
CS = 300


def _cuda_qkv(D, B=2, Hh=4, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, CS, Hh, D, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(3)]


@needs_cuda
def test_cuda_stage1_equals_sdpa():
    from torch.nn.attention import sdpa_kernel
    from dsv_ext.functional.attention import _sdpa_priority
    m = SparseAttention(4, 128, grid=CGRID).cuda()
    q, k, v = _cuda_qkv(128)
    out = m(q, k, v)
    with sdpa_kernel(_sdpa_priority(), set_priority=True):
        want = _sdpa(q, k, v)
    assert torch.equal(out, want)
    # bf16 inputs: errors of a few 2^-8 ulps on O(0.1) outputs
    torch.testing.assert_close(out.double(), ref.dense_attention_ref(q, k, v), rtol=2e-2, atol=1e-2)


@needs_cuda
@pytest.mark.parametrize("D", [64, 72, 96, 128])  # 72 and 96: zero-padded (72 to 96 or 128)
def test_cuda_stage2_full_k_equals_dense(D):
    cfg = DSVConfig()  # the defaults (G = 64, 4x4x4 cubes), K rounded to 64 and capped at S
    m = SparseAttention(4, D, grid=CGRID, config=cfg).cuda()
    m.stage, m.use_sparse = 2, True
    m.set_density([1.0] * 4, CS)
    assert m.kmax == CS
    q, k, v = _cuda_qkv(D)
    out = m(q, k, v)
    assert out.dtype == torch.bfloat16
    want = ref.dense_attention_ref(q, k, v)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=1e-2)
    # both gradients land in bf16 (the inputs' dtype): compare them with bf16 tolerances
    for a, b in zip(_grads(out.double(), (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a.double(), b.double(), rtol=5e-2, atol=2e-2)


def _with_module_index(m, q, k, v, grid):
    """(index, float64 reference output) of a stage-2 module on [B, S, H, D] CUDA inputs: the
    top-K lists of its predictors in its cube order, and dense masked attention over them."""
    cfg = m.config
    B, S, H = q.shape[:3]
    perm, inv = cube_permutation(grid, cfg.cube, S, "cuda")
    qp = q.detach().index_select(1, perm)
    q_lr = torch.einsum("bshd,hdr->bshr", qp, m.predictor.wq.to(torch.bfloat16)).contiguous()
    k_lr = torch.einsum("bshd,hdr->bshr", k.detach(), m.predictor.wk.to(torch.bfloat16)).contiguous()
    counts = m.kv_count.view(1, H).expand(B, H).contiguous()
    index = dsv_ext.topk_estimate(q_lr, k_lr, counts, cfg.group_size, m.kmax)
    return index, ref.sparse_attention_ref(q[:, perm], k, v, index, counts, cfg.group_size)[:, inv]


@needs_cuda
def test_cuda_stage2_matches_reference_with_its_index():
    cfg = DSVConfig()
    m = SparseAttention(4, 128, grid=CGRID, config=cfg).cuda()
    m.stage, m.use_sparse = 2, True
    m.set_density([0.1, 0.2, 0.3, 0.5], CS)
    q, k, v = _cuda_qkv(128, seed=3)
    out = m(q, k, v)
    assert cfg.group_size == 128  # the default: 2 full groups and a partial one of 44 queries
    _, want = _with_module_index(m, q, k, v, CGRID)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=1e-2)
    # float32 inputs run the kernels in bf16 and come back as float32
    out32 = m(q.float(), k.float(), v.float())
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), want, rtol=2e-2, atol=1e-2)


@needs_cuda
@pytest.mark.parametrize("grid", [(2, 8, 10), (1, 4, 6)])  # S = 160 = 128 + 32 on 2 frames; S = 24 < G
def test_cuda_default_groups_on_short_grids(grid):
    """The default groups (128 queries, 4x4x4 cubes) on grids of fewer than 4 frames and
    sequences that are not a multiple of 128 or shorter than it: forward and gradients against the float64
    reference with the module's index (bf16 tolerances as above)."""
    cfg = DSVConfig()
    Sg = grid[0] * grid[1] * grid[2]
    m = SparseAttention(4, 128, grid=grid, config=cfg).cuda()
    m.stage, m.use_sparse = 2, True
    m.set_density([0.1, 0.3, 0.6, 1.0], Sg)
    assert m.head_k == ([64, 64, 128, 160] if Sg == 160 else [24] * 4)
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = [torch.randn(2, Sg, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3)]
    out = m(q, k, v)
    index, want = _with_module_index(m, q, k, v, grid)
    assert index.shape[2] == -(-Sg // cfg.group_size)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=1e-2)
    for a, b in zip(_grads(out.double(), (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a.double(), b.double(), rtol=5e-2, atol=2e-2)


@needs_cuda
@pytest.mark.parametrize("width", [512, 288])  # heads of 128, and of 72 (run zero-padded)
def test_cuda_training_step_compiled_bf16(width):
    """A training step with the sparse path (and the side tasks) eager and under torch.compile:
    the same output and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(DSVAttention(width, 4, grid=CGRID, qk_norm=True)).cuda()
    core = model[0].attn_core
    core.stage, core.use_sparse = 2, True
    core.set_density([0.2, 0.3, 0.4, 0.5], CS)
    core.train()
    x = torch.randn(2, CS, width, device="cuda")

    def step(fn):
        model.zero_grad(set_to_none=True)
        core.plan_step(replace(core.plan, train=True, profile=True))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x)
        y.float().square().mean().backward()
        return y.detach().float(), [p.grad.float().clone() for p in model.parameters() if p.requires_grad]

    y0, g0 = step(model)
    assert core.take_stats().grads is not None
    y1, g1 = step(torch.compile(model))
    st = core.take_stats()
    assert st.grads is not None and st.loss is not None
    torch.testing.assert_close(y1, y0, rtol=2e-2, atol=2e-2)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3)


# ------------------------------------------------------------------------------------------------
# review regressions

def test_set_density_without_seq_len_keeps_counts_in_sync():
    """set_density(d) with no seq_len after a stage-2 forward (no side task ran, so the training
    length is unknown) must refresh kv_count/kmax for the length the block last ran at: the
    kernels read kv_count, the head_k property must agree with it."""
    cfg = DSVConfig(group_size=8, k_multiple=8)
    m = SparseAttention(H, D, grid=GRID, config=cfg).double().eval()
    m.stage, m.use_sparse = 2, True
    m.set_density([0.2, 0.2])
    q, k, v = _qkv(requires_grad=False, seed=0)
    m(q, k, v)
    assert m.head_k == [24, 24] and m.kv_count.tolist() == [24, 24]
    m.set_density([1.0, 1.0])  # full K: the output must be dense attention
    assert m.kv_count.tolist() == m.head_k == [S, S] and m.kmax == S
    torch.testing.assert_close(m(q, k, v), ref.dense_attention_ref(q, k, v), rtol=1e-12, atol=1e-12)


@needs_cuda
def test_cuda_backward_with_misaligned_output_gradient():
    """The backward reads dout with 16-byte vector loads: a gradient that arrives as a
    misaligned view (here: a slice of a concatenation's gradient) must be copied first."""
    q, k, v = _cuda_qkv(64)
    cnt = torch.full((2, 4), 64, dtype=torch.int32, device="cuda")
    idx = torch.arange(64, dtype=torch.int32, device="cuda").expand(2, 4, -(-CS // 32), 64).contiguous()
    out = dsv_ext.sparse_attention(q, k, v, idx, cnt, 32)
    y = torch.cat([torch.zeros(2, CS, 4, 3, device="cuda", dtype=out.dtype), out], dim=-1)
    (g,) = torch.autograd.grad(y.float().square().sum(), q, retain_graph=True)
    (want,) = torch.autograd.grad(out.float().square().sum(), q)
    torch.cuda.synchronize()
    torch.testing.assert_close(g, want)


def test_alignment_check_on_fake_tensors():
    """AOT autograd traces the backward with fake tensors: the alignment check must not read a
    data pointer there (it raised on torch 2.11, warns on 2.14) and must still see a misaligned
    storage offset; under dynamo it must not break the graph."""
    import warnings
    from torch._subclasses.fake_tensor import FakeTensorMode
    from dsv_ext import ops
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FakeTensorMode():
            assert not ops._misaligned(torch.empty(4, 8, dtype=torch.bfloat16))
            assert ops._misaligned(torch.empty(40, dtype=torch.bfloat16)[1:33].view(4, 8))
    ex = torch._dynamo.explain(lambda x: x * 2 if not ops._misaligned(x) else x)(torch.randn(4, 8))
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons


def test_cuda_alignment_check_is_traceable(monkeypatch):
    """On CUDA every kernel input goes through ops._kernel_ready, whose alignment check must be
    traceable by torch.compile (Tensor.data_ptr() is not: the core split into several graphs on
    the GPU and fullgraph=True failed). Simulated on the CPU by applying the CUDA rule to CPU
    tensors; the backward gets a misaligned output gradient (a slice of a concatenation's)."""
    from dsv_ext import ops
    x = torch.randn(1 + 2 * H * D)[1:].view(1, 2, H, D)  # data_ptr 4 bytes past an allocation
    assert ops._misaligned(x) and not ops._misaligned(x.clone())
    assert ops._misaligned(torch.randn(1, 2, H, D + 3)[..., :D])  # row strides of 76 bytes
    monkeypatch.setattr(ops, "_kernel_ready", lambda t: t.contiguous() if ops._misaligned(t) else t)
    torch._dynamo.reset()
    q, k, v = _qkv(dtype=torch.float32, seed=4)
    wq, wk = torch.randn(H, D, 16), torch.randn(H, D, 16)
    perm, inv = cube_permutation(GRID, (2, 4, 4), S)
    counts = torch.tensor([64, 32], dtype=torch.int32)
    args = (wq, wk, perm, inv, counts, 64, 8, None)
    ex = torch._dynamo.explain(sparse_core)(q, k, v, *args)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    torch._dynamo.reset()
    out = torch.compile(sparse_core, backend="aot_eager", fullgraph=True)(q, k, v, *args)
    y = torch.cat([torch.zeros(2, S, H, 3), out], dim=-1)
    want = sparse_core(q, k, v, *args)
    torch.testing.assert_close(out, want)
    for a, b in zip(_grads(y[..., 3:], (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_step_plan_contract_checks_and_round_trip():
    """The driver contract: plan_step takes a StepPlan only (clear errors), stage / use_sparse /
    density are views of the plan, take_stats resets while peek_stats does not, set_head_k pins
    K, and a context-parallel runner given to the module is what forward calls."""
    from dsv_ext.modules.contract import ModuleStats, StepPlan

    with pytest.raises(ValueError, match="^stage"):
        StepPlan(stage=3)
    with pytest.raises(ValueError, match="^mode"):
        StepPlan(mode="fast")
    with pytest.raises(ValueError, match="^row_offset"):
        StepPlan(row_offset=-1)
    m = SparseAttention(H, D, grid=GRID, config=DSVConfig(group_size=8, row_sample_stride=4)).double().train()
    with pytest.raises(TypeError, match="^plan"):
        m.plan_step({"stage": 2})
    with pytest.raises(ValueError, match="^plan"):
        m.plan_step(StepPlan(density=(0.5,) * (H + 1)))
    with pytest.raises(ValueError, match="^head_k"):
        m.set_head_k([0] * H, S)
    with pytest.raises(TypeError, match="^runner"):
        m.set_context_parallel(3)
    m.plan_step(StepPlan(stage=2, mode="sparse", density=[0.5] * H, train=True))
    assert (m.stage, m.use_sparse, m.density) == (2, True, [0.5] * H)
    assert m.head_k == []  # no workload yet: K is sized by the first forward
    q, k, v = _qkv()
    m(q, k, v)
    assert m.workload.seq_len == S and m.workload.batch == q.shape[0] and m.head_k
    assert m.peek_stats().trained == 1 and m.peek_stats().grads is not None
    st = m.take_stats()
    assert isinstance(st, ModuleStats) and st.trained == 1 and st.profiled == 0 and st.sparsity is None
    assert m.take_stats() == ModuleStats()
    m.use_sparse = False
    assert m.plan.mode == "dense" and m.plan.train
    m.set_head_k([8] * H, S)
    assert m.head_k == [8] * H and m.kmax == 8 and m.kv_count.tolist() == [8] * H
    calls = []
    m.set_context_parallel(lambda attn, q_, k_, v_, scale: calls.append(attn) or q_ * 0)
    out = m(q, k, v)
    assert calls == [m] and torch.equal(out, q * 0) and m.context_parallel is not None
    m.set_context_parallel(None)
    assert m.context_parallel is None


def test_rms_norm_keeps_the_fused_kernel_under_autocast(monkeypatch):
    """DSVAttention's QK norm: nn.RMSNorm's numbers in float64 (the same parameter and state_dict);
    with bf16 inputs and an fp32 weight (autocast) it calls rms_norm with the weight in bf16 (the
    condition of the fused CUDA kernel: nn.RMSNorm falls back to its composite form otherwise), a
    bf16 result within bf16 rounding of the float64 norm, and the weight's gradient in fp32."""
    from dsv_ext.modules import RMSNorm

    torch.manual_seed(0)
    ours, ref = RMSNorm(64, eps=1e-6), torch.nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
    ref.load_state_dict(ours.state_dict())
    assert list(ours.state_dict()) == ["weight"]
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    assert torch.equal(ours.double()(x), ref.double()(x))
    ours.float()
    seen = []
    real = F.rms_norm

    def spy(inp, shape, weight=None, eps=None):
        seen.append((inp.dtype, None if weight is None else weight.dtype))
        return real(inp, shape, weight, eps)

    monkeypatch.setattr(F, "rms_norm", spy)
    xb = torch.randn(2, 7, 3, 64).bfloat16().requires_grad_()
    y = ours(xb)
    assert seen == [(torch.bfloat16, torch.bfloat16)] and y.dtype == torch.bfloat16
    want = ref.double()(xb.detach().double())
    assert (y.double() - want).abs().max() <= 2 ** -7 * want.abs().max()
    y.float().square().sum().backward()
    assert ours.weight.grad.dtype == torch.float32 and torch.isfinite(ours.weight.grad).all()
    ref.float()(xb.detach())
    assert seen[-1] == (torch.bfloat16, torch.float32)  # what nn.RMSNorm passes: no fused kernel
