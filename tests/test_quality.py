"""Paired quality evaluation (dsv_ext.app.evaluate) and the multi-seed comparison (compare --seeds)."""
import json
import math

import pytest
import torch

from dsv_ext.app.checkpoint import load_checkpoint, save_checkpoint
from dsv_ext.app.models import dsv_attention_available
from test_train import micro_config

needs_dsv = pytest.mark.skipif(not dsv_attention_available(), reason="DSVAttention not importable")


def test_paired_stats():
    from dsv_ext.app.evaluate import paired_stats

    g = torch.Generator().manual_seed(0)
    a = torch.rand(12, generator=g, dtype=torch.float64) + 1.0
    d = torch.randn(12, generator=g, dtype=torch.float64) * 0.01
    st = paired_stats(a, a + d, 3)  # 4 videos x 3 timesteps
    per_video = [sum(d[3 * j:3 * j + 3].tolist()) / 3 for j in range(4)]
    m = sum(per_video) / 4
    se = math.sqrt(sum((x - m) ** 2 for x in per_video) / 3) / 2
    base = sum(a.tolist()) / 12
    assert st["diff"] == pytest.approx(m, abs=1e-15) and st["diff_se"] == pytest.approx(se, rel=1e-12)
    assert st["rel"] == pytest.approx(m / base, rel=1e-12) and st["rel_se"] == pytest.approx(se / base, rel=1e-12)
    assert st["videos"] == 4 and st["loss_full"] == pytest.approx(base, rel=1e-14)
    assert paired_stats(a[:3], a[:3], 3)["diff_se"] is None  # one video: no standard error
    with pytest.raises(ValueError, match="^b"):
        paired_stats(a, a[:6], 3)
    with pytest.raises(ValueError, match="^per_video"):
        paired_stats(a, a, 5)


def test_seed_stats_and_verdict():
    from dsv_ext.app.seeds import gap_verdict, seed_stats

    st = seed_stats([1.0, 2.0, 3.0])
    h = 4.303 / math.sqrt(3)
    assert st["mean"] == 2.0 and st["std"] == pytest.approx(1.0) and st["ci95"] == pytest.approx([2 - h, 2 + h])
    assert seed_stats([5.0])["ci95"] is None
    assert gap_verdict([-0.004, 0.008]).startswith("resolved") and "within 1%" in gap_verdict([-0.004, 0.008])
    assert gap_verdict([0.012, 0.03]).startswith("resolved") and "above" in gap_verdict([0.012, 0.03])
    assert gap_verdict([0.0, 0.02]).startswith("not resolved")
    assert gap_verdict(None).startswith("not resolved")
    with pytest.raises(ValueError, match="^xs"):
        seed_stats([])


@pytest.fixture(scope="module")
def micro_ckpt(tmp_path_factory):
    if not dsv_attention_available():
        pytest.skip("DSVAttention not importable")
    from dsv_ext.app.train import train

    out = tmp_path_factory.mktemp("micro_dsv")
    cfg = micro_config()  # the theta K rule: its blocks run sparse in stage 2 (the "checkpoint" arm)
    train(cfg, out_dir=str(out), attention="dsv", device="cpu", progress=False)
    # adaLN-zero layers (still ~0 after 6 steps) set to random values, so that attention changes
    # the output at O(1) and a sparse approximation shows
    ck = load_checkpoint(str(out / "ckpt_last.pt"), map_location="cpu")
    g = torch.Generator().manual_seed(0)
    for name, v in ck["model"].items():
        if name.endswith(("ada.1.weight", "final.linear.weight")):
            v.copy_(torch.randn(v.shape, generator=g) * 0.2)
    save_checkpoint(ck, str(out / "ckpt_active.pt"))
    return str(out / "ckpt_active.pt")


