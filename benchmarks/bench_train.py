"""Training-step throughput of 2.7B-shaped DiT blocks: dense cuDNN vs 3D window vs DSV.

    python benchmarks/bench_train.py                      # 32k and 64k tokens, auto layer count
    python benchmarks/bench_train.py --seq 32768 --layers 8 --iters 5
    python benchmarks/bench_train.py --seq 4096 --layers 2 --iters 2 --tag smoke   # quick check

One training step = forward + backward + AdamW (fused, fp32 master weights) of a stack of
DiT blocks (adaLN-zero, self-attention, MLP; hidden 2048, 16 heads of dim 128 = the paper's
2.7B block) on one video of S tokens, bf16 autocast, batch 1. Modes (same weights, same input):

  dense        plain SDPA with cuDNN first in the backend priority (stage 1 without side work)
  window       3D window attention through FlexAttention: each query attends to a
               (2/3 T) x (2/3 H) x (2/3 W) window of the token grid (shifted inside the grid at
               the borders, NATTEN style; the paper's WA-L baseline), 128x128 block mask
  dsv_stage1   DSV stage 1: dense attention + predictor training on sampled rows every step
               (the stage-1 overhead; profiling steps are rare and excluded by the median)
  dsv_prof     DSV stage 2 at the per-head sparsity the profiler measures on this model and
               input (random weights give low sparsity; --sparsity-from takes a trained run's)
  dsv_0.9      DSV stage 2 at sparsity 0.9 in every head (K = 10% of S per head)
  dsv_0.95     DSV stage 2 at sparsity 0.95

Timing: CUDA events around each whole step, after --warmup steps; the median of --iters steps
is reported (min and max too). Memory: peak allocated bytes of the timed steps.
Results: benchmarks/results/bench_train[_TAG].json and .md.

Layers: ``--layers auto`` (default) measures the memory of one and two dense blocks at the
longest sequence and uses as many blocks as fit in 85% of the free memory (capped by
--max-layers); every mode and length then uses that count.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dsv_ext.app.models.dit import DiTBlock, DiTConfig, SelfAttention  # noqa: E402
from dsv_ext.config import DSVConfig  # noqa: E402

sys.path.insert(0, HERE)
from bench_common import add_seq_grid_args, provenance, provenance_line, cuda_time_ms, resolve_grids  # noqa: E402



# ---------------------------------------------------------------------------------------------
# 3D window attention (FlexAttention)
# ---------------------------------------------------------------------------------------------

_FLEX = None


def _compiled_flex():
    """One compiled flex_attention shared by every layer (compiled once per shape)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


