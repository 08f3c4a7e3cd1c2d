"""CPU tests of the reference video DiT (dsv_ext.app.models)."""
import pytest
import torch

from dsv_ext.app.models import DiTConfig, VideoDiT, dsv_attention_available
from dsv_ext.app.models.dit import Rope3D, rope_3d_tables, sincos_pos_embed_3d

needs_dsv = pytest.mark.skipif(not dsv_attention_available(), reason="DSVAttention not importable")


def _cfg(**kw):
    base = dict(in_channels=4, latent_size=(4, 8, 8), patch=(1, 2, 2), hidden=32, depth=2, heads=2,
                attention="dense")
    base.update(kw)
    return DiTConfig(**base)


def _perturb(model, seed=0):
    """Give the zero-initialised adaLN / output layers random values so outputs are non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def test_shapes_patchify_and_zero_init():
    cfg = _cfg()
    assert cfg.grid == (4, 4, 4) and cfg.num_tokens == 64 and cfg.head_dim == 16
    m = VideoDiT(cfg, seed=0)
    x = torch.randn(3, 4, 4, 8, 8)
    t = torch.rand(3)
    y = m(x, t)
    assert y.shape == x.shape
    assert torch.count_nonzero(y) == 0  # adaLN-zero: the output layer starts at zero
    # unpatchify is the exact inverse of the patch layout (token = (t, h, w) raster order).
    tok = x.view(3, 4, 4, 1, 4, 2, 4, 2).permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(3, 64, 16)
    assert torch.equal(m.unpatchify(tok), x)
    with pytest.raises(ValueError, match="^x"):
        m(torch.randn(3, 4, 4, 8, 6), t)
    with pytest.raises(ValueError, match="^t"):
        m(x, torch.rand(2))
    with pytest.raises(ValueError, match="^model.latent_size"):
        _cfg(latent_size=(4, 7, 8))
    with pytest.raises(ValueError, match="^model.hidden"):
        _cfg(hidden=30, heads=4)
    with pytest.raises(ValueError, match="unknown keys"):
        DiTConfig.from_dict({"hiden": 3})


def test_init_is_seeded_and_trains():
    a, b, c = VideoDiT(_cfg(), seed=1), VideoDiT(_cfg(), seed=1), VideoDiT(_cfg(), seed=2)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
    assert any(not torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters()))
    # One optimizer step moves the zero-initialised output and the loss decreases over a few.
    torch.manual_seed(0)
    x, t = torch.randn(2, 4, 4, 8, 8), torch.rand(2)
    opt = torch.optim.AdamW(a.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = (a(x, t) - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("position", ["sincos", "rope"])
def test_grad_checkpointing_same_gradients(position):
    m = VideoDiT(_cfg(position=position), seed=0)
    _perturb(m)
    x, t = torch.randn(2, 4, 4, 8, 8), torch.rand(2)
    grads = []
    for gc in (False, True):
        m.grad_checkpointing = gc
        m.zero_grad()
        m(x, t).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for g0, g1 in zip(*grads):
        assert torch.allclose(g0, g1, rtol=1e-5, atol=1e-7)


def test_pos_embed():
    pe = sincos_pos_embed_3d(36, (2, 3, 4))
    assert pe.shape == (24, 36)
    assert len({tuple(r.tolist()) for r in pe}) == 24  # every position distinct
    assert torch.count_nonzero(sincos_pos_embed_3d(38, (2, 3, 4))[:, 36:]) == 0


def test_rope_scores_depend_on_displacement_only():
    """q . k after the 3D rotary embedding: for one q and one k vector at every position of a
    (3, 4, 5) grid, each score is a function of the displacement between the two tokens alone,
    norms are kept, and a displacement along w turns only w's channel pairs (Wan's split: t 22
    pairs, h and w 21 each at D = 128)."""
    grid, D = (3, 4, 5), 128
    S = 60
    rope = Rope3D(D, grid).to(torch.bfloat16)  # the turns stay complex64 whatever the module's dtype
    assert rope.freqs.dtype == torch.complex64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(D, generator=g, dtype=torch.float64).expand(1, S, 1, D)
    k = torch.randn(D, generator=g, dtype=torch.float64).expand(1, S, 1, D)
    qr, kr = rope(q, k)
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1), rtol=1e-6, atol=0)
    scores = qr[0, :, 0] @ kr[0, :, 0].T  # [S, S]
    pos = torch.stack(torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij"), -1).reshape(S, 3)
    by_disp = {}
    for i in range(S):
        for j in range(S):
            by_disp.setdefault(tuple((pos[j] - pos[i]).tolist()), []).append(float(scores[i, j]))
    assert len(by_disp) == 5 * 7 * 9
    for d, v in by_disp.items():
        assert max(v) - min(v) <= 1e-5 * (1 + abs(v[0])), (d, min(v), max(v))
    assert len({round(v[0], 6) for v in by_disp.values()}) > 100  # and the function is not flat
    cos, sin = rope_3d_tables(D, grid)
    assert cos.shape == (S, D // 2)
    moved = (sin[1] != 0).nonzero().flatten().tolist()  # raster position 1 = one step along w
    assert moved == list(range(43, 64))
    assert (sin[5] != 0).nonzero().flatten().tolist() == list(range(22, 43))  # one step along h
    assert (sin[20] != 0).nonzero().flatten().tolist() == list(range(0, 22))  # one step along t
    with pytest.raises(ValueError, match="^q"):
        rope(q[:, :10], k[:, :10])


def test_rope_turn_and_gradient():
    """Rope3D against the rotation written on real pairs in float64 with the same angles: outputs
    and the gradients of q and k (the backward turns back by the conjugate) equal to float64's
    rounding, inputs that are views of a wider tensor (q and k split from qkv) included; bf16
    inputs within bf16's rounding of the float64 result."""
    grid, D = (2, 3, 4), 64
    S = 24
    rope = Rope3D(D, grid)
    cos, sin = (t.double()[:, None] for t in rope_3d_tables(D, grid))

    def ref(x):
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)

    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, S, 3, 2 * D, generator=g, dtype=torch.float64)
    gq, gk = (torch.randn(2, S, 3, D, generator=g, dtype=torch.float64) for _ in range(2))
    q, k = (t.requires_grad_() for t in qkv.clone().split(D, -1))  # views: not contiguous
    qr, kr = rope(q, k)
    q0, k0 = (t.detach().clone().requires_grad_() for t in (q, k))
    r0 = (ref(q0), ref(k0))
    torch.autograd.backward((qr, kr), (gq, gk))
    torch.autograd.backward(r0, (gq, gk))
    for got, want in ((qr, r0[0]), (kr, r0[1]), (q.grad, q0.grad), (k.grad, k0.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # float64 rounding, |x| < 10
    qb, kb = q.detach().bfloat16(), k.detach().bfloat16()
    qbr, kbr = rope(qb, kb)
    assert qbr.dtype == torch.bfloat16
    for got, x in ((qbr, qb), (kbr, kb)):  # float32 arithmetic, one bf16 rounding at the end
        want = ref(x.double())
        torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-6)


def test_rope_model():
    """position: rope: no added embedding, the rotary hook in every block; outputs differ from the
    sincos model's and the config refuses head dims it cannot split."""
    m = VideoDiT(_cfg(position="rope"), seed=0)
    assert m.pos_embed is None and isinstance(m.rope, Rope3D)
    assert not any(n.startswith("rope") or n == "pos_embed" for n in m.state_dict())
    _perturb(m)
    ref = VideoDiT(_cfg(), seed=0)
    ref.load_state_dict(m.state_dict())
    x, t = torch.randn(2, 4, 4, 8, 8), torch.rand(2)
    y = m(x, t)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert not torch.allclose(y, ref(x, t))
    with pytest.raises(ValueError, match="^model.position"):
        _cfg(position="rope", hidden=8, heads=2)  # head dim 4
    with pytest.raises(ValueError, match="^model.position"):
        _cfg(position="alibi")


@needs_dsv
@pytest.mark.parametrize("position", ["sincos", "rope"])
def test_dsv_model_matches_dense_in_stage1(position):
    from dsv_ext.modules.attention import DSVAttention

    dense = VideoDiT(_cfg(position=position), seed=5)
    dsv = VideoDiT(_cfg(attention="dsv", position=position), seed=5)
    assert isinstance(dsv.blocks[0].attn, DSVAttention)
    dsd = dict(dsv.named_parameters())
    for n, p in dense.named_parameters():
        assert torch.equal(p, dsd[n]), n  # identical DiT weights from the same seed
    own = {id(p) for p in dsv.dit_parameters()}
    assert len(own) == sum(1 for _ in dense.parameters())  # predictors are not DiT parameters
    _perturb(dense, 1)
    dsv.load_state_dict(dense.state_dict(), strict=False)
    x, t = torch.randn(2, 4, 4, 8, 8, dtype=torch.float64), torch.rand(2, dtype=torch.float64)
    dense.double()
    dsv.double()
    torch.testing.assert_close(dsv(x, t), dense(x, t), rtol=1e-10, atol=1e-10)
