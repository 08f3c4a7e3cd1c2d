"""End-to-end sampling latency of a 2.7B-shaped video DiT: full attention (cuDNN SDPA) vs DSV.

    python benchmarks/bench_inference.py            # 32k and 64k tokens, 32 layers, ~2-3 min on an H200
    python benchmarks/bench_inference.py --quick    # 4 layers, 3 steps: a ~20 s check
    python benchmarks/bench_inference.py --seq 65536 --layers 16 --steps 10 --tag l16

One device call (CUDA build of the extension, then the benchmark; results in $OUT):

    MAX_JOBS=16 DSV_BUILD_CUDA=1 pip install -q --no-build-isolation --no-deps -e . && \
        python benchmarks/bench_inference.py --out $OUT

What is timed: the sampler of ``dsv_ext.app.sample`` (:func:`dsv_ext.app.sample.sample_latents`, Euler,
bf16 autocast) running ``--steps`` flow-matching steps of the reference ``VideoDiT``
(``dsv_ext.app.models``) shaped like the paper's 2.7B model: hidden 2048, 16 heads of dim 128,
``--layers`` blocks (default 32, the full 2.7B depth: inference keeps no activations, so the
whole model fits one H200; ``auto`` fits what the free memory allows), 16 latent channels,
patch 1x2x2, batch 1. Tokens / latent grid (T x H x W after patchify): 32768 = 32x32x32,
65536 = 16x64x64. Weights are bf16, random (PyTorch default init, adaLN gates non-zero so
every block carries signal); timing does not depend on the values: DSV's per-head K is fixed by
the sparsity under test, not by the weights.

Modes (same model, same weights, same noise):

  full       every block dense: SDPA with cuDNN first in the backend priority (what
             ``python -m dsv_ext.app.sample --full-attention`` runs, and DSV's stage-1 path)
  dsv_0.9    every block in DSV stage 2 at sparsity 0.9 in every head (K = 10% of S, rounded
             up to --k-multiple): per block and step, the cube reordering, the low-rank
             projections (rank --rank), the top-K estimation and the sparse attention. The
             estimation cost is inside the timed steps.
  dsv_0.95   the same at sparsity 0.95.
  dsv_0.9_r2 sparsity 0.9, the critical keys estimated on every 2nd step only and reused in
             between (``dsv_ext.set_index_refresh`` / ``python -m dsv_ext.app.sample
             --index-refresh 2``; any ``_rN`` suffix works). Not in the default modes.

Timing: CUDA events around every sampling step (one model evaluation + the Euler update),
after --warmup untimed steps; the median, min and max step are reported, and the end-to-end
latency of the timed --steps (event before the first to event after the last). A second table
splits one block's attention at each length: dense SDPA, DSV's whole sparse core, and its
estimation part alone (projections + top-K), medians of --core-iters calls.

Results: benchmarks/results/bench_inference[_TAG].json and .md (written after every mode, so a
run cut short keeps what it measured). Needs a CUDA build of dsv_ext (``DSV_BUILD_CUDA=1 pip
install --no-build-isolation -e .``); without the CUDA kernels the DSV modes are reported as
errors and the full-attention mode still runs.

Expected runtime on one H200 (default arguments): about 2-3 minutes (full attention at 64k is
about 2 s a step with 32 layers; each mode runs warm-up + 5 steps), plus the extension build.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dsv_ext.app.models.dit import DiTConfig, VideoDiT  # noqa: E402
from dsv_ext.config import DSVConfig  # noqa: E402

sys.path.insert(0, HERE)
from bench_common import add_seq_grid_args, provenance, provenance_line, cuda_time_ms, resolve_grids  # noqa: E402

PAPER_DEPTH = 32


class BenchDiT(VideoDiT):
    """VideoDiT with PyTorch's default initialisation (done on the device; the reference
    initialisation draws every weight on the CPU, slow at 2.7B) and small non-zero adaLN
    modulation, so that attention and MLP outputs reach the residual stream."""

    def initialize_weights(self, seed: int = 0) -> None:
        with torch.no_grad():
            for blk in self.blocks:
                blk.ada[-1].weight.normal_(0.0, 0.02)
            self.final.ada[-1].weight.normal_(0.0, 0.02)


def _dsv_config(args):
    return DSVConfig(group_size=args.group_size, rank=args.rank, k_multiple=args.k_multiple,
                     cube=tuple(args.cube), use_calibration=False, measure_recall=False)


def build_model(S: int, grid, layers: int, args, dev) -> BenchDiT:
    T, H, W = grid
    cfg = DiTConfig(in_channels=args.channels, latent_size=(T, 2 * H, 2 * W), patch=(1, 2, 2),
                    hidden=args.hidden, depth=layers, heads=args.heads, attention="dsv", qk_norm=True)
    assert cfg.num_tokens == S, (cfg.grid, S)
    torch.manual_seed(0)
    with torch.device(dev):
        model = BenchDiT(cfg, dsv_config=_dsv_config(args))
    model = model.to(dtype=torch.bfloat16).eval()
    return model


def attention_modules(model):
    from dsv_ext.modules.attention import SparseAttention

    return [m for m in model.modules() if isinstance(m, SparseAttention)]


def parse_mode(mode: str):
    """'dsv_<s>[_r<N>]' -> (s, N); ValueError naming --modes for anything else but 'full'."""
    parts = mode.split("_")
    try:
        if len(parts) not in (2, 3) or parts[0] != "dsv" or (len(parts) == 3 and parts[2][:1] != "r"):
            raise ValueError
        s = float(parts[1])
        refresh = int(parts[2][1:]) if len(parts) == 3 else 1
        if not 0.0 <= s < 1.0 or refresh < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"--modes: expected full or dsv_<sparsity in [0, 1)>[_r<N >= 1>], got {mode!r}") from None
    return s, refresh


def set_mode(model, mode: str, S: int) -> Dict:
    """full: every block dense; dsv_<s>[_r<N>]: every block sparse at sparsity s in every head,
    the index estimated on every N-th step (default 1)."""
    from dsv_ext.modules.attention import set_index_refresh

    mods = attention_modules(model)
    if mode == "full":
        set_index_refresh(model, 1)
        for m in mods:
            m.stage, m.use_sparse = 1, False
            m.set_density(None)
        return {"sparsity": None, "head_k": None, "index_refresh": None}
    s, refresh = parse_mode(mode)
    for m in mods:
        m.set_density([1.0 - s] * m.num_heads, seq_len=S)
        m.stage, m.use_sparse = 2, True
        m.plan_step(replace(m.plan, train=False, profile=False))
    set_index_refresh(model, refresh)
    return {"sparsity": s, "head_k": mods[0].head_k, "kmax": mods[0].kmax, "index_refresh": refresh}


def time_sampling(model, S: int, args, dev) -> Dict:
    from dsv_ext.app.sample import sample_latents

    cfg = model.cfg
    g = torch.Generator(device="cpu").manual_seed(0)
    noise = torch.randn(1, cfg.in_channels, *cfg.latent_size, generator=g).to(dev)
    if args.warmup > 0:
        sample_latents(model, noise, args.warmup, "euler", 1.0, "bf16")
    for m in attention_modules(model):
        m.reset_index_cache()  # the timed steps start with a fresh estimate
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]

    def cb(i, t):
        events[i + 1].record()

    events[0].record()
    x = sample_latents(model, noise, args.steps, "euler", 1.0, "bf16", callback=cb)
    torch.cuda.synchronize()
    steps = [events[i].elapsed_time(events[i + 1]) for i in range(args.steps)]
    total = events[0].elapsed_time(events[-1])
    finite = bool(torch.isfinite(x).all())
    return {"median_step_ms": statistics.median(steps), "min_step_ms": min(steps),
            "max_step_ms": max(steps), "step_ms": steps, "latency_s": total / 1000.0,
            "steps": args.steps, "peak_gb": torch.cuda.max_memory_allocated() / 2**30,
            "output_finite": finite}


def _median_ms(fn, iters: int) -> float:
    return cuda_time_ms(fn, warmup=1, reps=iters)["median_ms"]


@torch.no_grad()
def attention_breakdown(S: int, grid, sparsities: Sequence[float], args, dev) -> List[Dict]:
    """One block's attention core: dense SDPA vs DSV sparse core vs its estimation alone."""
    import dsv_ext
    from dsv_ext.functional.attention import dense_core, sparse_core
    from dsv_ext.grouping import cube_permutation

    cfg = _dsv_config(args)
    H, D, r, G = args.heads, args.hidden // args.heads, args.rank, args.group_size
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(1, S, H, D, generator=g).to(dev, torch.bfloat16) for _ in range(3))
    wq = (torch.randn(H, D, r, generator=g) / math.sqrt(D)).to(dev)
    wk = (torch.randn(H, D, r, generator=g) / math.sqrt(D)).to(dev)
    perm, inv = cube_permutation(grid, cfg.cube, S, dev)
    rows = []
    dense_ms = _median_ms(lambda: dense_core(q, k, v, None, "auto"), args.core_iters)
    rows.append({"seq_len": S, "what": "dense", "ms": dense_ms})
    for s in sparsities:
        K = cfg.head_k(s, S)
        cnt = torch.full((H,), K, dtype=torch.int32, device=dev)
        counts = cnt.view(1, H).expand(1, H).contiguous()
        try:
            sp_ms = _median_ms(lambda: sparse_core(q, k, v, wq, wk, perm, inv, cnt, K, G, None),
                               args.core_iters)

            def est():
                qp = q.index_select(1, perm)
                q_lr = torch.einsum("bshd,hdr->bshr", qp, wq.to(q.dtype)).contiguous()
                k_lr = torch.einsum("bshd,hdr->bshr", k, wk.to(k.dtype)).contiguous()
                return dsv_ext.topk_estimate(q_lr, k_lr, counts, G, K)

            est_ms = _median_ms(est, args.core_iters)
            rows.append({"seq_len": S, "what": f"dsv_{s}", "sparsity": s, "K": K, "ms": sp_ms,
                         "estimation_ms": est_ms, "estimation_share": est_ms / sp_ms,
                         "speedup_vs_dense": dense_ms / sp_ms})
        except Exception as e:  # no CUDA kernels, OOM, ...
            rows.append({"seq_len": S, "what": f"dsv_{s}", "sparsity": s,
                         "error": f"{type(e).__name__}: {e}"[:300]})
    del q, k, v
    return rows