@needs_dsv
def test_paired_evaluation_on_a_trained_checkpoint(micro_ckpt, tmp_path):
    from dsv_ext.modules.attention import SparseAttention
    from dsv_ext.app.evaluate import evaluate, main
    from dsv_ext.recall import k_for_recall
    from dsv_ext.app.common import TrainConfig, ValidationSet, build_model, load_config, validation_loss

    ck = torch.load(micro_ckpt, map_location="cpu", weights_only=False)
    # every head may run sparse at its K (no all-keys cap): a low target drops keys
    cfg = load_config(base=ck["config"], overrides=["dsv.recall_max_density=1.0", "dsv.k_rule=recall"])
    res = evaluate(cfg, ck, str(tmp_path / "ev"), targets=[0.5, 1.0], device="cpu", calib_batches=2,
                   progress=False)
    S = 64
    arms = {(a["arm"], a["target"]): a for a in res["arms"]}
    assert ("checkpoint", None) in arms  # the run reached stage 2
    assert set(arms) >= {("all", 0.5), ("block 0", 0.5), ("block 1", 0.5), ("all", 1.0)}
    lo, full_k = arms[("all", 0.5)], arms[("all", 1.0)]
    # the K of every head is the recall rule's on the measured curve (min_density 0.25 -> >= 16)
    for blk, c in enumerate(res["curves"]):
        want = [max(k_for_recall(c[h], 0.5, S, 16), 16) for h in range(len(c))]
        assert lo["head_k"][blk] == want
        assert full_k["head_k"][blk] == [S] * len(c)
    assert any(k < S for ks in lo["head_k"] for k in ks)
    # K = S: sparse attention over all keys equals full attention up to float32 round-off
    assert abs(full_k["rel"]) < 1e-5
    assert abs(lo["diff"]) > 1e-6 and lo["diff_se"] is not None and lo["diff_se"] > 0
    # independent recomputation of both losses on the same validation set
    tcfg = TrainConfig.from_dict(cfg["train"])
    torch.manual_seed(0)
    model, _ = build_model(cfg, "dsv", "cpu")
    model.load_state_dict(ck["model"])
    vs = ValidationSet(cfg, tcfg)
    cores = [m for m in model.modules() if isinstance(m, SparseAttention)]
    assert validation_loss(model, vs, torch.device("cpu"), "fp32") == pytest.approx(res["loss_full"], rel=1e-12)
    for m, ks in zip(cores, lo["head_k"]):
        m.stage, m.use_sparse = 2, True
        m.set_head_k(ks, S)
    assert validation_loss(model, vs, torch.device("cpu"), "fp32") == pytest.approx(lo["loss_sparse"], rel=1e-9)
    assert arms[("block 0", 0.5)]["sparse_blocks"] == [0]
    # the files and the command line
    assert json.load(open(tmp_path / "ev" / "evaluate.json"))["loss_full"] == res["loss_full"]
    md = open(tmp_path / "ev" / "evaluate.md").read()
    assert "| all | 0.50 |" in md and "Measured " in md and res["provenance"]["device_name"] == "cpu"
    assert main(["--checkpoint", micro_ckpt, "--out", str(tmp_path / "cli"), "--targets", "0.9",
                 "--no-per-block", "--calib-batches", "1", "--device", "cpu", "--no-progress"]) == 0
    r = json.load(open(tmp_path / "cli" / "evaluate.json"))
    assert [a["arm"] for a in r["arms"] if a["target"] == 0.9][0] == "all"
    assert not any(a["arm"].startswith("block") for a in r["arms"])
    with pytest.raises(ValueError, match="^targets"):
        evaluate(cfg, ck, None, targets=[1.5], device="cpu", progress=False)
    dense_ck = dict(ck, attention="dense")
    with pytest.raises(ValueError, match="^checkpoint"):
        evaluate(cfg, dense_ck, None, device="cpu", progress=False)
    assert main(["--checkpoint", str(tmp_path / "missing.pt")]) != 0


