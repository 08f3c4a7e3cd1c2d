"""Where each head's attention goes in space and time: the share of a query's softmax mass on the
keys within a spatial radius of it through every frame, and on the keys within a few frames of it
at every position.

    python benchmarks/attention_span.py --checkpoint runs/x/dsv/ckpt_last.pt [--out DIR]
    python benchmarks/attention_span.py --checkpoint CKPT --clips-from clips.pt --frames 16

The checkpoint's model runs (full attention) on one held-out clip at --timesteps; per block and
head, over --rows random queries, the mean mass within Chebyshev radius r of the query's (h, w)
in the latent grid through all frames (--radii), and within +-f frames of its frame through all
positions (--frames-within). A head whose mass sits in a spatial neighbourhood through every
frame needs the same fraction of the keys however many frames a clip has, and a smaller one the
larger the frames (benchmarks/bench_length.py measures that fraction by length). Writes span.json
and span.md to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


@torch.no_grad()
def head_span(q: torch.Tensor, k: torch.Tensor, grid, rows: torch.Tensor, radii: Sequence[int],
              frames: Sequence[int]) -> Dict[str, List[float]]:
    """q, k: [S, D] of one head in raster order over ``grid`` (T, H, W); rows: query positions.
    Returns {"space": mean mass within each radius, "time": within each frame distance}."""
    T, Hh, W = grid
    S, D = q.shape
    pos = torch.arange(S, device=q.device)
    kt, kh, kw = pos // (Hh * W), (pos // W) % Hh, pos % W
    qt, qh, qw = kt[rows], kh[rows], kw[rows]
    p = torch.softmax(q[rows].float() @ k.float().T / math.sqrt(D), dim=-1)  # [R, S]
    dsp = torch.maximum((kh[None] - qh[:, None]).abs(), (kw[None] - qw[:, None]).abs())
    dt = (kt[None] - qt[:, None]).abs()
    return {"space": [float((p * (dsp <= r)).sum(-1).mean()) for r in radii],
            "time": [float((p * (dt <= f)).sum(-1).mean()) for f in frames]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--frames", type=int, default=None, help="clip length in latent frames (default: the config's)")
    ap.add_argument("--clips-from", metavar="FILE", help="held-out clips saved by bench_length.py --save-clips")
    ap.add_argument("--timesteps", type=float, nargs="+", default=[0.5])
    ap.add_argument("--rows", type=int, default=64, help="random query positions per capture")
    ap.add_argument("--radii", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--frames-within", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "span"))
    a = ap.parse_args(argv)
    if a.rows < 1 or min(a.radii) < 0 or min(a.frames_within) < 0:
        ap.error("--rows: positive; --radii, --frames-within: >= 0")
    from bench_common import provenance
    from bench_equal_recall import capture_qk
    from dsv_ext.app.checkpoint import load_checkpoint
    from dsv_ext.app.common import (TrainConfig, ValidationSet, autocast, build_model, inference_state_dict,
                                    load_config, resolve_device)

    dev = resolve_device(a.device)
    ck = load_checkpoint(a.checkpoint, map_location="cpu", required=("model", "config"))
    over = ["train.val_videos=1"] + ([f"data.frames={a.frames}"] if a.frames else [])
    cfg = load_config(base=ck["config"], overrides=over)
    cfg["train"]["val_timesteps"] = list(a.timesteps)
    frames = int(cfg["data"]["frames"])
    clips = None
    if a.clips_from:
        saved = torch.load(a.clips_from, map_location="cpu")
        if frames not in saved:
            ap.error(f"--clips-from: no clips of {frames} frames in {a.clips_from} ({sorted(saved)})")
        clips = saved[frames][:1]
    vs = ValidationSet(cfg, TrainConfig.from_dict(cfg["train"]), clips=clips)
    model, _ = build_model(cfg, "dsv", dev)
    got = model.load_state_dict(inference_state_dict(ck), strict=False)
    if [k for k in list(got.missing_keys) + list(got.unexpected_keys) if ".predictor." not in k]:
        raise SystemExit(f"--checkpoint {a.checkpoint}: its weights do not fit the model of its config")
    model.eval()
    precision = cfg["train"].get("precision", "fp32")
    g = torch.Generator().manual_seed(0)
    acc: Dict[str, Dict[str, List[float]]] = {}
    for i in range(vs.x.shape[0]):
        with autocast(dev, precision if dev.type == "cuda" else "fp32"):
            caps = capture_qk(model, vs.x[i:i + 1].to(dev), vs.t[i:i + 1].to(dev), vs.noise[i:i + 1].to(dev))
        for name, q, k, grid, _ in caps:
            S, H = q.shape[1], q.shape[2]
            rows = torch.randint(0, S, (a.rows,), generator=g).to(q.device)
            for h in range(H):
                sp = head_span(q[0, :, h], k[0, :, h], grid, rows, a.radii, a.frames_within)
                key = f"{name}:{h}"
                cur = acc.setdefault(key, {"space": [0.0] * len(a.radii), "time": [0.0] * len(a.frames_within)})
                for part in ("space", "time"):
                    cur[part] = [c + x / vs.x.shape[0] for c, x in zip(cur[part], sp[part])]
    res = {"source": f"{cfg.get('name')} step {ck.get('step')}", "checkpoint": a.checkpoint,
           "provenance": provenance(), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
           "grid": list(caps[0][3]), "timesteps": list(a.timesteps), "rows": a.rows, "radii": a.radii,
           "frames_within": a.frames_within, "heads": acc}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "span.json"), "w") as f:
        json.dump(res, f, indent=1)
    from bench_common import provenance_line

    L = [f"# Where attention goes in space and time ({res['source']})", "", provenance_line(res), "",
         f"Grid {'x'.join(map(str, res['grid']))} (frames x height x width), one held-out clip at t = "
         f"{', '.join(f'{t:g}' for t in a.timesteps)}, {a.rows} random queries: the mean share of a query's "
         "attention mass within a spatial (Chebyshev) radius of it through every frame, and within a "
         "few frames of it at every position.", "",
         "| block, head | " + " | ".join(f"radius {r}" for r in a.radii) + " | "
         + " | ".join(f"+-{f} frames" for f in a.frames_within) + " |",
         "|---|" + "---|" * (len(a.radii) + len(a.frames_within))]
    for key, v in acc.items():
        L.append(f"| {key} | " + " | ".join(f"{x:.2f}" for x in v["space"] + v["time"]) + " |")
    with open(os.path.join(a.out, "span.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
