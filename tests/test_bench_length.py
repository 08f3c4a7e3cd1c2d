"""benchmarks/bench_length.py: a tiny DSV run's checkpoint at two lengths on the CPU: the lists'
densities per head, the step times, the pinned densities in the controller's K."""
import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
_spec = importlib.util.spec_from_file_location("bench_length", os.path.join(ROOT, "benchmarks", "bench_length.py"))
BL = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(BL)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from dsv_ext.app.train import load_config, train
    from test_train import micro_dict

    d = micro_dict(steps=4, val_videos=1)
    d["dsv"].update(k_rule="recall", recall_max_density=0.6)
    run = tmp_path_factory.mktemp("run")
    train(load_config(base=d), out_dir=str(run), attention="dsv", device="cpu", progress=False)
    return str(run / "ckpt_last.pt")


def test_two_lengths_on_the_cpu(tmp_path, checkpoint):
    out = tmp_path / "len"
    assert BL.main(["--checkpoint", checkpoint, "--frames", "8", "16", "--timesteps", "0.5", "--rows", "64",
                    "--warmup", "1", "--steps", "2", "--stage1-steps", "2", "--device", "cpu",
                    "--set", "dsv.recall_target=0.6", "--out", str(out)]) == 0
    res = json.load(open(out / "length.json"))
    assert [r["seq_len"] for r in res["lengths"]] == [128, 256]  # frames x 4 x 4 tokens
    for r in res["lengths"]:
        S = r["seq_len"]
        assert len(r["blocks"]) == 2 and r["heads"] == 4
        for b in r["blocks"]:
            assert b["seq_len"] == S
            for m in ("predicted", "exact", "flex"):
                assert len(b[m]) == 2 and all(0 < d <= 1 for d in b[m]), m
            # the exact lists of the same groups cover at least what the predicted ones do (K grid 16)
            assert all(e <= p + 16 / S for e, p in zip(b["exact"], b["predicted"]))
        assert r["dense_heads"] == sum(d > 0.6 for b in r["blocks"] for d in b["predicted"])
        # the pinned densities set K (multiples of 16, all keys above recall_max_density)
        for b, ks in zip(r["blocks"], r["head_k"]):
            for d, k in zip(b["predicted"], ks):
                assert k == (S if d > 0.6 else min(S, max(-(-round(d * S) // 16) * 16, 0.25 * S)))
        # a block whose heads all attend to all keys stays dense
        assert all(not sp for b, sp in zip(r["blocks"], r["sparse_blocks"]) if min(b["predicted"]) > 0.6)
        assert all(v > 0 for v in r["ms"].values()) and set(r["ms"]) == {"dense", "dsv", "stage1"}
        assert r["speedup"] == pytest.approx(r["ms"]["dense"] / r["ms"]["dsv"])
        assert r["dispatcher_ms"] == [None, None]  # no calibration table on the CPU
    assert res["recall_target"] == 0.6 and any(res["lengths"][-1]["sparse_blocks"])
    md = (out / "length.md").read_text()
    assert "| 8 | 128 |" in md and "| 16 | 256 |" in md and "| 1, 1 |" in md


def test_saved_clips_give_the_same_lists(tmp_path, checkpoint):
    """--save-clips then --clips-from: the clips as the config's data makes them, so the same
    densities (timing left out of the comparison)."""
    common = ["--checkpoint", checkpoint, "--frames", "8", "--timesteps", "0.3", "0.7", "--rows", "64",
              "--warmup", "0", "--steps", "1", "--stage1-steps", "0", "--device", "cpu"]
    clips = tmp_path / "clips.pt"
    assert BL.main(common + ["--save-clips", str(clips)]) == 0
    assert BL.main(common + ["--out", str(tmp_path / "a")]) == 0
    assert BL.main(common + ["--clips-from", str(clips), "--out", str(tmp_path / "b")]) == 0
    ra, rb = (json.load(open(tmp_path / d / "length.json"))["lengths"][0] for d in ("a", "b"))
    assert ra["blocks"] == rb["blocks"]
    with pytest.raises(SystemExit):  # no clips of 16 frames in the file
        BL.main(common[:3] + ["16"] + common[4:] + ["--clips-from", str(clips)])


def test_bad_arguments(checkpoint):
    for bad in (["--frames", "0"], ["--frames", "8", "--steps", "0"], ["--frames", "8", "--stage1-steps", "-1"]):
        with pytest.raises(SystemExit):
            BL.main(["--checkpoint", checkpoint, "--device", "cpu"] + bad)


def test_a_checkpoint_without_dsv_state(tmp_path):
    from dsv_ext.app.train import load_config, train
    from test_train import micro_dict

    train(load_config(base=micro_dict(steps=2, val_videos=1)), out_dir=str(tmp_path / "d"), attention="dense",
          device="cpu", progress=False)
    with pytest.raises(SystemExit):
        BL.main(["--checkpoint", str(tmp_path / "d" / "ckpt_last.pt"), "--frames", "8", "--device", "cpu",
                 "--out", str(tmp_path / "o")])


def test_the_dispatchers_block_times_in_the_table(tmp_path):
    """length.md shows the dispatcher's calibrated dense / sparse time per block where it had them."""
    res = json.load(open(os.path.join(BL.HERE, "results", "length-narrow-rope-dispatch", "all-sparse-r0.85",
                                      "length.json")))
    for r in res["lengths"]:
        r["dispatcher_ms"] = [{"dense": 25.0, "sparse": 20.5}, None] + [None] * (len(r["blocks"]) - 2)
    BL.write_outputs(res, str(tmp_path))
    md = (tmp_path / "length.md").read_text()
    assert "| 0 | 25.0 / 20.5 (sparse) | 25.0 / 20.5 (sparse) |" in md and "| 1 | - | - |" in md