def test_stage2_val_gap():
    """The gap of the mean validation loss over the validations after DSV's switch."""
    from dsv_ext.app.compare import stage2_val_gap

    run = {"switch_step": 200, "val_at_equal_steps": [
        {"step": 100, "dense": 9.0, "dsv": 1.0},  # stage 1: not counted
        {"step": 200, "dense": 9.0, "dsv": 1.0},  # the switch step itself: not counted
        {"step": 300, "dense": 1.0, "dsv": 1.1}, {"step": 400, "dense": 3.0, "dsv": 3.3}]}
    assert stage2_val_gap(run) == pytest.approx(4.4 / 4.0 - 1)
    assert stage2_val_gap(dict(run, switch_step=400)) is None
    assert stage2_val_gap(dict(run, switch_step=None)) is None


@needs_dsv
def test_compare_seeds(tmp_path):
    from dsv_ext.app.compare import compare_seeds, main, stage2_val_gap

    res = compare_seeds(micro_config(steps=2, val_videos=3), str(tmp_path), 2, device="cpu", progress=False)
    assert res["seeds"] == [0, 1]
    per_seed = [json.load(open(tmp_path / f"seed{s}" / "compare.json")) for s in (0, 1)]
    assert [p["dense"]["final_val_loss"] for p in per_seed] == res["arms"]["dense"]["values"]
    assert res["rel_gap"]["values"] == pytest.approx([p["val_loss_rel_gap"] for p in per_seed])
    assert per_seed[0]["dense"]["final_val_loss"] != per_seed[1]["dense"]["final_val_loss"]  # other seed
    assert res["arms"]["dsv"]["eval_se"] > 0 and res["arms"]["dense"]["std"] > 0
    late = [stage2_val_gap(p) for p in per_seed]
    if all(g is not None for g in late):
        assert res["stage2_rel_gap"]["values"] == pytest.approx(late)
    else:
        assert res["stage2_rel_gap"] is None and res["stage2_verdict"] is None
    md = open(tmp_path / "compare_seeds.md").read()
    assert "95% interval" in md and "Gap against 1%" in md and "Measured " in md
    nsp = [json.load(open(tmp_path / f"seed{s}" / "dsv" / "summary.json"))["dsv_sparse_blocks"]
           for s in (0, 1)]
    assert res["dsv_sparse_blocks"] == nsp
    assert "Blocks running sparse at the end" in md
    assert ("No block ran sparse in any seed" in md) == (not any(nsp))
    assert main(["--config", "x.yaml", "--seeds", "0"]) != 0


@needs_dsv
def test_training_with_the_recall_rule_resumes_identically(tmp_path):
    """The recall K rule in a training run: per-head K from the recall measurement, blocks sparse
    in stage 2, and a resumed run continues exactly (the recall densities are checkpointed)."""
    from dsv_ext.app.train import load_config, train

    def cfg(steps):
        c = micro_config(steps=steps)
        c["dsv"].update(k_rule="recall", recall_target=0.6, recall_max_density=1.0)
        return load_config(base=c)

    full = train(cfg(6), out_dir=str(tmp_path / "full"), attention="dsv", device="cpu", progress=False)
    train(cfg(3), out_dir=str(tmp_path / "part"), attention="dsv", device="cpu", progress=False)
    res = train(cfg(6), out_dir=str(tmp_path / "part"), attention="dsv", device="cpu", progress=False,
                resume=str(tmp_path / "part" / "ckpt_last.pt"))
    assert res["summary"]["resumed_from"] == 3 and len(res["history"]) == 3
    assert [r["loss"] for r in full["history"][-3:]] == [r["loss"] for r in res["history"]]
    assert res["summary"]["final_val_loss"] == full["summary"]["final_val_loss"]
    last = full["history"][-1]["blocks"]
    assert all(b["sparse"] for b in last) and all(min(b["head_k"]) < 64 for b in last), last
    ca = torch.load(tmp_path / "full" / "ckpt_last.pt", weights_only=False)["controller"]
    cb = torch.load(tmp_path / "part" / "ckpt_last.pt", weights_only=False)["controller"]
    assert ca["recall_density"] == cb["recall_density"] and all(r is not None for r in ca["recall_density"])