def auto_layers(args, dev) -> int:
    """Blocks that fit: bf16 weights of one block plus ~12 GB of headroom for the transient
    activations of a 64k-token forward (qkv, MLP hidden, DSV index lists)."""
    h = args.hidden
    per_block = (3 * h * h + h * h + 2 * 4 * h * h + 6 * h * h) * 2  # qkv, proj, MLP, adaLN
    free, _ = torch.cuda.mem_get_info(dev)
    n = int((0.9 * free - 12 * 2**30) / per_block)
    return max(1, min(args.max_layers, n))


def write_markdown(res: Dict, path: str) -> None:
    L = ["# Sampling latency, 2.7B-shaped video DiT: full attention vs DSV", "", provenance_line(res), "",
         f"Device: {res['device']}; torch {res['torch']}; hidden {res['hidden']}, {res['heads']} "
         f"heads x {res['head_dim']}, {res['layers']} blocks, {res['channels']} latent channels, "
         f"patch 1x2x2, batch 1, bf16 weights and autocast; Euler sampler of dsv_ext.app.sample; "
         f"DSV: G={res['group_size']}, rank {res['rank']}, cube {'x'.join(map(str, res['cube']))}, "
         f"K rounded up to {res['k_multiple']}, estimation included. Median of {res['steps']} "
         f"sampling steps after {res['warmup']} warm-up steps (CUDA events per step).", "",
         "| tokens | grid | mode | K / S | step ms (median) | min-max | "
         f"latency of {res['steps']} steps (s) | latency vs full | peak GB |",
         "|---|---|---|---|---|---|---|---|---|"]
    for S, rows in res["runs"].items():
        full = next((r for r in rows if r["mode"] == "full" and "median_step_ms" in r), None)
        for r in rows:
            grid = "x".join(map(str, r.get("grid", [])))
            if "error" in r:
                L.append(f"| {S} | {grid} | {r['mode']} | - | error: {r['error'][:90]} | | | | |")
                continue
            dens = "1" if r["mode"] == "full" else f"{r['kmax'] / int(S):.3f}"
            # latency ratio over the same timed steps (with index reuse the steps differ: the
            # median step would hide the estimating ones)
            sp = f"{full['latency_s'] / r['latency_s']:.2f}x" if full else "-"
            L.append(f"| {S} | {grid} | {r['mode']} | {dens} | {r['median_step_ms']:.1f} | "
                     f"{r['min_step_ms']:.1f}-{r['max_step_ms']:.1f} | {r['latency_s']:.3f} | "
                     f"{sp} | {r['peak_gb']:.1f} |")
    if res.get("breakdown"):
        L += ["", "One block's attention (median of "
              f"{res['core_iters']} calls, [1, S, {res['heads']}, {res['head_dim']}] bf16):", "",
              "| tokens | attention | K | ms | estimation ms | estimation share | vs dense SDPA |",
              "|---|---|---|---|---|---|---|"]
        for r in res["breakdown"]:
            if "error" in r:
                L.append(f"| {r['seq_len']} | {r['what']} | - | error: {r['error'][:90]} | | | |")
            elif r["what"] == "dense":
                L.append(f"| {r['seq_len']} | dense SDPA (cuDNN first) | S | {r['ms']:.2f} | - | - | 1x |")
            else:
                L.append(f"| {r['seq_len']} | {r['what']} (sparse core) | {r['K']} | {r['ms']:.2f} | "
                         f"{r['estimation_ms']:.2f} | {100 * r['estimation_share']:.1f}% | "
                         f"{r['speedup_vs_dense']:.2f}x |")
    for note in res.get("notes", []):
        L += ["", note]
    if any(str(r.get("mode", "")).count("_") == 2 for rows in res["runs"].values() for r in rows):
        L += ["", "dsv_<s>_r<N>: the critical keys are estimated on every N-th step only and reused "
              "in between (python -m dsv_ext.app.sample --index-refresh N); the timed steps start with "
              "an estimating one. The reused index lists stay in memory (peak GB)."]
    L += ["", "Target: DSV sampling latency at 64k tokens and sparsity 0.9 at least 2x "
          "lower than full attention (paper: 2.0-3.5x).", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_seq_grid_args(p)
    p.add_argument("--layers", default=str(PAPER_DEPTH),
                   help=f"DiT blocks (default {PAPER_DEPTH}, the 2.7B depth) or 'auto' (as many as fit)")
    p.add_argument("--max-layers", type=int, default=64, help="cap of --layers auto")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--channels", type=int, default=16, help="latent channels")
    p.add_argument("--group-size", type=int, default=DSVConfig.group_size)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--k-multiple", type=int, default=64)
    p.add_argument("--cube", type=int, nargs=3, default=list(DSVConfig.cube))
    p.add_argument("--modes", nargs="+", default=["full", "dsv_0.9", "dsv_0.95"])
    p.add_argument("--steps", type=int, default=5, help="timed sampling steps per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed sampling steps first")
    p.add_argument("--core-iters", type=int, default=10, help="calls per attention breakdown entry")
    p.add_argument("--no-breakdown", action="store_true", help="skip the one-block attention table")
    p.add_argument("--quick", action="store_true",
                   help="4 layers, 3 timed steps, 3 core iterations (about 20 s)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.steps, args.core_iters = "4", 3, 3
        args.tag = args.tag or "quick"
    for m in args.modes:
        if m != "full":
            try:
                parse_mode(m)  # a bad mode fails here, before any model is built
            except ValueError as e:
                p.error(str(e))
    if not torch.cuda.is_available():
        print("bench_inference.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import dsv_ext

    if not dsv_ext.has_cuda_kernels():
        print("warning: dsv_ext was built without CUDA kernels; the DSV modes will fail "
              "(build with DSV_BUILD_CUDA=1 pip install --no-build-isolation -e .)", file=sys.stderr)
    dev = torch.device("cuda")
    grids = resolve_grids(args.seq, args.grid)
    layers = auto_layers(args, dev) if args.layers == "auto" else int(args.layers)
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "provenance": provenance(),
           "hidden": args.hidden, "heads": args.heads, "head_dim": args.hidden // args.heads,
           "layers": layers, "channels": args.channels, "group_size": args.group_size,
           "rank": args.rank, "k_multiple": args.k_multiple, "cube": list(args.cube),
           "steps": args.steps, "warmup": args.warmup, "core_iters": args.core_iters,
           "runs": {}, "breakdown": []}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "bench_inference" + (f"_{args.tag}" if args.tag else ""))

    def save():
        with open(stem + ".json", "w") as f:
            json.dump(res, f, indent=1)
        write_markdown(res, stem + ".md")

    for S in args.seq:
        grid = grids[S]
        rows: List[Dict] = []
        res["runs"][str(S)] = rows
        try:
            model = build_model(S, grid, layers, args, dev)
        except torch.cuda.OutOfMemoryError as e:
            rows.append({"mode": "all", "seq_len": S, "grid": list(grid), "error": f"OOM building: {e}"[:300]})
            save()
            continue
        print(f"S={S}: {layers} blocks, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B "
              f"parameters [{time.time() - t0:.0f}s]", flush=True)
        for mode in args.modes:
            info: Dict = {"mode": mode, "seq_len": S, "grid": list(grid), "layers": layers}
            try:
                info.update(set_mode(model, mode, S))
                info.update(time_sampling(model, S, args, dev))
            except torch.cuda.OutOfMemoryError as e:
                info["error"] = f"OOM: {e}"[:300]
            except Exception as e:  # keep going: report the failure in the table
                info["error"] = f"{type(e).__name__}: {e}"[:300]
            gc.collect()
            torch.cuda.empty_cache()
            rows.append(info)
            msg = (f"S={S} {mode:>9}: {info['median_step_ms']:.1f} ms/step, {info['latency_s']:.2f} s "
                   f"for {args.steps} steps, peak {info['peak_gb']:.1f} GB"
                   if "median_step_ms" in info else f"S={S} {mode}: {info['error']}")
            print(msg, f"[{time.time() - t0:.0f}s]", flush=True)
            save()
        del model
        gc.collect()
        torch.cuda.empty_cache()
        if not args.no_breakdown:
            sps = sorted({parse_mode(m)[0] for m in args.modes if m != "full"})
            try:
                res["breakdown"] += attention_breakdown(S, grid, sps, args, dev)
            except Exception as e:
                res["breakdown"].append({"seq_len": S, "what": "all", "error": f"{type(e).__name__}: {e}"[:300]})
            gc.collect()
            torch.cuda.empty_cache()
            save()
    print(open(stem + ".md").read())
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
