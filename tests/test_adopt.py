"""Adoption paths on the CPU: dsv_ext.convert on diffusers' Wan, Wan VACE, SkyReels-V2, LTX-Video,
CogVideoX, HunyuanVideo, Mochi, Allegro and Cosmos transformers (tiny random configs),
nn.MultiheadAttention (batch_first True/False), modules calling F.scaled_dot_product_attention
(route_sdpa), joint text+video attention against a float64 reference, and save_pretrained ->
from_pretrained with predictors and controller state.

Stage 1 must be bitwise equal to the unconverted model (outputs and every parameter gradient):
the converted processors hand SDPA the very tensors the model's own processor builds. Stage 2
must run the sparse op (counted) and, with every key selected (density 1), agree with the dense
model to float32 rounding (2e-5 relative to the output scale: a different summation order only).
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv_ext
import dsv_ext.ops
from dsv_ext.functional.attention import joint_sparse_core
from dsv_ext.modules.attention import SparseAttention
from dsv_ext.config import DSVConfig
from dsv_ext.control.controller import DSVController
from dsv_ext.adopt.convert import convert, sparse_modules
from dsv_ext.adopt.generic import DSVMultiheadAttention, route_sdpa
from dsv_ext.grouping import cube_permutation

B = 2

# diffusers' Mochi opens a float32 CPU autocast region, which torch warns about
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


def _cfg(group_size=8):
    """group_size None: DSVConfig's default groups (128 queries, 4x4x4 cubes: one partial group
    and partial cubes on these 2 x 4 x 6 token grids)."""
    kw = {} if group_size is None else {"group_size": group_size}
    return DSVConfig(k_multiple=8, rank=4, row_sample_stride=4, force_stage2_step=2,
                     dispatch_threshold=0.0, use_calibration=False,
                     k_rule="theta", **kw)  # untrained predictors: the theta rule's K < S


@pytest.fixture
def sparse_calls(monkeypatch):
    """Counts calls of dsv_ext.ops.sparse_attention (the sparse kernel) made by the modules."""
    calls = []
    orig = dsv_ext.ops.sparse_attention

    def counted(*a, **k):
        calls.append(a[0].shape)
        return orig(*a, **k)

    monkeypatch.setattr(dsv_ext.ops, "sparse_attention", counted)
    return calls


# ------------------------------------------------------------------------------------------------
# tiny diffusers video transformers

def _g(seed):
    return torch.Generator().manual_seed(seed)


def _ltx(seed):
    from diffusers import LTXVideoTransformer3DModel
    torch.manual_seed(seed)
    m = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                   cross_attention_dim=32, num_layers=2, caption_channels=16)
    g = _g(seed + 1)
    args = dict(hidden_states=torch.randn(B, 2 * 4 * 6, 4, generator=g),
                encoder_hidden_states=torch.randn(B, 5, 16, generator=g), timestep=torch.tensor([300, 700]),
                encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
                num_frames=2, height=4, width=6)
    return m, args


def _cogvideox(seed):
    from diffusers import CogVideoXTransformer3DModel
    torch.manual_seed(seed)
    m = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                    time_embed_dim=16, text_embed_dim=16, num_layers=2, patch_size=2,
                                    use_rotary_positional_embeddings=True, max_text_seq_length=6)
    g = _g(seed + 1)
    args = dict(hidden_states=torch.randn(B, 2, 4, 8, 12, generator=g),
                encoder_hidden_states=torch.randn(B, 6, 16, generator=g), timestep=torch.tensor([300, 700]),
                image_rotary_emb=(torch.randn(48, 16, generator=g), torch.randn(48, 16, generator=g)))
    return m, args


def _hunyuan(seed):
    from diffusers import HunyuanVideoTransformer3DModel
    torch.manual_seed(seed)
    m = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                       num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2,
                                       patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
                                       rope_axes_dim=(4, 6, 6), guidance_embeds=False)
    g = _g(seed + 1)
    args = dict(hidden_states=torch.randn(B, 4, 2, 8, 12, generator=g), timestep=torch.tensor([300, 700]),
                encoder_hidden_states=torch.randn(B, 6, 16, generator=g),
                encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),
                pooled_projections=torch.randn(B, 8, generator=g))
    return m, args


def _mochi(seed):
    from diffusers import MochiTransformer3DModel
    torch.manual_seed(seed)
    m = MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                                pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=16,
                                max_sequence_length=6)
    g = _g(seed + 1)
    args = dict(hidden_states=torch.randn(B, 4, 2, 8, 12, generator=g),
                encoder_hidden_states=torch.randn(B, 6, 16, generator=g), timestep=torch.tensor([300, 700]),
                encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]))
    return m, args


def _wan(seed, cls_name="WanTransformer3DModel"):
    import diffusers
    torch.manual_seed(seed)
    m = getattr(diffusers, cls_name)(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                     in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64,
                                     num_layers=2, rope_max_seq_len=64)
    g = _g(seed + 1)
    args = dict(hidden_states=torch.randn(B, 4, 2, 8, 12, generator=g), timestep=torch.tensor([300, 700]),
                encoder_hidden_states=torch.randn(B, 5, 16, generator=g))
    return m, args


def _skyreels(seed):  # SkyReels-V2: Wan's attention and arguments
    return _wan(seed, "SkyReelsV2Transformer3DModel")


def _wan_vace(seed):  # Wan VACE: Wan's blocks plus VACE blocks over control latents
    import diffusers
    torch.manual_seed(seed)
    m = diffusers.WanVACETransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                            in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64,
                                            num_layers=2, rope_max_seq_len=64, vace_layers=[0], vace_in_channels=6)
    g = _g(seed + 1)
    args = dict(hidden_states=torch.randn(B, 4, 2, 8, 12, generator=g), timestep=torch.tensor([300, 700]),
                encoder_hidden_states=torch.randn(B, 5, 16, generator=g),
                control_hidden_states=torch.randn(B, 6, 2, 8, 12, generator=g))
    return m, args


def _allegro(seed):
    from diffusers import AllegroTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro
    torch.manual_seed(seed)
    m = AllegroTransformer3DModel(patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=24,
                                  in_channels=4, out_channels=4, num_layers=2, cross_attention_dim=48,
                                  sample_height=8, sample_width=12, sample_frames=2, caption_channels=16)
    g = _g(seed + 1)
    # the pipeline's rotary embedding (AllegroPipeline._prepare_rotary_positional_embeddings) at grid 2 x 4 x 6
    ft, fh, fw, gt, gh, gw = get_3d_rotary_pos_embed_allegro(24, ((0, 0), (4, 6)), (4, 6), 2, (2.2, 2.0, 2.0))
    pos = torch.cartesian_prod(gt.long(), gh.long(), gw.long()).reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1)
    args = dict(hidden_states=torch.randn(B, 4, 2, 8, 12, generator=g),
                encoder_hidden_states=torch.randn(B, 5, 16, generator=g), timestep=torch.tensor([300, 700]),
                encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
                image_rotary_emb=((ft, fh, fw), tuple(pos.contiguous())))
    return m, args


def _cosmos(seed):
    from diffusers import CosmosTransformer3DModel
    torch.manual_seed(seed)
    m = CosmosTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                 num_layers=2, text_embed_dim=16, adaln_lora_dim=8, max_size=(4, 16, 16),
                                 patch_size=(1, 2, 2), concat_padding_mask=False)
    g = _g(seed + 1)
    args = dict(hidden_states=torch.randn(B, 4, 2, 8, 12, generator=g), timestep=torch.tensor([300, 700]),
                encoder_hidden_states=torch.randn(B, 5, 16, generator=g))
    return m, args


# name: (builder, converted attention paths, sparse calls per forward, processor class name)
MODELS = {
    "wan": (_wan, ["blocks.0.attn1", "blocks.1.attn1"], 2, "DSVWanAttnProcessor"),
    "skyreels_v2": (_skyreels, ["blocks.0.attn1", "blocks.1.attn1"], 2, "DSVWanAttnProcessor"),
    "wan_vace": (_wan_vace, ["blocks.0.attn1", "blocks.1.attn1", "vace_blocks.0.attn1"], 3, "DSVWanAttnProcessor"),
    "ltx": (_ltx, ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"], 2, "DSVLTXAttnProcessor"),
    "cogvideox": (_cogvideox, ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"], 2,
                  "DSVCogVideoXAttnProcessor"),
    "hunyuan": (_hunyuan, ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"], 2,
                "DSVHunyuanVideoAttnProcessor"),
    "mochi": (_mochi, ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"], 2 * B, "DSVMochiAttnProcessor"),
    "allegro": (_allegro, ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"], 2,
                "DSVAllegroAttnProcessor"),
    "cosmos": (_cosmos, ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"], 2, "DSVCosmosAttnProcessor"),
}


def _build(name, seed=0):
    pytest.importorskip("diffusers")
    model, args = MODELS[name][0](seed)
    g = _g(seed + 7)
    with torch.no_grad():  # zero-initialised gates / projections would hide the attention
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model, args


def _run(model, args):
    return model(**args, return_dict=False)[0]


def _train(model, args, ctl, steps):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(steps):
        _run(model, args).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ctl.step()


@pytest.mark.parametrize("name", list(MODELS))
def test_diffusers_stage1_bitwise_equal(name):
    model, args = _build(name)
    ref = _run(model, args)
    ref.square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    keys = set(model.state_dict())
    convert(model, config=_cfg())
    assert [n for n, _ in sparse_modules(model)] == [p + ".dsv_core" for p in MODELS[name][1]]
    for p in MODELS[name][1]:
        assert type(model.get_submodule(p).processor).__name__ == MODELS[name][3]
    assert keys < set(model.state_dict())
    ctl = DSVController(model)  # step 0 armed: predictor training + profiling run on the side
    out = _run(model, args)
    assert torch.equal(out, ref)
    out.square().mean().backward()
    assert len(ref_grads) > 20
    for n, g in ref_grads.items():
        assert torch.equal(model.get_parameter(n).grad, g), n
    ctl.step()
    assert ctl.mean_loss() is not None and ctl.mean_sparsity() is not None  # the video part was seen
    # the video token grid comes from the model's patching
    assert all(m.grid == (2, 4, 6) for _, m in sparse_modules(model))


@pytest.mark.parametrize("G", [8, None])
@pytest.mark.parametrize("name", list(MODELS))
def test_diffusers_stage2_sparse_and_save_load(name, G, sparse_calls, tmp_path):
    model, args = _build(name)
    with torch.no_grad():
        dense = _run(model, args)
    convert(model, config=_cfg(G))
    ctl = DSVController(model)
    assert all(m.config.group_size == (G or DSVConfig.group_size) for _, m in ctl.modules)
    _train(model, args, ctl, 3)
    assert ctl.stage == 2 and all(m.use_sparse for _, m in ctl.modules)
    assert all(len(m.head_k) == 2 for _, m in ctl.modules)
    sparse_calls.clear()
    out = _run(model, args)
    assert len(sparse_calls) == MODELS[name][2]
    out.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)

    # save -> load: identical stage-2 outputs, controller state restored
    model.eval()
    with torch.no_grad():
        out1 = _run(model, args)
    dsv_ext.save_pretrained(model, str(tmp_path), ctl)
    cls = type(model)
    model2, ctl2 = dsv_ext.from_pretrained(cls, str(tmp_path))
    assert ctl2.stage == 2 and ctl2.step_count == ctl.step_count
    assert ctl2.config.group_size == ctl.config.group_size and ctl2.config.cube == ctl.config.cube
    assert [m.use_sparse for _, m in ctl2.modules] == [m.use_sparse for _, m in ctl.modules]
    assert [m.head_k for _, m in ctl2.modules] == [m.head_k for _, m in ctl.modules]
    model2.eval()
    sparse_calls.clear()
    with torch.no_grad():
        out2 = _run(model2, args)
    assert len(sparse_calls) == MODELS[name][2]
    assert torch.equal(out1, out2)
    # diffusers' own loader drops the predictors: converting that model is an error, not a warning
    plain = cls.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="^model: .*dsv_ext.from_pretrained"):
        convert(plain)
    # a folder without predictors cannot be loaded as a DSV model
    plain_dir = tmp_path / "plain"
    _build(name)[0].save_pretrained(str(plain_dir))
    with pytest.raises(ValueError, match="^path: .*no DSV predictors"):
        dsv_ext.from_pretrained(cls, str(plain_dir))

    # every key selected (K = S in every head): the stage-2 modules run dense attention, no sparse call
    ctl.set_sparsity([0.0] * len(ctl.modules), force_sparse=True)
    ctl.config.k_margin = 0.0
    sparse_calls.clear()
    with torch.no_grad():
        full = _run(model, args)
    assert len(sparse_calls) == 0
    with torch.no_grad():  # the same weights, unconverted
        ref_model, _ = _build(name)
        ref_model.load_state_dict({k: v for k, v in model.state_dict().items() if ".dsv_core." not in k})
        ref_model.eval()
        ref = _run(ref_model, args)
    assert not torch.equal(ref, dense)  # the training steps changed the weights
    torch.testing.assert_close(full, ref, rtol=0, atol=2e-5 * ref.abs().max().item())


def test_plain_save_pretrained_subfolder_round_trip(tmp_path):
    """diffusers' own save_pretrained of a converted model (a pipeline's subfolder) keeps the
    predictors; from_pretrained restores them and says that the controller state is missing."""
    model, args = _build("ltx")
    convert(model, config=_cfg())
    with torch.no_grad():
        for _, m in sparse_modules(model):
            m.predictor.wq.normal_()
    model.save_pretrained(str(tmp_path / "transformer"))
    cls = type(model)
    with pytest.warns(UserWarning, match="^path: .*no dsv_controller.pt"):
        model2, ctl2 = dsv_ext.from_pretrained(cls, str(tmp_path), subfolder="transformer", config=_cfg())
    assert ctl2.stage == 1
    for (n, a), (n2, b) in zip(sparse_modules(model), sparse_modules(model2)):
        assert n == n2 and torch.equal(a.predictor.wq, b.predictor.wq) and torch.equal(a.predictor.wk, b.predictor.wk)
    plain = cls.from_pretrained(str(tmp_path), subfolder="transformer")
    with pytest.raises(ValueError, match="^model: .*subfolder='transformer'"):
        convert(plain)
    with pytest.raises(TypeError, match="^cls"):
        dsv_ext.from_pretrained("LTX", str(tmp_path))
    with pytest.raises(ValueError, match="^path"):
        dsv_ext.from_pretrained(cls, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="^model"):
        dsv_ext.save_pretrained(_build("ltx")[0], str(tmp_path / "x"))


def test_diffusers_grid_follows_input():
    model, args = _build("hunyuan")
    convert(model, config=_cfg())
    args["hidden_states"] = torch.randn(B, 4, 3, 4, 10)
    with torch.no_grad():
        _run(model, args)
    assert all(m.grid == (3, 2, 5) for _, m in sparse_modules(model))


# ------------------------------------------------------------------------------------------------
# joint text+video core against float64

def _ref_attention(q, k, v, allow):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allow, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def _assert_matches_reference(out, q, k, v, allow):
    """out and its gradients in q, k, v equal the float64 masked softmax's (allow [B, H, S, S])."""
    ref = _ref_attention(q, k, v, allow)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    gout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), gout)
    want = torch.autograd.grad(ref, (q, k, v), gout)
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-12)


