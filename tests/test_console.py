"""What the console says: the training run's lines (stage switch, validation, summary table),
the GPU-skip summary of the test suite, the package's exports."""
import os
import re
import subprocess
import sys

import pytest
import torch

import dsv_ext
from dsv_ext.app.models import dsv_attention_available
from dsv_ext.app.train import train
from test_train import micro_config

SWITCH = re.compile(r"step (\d+): switched to stage 2 \((.+)\): (\d+)/(\d+) blocks sparse, "
                    r"mean sparsity (\d\.\d{3}|n/a), recall (\d\.\d{3}|n/a)$")


@pytest.mark.skipif(not dsv_attention_available(), reason="DSVAttention not importable")
def test_training_console_lines(tmp_path):
    lines = []
    res = train(micro_config(steps=6, val_every=2), out_dir=str(tmp_path), attention="dsv",
                device="cpu", progress=False, log=lines.append)
    s = res["summary"]
    # one switch line, at the step the controller switched, with the state the metrics log
    # recorded for that step
    sw = [(i, SWITCH.match(l)) for i, l in enumerate(lines) if "switched to stage 2" in l]
    assert len(sw) == 1 and sw[0][1], lines
    i_sw, m = sw[0]
    step = int(m.group(1))
    assert step == s["dsv_switch_step"] == 3
    assert "force_stage2_step=3" in m.group(2)
    rec = next(r for r in res["history"] if r["step"] == step)
    assert int(m.group(3)) == sum(b["sparse"] for b in rec["blocks"])
    assert int(m.group(4)) == len(rec["blocks"]) == 2
    assert m.group(5) == f"{rec['sparsity']:.3f}"
    # a validation line for every validation, in step order around the switch line
    assert [v["step"] for v in res["val"]] == [2, 4, 6]
    idx = []
    for v in res["val"]:
        want = f"step {v['step']}: val_loss {v['val_loss']:.4f} (stage {v['stage']},"
        hits = [i for i, l in enumerate(lines) if l.startswith(want)]
        assert len(hits) == 1, (want, lines)
        idx.append(hits[0])
    assert idx[0] < i_sw < idx[1] < idx[2]
    assert res["val"][0]["stage"] == 1 and res["val"][1]["stage"] == 2
    # the summary table closes the output
    t = next(i for i, l in enumerate(lines) if l.startswith("summary: micro / dsv on cpu"))
    table = lines[t:]
    assert t > idx[2]
    row = {l[:17].strip(): l[17:].strip() for l in table[2:]}
    assert row["final val loss"] == f"{s['final_val_loss']:.4f}"
    assert row["final train loss"] == f"{s['final_train_loss']:.4f}"
    assert row["val loss by step"] == "  ".join(f"{v['step']}: {v['val_loss']:.4f}" for v in res["val"])
    assert row["DSV stage"] == "2 (switched at step 3)"
    assert row["blocks sparse"] == f"{s['dsv_sparse_blocks']}/2"
    assert row["outputs"] == str(tmp_path)
    assert sum(1 for l in table if re.match(r"blocks\.\d+\.", l)) == 2  # one row per block
    # at most one note on the CPU's stage-2 throughput
    assert sum("tokens/s" in l and l.startswith("note:") for l in lines) <= 1


def test_dense_run_has_no_switch_line(tmp_path):
    lines = []
    train(micro_config(steps=2), out_dir=str(tmp_path), attention="dense", device="cpu",
          progress=False, log=lines.append)
    assert not any("switched" in l for l in lines)
    assert any(l.startswith("summary: micro / dense on cpu") for l in lines)
    assert not any(l.startswith("DSV stage") for l in lines)


def test_dense_attention_is_exported():
    from dsv_ext import DenseAttention
    from dsv_ext.modules.attention import DenseAttention as DA

    assert DenseAttention is DA and "DenseAttention" in dsv_ext.__all__
    assert "DenseAttention" in dir(dsv_ext)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the summary on a machine without a GPU")
def test_gpu_skips_are_one_summary_line():
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                        os.path.join(here, "test_rows_cuda.py"), os.path.join(here, "test_train_cuda.py")],
                       capture_output=True, text=True, timeout=600, cwd=os.path.dirname(here))
    assert p.returncode == 0, p.stdout + p.stderr
    skipped = [l for l in p.stdout.splitlines() if l.startswith("SKIPPED")]
    assert len(skipped) == 1 and "no CUDA GPU on this machine" in skipped[0], p.stdout
    n = int(re.match(r"SKIPPED \[(\d+)\]", skipped[0]).group(1))
    assert n >= 3 and f"{n} skipped" in p.stdout


@pytest.mark.skipif(not dsv_attention_available(), reason="DSVAttention not importable")
def test_switch_line_of_the_dispatch_rule(tmp_path):
    """dsv.switch_rule=dispatch through the trainer: the switch comes on the lists (no forced
    step, a loss bar it cannot meet), the line says why, and a block runs sparse from it."""
    from dsv_ext.app.train import load_config
    from test_train import micro_dict

    d = micro_dict(steps=6)
    d["dsv"].update(k_rule="recall", switch_rule="dispatch", switch_loss=0.0, force_stage2_step=None,
                    recall_target=0.6, recall_max_density=0.9)
    lines = []
    res = train(load_config(base=d), out_dir=str(tmp_path), attention="dsv", device="cpu", progress=False,
                log=lines.append)
    sw = [SWITCH.match(l) for l in lines if "switched to stage 2" in l]
    assert len(sw) == 1 and sw[0], lines
    assert sw[0].group(2) == "dsv.switch_rule=dispatch: the lists pay in a block"
    assert int(sw[0].group(1)) == res["summary"]["dsv_switch_step"] and int(sw[0].group(3)) >= 1
