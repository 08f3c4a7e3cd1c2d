"""dsv_ext.convert on diffusers' Wan transformer, the reference video DiT and `.attn_core` models."""
import sys

import pytest
import torch

from dsv_ext.modules.attention import DenseAttention, DSVAttention, SparseAttention
from dsv_ext.config import DSVConfig
from dsv_ext.control.controller import DSVController
from dsv_ext.adopt.convert import DSVWanAttnProcessor, convert, sparse_modules

diffusers = pytest.importorskip("diffusers")


def _tiny_wan(seed=0):
    from diffusers import WanTransformer3DModel
    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                 in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                                 num_layers=2, rope_max_seq_len=64)


def _wan_inputs(T=3, Hl=8, Wl=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, T, Hl, Wl, generator=g), torch.tensor([500]), torch.randn(1, 7, 32, generator=g))


def test_wan_stage1_outputs_and_grads_unchanged():
    model = _tiny_wan()
    x, t, enc = _wan_inputs()
    ref = model(x, t, enc, return_dict=False)[0]
    ref.square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    keys_before = set(model.state_dict())

    assert convert(model) is model
    mods = sparse_modules(model)
    assert [n for n, _ in mods] == ["blocks.0.attn1.dsv_core", "blocks.1.attn1.dsv_core"]
    assert all(isinstance(b.attn1.processor, DSVWanAttnProcessor) for b in model.blocks)
    assert all(not isinstance(b.attn2.processor, DSVWanAttnProcessor) for b in model.blocks)  # cross-attn
    assert keys_before < set(model.state_dict())
    out = model(x, t, enc, return_dict=False)[0]
    assert torch.equal(out, ref)
    out.square().mean().backward()
    for n, p in model.named_parameters():
        if n in ref_grads:
            assert torch.equal(p.grad, ref_grads[n]), n
    # the token grid is taken from each forward's latent shape / patch size
    assert all(m.grid == (3, 4, 6) for _, m in mods)
    x2, t2, enc2 = _wan_inputs(T=2, Hl=6, Wl=10, seed=1)
    model(x2, t2, enc2)
    assert all(m.grid == (2, 3, 5) for _, m in mods)


def test_wan_trains_with_controller_and_goes_sparse():
    cfg = DSVConfig(group_size=8, k_multiple=8, row_sample_stride=4, force_stage2_step=2, dispatch_threshold=0.0,
                    use_calibration=False, k_rule="theta")  # untrained predictors: the theta rule's K < S
    model = convert(_tiny_wan(), config=cfg)
    ctl = DSVController(model)
    assert len(ctl.modules) == 2 and ctl.config is cfg
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x, t, enc = _wan_inputs()
    for _ in range(3):
        out = model(x, t, enc, return_dict=False)[0]
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        ctl.step()
    assert ctl.stage == 2 and all(m.use_sparse for _, m in ctl.modules)
    s = ctl.summary()
    assert s["dsv/sparse_blocks"] == 2 and 0 <= s["dsv/sparsity"] <= 1 and s["dsv/loss"] > 0
    assert torch.isfinite(model(x, t, enc, return_dict=False)[0]).all()


def test_reference_dit_dense_layers_converted_in_place():
    from dsv_ext.app.models.dit import DiTConfig, SelfAttention, VideoDiT
    cfg = DiTConfig(latent_size=(2, 6, 10), patch=(1, 2, 2), hidden=32, depth=2, heads=2, attention="dense")
    model = VideoDiT(cfg, seed=0)
    x = torch.randn(2, 4, 2, 6, 10)
    tt = torch.rand(2)
    with torch.no_grad():
        for p in model.parameters():  # adaLN-zero starts at zero: make the blocks matter
            p.add_(0.02 * torch.randn_like(p))
    ref = model(x, tt)
    keys = set(model.state_dict())
    qkv0 = model.blocks[0].attn.qkv
    convert(model, config=DSVConfig(group_size=8))
    assert not any(isinstance(m, SelfAttention) for m in model.modules())
    attn = model.blocks[0].attn
    assert isinstance(attn, DSVAttention) and attn.qkv is qkv0  # same parameters, no copies
    assert attn.attn_core.grid == (2, 3, 5)  # model.cfg.grid
    assert keys < set(model.state_dict())
    assert torch.equal(model(x, tt), ref)