def _joint_case(seed, G, density, text_first):
    """A float64 stage-2 SparseAttention (2 heads of 16, grid 2x4x6 = 48 video tokens, 5 text
    tokens) at ``density`` and its inputs: (H, St, Sv, S, cfg, core, q, k, v, vid, txt)."""
    torch.manual_seed(seed)
    H, D, grid, St, Sv = 2, 16, (2, 4, 6), 5, 48
    S = Sv + St
    cfg = DSVConfig(group_size=G, k_multiple=8, rank=4)
    core = SparseAttention(H, D, grid=grid, config=cfg).double()
    core.stage, core.use_sparse = 2, True
    core.set_density(density, seq_len=Sv)
    q, k, v = (torch.randn(B, S, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    vid = slice(St, S) if text_first else slice(0, Sv)
    txt = slice(0, St) if text_first else slice(Sv, S)
    return H, St, Sv, S, cfg, core, q, k, v, vid, txt


@pytest.mark.parametrize("G", [8, 64])  # 64: one partial group of the 48 video tokens
@pytest.mark.parametrize("text_first", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_joint_core_matches_float64_reference(text_first, masked, G):
    """Video queries see their group's top-K video keys and every valid text key, text queries
    every valid key; forward and gradients against an explicit float64 masked softmax."""
    H, St, Sv, S, cfg, core, q, k, v, vid, txt = _joint_case(0, G, [0.3, 0.5], text_first)
    valid = torch.ones(B, S, dtype=torch.bool)
    mask = None
    if masked:
        valid[1, txt.start + 3:txt.stop] = False
        mask = valid[:, None, None, :]
    perm, inv = cube_permutation(core.grid, cfg.cube, Sv)
    out, index = joint_sparse_core(q, k, v, core.predictor.wq, core.predictor.wk, perm, inv, core.kv_count,
                                   core.kmax, G, None, St, text_first, mask, return_index=True)
    assert torch.equal(core(q, k, v, n_text=St, text_first=text_first, attn_mask=mask), out)
    kh = core.kv_count.tolist()
    assert kh == [16, 24]
    allow = valid[:, None, None, :].expand(B, H, S, S).clone()
    vpos = torch.arange(S)[vid]
    for b in range(B):
        for h in range(H):
            for i in range(Sv):
                row = torch.zeros(S, dtype=torch.bool)
                row[vpos[index[b, h, int(inv[i]) // G, :kh[h]].long()]] = True
                row[txt] = valid[b, txt]
                allow[b, h, vpos[i]] = row
    _assert_matches_reference(out, q, k, v, allow)


@pytest.mark.parametrize("text_first", [False, True])
def test_joint_core_dense_heads_match_float64_reference(text_first):
    """A head at K = S (all video keys) runs dense attention for every query; the other head
    its joint lists; forward and gradients against the float64 masked softmax."""
    G = 8
    H, St, Sv, S, cfg, core, q, k, v, vid, txt = _joint_case(1, G, [0.3, 1.0], text_first)
    assert core.kv_count.tolist() == [16, Sv]
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, txt.start + 3:txt.stop] = False
    mask = valid[:, None, None, :]
    perm, inv = cube_permutation(core.grid, cfg.cube, Sv)
    out, index = joint_sparse_core(q, k, v, core.predictor.wq, core.predictor.wk, perm, inv, core.kv_count,
                                   16, G, None, St, text_first, mask, return_index=True, dense_heads=(1,))
    assert index.shape[1] == 1  # the sparse head's lists only
    assert torch.equal(core(q, k, v, n_text=St, text_first=text_first, attn_mask=mask), out)
    allow = valid[:, None, None, :].expand(B, H, S, S).clone()
    vpos = torch.arange(S)[vid]
    for b in range(B):
        for i in range(Sv):
            row = torch.zeros(S, dtype=torch.bool)
            row[vpos[index[b, 0, int(inv[i]) // G, :16].long()]] = True
            row[txt] = valid[b, txt]
            allow[b, 0, vpos[i]] = row
    _assert_matches_reference(out, q, k, v, allow)
    with pytest.raises(ValueError, match="^dense_heads: expected head indices in \\[0, 2\\)"):
        joint_sparse_core(q, k, v, core.predictor.wq, core.predictor.wk, perm, inv, core.kv_count, 16, G, None,
                          St, text_first, mask, dense_heads=(2,))
    # both heads at K = S: the whole call is dense attention
    core.set_density([1.0, 1.0], seq_len=Sv)
    full = core(q, k, v, n_text=St, text_first=text_first, attn_mask=mask)
    torch.testing.assert_close(full, _ref_attention(q, k, v, valid[:, None, None, :].expand(B, H, S, S)),
                               rtol=0, atol=1e-12)


def test_joint_key_padding_mask_as_b_by_s():
    """A key-padding mask given as [B, S] (the class doc's second form) gives what [B, 1, 1, S]
    gives, in stage 1 (dense) and in stage 2 (sparse, and with a head at K = S)."""
    torch.manual_seed(2)
    core = SparseAttention(2, 16, grid=(2, 4, 6), config=DSVConfig(group_size=8, k_multiple=8, rank=4))
    q, k, v = (torch.randn(B, 53, 2, 16) for _ in range(3))
    valid = torch.ones(B, 53, dtype=torch.bool)
    valid[1, 50:] = False
    for density in (None, [0.3, 0.5], [0.3, 1.0]):
        if density is not None:
            core.stage, core.use_sparse = 2, True
            core.set_density(density, seq_len=48)
        want = core(q, k, v, n_text=5, attn_mask=valid[:, None, None, :])
        torch.testing.assert_close(core(q, k, v, n_text=5, attn_mask=valid), want, rtol=0, atol=0)
        # the masked text keys matter (the test can fail)
        assert not torch.allclose(core(q, k, v, n_text=5), want, atol=1e-4)


def test_joint_index_reuse_in_eval():
    torch.manual_seed(0)
    core = SparseAttention(2, 16, grid=(2, 4, 6), config=DSVConfig(group_size=8, k_multiple=8, rank=4)).eval()
    core.stage, core.use_sparse = 2, True
    core.set_density([0.3, 0.5], seq_len=48)
    core.set_index_refresh(2)
    q, k, v = (torch.randn(B, 53, 2, 16) for _ in range(3))
    first = core(q, k, v, n_text=5)
    key_index = core._index_cache[1]
    q2 = torch.randn_like(q)
    second = core(q2, k, v, n_text=5)                # reuses the index of the first call
    assert core._index_cache[1] is key_index
    core.set_index_refresh(1)
    again = core(q, k, v, n_text=5)
    assert torch.equal(first, again)
    want, index = joint_sparse_core(q2, k, v, core.predictor.wq, core.predictor.wk,
                                    *cube_permutation((2, 4, 6), core.config.cube, 48), core.kv_count, core.kmax,
                                    8, None, 5, index=key_index, return_index=True)
    assert torch.equal(second, want)


def test_joint_core_argument_errors():
    core = SparseAttention(2, 8)
    q = torch.randn(1, 10, 2, 8)
    with pytest.raises(ValueError, match="^n_text"):
        core(q, q, q, n_text=10)
    with pytest.raises(ValueError, match="^grid"):
        core(q, q, q, grid=(2, 2, 2), n_text=4)


# ------------------------------------------------------------------------------------------------
# generic blocks

def _encoder(batch_first, seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, dropout=0.0,
                                       batch_first=batch_first)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


class SDPABlock(nn.Module):
    """The common qkv-linear + F.scaled_dot_product_attention block."""

    def __init__(self, dim=32, num_heads=2):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        Bx, S, _ = x.shape
        q, k, v = self.qkv(x).view(Bx, S, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(o.transpose(1, 2).reshape(Bx, S, -1))


def _sdpa_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(SDPABlock(), nn.LayerNorm(32), SDPABlock())


GENERIC = {
    "mha_batch_first": (lambda s=0: _encoder(True, s), lambda: {}, True),
    "mha_seq_first": (lambda s=0: _encoder(False, s), lambda: {}, False),
    "sdpa": (_sdpa_model, lambda: {"sdpa_modules": (SDPABlock,)}, True),
}


def _x(batch_first, seed=1):
    x = torch.randn(B, 48, 32, generator=_g(seed))
    return x if batch_first else x.transpose(0, 1)


@pytest.mark.parametrize("name", list(GENERIC))
def test_generic_stage1_bitwise_equal(name):
    build, kw, bf = GENERIC[name]
    model = build()
    x = _x(bf)
    ref = model(x)
    ref.square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    convert(model, grid=(2, 4, 6), config=_cfg(), **kw())
    assert len(sparse_modules(model)) == 2
    if name.startswith("mha"):
        assert all(isinstance(l.self_attn, DSVMultiheadAttention) for l in model.layers)
    ctl = DSVController(model)
    out = model(x)
    assert F.scaled_dot_product_attention is dsv_ext.functional.attention._SDPA  # the scoped patch is gone
    assert torch.equal(out, ref)
    out.square().mean().backward()
    for n, p in model.named_parameters():
        if n in ref_grads:
            assert torch.equal(p.grad, ref_grads[n]), n
    ctl.step()
    assert ctl.mean_loss() is not None and ctl.mean_sparsity() is not None


@pytest.mark.parametrize("name", list(GENERIC))
def test_generic_stage2_sparse_and_state_round_trip(name, sparse_calls):
    build, kw, bf = GENERIC[name]
    model = build()
    x = _x(bf)
    convert(model, grid=(2, 4, 6), config=_cfg(), **kw())
    ctl = DSVController(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ctl.step()
    assert ctl.stage == 2 and all(m.use_sparse for _, m in ctl.modules)
    sparse_calls.clear()
    out = model(x)
    # one sparse call per module with a head at K < S (heads at K = S run dense)
    n_sparse = sum(any(k < m.k_seq_len for k in m.head_k) for _, m in ctl.modules)
    assert n_sparse >= 1 and len(sparse_calls) == n_sparse
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    model.zero_grad()
    with torch.no_grad():
        out1 = model(x)
    # torch.save of the state dicts -> a fresh converted model
    model2 = build(5)
    convert(model2, grid=(2, 4, 6), config=_cfg(), **kw())
    ctl2 = DSVController(model2)
    model2.load_state_dict(model.state_dict())
    ctl2.load_state_dict(ctl.state_dict())
    sparse_calls.clear()
    with torch.no_grad():
        out2 = model2(x)
    assert len(sparse_calls) == n_sparse and torch.equal(out1, out2)
    # every key selected: dense attention up to float32 rounding
    ctl.config.k_margin = 0.0
    ctl.set_sparsity([0.0, 0.0], force_sparse=True)
    with torch.no_grad():
        full = model(x)
        ctl.set_sparsity([0.0, 0.0], force_sparse=False)
        dense = model(x)
    torch.testing.assert_close(full, dense, rtol=0, atol=2e-5 * dense.abs().max().item())


def test_route_sdpa_scope_and_fallbacks():
    blk = SDPABlock()
    core = route_sdpa(blk, 2, 16, grid=(2, 4, 6), config=_cfg())
    assert route_sdpa(blk, 2, 16) is core  # idempotent
    with pytest.raises(ValueError, match="^num_heads"):
        route_sdpa(blk, 4, 8)
    # a forward that raises leaves SDPA unpatched
    with pytest.raises(RuntimeError):
        blk(torch.randn(B, 48, 31))
    assert F.scaled_dot_product_attention is dsv_ext.functional.attention._SDPA
    # masked / causal calls inside the module keep the original SDPA in stage 2
    core.stage, core.use_sparse = 2, True
    core.set_density([0.5, 0.5], seq_len=48)

    class Causal(SDPABlock):
        def forward(self, x):
            Bx, S, _ = x.shape
            q, k, v = self.qkv(x).view(Bx, S, 3, 2, 16).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    c = Causal()
    c.load_state_dict({k: v for k, v in blk.state_dict().items() if "dsv_core" not in k})
    route_sdpa(c, 2, 16).stage = 2
    x = torch.randn(B, 48, 32)
    q, k, v = c.qkv(x).view(B, 48, 3, 2, 16).permute(2, 0, 3, 1, 4)
    assert torch.equal(c(x), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    with pytest.raises(TypeError, match="^module"):
        route_sdpa("x", 2, 16)
    with pytest.raises(TypeError, match="^sdpa_modules"):
        convert(SDPABlock(), sdpa_modules=("SDPABlock",))


def test_mha_decoder_cross_attention_not_converted():
    layer = nn.TransformerDecoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    other = nn.MultiheadAttention(32, 2, kdim=16, vdim=16)
    convert(nn.Sequential(layer, nn.ModuleList([other])), grid=(2, 4, 6))
    assert isinstance(layer.self_attn, DSVMultiheadAttention)
    assert type(layer.multihead_attn) is nn.MultiheadAttention and type(other) is nn.MultiheadAttention


def test_mha_cross_attention_and_masks_stay_dense(sparse_calls):
    mha = nn.MultiheadAttention(32, 2, batch_first=True)
    convert(nn.Sequential(mha), grid=(2, 4, 6), config=_cfg())
    core = mha.dsv_core
    core.stage, core.use_sparse = 2, True
    core.set_density([0.5, 0.5], seq_len=48)
    x, y = torch.randn(B, 48, 32), torch.randn(B, 48, 32)
    ref = nn.MultiheadAttention(32, 2, batch_first=True)
    ref.load_state_dict({k: v for k, v in mha.state_dict().items() if "dsv_core" not in k})
    assert torch.equal(mha(x, y, y)[0], ref(x, y, y)[0])                 # cross-attention
    kpm = torch.zeros(B, 48, dtype=torch.bool)
    kpm[:, -3:] = True
    assert torch.equal(mha(x, x, x, key_padding_mask=kpm)[0], ref(x, x, x, key_padding_mask=kpm)[0])
    assert not sparse_calls
    with pytest.warns(UserWarning, match="need_weights"):
        out, w = mha(x, x, x)
    assert w is None and len(sparse_calls) == 1
    # unbatched input [S, E]: the same as its batch of one
    x0, x1 = x[0], x[:1]
    out1, _ = mha(x0, x0, x0, need_weights=False)
    assert out1.shape == (48, 32) and len(sparse_calls) == 2
    torch.testing.assert_close(out1, mha(x1, x1, x1, need_weights=False)[0][0], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# GPU (skipped without one)

@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and dsv_ext.has_cuda_kernels()),
                    reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("text_first", [False, True])
def test_joint_core_cuda_bf16_matches_cpu_float64(text_first):
    """The CUDA kernels on the joint lists (bf16, head dim 64) against the same lists in float64
    on the CPU. Bounds as tests/helpers.py states them for bf16 (CUDA_TOL): elementwise
    1.6e-2 * rms + 2e-2 * |ref| for the output; relative Frobenius error 2e-2 for the gradients."""
    torch.manual_seed(0)
    H, D, grid, St, G = 2, 64, (2, 8, 8), 40, 32
    Sv = 128
    S = Sv + St
    cfg = DSVConfig(group_size=G, k_multiple=16, rank=8)
    core = SparseAttention(H, D, grid=grid, config=cfg)
    core.set_density([0.3, 0.5], seq_len=Sv)
    valid = torch.ones(B, S, dtype=torch.bool)
    txt = slice(0, St) if text_first else slice(Sv, S)
    valid[1, txt.start + 30:txt.stop] = False
    mask = valid[:, None, None, :]
    perm, inv = cube_permutation(grid, cfg.cube, Sv)
    x = [torch.randn(B, S, H, D).bfloat16() for _ in range(3)]
    gout = torch.randn(B, S, H, D).bfloat16()
    dev = [t.cuda().requires_grad_(True) for t in x]
    out, index = joint_sparse_core(*dev, core.predictor.wq.cuda(), core.predictor.wk.cuda(), perm.cuda(), inv.cuda(),
                                   core.kv_count.cuda(), core.kmax, G, None, St, text_first, mask.cuda(),
                                   return_index=True)
    grads = torch.autograd.grad(out, dev, gout.cuda())
    ref_in = [t.double().requires_grad_(True) for t in x]
    ref = joint_sparse_core(*ref_in, core.predictor.wq.double(), core.predictor.wk.double(), perm, inv,
                            core.kv_count, core.kmax, G, None, St, text_first, mask, index=index.cpu())
    ref_grads = torch.autograd.grad(ref, ref_in, gout.double())
    o, r = out.double().cpu(), ref.detach()
    rms = r.square().mean().sqrt()
    assert ((o - r).abs() <= 1.6e-2 * rms + 2e-2 * r.abs()).all()
    for g, rg in zip(grads, ref_grads):
        assert (g.double().cpu() - rg).norm() <= 2e-2 * rg.norm()


def _cuda_stage2_step(model, args, sparse_calls):
    """Convert a CUDA model, train it in bf16 to stage 2 (every block sparse), then one more step:
    two sparse calls, finite output and gradients. Returns the controller."""
    convert(model, config=DSVConfig(group_size=32, k_multiple=16, force_stage2_step=2, dispatch_threshold=0.0,
                                    use_calibration=False, k_rule="theta"))
    ctl = DSVController(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        with torch.autocast("cuda", torch.bfloat16):
            out = model(**args, return_dict=False)[0]
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        ctl.step()
    assert ctl.stage == 2 and all(m.use_sparse for _, m in ctl.modules)
    sparse_calls.clear()
    with torch.autocast("cuda", torch.bfloat16):
        out = model(**args, return_dict=False)[0]
    assert len(sparse_calls) == 2 and torch.isfinite(out).all()
    out.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    return ctl


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and dsv_ext.has_cuda_kernels()),
                    reason="needs a GPU and the CUDA kernels")
def test_diffusers_joint_model_cuda_stage2(sparse_calls):
    """HunyuanVideo (joint attention, text padding) with head dim 64 on the GPU in bf16: stage 2
    runs the sparse kernels and trains with finite gradients."""
    pytest.importorskip("diffusers")
    from diffusers import HunyuanVideoTransformer3DModel
    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                           attention_head_dim=64, num_layers=1, num_single_layers=1,
                                           num_refiner_layers=1, patch_size=2, text_embed_dim=16,
                                           pooled_projection_dim=8, rope_axes_dim=(16, 24, 24),
                                           guidance_embeds=False).cuda()
    args = dict(hidden_states=torch.randn(B, 4, 4, 16, 16, device="cuda"), timestep=torch.tensor([300, 700]).cuda(),
                encoder_hidden_states=torch.randn(B, 40, 16, device="cuda"),
                encoder_attention_mask=(torch.arange(40) < torch.tensor([[40], [25]])).long().cuda(),
                pooled_projections=torch.randn(B, 8, device="cuda"))
    _cuda_stage2_step(model, args, sparse_calls)


def _allegro_cuda():
    from diffusers import AllegroTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro
    model = AllegroTransformer3DModel(patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=96,
                                      in_channels=4, out_channels=4, num_layers=2, cross_attention_dim=192,
                                      sample_height=16, sample_width=16, sample_frames=4, caption_channels=16)
    ft, fh, fw, gt, gh, gw = get_3d_rotary_pos_embed_allegro(96, ((0, 0), (8, 8)), (8, 8), 4, (2.2, 2.0, 2.0))
    pos = torch.cartesian_prod(gt.long(), gh.long(), gw.long()).reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1)
    rope = (tuple((c.cuda(), s.cuda()) for c, s in (ft, fh, fw)), tuple(p.cuda() for p in pos.contiguous()))
    return model, dict(encoder_hidden_states=torch.randn(B, 6, 16, device="cuda"), image_rotary_emb=rope)


def _cosmos_cuda():
    from diffusers import CosmosTransformer3DModel
    model = CosmosTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=128,
                                     num_layers=2, text_embed_dim=16, adaln_lora_dim=8, max_size=(8, 32, 32),
                                     patch_size=(1, 2, 2), concat_padding_mask=False)
    return model, dict(encoder_hidden_states=torch.randn(B, 6, 16, device="cuda"))


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and dsv_ext.has_cuda_kernels()),
                    reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("name,build,head_dim", [("allegro", _allegro_cuda, 96), ("cosmos", _cosmos_cuda, 128)])
def test_diffusers_self_attention_models_cuda_stage2(name, build, head_dim, sparse_calls):
    """Allegro (heads of 96, zero-padded for the kernels where the wgmma kernels run) and Cosmos
    (heads of 128) on the GPU in bf16: stage 2 runs the sparse kernels, with finite outputs and
    gradients (their values against float64: test_sparse_attention_cuda.py)."""
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model, args = build()
    model.cuda()
    args.update(hidden_states=torch.randn(B, 4, 4, 16, 16, device="cuda"), timestep=torch.tensor([300, 700]).cuda())
    ctl = _cuda_stage2_step(model, args, sparse_calls)
    assert all(m.head_dim == head_dim for _, m in ctl.modules)
    assert all(shape[-1] == head_dim for shape in sparse_calls)