class WindowAttention(SelfAttention):
    """Self-attention restricted to a 3D window of the token grid, through FlexAttention.

    The layers (``qkv`` / ``q_norm`` / ``k_norm`` / ``proj``) are the dense baseline's.
    The window covers ``w_d = round(frac * L_d)`` positions along each grid axis, centred on the
    query and shifted to stay inside the grid (so every query sees the same number of keys).
    """

    def __init__(self, hidden: int, heads: int, grid: Tuple[int, int, int], frac: float = 2 / 3,
                 qk_norm: bool = True, block_size: int = 128):
        super().__init__(hidden, heads, qk_norm=qk_norm)
        from torch.nn.attention.flex_attention import create_block_mask

        self.grid = tuple(grid)
        T, H, W = self.grid
        self.win = tuple(max(1, int(round(frac * L))) for L in self.grid)
        wt, wh, ww = self.win
        S = T * H * W

        def start(c, w, L):
            return torch.clamp(c - w // 2, 0, L - w)

        def mask_mod(b, h, q_idx, kv_idx):
            tq, yq, xq = q_idx // (H * W), (q_idx // W) % H, q_idx % W
            tk, yk, xk = kv_idx // (H * W), (kv_idx // W) % H, kv_idx % W
            st, sy, sx = start(tq, wt, T), start(yq, wh, H), start(xq, ww, W)
            return ((tk >= st) & (tk < st + wt) & (yk >= sy) & (yk < sy + wh)
                    & (xk >= sx) & (xk < sx + ww))

        self._mask_mod = mask_mod
        self.block_mask = None
        self._S = S
        self._block_size = block_size
        self._create = create_block_mask
        self._flex = _compiled_flex()

    def build_mask(self, device):
        self.block_mask = self._create(self._mask_mod, None, None, self._S, self._S,
                                       device=device, BLOCK_SIZE=self._block_size, _compile=True)
        return self.block_mask

    @property
    def density(self) -> float:
        return math.prod(self.win) / self._S

    def forward(self, x: torch.Tensor, grid=None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.block_mask is None:
            self.build_mask(x.device)
        dt = v.dtype  # the qkv output: bf16 under autocast (the norms may return fp32)
        o = self._flex(q.transpose(1, 2).to(dt), k.transpose(1, 2).to(dt), v.transpose(1, 2),
                       block_mask=self.block_mask)
        return self.proj(o.transpose(1, 2).reshape(b, s, self.hidden))


# ---------------------------------------------------------------------------------------------
# The model under test
# ---------------------------------------------------------------------------------------------

class BlockStack(nn.Module):
    """``layers`` DiT blocks on pre-embedded tokens ([B, S, hidden]) with a conditioning vector."""

    def __init__(self, cfg: DiTConfig, layers: int, dsv_config=None, window: bool = False,
                 device="cpu"):
        super().__init__()
        with torch.device(device):  # allocate (and default-initialise) on the device: fast
            self.blocks = nn.ModuleList([DiTBlock(cfg, dsv_config) for _ in range(layers)])
            if window:
                for blk in self.blocks:
                    blk.attn = WindowAttention(cfg.hidden, cfg.heads, cfg.grid, qk_norm=cfg.qk_norm)
        g = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():  # same weights in every mode; non-zero adaLN so every path matters
            for blk in self.blocks:
                for m in blk.modules():
                    if isinstance(m, nn.Linear):
                        nn.init.xavier_uniform_(m.weight, generator=g)
                        if m.bias is not None:
                            m.bias.zero_()
                blk.ada[-1].weight.mul_(0.1)
        self.grad_checkpointing = False

    def forward(self, x, c):
        for blk in self.blocks:
            if self.grad_checkpointing:
                x = torch.utils.checkpoint.checkpoint(blk, x, c, use_reentrant=False)
            else:
                x = blk(x, c)
        return x

    def dit_parameters(self):
        return [p for n, p in self.named_parameters() if "predictor" not in n]


def _dsv_config(**kw):
    base = dict(profile_every=10**6, profile_until=10**9, train_every_stage1=1,
                train_every_stage2=0, use_calibration=False, dispatch_threshold=0.0,
                memory_fraction=1.0, measure_recall=False, k_rule="theta")  # K follows the set sparsity
    base.update(kw)
    return DSVConfig(**base)


def _structured_input(S: int, grid, hidden: int, device, seed: int = 0) -> torch.Tensor:
    """Tokens with spatial structure: a smooth random field over the (T, H, W) grid (sum of a
    few low-frequency waves per channel group) plus a little noise, unit variance."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    T, H, W = grid
    coords = torch.stack(torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W),
                                        indexing="ij"), -1).reshape(S, 3).float()
    coords = coords / torch.tensor([T, H, W]).float()
    nw = 64
    freqs = torch.randn(nw, 3, generator=g) * 3.0
    phase = torch.rand(nw, generator=g) * 6.283
    waves = torch.sin(coords @ freqs.T * 6.283 + phase)          # [S, nw]
    mix = torch.randn(nw, hidden, generator=g) / math.sqrt(nw)
    x = waves @ mix + 0.1 * torch.randn(S, hidden, generator=g)
    x = (x - x.mean()) / x.std()
    return x[None].to(device)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def _time_steps(step_fn, warmup: int, iters: int) -> Dict[str, float]:
    for _ in range(warmup):
        step_fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    res = cuda_time_ms(step_fn, warmup=0, reps=iters)
    res["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def _make_step(model, x, c, target, opt, controller=None):
    params = model.dit_parameters()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x, c)
        loss = F.mse_loss(y.float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if controller is not None:
            controller.step()
    return step


def run_mode(mode: str, S: int, grid, layers: int, args, profiled: Optional[List[List[float]]],
             dev) -> Dict:
    hidden, heads = args.hidden, args.heads
    cfg = DiTConfig(in_channels=4, latent_size=grid, patch=(1, 1, 1), hidden=hidden, depth=layers,
                    heads=heads, attention="dense" if mode in ("dense", "window") else "dsv",
                    qk_norm=True)
    dsv_cfg = None
    if cfg.attention == "dsv":
        dsv_cfg = _dsv_config(group_size=args.group_size, rank=args.rank)
    torch.manual_seed(0)
    model = BlockStack(cfg, layers, dsv_cfg, window=(mode == "window"), device=dev)
    model.grad_checkpointing = args.grad_ckpt
    x = _structured_input(S, grid, hidden, dev)
    c = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1)).to(dev)
    target = torch.randn(1, S, hidden, generator=torch.Generator().manual_seed(2)).to(dev)
    opt = torch.optim.AdamW(model.dit_parameters(), lr=1e-5, fused=True)
    controller = None
    info: Dict = {"mode": mode, "seq_len": S, "grid": list(grid), "layers": layers}
    if cfg.attention == "dsv":
        from dsv_ext.control.controller import DSVController

        controller = DSVController(model, dsv_cfg)
        step = _make_step(model, x, c, target, opt, controller)
        step()  # step 0: predictor training + profiling (records seq_len / dtype per block)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        measured = [list(e) for e in controller.sparsity_ema]
        info["profiled_sparsity"] = [sum(e) / len(e) for e in measured]
        if mode != "dsv_stage1":
            if mode == "dsv_prof":
                sp = profiled if profiled is not None else measured
                if len(sp) != layers:  # a trained run's blocks: cycle over them
                    sp = [sp[i % len(sp)] for i in range(layers)]
                # per-head values when the head counts match, else the block mean in every head
                sp = [[float(v) for v in s] if isinstance(s, list) and len(s) == heads else
                      [float(sum(s) / len(s) if isinstance(s, list) else s)] * heads for s in sp]
            else:
                val = float(mode.split("_", 1)[1])
                sp = [[val] * heads for _ in range(layers)]
            controller.sparsity_ema = sp
            controller.switch_to_stage2()
            for _, m in controller.modules:  # run every block sparse (benchmark the sparse path)
                m.use_sparse = True
            info["sparsity"] = [sum(s) / len(s) for s in sp]
            info["head_k"] = [m.head_k for _, m in controller.modules][:1]
        else:
            info["sparsity"] = None
    elif mode == "window":
        model.blocks[0].attn.build_mask(dev)
        mask = model.blocks[0].attn.block_mask
        for blk in model.blocks[1:]:
            blk.attn.block_mask = mask
        info["window"] = list(model.blocks[0].attn.win)
        info["density"] = model.blocks[0].attn.density
        try:  # fraction of 128x128 blocks FlexAttention computes (full or partial)
            info["block_density"] = 1.0 - float(mask.sparsity()) / 100.0
        except Exception:
            pass
        step = _make_step(model, x, c, target, opt)
    else:
        step = _make_step(model, x, c, target, opt)
    res = _time_steps(step, args.warmup, args.iters)
    info.update(res)
    info["tokens_per_s"] = S / (res["median_ms"] / 1000)
    del model, opt, controller, step, x, target
    gc.collect()
    torch.cuda.empty_cache()
    return info


def auto_layers(S: int, grid, args, dev) -> int:
    peaks = []
    for L in (1, 2):
        torch.cuda.empty_cache()
        r = run_mode("dense", S, grid, L, argparse.Namespace(**{**vars(args), "warmup": 1, "iters": 1}),
                     None, dev)
        peaks.append(r["peak_gb"])
    per = max(peaks[1] - peaks[0], 1e-3)
    base = peaks[0] - per
    free, _ = torch.cuda.mem_get_info(dev)
    # headroom: DSV adds index / low-rank tensors per block (~1 GB at 64k, 0.9)
    n = int((0.85 * free / 2**30 - base) / (per * 1.15))
    return max(1, min(args.max_layers, n)), per


def _load_profile(path: str) -> List[List[float]]:
    """Per-block sparsity from a training run's metrics.jsonl (the last line with blocks)."""
    last = None
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("blocks"):
                last = r
    if last is None:
        raise ValueError(f"--sparsity-from: no per-block sparsity in {path}")
    return [b.get("head_sparsity") or [b["sparsity"]] for b in last["blocks"]]


def write_markdown(results: Dict, path: str) -> None:
    L = ["# Training-step throughput, 2.7B-shaped DiT blocks", "", provenance_line(results), "",
         f"Device: {results['device']}; torch {results['torch']}; hidden {results['hidden']}, "
         f"{results['heads']} heads x {results['head_dim']}, {results['layers']} blocks, batch 1, "
         f"bf16 autocast, fused AdamW (fp32 master weights), gradient checkpointing "
         f"{'on' if results['grad_ckpt'] else 'off'}; median of {results['iters']} steps after "
         f"{results['warmup']} warm-up steps (CUDA events around forward + backward + optimizer"
         f" + DSV controller).", "",
         "| tokens | grid | mode | attention density | step ms (median) | min-max | tokens/s | vs dense | peak GB |",
         "|---|---|---|---|---|---|---|---|---|"]
    for S, rows in results["runs"].items():
        dense = next((r for r in rows if r["mode"] == "dense" and "median_ms" in r), None)
        for r in rows:
            if "error" in r:
                L.append(f"| {S} | {'x'.join(map(str, r.get('grid', [])))} | {r['mode']} | - | "
                         f"error: {r['error'][:80]} | | | | |")
                continue
            if r["mode"].startswith("dsv") and r.get("sparsity"):
                dens = f"{1 - sum(r['sparsity']) / len(r['sparsity']):.3f}"
            elif r["mode"] == "window":
                dens = f"{r['density']:.3f}"
            else:
                dens = "1"
            sp = f"{dense['median_ms'] / r['median_ms']:.2f}x" if dense else "-"
            L.append(f"| {S} | {'x'.join(map(str, r['grid']))} | {r['mode']} | {dens} | "
                     f"{r['median_ms']:.1f} | {r['min_ms']:.1f}-{r['max_ms']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {sp} | {r['peak_gb']:.1f} |")
    src = results.get("sparsity_from")
    key = "sparsity" if src else "profiled_sparsity"  # the sparsity each block ran at
    prof = [(S, r.get(key)) for S, rows in results["runs"].items() for r in rows
            if r["mode"] == "dsv_prof" and r.get(key)]
    L += ["", "dsv_prof runs every block sparse at " + (
        f"the per-block sparsity of `{src}` (a trained run's profiler, the block means cycled "
        "over this model's blocks)" if src else
        "the sparsity the profiler measured on this (untrained) model and input") + "; per block: "
          + "; ".join(f"{S}: {', '.join(f'{v:.3f}' for v in p[:8])}{' ...' if len(p) > 8 else ''}"
                      for S, p in prof), ""]
    L += ["dsv_stage1 is DSV's stage 1 (dense attention + predictor training every step): the "
          "cost paid before the switch.", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_seq_grid_args(p)
    p.add_argument("--layers", default="auto", help="block count or 'auto'")
    p.add_argument("--max-layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--group-size", type=int, default=DSVConfig.group_size)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--modes", nargs="+",
                   default=["dense", "window", "dsv_stage1", "dsv_prof", "dsv_0.9", "dsv_0.95"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--sparsity-from", default=None,
                   help="metrics.jsonl of a training run: per-block sparsity for dsv_prof")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_train.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import dsv_ext

    if not dsv_ext.has_cuda_kernels():
        print("warning: dsv_ext was built without CUDA kernels; DSV modes will fail",
              file=sys.stderr)
    dev = torch.device("cuda")
    grids = resolve_grids(args.seq, args.grid)
    profiled = _load_profile(args.sparsity_from) if args.sparsity_from else None
    t0 = time.time()
    if args.layers == "auto":
        Smax = max(args.seq)
        layers, per = auto_layers(Smax, grids[Smax], args, dev)
        print(f"auto layers: {layers} ({per:.2f} GB per dense block at {Smax} tokens)", flush=True)
    else:
        layers = int(args.layers)
    results = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
               "provenance": provenance(),
               "hidden": args.hidden, "heads": args.heads, "head_dim": args.hidden // args.heads,
               "layers": layers, "group_size": args.group_size, "rank": args.rank,
               "grad_ckpt": args.grad_ckpt, "warmup": args.warmup, "iters": args.iters,
               "sparsity_from": args.sparsity_from, "runs": {}}
    os.makedirs(args.out, exist_ok=True)
    stem = "bench_train" + (f"_{args.tag}" if args.tag else "")
    for S in args.seq:
        rows = []
        for mode in args.modes:
            try:
                r = run_mode(mode, S, grids[S], layers, args, profiled, dev)
            except torch.cuda.OutOfMemoryError as e:
                r = {"mode": mode, "seq_len": S, "grid": list(grids[S]), "error": f"OOM: {e}"[:300]}
            except Exception as e:  # keep going: report the failure in the table
                r = {"mode": mode, "seq_len": S, "grid": list(grids[S]),
                     "error": f"{type(e).__name__}: {e}"[:300]}
            gc.collect()
            torch.cuda.empty_cache()
            rows.append(r)
            msg = (f"S={S} {mode:>10}: {r['median_ms']:.1f} ms/step, {r['tokens_per_s']:.0f} tok/s, "
                   f"peak {r['peak_gb']:.1f} GB" if "median_ms" in r else f"S={S} {mode}: {r['error']}")
            print(msg, f"[{time.time() - t0:.0f}s]", flush=True)
            results["runs"][str(S)] = rows
            with open(os.path.join(args.out, stem + ".json"), "w") as f:
                json.dump(results, f, indent=1)
            write_markdown(results, os.path.join(args.out, stem + ".md"))
    print(open(os.path.join(args.out, stem + ".md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