def test_register_layer_teaches_convert_a_layer_class():
    import dsv_ext.adopt.convert as convert_mod
    from dsv_ext import register_layer

    class MyAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

        def forward(self, x):
            q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 8).transpose(1, 3).unbind(2)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return self.proj(o.transpose(1, 2).flatten(2))

    class Sub(MyAttention):  # exactly the registered class only
        pass

    seen = []

    def replace(layer, grid, config):
        seen.append((grid, config))
        return DSVAttention.from_modules(layer.qkv, layer.proj, 2, 8, grid=grid, config=config)

    with pytest.raises(TypeError, match="^cls"):
        register_layer(int, replace)
    with pytest.raises(TypeError, match="^replace"):
        register_layer(MyAttention, "nope")
    register_layer(MyAttention, replace)
    try:
        model = torch.nn.Sequential(MyAttention(), MyAttention()).eval()
        qkv0 = model[0].qkv
        x = torch.randn(2, 30, 16)
        ref = model(x)
        cfg = DSVConfig(rank=4)
        convert(model, grid=(2, 3, 5), config=cfg)
        assert all(type(m) is DSVAttention and not m.training for m in model) and model[0].qkv is qkv0
        assert seen == [((2, 3, 5), cfg)] * 2
        assert [m.name for _, m in sparse_modules(model)] == ["0.attn_core", "1.attn_core"]
        torch.testing.assert_close(model(x), ref)  # stage 1: the same dense attention
        with pytest.raises(ValueError, match="^model: no convertible"):
            convert(torch.nn.Sequential(Sub()))
        register_layer(MyAttention, lambda layer, grid, config: "not a module")
        with pytest.raises(TypeError, match="^register_layer: .*MyAttention"):
            convert(torch.nn.Sequential(MyAttention()))
        with pytest.raises(ValueError, match="^model: is itself"):
            convert(MyAttention())
    finally:
        convert_mod._LAYERS.pop(MyAttention, None)


def test_attn_core_hook_and_existing_sparse_attention():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads, self.head_dim = 2, 8
            self.qkv = torch.nn.Linear(16, 48)
            self.attn_core = DenseAttention(2, 8)

        def forward(self, x):
            q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 8).unbind(2)
            return self.attn_core(q, k, v).flatten(2)

    model = torch.nn.Sequential(Layer(), DSVAttention(16, 2))
    x = torch.randn(2, 30, 16)
    ref = model(x)
    cfg = DSVConfig(rank=4)
    convert(model, grid=(2, 3, 5), config=cfg)
    assert isinstance(model[0].attn_core, SparseAttention)
    assert all(m.grid == (2, 3, 5) and m.config is cfg for _, m in sparse_modules(model))
    assert model[0].attn_core.predictor.rank == 4
    assert torch.equal(model(x), ref)


def test_convert_errors():
    with pytest.raises(ValueError, match="^model"):
        convert(torch.nn.Linear(3, 3))
    with pytest.raises(TypeError, match="^model"):
        convert("nope")
    with pytest.raises(ValueError, match="^grid"):
        convert(torch.nn.Sequential(DSVAttention(16, 2)), grid=(2, 0, 2))

    class NoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_core = torch.nn.Identity()

    with pytest.raises(ValueError, match="num_heads"):
        convert(torch.nn.Sequential(NoHeads()))


def test_package_level_convert_is_callable_after_submodule_import():
    import dsv_ext
    import dsv_ext.adopt.convert  # noqa: F401
    model = dsv_ext.convert(torch.nn.Sequential(DSVAttention(16, 2)), grid=(2, 3, 5))
    assert model[0].attn_core.grid == (2, 3, 5)
    sys.modules.pop("dsv_ext.convert", None)
    with pytest.warns(DeprecationWarning, match="dsv_ext.adopt.convert"):
        import dsv_ext.convert  # the old path binds the package attribute to the module
    model = dsv_ext.convert(torch.nn.Sequential(DSVAttention(16, 2)), grid=(2, 3, 5))
    assert model[0].attn_core.grid == (2, 3, 5)


def test_convert_gives_existing_cores_the_config_rank():
    """An existing SparseAttention (inside DSVAttention, or from an earlier convert) takes the
    new config; its predictor must then have the config's rank, not the one it was built with."""
    model = torch.nn.Sequential(DSVAttention(16, 2))
    assert model[0].attn_core.predictor.rank == 16
    convert(model, grid=(2, 3, 5), config=DSVConfig(rank=4))
    core = model[0].attn_core
    assert core.config.rank == 4 and core.predictor.rank == 4
    assert core.predictor.wq.shape == core.predictor.wk.shape == (2, 8, 4)
    ctl = DSVController(model)  # the controller accepts it (its config's rank matches)
    model.train()(torch.randn(1, 30, 16))
    ctl.step()
    assert ctl.mean_loss() is not None
