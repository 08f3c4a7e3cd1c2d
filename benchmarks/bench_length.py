"""The sequence length at which DSV's training step reaches a speed target: a trained model on
longer clips of the same videos (more frames), its predictors' lists measured at each length, then
one training step timed with full attention and with DSV at those lists.

    python benchmarks/bench_length.py --checkpoint runs/x/dsv/ckpt_last.pt --frames 16 32 48 --out DIR
    python benchmarks/bench_length.py --checkpoint CKPT --frames 16 32 48 --save-clips clips.pt
        # the held-out clips only (decoded here), for --clips-from clips.pt on a GPU machine

Per length (``--frames`` x the config's latent height x width tokens):

1. **Lists.** The checkpoint's model (its weights and trained predictors, full attention) runs on
   ``--clips`` held-out clips of that many frames at ``--timesteps``; per block and head, the
   recall-versus-K curve of the trained predictors' lists (``dsv_ext.recall.recall_curve`` on
   ``--rows`` evenly spaced query rows, the config's group size, cube and K grid), averaged over
   the captures, gives the density the lists need for the config's ``recall_target``; a head
   needing more than ``recall_max_density`` attends to all keys, as the controller runs it.
   For reference, the same for the exact lists of the same groups of queries (the best a
   predictor could do) and for FlexAttention's 128x128 tiles (oracle tiles in raster order).
2. **Time.** One training step on a held-out clip of that length (the config's precision,
   forward, backward, gradient clipping, AdamW), mean over ``--steps`` steps after ``--warmup``
   (CUDA events): full attention; DSV in stage 2 with the densities of 1 pinned
   (``DSVController.set_sparsity``), the dispatcher choosing sparse or dense per block, the
   predictors fine-tuned every ``dsv.train_every_stage2`` steps (``--steps`` a multiple of it;
   the profile steps, one in ``dsv.profile_every_late``, are left out); and DSV's stage 1
   (full attention, predictor training every step, one profile per ``dsv.profile_every``
   steps: ``--steps`` a multiple of it counts the profile's share). Ratios against full
   attention in the same run.

Writes ``length.json`` / ``length.md`` to ``--out``. The model has been trained at one length
only: the lists at other lengths are those of that model on longer clips (rotary positions
extend in time; sin-cos positions too, but further from what the model saw).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


@torch.no_grad()
def measure_lists(model, dsv_cfg, vs, dev, rows: int, exact: bool) -> List[Dict]:
    """Per attention block of ``model`` (full attention, no controller): per head the density the
    trained predictors' lists need for ``dsv_cfg.recall_target`` on the clips of ``vs``; with
    ``exact`` also the exact lists' and FlexAttention's tiles'."""
    from bench_equal_recall import capture_qk, density_for, head_curves
    from dsv_ext.grouping import cube_permutation
    from dsv_ext.recall import density_for_recall, recall_curve

    G, km, target = dsv_cfg.group_size, dsv_cfg.k_multiple, dsv_cfg.recall_target
    acc: Dict[str, Dict] = {}
    model.eval()
    for i in range(vs.x.shape[0]):
        sl = slice(i, i + 1)
        for name, q, k, grid, mod in capture_qk(model, vs.x[sl].to(dev), vs.t[sl].to(dev), vs.noise[sl].to(dev)):
            B, S, H, D = q.shape
            perm = cube_permutation(grid, tuple(dsv_cfg.cube), S, q.device)[0]
            scale = 1.0 / math.sqrt(D)
            r = torch.arange(0, S, max(1, S // rows), device=q.device)
            qc, kc = q.index_select(1, perm), k.index_select(1, perm)
            a = acc.setdefault(name, {"S": S, "n": 0, "pred": 0.0, "exact": 0.0, "flex": 0.0})
            a["pred"] = a["pred"] + recall_curve(qc, kc, mod.predictor.wq, mod.predictor.wk, r, G, km,
                                                 scale=scale).double().mean(0).cpu()
            if exact and S % G == 0 and S % 128 == 0:
                n_runs = max(1, min(rows // max(G, 128), S // max(G, 128)))
                for b in range(B):
                    per = [head_curves(q[b, :, h], k[b, :, h], perm, scale, groups=(G,), blocks=(),
                                       block_groups=(), tile=128, per_query=False, sample=n_runs)
                           for h in range(H)]
                    a["exact"] = a["exact"] + torch.stack([p[f"token G={G}"][1].cpu() for p in per]) / B
                    a["flex"] = a["flex"] + torch.stack([p["flex 128x128"][1].cpu() for p in per]) / B
            a["n"] += 1
    out = []
    for name, a in acc.items():
        S, n = a["S"], a["n"]
        H = a["pred"].shape[0]
        row = {"name": name, "seq_len": S,
               "predicted": [density_for_recall((a["pred"][h] / n).tolist(), target, S, km) for h in range(H)]}
        if isinstance(a["exact"], torch.Tensor):
            row["exact"] = [density_for(a["exact"][h] / n, 1, S, target) for h in range(H)]
            row["flex"] = [density_for(a["flex"][h] / n, 128, S, target) for h in range(H)]
        out.append(row)
    return out


def length_config(base_cfg: Dict, frames: int, a) -> Dict:
    """The checkpoint's config with clips of ``frames`` frames and the run's held-out set."""
    from dsv_ext.app.common import load_config

    cfg = load_config(base=base_cfg, overrides=[f"data.frames={frames}", f"train.val_videos={a.clips}"])
    cfg["train"]["val_timesteps"] = list(a.timesteps)
    return cfg


def save_clips(base_cfg: Dict, a) -> None:
    """--save-clips: the held-out clips of every --frames (as run_length builds them), for
    --clips-from on a machine without the video decoder or the videos."""
    from dsv_ext.app.common import TrainConfig, ValidationSet

    out = {}
    for f in a.frames:
        cfg = length_config(base_cfg, f, a)
        out[f] = ValidationSet(cfg, TrainConfig.from_dict(cfg["train"])).clips()
    torch.save(out, a.save_clips)
    print(f"{a.save_clips}: {sum(len(v) for v in out.values())} clips of {list(out)} frames")


def run_length(ck: Dict, base_cfg: Dict, frames: int, a, dev: torch.device, log=print) -> Dict:
    """Lists and step times of the checkpoint's model at ``frames`` frames (module docstring)."""
    from bench_common import step_times, train_step
    from dsv_ext.app.common import TrainConfig, ValidationSet, autocast, build_model, inference_state_dict
    from dsv_ext.control.controller import DSVController

    cfg = length_config(base_cfg, frames, a)
    saved = None if a.clips_from is None else torch.load(a.clips_from, map_location="cpu")[frames]
    vs = ValidationSet(cfg, TrainConfig.from_dict(cfg["train"]), clips=saved)
    weights = inference_state_dict(ck)

    def model_of(attention: str):
        torch.manual_seed(0)
        model, dsv_cfg = build_model(cfg, attention, dev)
        got = model.load_state_dict(weights, strict=False)
        bad = [k for k in list(got.missing_keys) + list(got.unexpected_keys) if ".predictor." not in k]
        if bad or (attention == "dsv" and got.missing_keys):
            raise ValueError(f"--checkpoint: its weights do not fit the {attention} model "
                             f"(e.g. {(bad or got.missing_keys)[0]})")
        return model, dsv_cfg

    precision = cfg["train"].get("precision", "bf16" if dev.type == "cuda" else "fp32")
    if precision == "auto":
        precision = "bf16" if dev.type == "cuda" else "fp32"
    t0 = time.perf_counter()
    model, dsv_cfg = model_of("dsv")
    with autocast(dev, precision):  # q and k as training computes them
        blocks = measure_lists(model, dsv_cfg, vs, dev, a.rows, not a.no_exact)
    S = blocks[0]["seq_len"]
    log(f"frames {frames} ({S} tokens): lists measured in {time.perf_counter() - t0:.0f} s: "
        + "; ".join(" ".join(f"{d:.3f}" for d in b["predicted"]) for b in blocks))
    cap = dsv_cfg.recall_max_density
    runs = [d for b in blocks for d in b["predicted"]]
    res = {"frames": frames, "seq_len": S, "blocks": blocks,
           "dense_heads": sum(d > cap for d in runs), "heads": len(runs)}

    x0, noise = vs.x[:1].to(dev), vs.noise[:1].to(dev)
    t = torch.full((1,), 0.5, device=dev)
    times = {}
    dense, _ = model_of("dense")
    dense.train()
    gpu = dev.type == "cuda"
    times["dense"] = step_times(train_step(dense, cfg, x0, noise, t, dev), a.warmup, a.steps, gpu)
    del dense

    # stage 2 at the measured lists; profile steps left out (module docstring)
    ctl_cfg = replace(dsv_cfg, profile_until=0, profile_every_late=10 ** 9)
    model.train()
    ctl = DSVController(model, ctl_cfg)
    ctl.load_state_dict(ck["controller"])  # armed under ctl_cfg: no profile step
    ctl.switch_to_stage2()  # a checkpoint from before the switch
    # K is sized for the length, the dispatcher weighs the kernels' dtype
    kdt = torch.bfloat16 if precision == "bf16" else torch.float32
    for _, m in ctl.modules:
        m.set_workload(S, 1, kdt)
    ctl.set_sparsity([[0.0 if d > cap else 1.0 - d for d in b["predicted"]] for b in blocks])
    times["dsv"] = step_times(train_step(model, cfg, x0, noise, t, dev, ctl), a.warmup, a.steps, gpu)
    res["sparse_blocks"] = [bool(st["use_sparse"]) for st in ctl.block_stats()]
    res["head_k"] = [list(st["head_k"]) for st in ctl.block_stats()]
    # what the dispatcher expected of each block (None without a calibration table for it)
    res["dispatcher_ms"] = [ctl.dispatcher.block_ms([k / S for k in m.head_k], S, m.num_heads, m.head_dim, dev, kdt)
                            for _, m in ctl.modules]
    del ctl, model

    if a.stage1_steps:
        m1, d1 = model_of("dsv")
        m1.train()
        ctl1 = DSVController(m1, d1)  # stage 1 from step 0; 25 steps in a row hold one profile step
        times["stage1"] = step_times(train_step(m1, cfg, x0, noise, t, dev, ctl1), a.warmup, a.stage1_steps, gpu)
        del ctl1, m1
    res["ms"] = {k: sum(v) / len(v) for k, v in times.items()}
    res["ms_median"] = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    res["speedup"] = res["ms"]["dense"] / res["ms"]["dsv"]
    if "stage1" in times:
        res["stage1_overhead"] = res["ms"]["stage1"] / res["ms"]["dense"] - 1
    log(f"frames {frames}: dense {res['ms']['dense']:.1f} ms, DSV {res['ms']['dsv']:.1f} ms "
        f"({res['speedup']:.2f}x), sparse blocks {res['sparse_blocks']}")
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def write_outputs(res: Dict, out: str) -> None:
    from bench_common import provenance_line

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "length.json"), "w") as f:
        json.dump(res, f, indent=1)
    L = [f"# DSV's training step against full attention by sequence length ({res['source']})", "",
         provenance_line(res), "",
         f"Lists for recall {res['recall_target']} of the trained predictors (group size {res['group_size']}), "
         f"heads above {res['recall_max_density']} of the keys on all keys; {len(res['timesteps'])} "
         f"timesteps x {res['clips']} held-out clip(s) per length; step times: mean of "
         f"{res['steps']} steps after {res['warmup']}.", "",
         "| frames | tokens | dense step ms | DSV step ms | speedup | stage 1 overhead | sparse blocks | "
         "heads on all keys |", "|---|---|---|---|---|---|---|---|"]
    for r in res["lengths"]:
        ov = r.get("stage1_overhead")
        L.append(f"| {r['frames']} | {r['seq_len']} | {r['ms']['dense']:.1f} | {r['ms']['dsv']:.1f} | "
                 f"{r['speedup']:.2f}x | {'-' if ov is None else f'{100 * ov:+.1f}%'} | "
                 f"{sum(r['sparse_blocks'])} / {len(r['sparse_blocks'])} | {r['dense_heads']} / {r['heads']} |")
    L += ["", "Per block and head, the density (keys / S) for the recall target: trained predictors' lists "
          "(exact lists of the same groups; FlexAttention 128x128 tiles):", ""]
    lens = res["lengths"]
    L += ["| block, head | " + " | ".join(f"{r['seq_len']} tokens" for r in lens) + " |",
          "|---|" + "---|" * len(lens)]
    for bi, b in enumerate(lens[0]["blocks"]):
        for h in range(len(b["predicted"])):
            cells = []
            for r in lens:
                rb = r["blocks"][bi]
                c = f"{rb['predicted'][h]:.3f}"
                if "exact" in rb:
                    c += f" ({rb['exact'][h]:.3f}; {rb['flex'][h]:.3f})"
                cells.append(c)
            L.append(f"| {bi}, {h} | " + " | ".join(cells) + " |")
    if any(any(b is not None for b in r.get("dispatcher_ms", [])) for r in lens):
        L += ["", "The dispatcher's calibrated attention time per block (forward + backward, ms: dense / sparse "
              "at the heads' K's; - where its table has no entry), against which it chose the sparse blocks:", "",
              "| block | " + " | ".join(f"{r['seq_len']} tokens" for r in lens) + " |", "|---|" + "---|" * len(lens)]
        for bi in range(len(lens[0]["blocks"])):
            cells = []
            for r in lens:
                b = r.get("dispatcher_ms", [None] * (bi + 1))[bi]
                cells.append("-" if b is None else f"{b['dense']:.1f} / {b['sparse']:.1f}"
                             + (" (sparse)" if r["sparse_blocks"][bi] else ""))
            L.append(f"| {bi} | " + " | ".join(cells) + " |")
    with open(os.path.join(out, "length.md"), "w") as f:
        f.write("\n".join(L) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a DSV training checkpoint or its slim copy")
    ap.add_argument("--frames", type=int, nargs="+", required=True, help="clip lengths in latent frames")
    ap.add_argument("--clips", type=int, default=1, help="held-out clips per length")
    ap.add_argument("--timesteps", type=float, nargs="+", default=[0.3, 0.6, 0.9])
    ap.add_argument("--rows", type=int, default=2048, help="sampled query rows per capture")
    ap.add_argument("--no-exact", action="store_true", help="skip the exact lists and the tiles")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps (a multiple of dsv.train_every_stage2)")
    ap.add_argument("--stage1-steps", type=int, default=25,
                    help="timed stage-1 steps (a multiple of dsv.profile_every; 0: skip stage 1)")
    ap.add_argument("--set", action="append", default=[], metavar="SEC.KEY=VALUE",
                    help="change the checkpoint's config (e.g. dsv.recall_target=0.9)")
    ap.add_argument("--save-clips", metavar="FILE",
                    help="only build the held-out clips of every --frames and save them to FILE")
    ap.add_argument("--clips-from", metavar="FILE", help="the clips --save-clips saved (no video decoding)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "length"))
    a = ap.parse_args(argv)
    if min(a.frames) < 1 or a.clips < 1 or a.rows < 1 or a.steps < 1 or a.warmup < 0 or a.stage1_steps < 0:
        ap.error("--frames, --clips, --rows, --steps: positive; --warmup, --stage1-steps: >= 0")
    from bench_common import provenance
    from dsv_ext.app.checkpoint import load_checkpoint
    from dsv_ext.app.common import load_config, resolve_device
    from dsv_ext.config import DSVConfig

    dev = resolve_device(a.device)
    ck = load_checkpoint(a.checkpoint, map_location="cpu", required=("model", "config"))
    cfg = load_config(base=ck["config"], overrides=a.set)
    if a.save_clips:
        save_clips(cfg, a)
        return 0
    if not isinstance(ck.get("controller"), dict):
        ap.error(f"--checkpoint: {a.checkpoint} holds no DSV controller state (a run with attention dsv)")
    if a.clips_from:
        have = torch.load(a.clips_from, map_location="cpu")
        if not isinstance(have, dict) or any(f not in have for f in a.frames):
            ap.error(f"--clips-from: {a.clips_from} holds clips of {sorted(have) if isinstance(have, dict) else '?'} "
                     f"frames, not of every --frames {a.frames}")
    dsv_cfg = DSVConfig.from_dict(cfg.get("dsv") or {})
    res = {"source": f"{cfg.get('name')} step {ck.get('step')}", "checkpoint": a.checkpoint,
           "provenance": provenance(),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
           "recall_target": dsv_cfg.recall_target, "recall_max_density": dsv_cfg.recall_max_density,
           "group_size": dsv_cfg.group_size, "clips": a.clips, "timesteps": list(a.timesteps),
           "warmup": a.warmup, "steps": a.steps, "stage1_steps": a.stage1_steps, "lengths": []}
    for f in a.frames:
        res["lengths"].append(run_length(ck, cfg, f, a, dev))
        write_outputs(res, a.out)  # after each length: a run cut short keeps what it measured
    print(open(os.path.join(a.out, "length.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
