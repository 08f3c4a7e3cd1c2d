"""benchmarks/profile_step.py: the step profile of a config (CPU run of the tiny config) and the
kinds it sorts kernel names into."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import profile_step as PS  # noqa: E402


@pytest.mark.parametrize("name,kind", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
    ("void dsv_attn::sparse_attn_fwd_wg_kernel<__nv_bfloat16, 128>", "attention"),
    ("void dsv_topk::dsv_topk_kernel<16>", "dsv side work"),
    ("dsv::predictor_loss_bwd", "dsv side work"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("aten::addmm", "matmul"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "other"),
    ("aten::rms_norm", "other"),
])
def test_kind_of(name, kind):
    assert PS.kind_of(name) == kind


@pytest.mark.parametrize("attention", ["dense", "dsv"])
def test_profile_of_the_tiny_config(tmp_path, capsys, attention):
    out = tmp_path / "p.json"
    rc = PS.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--device", "cpu",
                  "--attention", attention, "--warmup", "0", "--steps", "1", "--json", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    ms = got["ms_per_step"]
    assert set(ms) == set(PS.KINDS) and ms["attention"] > 0 and ms["matmul"] > 0
    assert (ms["dsv side work"] > 0) == (attention == "dsv")  # stage 1 trains the predictors
    assert got["top"] and all(r["kind"] in PS.KINDS for r in got["top"])
    assert "ms of CPU time per step" in capsys.readouterr().out


def test_bad_arguments():
    with pytest.raises(SystemExit):
        PS.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--steps", "0"])


def test_profile_of_a_checkpoint_past_the_switch(tmp_path, capsys):
    """--checkpoint: the model's weights and the controller's saved state (stage 2, its sparse
    blocks): the profiled step runs the top-K estimation and the sparse kernels; the slim copy
    and the checkpoint's own config work as well."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_train import micro_config  # noqa: E402

    from dsv_ext.app.checkpoint import load_checkpoint, slim_checkpoint
    from dsv_ext.app.train import train

    train(micro_config(), out_dir=str(tmp_path / "a"), attention="dsv", device="cpu", progress=False)
    src = str(tmp_path / "a" / "ckpt_last.pt")
    assert load_checkpoint(src)["controller"]["stage"] == 2
    slim = str(tmp_path / "slim.pt")
    slim_checkpoint(src, slim)
    for ck in (src, slim):
        out = tmp_path / "p.json"
        assert PS.main(["--checkpoint", ck, "--device", "cpu", "--attention", "dsv", "--warmup", "0",
                        "--steps", "1", "--top", "200", "--json", str(out)]) == 0
        got = json.loads(out.read_text())
        assert got["dsv_stage"] == 2 and got["config"] == "micro" and got["checkpoint"] == ck
        names = " ".join(r["name"] for r in got["top"])
        assert "topk_estimate" in names and "sparse_attention" in names, names
        assert "attention=dsv (DSV stage 2)" in capsys.readouterr().out
    # dense attention from a DSV checkpoint: its weights without the predictors
    assert PS.main(["--checkpoint", slim, "--device", "cpu", "--warmup", "0", "--steps", "1"]) == 0
    with pytest.raises(SystemExit):
        PS.main(["--steps", "1"])  # neither --config nor --checkpoint
