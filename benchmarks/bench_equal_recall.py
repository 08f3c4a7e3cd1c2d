"""Speed at equal quality: the density each selection granularity needs for an attention recall,
then the attention time of each at that density.

    python benchmarks/bench_equal_recall.py --checkpoint runs/x/dsv/ckpt_last.pt [--out DIR]
    python benchmarks/bench_equal_recall.py --train-steps 800        # trains configs/small-video.yaml first
    python benchmarks/bench_equal_recall.py --analysis DIR/equal_recall.json --time   # times an earlier analysis
    python benchmarks/bench_equal_recall.py --checkpoint CKPT --locality 16 --timesteps 0.1 0.5 0.9
        # per timestep and head: lists of 128 queries against each query's own, on sampled rows

1. **Capture.** The reference DiT of a checkpoint (a DSV run on real video, so its predictors are
   trained) runs on held-out clips at a few timesteps; a hook keeps the q and k that each
   attention block sees (raster order, with the token grid).
2. **Recall curves** per block and head, from the exact softmax of every query row (float32):
   - `token`: each query its own top keys (the per-query oracle);
   - `token G=32`, `token G=64`, `token G=128`: one list per group of G queries in cube order,
     the group's top keys by summed probability (oracle) -- DSV's token lists. The cube is the
     checkpoint's DSV cube or --cube: with 4x4x4 cubes the groups are 2x4x4 (G = 32), 4x4x4
     (G = 64) and 4x4x8 (G = 128) regions; with 2x4x4 cubes, G = 64 groups are two neighbouring
     cubes (2x4x8);
   - `predictor G=32/64/128`: the lists the checkpoint's trained low-rank predictors produce
     (`dsv_ext.recall.recall_curve` on sampled rows) -- what DSV actually runs;
   - `block b=16/64`: groups of 64 queries (as `token G=64`) choosing whole key blocks of b keys
     in cube order (1x4x4 patches / 64-key regions shaped as the groups of 64), oracle;
     `block b=16/64 G=128`: the same for groups of 128 queries (the default group size);
   - `flex 128x128`: FlexAttention's block-sparse tiles, 128 queries x 128 keys in raster order,
     oracle tiles from the same scores.
   Recall of a row: the fraction of its softmax mass inside the keys its list covers. Every method
   uses one list length per head (as DSV's K per head); the density a head needs for a target is
   the smallest length whose mean recall over the rows reaches it, in keys / S.
3. **Time** at the long shape (S = 64k, H = 24, D = 128, bf16, CUDA): each method's estimate +
   forward + backward at its mean density (DSV token lists through benchmarks/bench_kernels.py's
   `run_shape` with spatially smooth lists; FlexAttention block-sparse at its density;
   cuDNN dense), all in the same run; key blocks as dsv_ext.sparse_attention runs them on CUDA
   (64-key lists on the block-list kernels, 16-key lists expanded to token lists; through the C
   API) with the block estimation (dsv_ext.topk_estimate with kv_block). Per-head rows:
   `<method> + dense heads` (heads needing more than recall_max_density of the keys on cuDNN, as
   SparseAttention runs K = S heads; the others sparse at their mean density), the same for
   FlexAttention (`flex 128x128 + dense heads`: dense above the density where its tiles cost
   what cuDNN does, `flex_crossover`; the baseline given the same per-head freedom) and
   `auto G=128` (kv_block="auto": per head the granularity `auto_choice` picks from its
   densities with tokens, 16- and 64-key blocks at G = 128, dense where none fits; each
   granularity timed at its heads' mean density and scaled by its share of the heads).

Writes `equal_recall.json` / `.md` / `.png` to --out. The curve code runs on the CPU too (tests).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

TARGETS = (0.8, 0.9, 0.95)


# ---------------------------------------------------------------------------------------------
# recall curves of one head (the exact softmax of every row)
# ---------------------------------------------------------------------------------------------

def _group_curve(p: torch.Tensor, rows_per_list: int, key_block: int = 1) -> torch.Tensor:
    """Sum over the lists of a chunk of the covered mass (float64 [n_items]): p [R, S] row
    probabilities; consecutive ``rows_per_list`` rows share a list of whole key blocks of
    ``key_block`` consecutive keys, chosen by summed probability. Item i of the result is the
    total mass of all rows covered by each list's top i+1 blocks."""
    R, S = p.shape
    col = p.view(R // rows_per_list, rows_per_list, S).sum(1, dtype=torch.float64)
    if key_block > 1:
        col = col.view(col.shape[0], S // key_block, key_block).sum(-1)
    return col.sort(dim=-1, descending=True).values.cumsum(-1).sum(0)


@torch.no_grad()
def head_curves(q: torch.Tensor, k: torch.Tensor, perm: torch.Tensor, scale: float,
                groups: Sequence[int] = (32, 64, 128), blocks: Sequence[int] = (16, 64),
                block_groups: Sequence[int] = (64, 128), tile: int = 128, per_query: bool = True,
                chunk: int = 1024, sample: int = 0) -> Dict[str, Tuple[int, torch.Tensor]]:
    """Mean recall curves of one head: name -> (keys per item, float64 [n_items] curve), where
    curve[i] is the mean over all S rows of the mass covered by i+1 items.

    q, k: [S, D] in raster order; perm: int64 [S], raster position of each cube-order position
    (``dsv_ext.grouping.cube_permutation(grid)[0]``); S must be a multiple of every group size,
    block size, block group and ``tile``. Block lists of groups of 64 queries are named
    ``block b=<b>``, of other group sizes ``block b=<b> G=<g>``. ``sample`` > 0: the mean over
    that many evenly spaced runs of max(groups, block groups, tile) rows instead of all S (whole
    groups and tiles: the same lists, a fraction of the work)."""
    S, D = q.shape
    for n, v in [("groups", g) for g in groups] + [("blocks", b) for b in blocks] + \
                [("block_groups", g) for g in block_groups] + [("tile", tile)]:
        if v < 1 or S % v:
            raise ValueError(f"{n}: {v} does not divide the sequence length {S}")
    step = max(tile, *block_groups, *groups)
    if sample < 0 or any(step % v for v in (tile, *block_groups, *groups)):
        raise ValueError(f"sample: {sample}; needs sample >= 0 and group sizes that divide {step}")
    chunk = max(step, chunk // step * step)
    rows = None  # all rows, else the sampled ones (whole runs of `step` rows)
    if sample:
        runs = torch.linspace(0, S // step - 1, min(sample, S // step)).round().long().unique()
        rows = (runs[:, None] * step + torch.arange(step)).flatten().to(q.device)
    R = S if rows is None else rows.numel()
    f32 = torch.float32
    qr, kr = q.to(f32), k.to(f32)
    qc, kc = qr.index_select(0, perm), kr.index_select(0, perm)
    acc: Dict[str, Tuple[int, torch.Tensor]] = {}

    def add(name, keys_per_item, part):
        if name in acc:
            acc[name][1].add_(part)
        else:
            acc[name] = (keys_per_item, part.clone())

    for i in range(0, R, chunk):
        sel = slice(i, i + chunk) if rows is None else rows[i:i + chunk]
        # cube order: per-query oracle, token groups, key blocks
        p = torch.softmax(scale * (qc[sel] @ kc.T), dim=-1)
        if per_query:
            add("token", 1, p.sort(dim=-1, descending=True).values.cumsum(-1, dtype=torch.float64).sum(0))
        for g in groups:
            add(f"token G={g}", 1, _group_curve(p, g))
        for b in blocks:
            for bg in block_groups:
                add(f"block b={b}" + ("" if bg == 64 else f" G={bg}"), b, _group_curve(p, bg, b))
        del p
        # raster order: FlexAttention's tiles
        p = torch.softmax(scale * (qr[sel] @ kr.T), dim=-1)
        add(f"flex {tile}x{tile}", tile, _group_curve(p, tile, tile))
        del p
    return {n: (kpi, c / R) for n, (kpi, c) in acc.items()}


def density_for(curve: torch.Tensor, keys_per_item: int, seq_len: int, target: float) -> float:
    """Smallest list length (in keys / S) whose mean recall reaches ``target`` (1.0 if none)."""
    hit = (curve >= target - 1e-12).nonzero()
    if hit.numel() == 0:
        return 1.0
    return min(1.0, (int(hit[0]) + 1) * keys_per_item / seq_len)


def predictor_curves(q: torch.Tensor, k: torch.Tensor, perm: torch.Tensor, wq: torch.Tensor,
                     wk: torch.Tensor, scale: float, groups: Sequence[int] = (32, 64, 128),
                     rows: int = 2048, k_multiple: int = 16) -> Dict[str, Tuple[int, torch.Tensor]]:
    """The trained predictors' lists (dsv_ext.recall.recall_curve): name -> (k_multiple, float64
    [H, n_bins]) for q, k [S, H, D] in raster order on ``rows`` evenly spaced rows."""
    from dsv_ext.recall import recall_curve

    S = q.shape[0]
    qc, kc = q.index_select(0, perm)[None], k.index_select(0, perm)[None]
    r = torch.arange(0, S, max(1, S // rows), device=q.device)
    out = {}
    for g in groups:
        c = recall_curve(qc, kc, wq, wk, r, group_size=g, k_multiple=k_multiple, scale=scale)
        out[f"predictor G={g}"] = (k_multiple, c[0].double())
    return out


# ---------------------------------------------------------------------------------------------
# capture
# ---------------------------------------------------------------------------------------------

def capture_qk(model, x: torch.Tensor, t: torch.Tensor, noise: torch.Tensor):
    """[(block name, q [B, S, H, D], k, grid, SparseAttention or None)] that the attention cores
    of ``model`` see in one forward of the noised clips (flow matching: x_t = (1-t) x + t e)."""
    from dsv_ext.modules.attention import DenseAttention, SparseAttention

    got: List = []
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, (SparseAttention, DenseAttention)):
            def pre(mod, args, kwargs, name=name):
                q, k = args[0], args[1]
                grid = kwargs.get("grid", args[3] if len(args) > 3 else None)
                if grid is None:
                    grid = getattr(mod, "grid", None)
                got.append((name, q.detach(), k.detach(), tuple(grid),
                            mod if isinstance(mod, SparseAttention) else None))
            hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        tb = t.view(-1, 1, 1, 1, 1).to(x.dtype)
        with torch.no_grad():
            model((1 - tb) * x + tb * noise, t)
    finally:
        for h in hooks:
            h.remove()
    return got


def analyse(captures, cube=(4, 4, 4), groups=(32, 64, 128), blocks=(16, 64), targets=TARGETS,
            per_query=True, predictor_rows=2048, sample=0, log=print) -> Dict:
    """Densities per method, block and head for each target, averaged over the captures
    (``sample``: head_curves on that many runs of rows)."""
    from dsv_ext.grouping import cube_permutation

    curves: Dict[Tuple[str, int, str], Tuple[int, torch.Tensor]] = {}
    counts: Dict[Tuple[str, int, str], int] = {}
    S = None
    t0 = time.perf_counter()
    for ci, (name, q, k, grid, mod) in enumerate(captures):
        B, S, H, D = q.shape
        perm = cube_permutation(grid, cube, S, q.device)[0]
        scale = 1.0 / math.sqrt(D)
        for b in range(B):
            for h in range(H):
                for m, (kpi, c) in head_curves(q[b, :, h], k[b, :, h], perm, scale, groups, blocks,
                                               per_query=per_query, sample=sample).items():
                    key = (name, h, m)
                    curves[key] = (kpi, curves[key][1] + c) if key in curves else (kpi, c)
                    counts[key] = counts.get(key, 0) + 1
            if mod is not None and predictor_rows:
                for m, (kpi, c) in predictor_curves(q[b], k[b], perm, mod.predictor.wq.float(),
                                                    mod.predictor.wk.float(), scale, groups,
                                                    predictor_rows).items():
                    for h in range(H):
                        key = (name, h, m)
                        curves[key] = (kpi, curves[key][1] + c[h]) if key in curves else (kpi, c[h].clone())
                        counts[key] = counts.get(key, 0) + 1
        log(f"  capture {ci + 1}/{len(captures)} ({name}, S={S}): {time.perf_counter() - t0:.0f} s")
    methods = sorted({m for (_, _, m) in curves})
    res = {"seq_len": S, "targets": list(targets), "methods": {},
           "head_names": [f"{n}:{h}" for (n, h, m) in curves if m == methods[0]]}  # densities' order
    for m in methods:
        per_t = {}
        for tg in targets:
            dens = [density_for(c / counts[key], kpi, S, tg) for key, (kpi, c) in curves.items()
                    if key[2] == m]
            per_t[str(tg)] = {"mean_density": sum(dens) / len(dens), "heads": len(dens),
                              "min": min(dens), "max": max(dens), "densities": dens}
        res["methods"][m] = per_t
    return res


def dense_head_split(densities: Sequence[float], heads: int, max_density: float) -> Tuple[int, int, float]:
    """DSV's per-head rule at the long shape: a head needing more than ``max_density`` of the
    keys attends to all of them and runs dense (DSVConfig.recall_max_density). Returns
    (sparse heads, dense heads, mean density of the sparse heads) for ``heads`` heads, the
    measured heads' dense share rounded to whole heads."""
    n = len(densities)
    if n == 0 or heads < 1:
        raise ValueError("densities: expected at least one head's density and heads >= 1")
    sparse = [float(d) for d in densities if d <= max_density]
    hd = round(heads * (n - len(sparse)) / n)
    hs = heads - hd
    return hs, hd, (sum(sparse) / len(sparse) if sparse and hs else 0.0)


def flex_crossover(density: float, flex_ms: float, cudnn_ms: float) -> float:
    """The density above which FlexAttention's tiles cost more than cuDNN's dense attention, from
    one measurement (``flex_ms`` at ``density``) with time proportional to density (its kernel
    visits the kept tiles only); at most 1."""
    if not (0.0 < density <= 1.0) or flex_ms <= 0.0 or cudnn_ms <= 0.0:
        raise ValueError(f"flex_crossover: expected 0 < density <= 1 and positive times, got "
                         f"{density}, {flex_ms}, {cudnn_ms}")
    return min(1.0, density * cudnn_ms / flex_ms)


def auto_choice(densities: Dict[int, Sequence[float]], max_density: float, group_size: int) -> List[int]:
    """kv_block="auto" per head, as the dispatcher picks it without a calibration table
    (Dispatcher.choose_kv_block): ``densities[b][h]`` is the density head h needs with lists of
    b-key entries (b in 1, 16, 64); among the granularities reaching the target within
    ``max_density``, the lowest block_cost_ratio(b, G) x density (ties: the smaller block);
    0 where none does (the head attends to all keys and runs dense)."""
    from dsv_ext.control.dispatch import block_cost_ratio

    bs = sorted(densities)
    n = {len(densities[b]) for b in bs}
    if len(n) != 1:
        raise ValueError(f"densities: expected one value per head for every granularity, got lengths {sorted(n)}")
    out = []
    for h in range(n.pop()):
        best = None
        for b in bs:
            d = float(densities[b][h])
            if d <= max_density:
                c = block_cost_ratio(b, group_size) * d
                if best is None or c < best[0]:
                    best = (c, b)
        out.append(0 if best is None else best[1])
    return out


def _auto_methods(G: int) -> Dict[int, str]:
    """The analysis names of the token and block lists of query groups of G."""
    return {1: f"token G={G}", 16: f"block b=16" + ("" if G == 64 else f" G={G}"),
            64: f"block b=64" + ("" if G == 64 else f" G={G}")}


# ---------------------------------------------------------------------------------------------
# timing at the long shape
# ---------------------------------------------------------------------------------------------

def time_methods(analysis: Dict, S: int, H: int, D: int, reps: int, log=print) -> List[Dict]:
    import bench_kernels as BK
    from dsv_ext.ops import _CUDA_NATIVE_KV_BLOCKS

    from dsv_ext.config import DSVConfig

    max_density = DSVConfig().recall_max_density
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    est_name, est = BK.estimate_fn()
    dense = BK.dense_times(1, S, H, D, dtype, reps, which=("cudnn",))
    rows = []
    cache: Dict = {}
    blocks = None  # the block kernels and their buffers, on first use

    def block_time(b: int, G: int, d: float) -> Dict:
        nonlocal blocks
        if blocks is None:
            blocks = BK.block_lib() + (BK.block_buffers(S, H, D, dtype),)
        lib, M, bufs = blocks
        native = b in _CUDA_NATIVE_KV_BLOCKS  # else sparse_attention expands to token lists
        r = BK.block_case(lib, M, bufs, G, 1.0 - d, b, reps, gen, token=not native)
        fwd, both = (r["fwd_ms"], r["fwdbwd_ms"]) if native else (r["token_fwd_ms"], r["token_fwdbwd_ms"])
        est_ms = BK.block_estimate_ms(S, H, G, b, r["K_blocks"], reps, gen=gen)
        return dict(total_ms=both + (est_ms or 0.0), fwd_ms=fwd, bwd_ms=both - fwd, est_ms=est_ms,
                    K=r["K_blocks"] * b, kernels="block" if native else "token (expanded)")

    for m, per_t in analysis["methods"].items():
        for tg, st in per_t.items():
            d = st["mean_density"]
            rec = {"method": m, "target": float(tg), "density": d, "cudnn_fwdbwd_ms": dense["cudnn_fwdbwd_ms"]}
            if m.startswith("flex"):
                r = BK.flex_times(1, S, H, D, dtype, d, reps, gen)
                rec.update(total_ms=r["flex_fwdbwd_ms"], fwd_ms=r["flex_fwd_ms"])
            elif m.startswith(("token G=", "predictor G=")):
                G = int(m.split("G=")[1])
                r = BK.run_shape(1, S, H, D, G, 1.0 - d, "smooth", dtype, reps, gen, est_name, est, cache)
                rec.update(total_ms=r["total_ms"], fwd_ms=r["fwd_ms"], bwd_ms=r["bwd_ms"],
                           est_ms=r["est_ms"], K=r["K"])
            elif m.startswith("block b="):  # groups of 64 (or G) queries over lists of b-key blocks
                b = int(m.split("b=")[1].split()[0])
                rec.update(block_time(b, int(m.split("G=")[1]) if "G=" in m else 64, d))
            else:  # the per-query oracle: no kernel (one list per query)
                rec.update(total_ms=None, note="no kernel")
            recs = [rec]
            part_ms = None  # the time of h heads at density ds, for the per-head split below
            if m.startswith(("token G=", "predictor G=")):
                # as SparseAttention runs it: heads above recall_max_density dense
                thr = max_density

                def part_ms(h, ds, G=G):
                    return BK.run_shape(1, S, h, D, G, 1.0 - ds, "smooth", dtype, reps, gen, est_name, est,
                                        cache)["total_ms"]
            elif m.startswith("flex") and rec.get("total_ms"):
                # the baseline given the same freedom: dense where its tiles cost more than cuDNN
                thr = flex_crossover(d, rec["total_ms"], dense["cudnn_fwdbwd_ms"])

                def part_ms(h, ds):
                    return BK.flex_times(1, S, h, D, dtype, ds, reps, gen)["flex_fwdbwd_ms"]
            if part_ms is not None and st.get("densities"):
                # dense heads on cuDNN (its time scaled by their share), the others sparse at
                # their mean density
                hs, hd, ds = dense_head_split(st["densities"], H, thr)
                mix = {"method": f"{m} + dense heads", "target": float(tg), "density": d, "dense_above": thr,
                       "dense_heads": hd, "sparse_density": ds, "cudnn_fwdbwd_ms": dense["cudnn_fwdbwd_ms"]}
                mix["total_ms"] = dense["cudnn_fwdbwd_ms"] * hd / H + (part_ms(hs, ds) if hs else 0.0)
                recs.append(mix)
            for r_ in recs:
                if r_.get("total_ms"):
                    r_["vs_cudnn"] = dense["cudnn_fwdbwd_ms"] / r_["total_ms"]
                rows.append(r_)
                log(f"  {r_['method']:>16} recall {tg}: density {d:.3f} -> "
                    + (f"{r_['total_ms']:.1f} ms ({r_['vs_cudnn']:.2f}x cuDNN)" if r_.get("total_ms") else "-"))
    # kv_block="auto" at G = 128: per head the granularity auto_choice picks; each granularity's
    # heads timed at their mean density (all H heads timed, scaled by the share of heads), the
    # dense share on cuDNN
    names = _auto_methods(128)
    meth = analysis["methods"]
    for tg in (map(str, analysis["targets"]) if all(n in meth for n in names.values()) else ()):
        if not all(meth[n][tg].get("densities") for n in names.values()):
            continue
        pick = auto_choice({b: meth[n][tg]["densities"] for b, n in names.items()}, max_density, 128)
        n = len(pick)
        total, parts = dense["cudnn_fwdbwd_ms"] * pick.count(0) / n, {"dense": pick.count(0)}
        for b, name in names.items():
            hs = [h for h in range(n) if pick[h] == b]
            if not hs:
                continue
            db = sum(meth[name][tg]["densities"][h] for h in hs) / len(hs)
            if b == 1:
                t = BK.run_shape(1, S, H, D, 128, 1.0 - db, "smooth", dtype, reps, gen, est_name, est, cache)["total_ms"]
            else:
                t = block_time(b, 128, db)["total_ms"]
            total += t * len(hs) / n
            parts[str(b)] = len(hs)
        d = sum(meth[names[pick[h]]][tg]["densities"][h] if pick[h] else 1.0 for h in range(n)) / n
        rec = {"method": "auto G=128", "target": float(tg), "density": d, "heads_by_kv_block": parts,
               "cudnn_fwdbwd_ms": dense["cudnn_fwdbwd_ms"], "total_ms": total,
               "vs_cudnn": dense["cudnn_fwdbwd_ms"] / total}
        rows.append(rec)
        log(f"        auto G=128 recall {tg}: heads {parts} -> {total:.1f} ms ({rec['vs_cudnn']:.2f}x cuDNN)")
    return rows


def write_outputs(res: Dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "equal_recall.json"), "w") as f:
        json.dump(res, f, indent=1)
    a = res["analysis"]
    prov = res.get("provenance", {})
    L = ["# Speed at equal recall", "",
         f"Measured {prov.get('date', '?')}, commit {prov.get('commit', '?')}"
         + (f" (csrc {prov['csrc']})" if prov.get("csrc") else "") + f", {prov.get('card', '?')}. "
         f"Recall from {res.get('captures', '?')} captures of `{res.get('source', '?')}` "
         f"(S = {a['seq_len']}, every block and head"
         + (f", cube {'x'.join(map(str, a['cube']))}" if a.get("cube") else "")
         + f"); times at S = {res.get('time_shape', {}).get('S', '-')}, "
         f"H = {res.get('time_shape', {}).get('H', '-')}, D = {res.get('time_shape', {}).get('D', '-')}, bf16 "
         "(estimate + forward + backward).", "",
         "Density each method needs (mean over blocks and heads of the smallest list reaching the target):", "",
         "| method | " + " | ".join(f"recall {t}" for t in a["targets"]) + " |",
         "|---|" + "---|" * len(a["targets"])]
    for m, per_t in a["methods"].items():
        L.append(f"| {m} | " + " | ".join(f"{per_t[str(t)]['mean_density']:.3f}" for t in a["targets"]) + " |")
    if res.get("timing"):
        L += ["", "Time at that density (`+ dense heads`: heads needing more than a density run dense on "
              "cuDNN, the others sparse at their mean density; for DSV above recall_max_density, as "
              "SparseAttention runs K = S heads, for FlexAttention above the density where its tiles "
              "cost what cuDNN does):", "",
              "| method | recall | density | ms | vs cuDNN |", "|---|---|---|---|---|"]
        for r in res["timing"]:
            dens = f"{r['density']:.3f}" + (f" ({r['dense_heads']} heads dense, the rest {r['sparse_density']:.3f})"
                                             if "dense_heads" in r else "")
            if "heads_by_kv_block" in r:
                dens += " (heads: " + ", ".join(f"{n} {'dense' if b == 'dense' else 'b=' + b}"
                                                for b, n in r["heads_by_kv_block"].items()) + ")"
            L.append(f"| {r['method']} | {r['target']} | {dens} | "
                     + (f"{r['total_ms']:.1f} | {r['vs_cudnn']:.2f}x |" if r.get("total_ms") else "- | - |"))
        best = {}
        for r in res["timing"]:
            if r.get("total_ms"):
                k = (r["target"], "flex" if r["method"].startswith("flex") else "dsv")
                if k not in best or r["total_ms"] < best[k][1]:
                    best[k] = (r["method"], r["total_ms"])
        L += [""]
        for t in a["targets"]:
            if (t, "flex") in best and (t, "dsv") in best:
                L.append(f"Recall {t}: best DSV ({best[(t, 'dsv')][0]}) {best[(t, 'flex')][1] / best[(t, 'dsv')][1]:.2f}x "
                         "the speed of FlexAttention block-sparse.")
    with open(os.path.join(out, "equal_recall.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2 if res.get("timing") else 1, figsize=(11 if res.get("timing") else 6, 4),
                           squeeze=False)
    for m, per_t in a["methods"].items():
        ax[0][0].plot([per_t[str(t)]["mean_density"] for t in a["targets"]], a["targets"], "o-", label=m)
    ax[0][0].set_xlabel("density (keys / S)")
    ax[0][0].set_ylabel("attention recall")
    ax[0][0].legend(fontsize=7)
    if res.get("timing"):
        for m in dict.fromkeys(r["method"] for r in res["timing"]):
            pts = [(r["total_ms"], r["target"]) for r in res["timing"] if r["method"] == m and r.get("total_ms")]
            if pts:
                ax[0][1].plot(*zip(*pts), "o-", label=m)
        ax[0][1].set_xlabel("estimate + forward + backward (ms)")
        ax[0][1].set_ylabel("attention recall")
        ax[0][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "equal_recall.png"), dpi=110)


def load_and_capture(a, ap, dev):
    """Train (--train-steps) or load --checkpoint, capture q / k on held-out clips: (source,
    number of clips x timesteps, captures, each capture's timestep, cube)."""
    from dsv_ext.app.checkpoint import load_checkpoint
    from dsv_ext.app.common import ValidationSet, TrainConfig, build_model, inference_state_dict, load_config
    from dsv_ext.app.train import train

    ckpt = a.checkpoint
    if ckpt is None:
        if a.train_steps < 1:
            ap.error("--checkpoint, --train-steps or --analysis is required")
        cfg = load_config(a.config)
        run = os.path.join(a.out, "run")
        train(cfg, out_dir=run, steps=a.train_steps, attention="dsv", device=a.device, progress=False)
        ckpt = os.path.join(run, "ckpt_last.pt")
    ck = load_checkpoint(ckpt, map_location=dev)  # verified; a slim copy (--slim) loads too
    cfg = load_config(base=ck["config"])
    cfg["train"]["val_videos"] = a.videos
    cfg["train"]["val_timesteps"] = list(a.timesteps)
    torch.manual_seed(0)
    model, dsv_cfg = build_model(cfg, "dsv", dev)
    # a model trained with full attention (attention: dense) has no predictors: its attention is
    # captured as well, without the trained-predictor rows
    got = model.load_state_dict(inference_state_dict(ck), strict=False)
    bad = [k for k in got.missing_keys if ".predictor." not in k] + list(got.unexpected_keys)
    if bad:
        raise RuntimeError(f"--checkpoint {ckpt}: does not fit the model of its config ({bad[:4]} ...)")
    trained = not got.missing_keys and ck.get("controller") is not None
    if trained:  # the trained predictors
        from dsv_ext.control.controller import DSVController

        DSVController(model, dsv_cfg).load_state_dict(ck["controller"])
    model.eval()
    vs = ValidationSet(cfg, TrainConfig.from_dict(cfg["train"]))
    captures, ts = [], []
    for i in range(vs.x.shape[0]):
        sl = slice(i, i + 1)
        got = capture_qk(model, vs.x[sl].to(dev), vs.t[sl].to(dev), vs.noise[sl].to(dev))
        captures += [c if trained else c[:4] + (None,) for c in got]
        ts += [round(float(vs.t[i]), 6)] * len(got)
    print(f"captured {len(captures)} attention inputs; recall curves ...", flush=True)
    cube = tuple(a.cube) if a.cube is not None else tuple(dsv_cfg.cube)
    if len(cube) != 3 or min(cube) < 1:
        ap.error(f"--cube: expected three positive integers, got {list(cube)}")
    return f"{cfg.get('name')} step {ck.get('step')}", vs.x.shape[0], captures, ts, cube


def capture_and_analyse(a, ap, dev) -> Dict:
    """Capture (load_and_capture) and analyse every method over all captures."""
    source, n, captures, _, cube = load_and_capture(a, ap, dev)
    analysis = analyse(captures, cube=cube, per_query=not a.no_per_query)
    analysis["cube"] = list(cube)
    del captures
    return {"source": source, "captures": n, "analysis": analysis}


def locality(a, ap, dev) -> Dict:
    """--locality N: per timestep, per block and head, the density that token lists of G = 128
    queries (DSV's default group) and of each query alone need for every target, from N
    sampled runs of 128 rows per head: how much a head's breadth is the group's (its queries
    attend to different keys) and how much its own, and how it changes with the noise level."""
    source, n, captures, ts, cube = load_and_capture(a, ap, dev)
    res = {"source": source, "captures": n, "cube": list(cube), "sample_rows": a.locality * 128,
           "timesteps": {}}
    for t in sorted(set(ts)):
        part = [c for c, tc in zip(captures, ts) if tc == t]
        res["timesteps"][f"{t:g}"] = analyse(part, cube=cube, groups=(128,), blocks=(), predictor_rows=0,
                                             sample=a.locality)
    return res


def write_locality(res: Dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "locality.json"), "w") as f:
        json.dump(res, f, indent=1)
    prov = res.get("provenance", {})
    ts = list(res["timesteps"])
    first = res["timesteps"][ts[0]]
    names = [n.replace(".attn.attn_core", "") for n in first["head_names"]]
    rows = []
    for i in range(len(names)):
        cells = []
        for t in ts:
            m = res["timesteps"][t]["methods"]
            cells.append(f"{m['token G=128']['0.9']['densities'][i]:.3f} / {m['token']['0.9']['densities'][i]:.3f}")
        rows.append(f"| {names[i]} | " + " | ".join(cells) + " |")
    L = ["# Locality of each head by timestep", "",
         f"Measured {prov.get('date', '?')}, commit {prov.get('commit', '?')}, {prov.get('card', '?')}. "
         f"`{res['source']}`, {res['captures']} captures (clips x timesteps), {res['sample_rows']} sampled "
         f"query rows per head (runs of 128 in cube order {'x'.join(map(str, res['cube']))}), S = {first['seq_len']}.",
         "",
         "The density each head needs for recall 0.9 with token lists of G = 128 queries (DSV's default "
         "group) / with each query's own list (the per-query oracle), at each timestep (noise level t: "
         "x_t = (1 - t) x + t e); head: attention block:head. Recall 0.8 and 0.95 in `locality.json`.", "",
         "| head | " + " | ".join(f"t = {t}" for t in ts) + " |",
         "|---|" + "---|" * len(ts)] + rows
    with open(os.path.join(out, "locality.md"), "w") as f:
        f.write("\n".join(L) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="a DSV training checkpoint (ckpt_last.pt, or its weights-only copy: "
                    "python -m dsv_ext.app.checkpoint CKPT --slim DST)")
    ap.add_argument("--analysis", help="an earlier run's equal_recall.json: reuse its capture and curves "
                    "(no checkpoint), e.g. to --time them in a separate run")
    ap.add_argument("--config", default=os.path.join(os.path.dirname(HERE), "configs", "small-video.yaml"))
    ap.add_argument("--train-steps", type=int, default=0, help="train --config this long first (DSV)")
    ap.add_argument("--videos", type=int, default=2, help="held-out clips to capture")
    ap.add_argument("--timesteps", type=float, nargs="+", default=[0.3, 0.6, 0.9])
    ap.add_argument("--cube", type=int, nargs=3, default=None, metavar=("T", "H", "W"),
                    help="query / key order for the curves (default: the checkpoint's DSV cube)")
    ap.add_argument("--no-per-query", action="store_true", help="skip the per-query oracle (one sort per row)")
    ap.add_argument("--locality", type=int, default=0, metavar="N",
                    help="instead: per timestep, each head's density with lists of 128 queries and per "
                         "query, on N sampled runs of 128 rows (locality.json / .md)")
    ap.add_argument("--time", action="store_true", help="time every method at --S/--H/--D (CUDA)")
    ap.add_argument("--S", type=int, default=65536)
    ap.add_argument("--H", type=int, default=24)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "equal_recall"))
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    from bench_common import provenance

    if a.locality:
        if a.locality < 0 or a.analysis is not None or a.time:
            ap.error("--locality: N >= 1 runs of rows, from --checkpoint or --train-steps (no --analysis, --time)")
        res = locality(a, ap, dev)
        p = provenance()
        res["provenance"] = {"date": p.get("date"), "commit": os.environ.get("DSV_COMMIT") or p.get("commit"),
                             "card": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
        write_locality(res, a.out)
        print(open(os.path.join(a.out, "locality.md")).read())
        return 0
    if a.analysis is not None:
        with open(a.analysis) as f:
            old = json.load(f)
        if "analysis" not in old:
            ap.error(f"--analysis: {a.analysis} holds no 'analysis' (not an equal_recall.json)")
        res = {k: old[k] for k in ("source", "captures", "analysis")}
    else:
        res = capture_and_analyse(a, ap, dev)
        write_outputs(res, a.out)  # the curves survive a timing run cut short (--analysis resumes)
    if a.time:
        res["time_shape"] = {"S": a.S, "H": a.H, "D": a.D}
        res["timing"] = time_methods(res["analysis"], a.S, a.H, a.D, a.reps)
    p = provenance()
    res["provenance"] = {"date": p.get("date"), "commit": os.environ.get("DSV_COMMIT") or p.get("commit"),
                         "csrc": p.get("csrc"), "card": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    write_outputs(res, a.out)
    print(open(os.path.join(a.out, "equal_recall.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
