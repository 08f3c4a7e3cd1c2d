"""Kernel benchmark: our estimate + sparse attention forward / forward+backward
against cuDNN SDPA (dense), FlashAttention via SDPA (dense) and FlexAttention block-sparse at
the same density, on one GPU.

Per shape (S, H, D, G, sparsity, index distribution):
  est        dsv topk_estimate (fused low-rank scores + top-K), rank 16
  fwd        dsv sparse attention forward
  fwdbwd     dsv forward + backward (backward: dQ query-major; dK/dV key-major or query-major
             with vector reductions, chosen per head; see csrc/cuda/sparse_attention_bwd.cu)
  cudnn / flash: dense SDPA forward and forward+backward (one per S, D)
  flex       FlexAttention with random 128x128 block masks at density 1 - sparsity (different
             per head and query block); compiled once per shape, so only with --flex
  bwd_reductions_g   fp32 values the backward adds into its dK / dV accumulators for these
             lists, in 1e9 (reduction_stats: the kernels' per-head path and merged-block rules;
             pair_reductions_g in the JSON: one reduction per (group, key) pair)
speedup_vs_cudnn_fwdbwd = cudnn fwd+bwd / (est + fwd+bwd).

Index distributions: "random" = top-K of random Gaussian low-rank inputs (scattered keys);
"smooth" = top-K of low-rank inputs that vary smoothly over a (T, H, W) latent grid, tokens
ordered cube by cube (2x4x4), as the method orders them (coherent keys).

Timing: CUDA events, warm-up, median of --reps runs; peak memory from the caching allocator.
Writes benchmarks/results/kernels.json (one record per shape), kernels.md (table with date,
commit and card) and kernels.png (speedup vs sparsity), or under --out.

Usage: python benchmarks/bench_kernels.py [--quick] [--flex] [--out DIR]
       python benchmarks/bench_kernels.py --deterministic [--S ...] [--D ...]   (cost of
       sparse_attention(..., deterministic=True) in the backward, and a bit-identity check)
       python benchmarks/bench_kernels.py --kv-block 16 64 [--flex] [--S ...] [--sparsity ...]
           (block lists: dsv forward and forward+backward with kv_block b on random block lists
           of density 1 - sparsity, the same lists expanded to token lists on the token kernels,
           and with --flex FlexAttention at the same density; kv_block.json under --out)
The kernels are reached through dsv_ext (built with CUDA) or, with DSV_ATTN_LIB set, through
the ctypes wrapper of tests/helpers.py. The kernels run with the device's
kernel tuning; time one forced backward path or key-range count per process with
DSV_KERNEL_TUNING (e.g. "km_ratio=0,bwd_ranges=4"), kernel variants with the csrc/dev/
libraries as DSV_ATTN_LIB.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # dsv_ext from this checkout when it is not installed
sys.path.insert(0, os.path.join(ROOT, "tests"))
import test_sparse_attention_cuda as T  # noqa: E402  (kernel access, ctypes wrapper)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import git_commit, provenance, provenance_line  # noqa: E402

RANK = 16

# --------------------------------------------------------------------------------------------
# timing


def bench(fn, reps=5, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# --------------------------------------------------------------------------------------------
# estimate (top-K) access


class _LrShape(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("seqlen", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("rank", ctypes.c_int64), ("group_size", ctypes.c_int64),
                ("num_groups", ctypes.c_int64), ("kmax", ctypes.c_int64), ("dtype", ctypes.c_int)]


def _topk_ctypes(q_lr, k_lr, kv_count, G, kmax):
    lib = T._get_lib()
    if lib is None or not hasattr(lib, "dsv_topk_estimate_cuda"):
        return None
    lib.dsv_topk_estimate_workspace_cuda.restype = ctypes.c_size_t
    lib.dsv_topk_estimate_workspace_cuda.argtypes = [ctypes.POINTER(_LrShape)]
    lib.dsv_topk_estimate_cuda.restype = ctypes.c_int
    lib.dsv_topk_estimate_cuda.argtypes = [ctypes.POINTER(_LrShape), T._Bshd, T._Bshd,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_size_t, ctypes.c_void_p]
    B, S, H, R = q_lr.shape
    NG = -(-S // G)
    sh = _LrShape(B, S, H, R, G, NG, kmax, T._DT[q_lr.dtype])
    ws = lib.dsv_topk_estimate_workspace_cuda(ctypes.byref(sh))
    work = torch.empty(max(ws, 16), dtype=torch.uint8, device=q_lr.device)
    out = torch.empty(B, H, NG, kmax, dtype=torch.int32, device=q_lr.device)
    st = lib.dsv_topk_estimate_cuda(ctypes.byref(sh), T._bshd(q_lr), T._bshd(k_lr),
                                    kv_count.data_ptr(), out.data_ptr(), work.data_ptr(), ws,
                                    torch.cuda.current_stream().cuda_stream)
    if st != 0:
        raise RuntimeError(f"dsv_topk_estimate_cuda returned {st}")
    return out


def _topk_torch(q_lr, k_lr, kv_count, G, kmax):
    """Fallback (torch matmul + topk per head), used only when no CUDA estimate is built."""
    B, S, H, R = q_lr.shape
    NG = -(-S // G)
    out = torch.full((B, H, NG, kmax), -1, dtype=torch.int32, device=q_lr.device)
    pad = NG * G - S
    for b in range(B):
        for h in range(H):
            qh = q_lr[b, :, h].float()
            if pad:
                qh = torch.cat([qh, qh.new_zeros(pad, R)])
            cnts = torch.full((NG, 1), G, device=q_lr.device, dtype=torch.float32)
            if pad:
                cnts[-1] = G - pad
            rep = qh.view(NG, G, R).sum(1) / cnts
            c = int(kv_count[b, h])
            sc = rep @ k_lr[b, :, h].float().t()
            idx = sc.topk(c, dim=-1).indices.sort(dim=-1).values
            out[b, h, :, :c] = idx.to(torch.int32)
    return out


def estimate_fn():
    if T.backend() == "ops":
        import dsv_ext
        return "dsv_ext.topk_estimate", lambda ql, kl, c, G, km: dsv_ext.topk_estimate(ql, kl, c, G, km)
    lib = T._get_lib()
    if lib is not None and hasattr(lib, "dsv_topk_estimate_cuda"):
        return "dsv_topk_estimate_cuda (ctypes)", _topk_ctypes
    return "torch fallback (matmul+topk)", _topk_torch


# --------------------------------------------------------------------------------------------
# inputs


def grid_of(S):
    """(T, H, W) latent grid with T*H*W = S (S a power of two >= 4096)."""
    n = int(round(math.log2(S)))
    t = 2 ** max(1, n - 12)
    rest = S // t
    h = 2 ** (int(math.log2(rest)) // 2)
    return t, h, rest // h


def cube_order(Tg, Hg, Wg, ct=2, ch=4, cw=4):
    """Token positions (row-major t, h, w) listed cube by cube: sequence index -> (t, h, w)."""
    t = torch.arange(Tg).view(Tg // ct, ct, 1, 1, 1, 1)
    h = torch.arange(Hg).view(1, 1, Hg // ch, ch, 1, 1)
    w = torch.arange(Wg).view(1, 1, 1, 1, Wg // cw, cw)
    tt, hh, ww = torch.broadcast_tensors(t, h, w)
    perm = lambda x: x.permute(0, 2, 4, 1, 3, 5).reshape(-1)  # noqa: E731
    return perm(tt), perm(hh), perm(ww)


def lowrank_inputs(dist, B, S, H, gen, device):
    if dist == "random":
        ql = torch.randn(B, S, H, RANK, generator=gen).to(device)
        kl = torch.randn(B, S, H, RANK, generator=gen).to(device)
        return ql, kl
    Tg, Hg, Wg = grid_of(S)
    t, h, w = cube_order(Tg, Hg, Wg)
    coords = torch.stack([t / Tg, h / Hg, w / Wg], -1).double()  # [S, 3]
    nf = 24
    freqs = torch.randn(H, nf, 3, generator=gen, dtype=torch.float64) * 3.0
    phase = torch.rand(H, nf, generator=gen, dtype=torch.float64) * 2 * math.pi
    feats = torch.cos(torch.einsum("sc,hfc->shf", coords, freqs) + phase)  # [S, H, nf]
    proj_q = torch.randn(H, nf, RANK, generator=gen, dtype=torch.float64)
    proj_k = torch.randn(H, nf, RANK, generator=gen, dtype=torch.float64)
    ql = torch.einsum("shf,hfr->shr", feats, proj_q)
    kl = torch.einsum("shf,hfr->shr", feats, proj_k)
    ql = ql + 0.1 * torch.randn(ql.shape, generator=gen, dtype=torch.float64)
    kl = kl + 0.1 * torch.randn(kl.shape, generator=gen, dtype=torch.float64)
    return (ql.unsqueeze(0).expand(B, -1, -1, -1).float().contiguous().to(device),
            kl.unsqueeze(0).expand(B, -1, -1, -1).float().contiguous().to(device))


def keys_for(S, sparsity):
    k = int(math.ceil((1.0 - sparsity) * S))
    k = max(k, int(math.ceil(0.02 * S)))
    return min(S, (k + 63) // 64 * 64)


def km_stats(kv_index, kv_count):
    """Key-major cost ratio per head (64-key block entries x 64 / (groups x K)), as the
    backward's path choice computes it (lists are sorted top-K output)."""
    B, H, NG, KM = kv_index.shape
    idx = kv_index.long()
    blk = idx // 64
    run_start = torch.ones_like(blk, dtype=torch.bool)
    run_start[..., 1:] = blk[..., 1:] != blk[..., :-1]
    used = torch.arange(KM, device=idx.device).view(1, 1, 1, KM) < kv_count.view(B, H, 1, 1)
    entries = (run_start & used & (idx >= 0)).sum(dim=(2, 3)).double()
    ratio = entries * 64 / (NG * kv_count.double().clamp(min=1))
    return ratio


def reduction_stats(kv_index, kv_count, G, D, tuning):
    """dK / dV reductions (fp32 values added into the accumulators) the backward makes for these
    lists, per head by the shipped kernels' rules (csrc/cuda/sparse_attention_bwd.cu,
    merged_groups.cuh): a head on the key-major pass (sorted lists, D <= 128, key-block entries
    x 64 <= km_ratio x groups x K) makes none; on the query-major pass each (group, listed key)
    pair is one row of D for dK and one for dV, except in a 128-query block whose G = 16 / 32 / 64
    groups merge (wgmma and g128 on, D 64 / 128, the head's key-block ratio <= 4 and the
    block's union at most ceil(merge x 128 / G x kmax) keys): there each key of the union once.
    Returns (pairs, done): values in G (1e9) for one reduction per pair, and as the rules do."""
    B, H, NG, KM = kv_index.shape
    S = NG * G  # lists of whole groups (the last one may be partial in S; not in this benchmark)
    idx = kv_index.long()
    pos = torch.arange(KM, device=idx.device).view(1, 1, 1, KM)
    used = (pos < kv_count.view(B, H, 1, 1)) & (idx >= 0)
    per_group = used.sum(-1)  # [B, H, NG]
    ratio = km_stats(kv_index, kv_count)
    km = (ratio <= float(tuning.get("km_ratio", 1.15))) & (D <= 128)
    merge = float(tuning.get("merge", 0.75))
    can_merge = (G in (16, 32, 64) and D in (64, 128) and merge > 0 and int(tuning.get("wgmma", 1))
                 and int(tuning.get("g128", 1)))
    M = 128 // G if can_merge else 1
    pairs = float(per_group.sum()) * 2 * D / 1e9
    done = 0.0
    for b in range(B):
        for h in range(H):
            if km[b, h]:
                continue
            rows = per_group[b, h].double()
            if not can_merge or float(ratio[b, h]) > 4.0:
                done += float(rows.sum())
                continue
            cap = min(S, math.ceil(merge * M * KM))  # union_capacity: from kmax
            nb = (NG + M - 1) // M
            sel = torch.zeros(nb, S + 1, dtype=torch.bool, device=idx.device)
            blk = (torch.arange(NG, device=idx.device) // M).view(NG, 1).expand(NG, KM)
            key = torch.where(used[b, h], idx[b, h], torch.full_like(idx[b, h], S))
            sel[blk.reshape(-1), key.reshape(-1)] = True
            union = sel[:, :S].sum(1).double()
            sums = torch.zeros(nb, dtype=torch.float64, device=idx.device).index_add_(
                0, torch.arange(NG, device=idx.device) // M, rows)
            done += float(torch.where(union <= cap, union, sums).sum())
    return pairs, done * 2 * D / 1e9


# --------------------------------------------------------------------------------------------
# baselines


def dense_times(B, S, H, D, dtype, reps, which=("cudnn", "flash")):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    res = {}
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    do = torch.randn(B, H, S, D, device="cuda", dtype=dtype)
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        if name not in which:
            res[f"{name}_fwd_ms"] = res[f"{name}_fwdbwd_ms"] = None
            continue
        try:
            with sdpa_kernel([be]):
                f = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731

                def fb():
                    o = F.scaled_dot_product_attention(q, k, v)
                    o.backward(do)
                res[f"{name}_fwd_ms"] = bench(lambda: f(), reps, 1)
                res[f"{name}_fwdbwd_ms"] = bench(fb, reps, 1)
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: not available ({type(e).__name__}: {str(e)[:100]})")
            res[f"{name}_fwd_ms"] = res[f"{name}_fwdbwd_ms"] = None
    del q, k, v, do
    torch.cuda.empty_cache()
    return res


def flex_times(B, S, H, D, dtype, density, reps, gen):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    nb = S // 128
    nkeep = max(1, int(round(density * nb)))
    scores = torch.rand(B, H, nb, nb, generator=gen)
    # the index tensors must span all nb key blocks (BlockMask transposes them through a dense
    # [nb x nb] map): the kept blocks first (ascending), then the rest, which kv_num excludes
    order = scores.argsort(dim=-1)
    kv_idx = torch.cat([order[..., :nkeep].sort(dim=-1).values, order[..., nkeep:].sort(dim=-1).values],
                       dim=-1).to(torch.int32).cuda()
    kv_num = torch.full((B, H, nb), nkeep, dtype=torch.int32, device="cuda")
    full_kv = torch.full((B, H, nb), 0, dtype=torch.int32, device="cuda")
    bm = BlockMask.from_kv_blocks(full_kv, torch.zeros_like(kv_idx), kv_num, kv_idx,
                                  BLOCK_SIZE=128)
    fa = torch.compile(flex_attention)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    do = torch.randn(B, H, S, D, device="cuda", dtype=dtype)

    def fb():
        o = fa(q, k, v, block_mask=bm)
        o.backward(do)
    r = {"flex_fwd_ms": bench(lambda: fa(q, k, v, block_mask=bm), reps, 2),
         "flex_fwdbwd_ms": bench(fb, reps, 2)}
    del q, k, v, do
    torch.cuda.empty_cache()
    return r


# --------------------------------------------------------------------------------------------


def run_shape(B, S, H, D, G, sparsity, dist, dtype, reps, gen, est_name, est, cache):
    K = keys_for(S, sparsity)
    key = (dist, S, H)
    if key not in cache:
        cache.clear()
        cache[key] = lowrank_inputs(dist, B, S, H, gen, "cuda")
    ql, kl = cache[key]
    ql = ql.to(dtype)
    kl = kl.to(dtype)
    cnt = torch.full((B, H), K, dtype=torch.int32, device="cuda")
    try:
        kv_index = est(ql, kl, cnt, G, K)
    except Exception as e:  # noqa: BLE001
        print(f"  estimate failed ({e}); torch fallback")
        est_name, est = "torch fallback (matmul+topk)", _topk_torch
        kv_index = est(ql, kl, cnt, G, K)
    est_ms = bench(lambda: est(ql, kl, cnt, G, K), reps, 1)
    ratio = km_stats(kv_index, cnt)
    pair_red, bwd_red = reduction_stats(kv_index, cnt, G, run_head_dim(D), TUNING)
    scale = 1.0 / math.sqrt(D)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=dtype) for _ in range(4))
    dim = run_head_dim(D)
    if dim == D:
        fwd = lambda: T.attn_fwd(q, k, v, kv_index, cnt, G, scale)  # noqa: E731
        out, lse = fwd()
        bwd = lambda: T.attn_bwd(do, q, k, v, out, lse, kv_index, cnt, G, scale)  # noqa: E731
    else:  # what dsv_ext.sparse_attention does (ops._PaddedHeads), the copies timed too
        def pad(t):
            return F.pad(t, (0, dim - D))

        def fwd():
            o, l = T.attn_fwd(pad(q), pad(k), pad(v), kv_index, cnt, G, scale)
            return o[..., :D].contiguous(), l

        out, lse = fwd()

        def bwd():
            return [g[..., :D] for g in T.attn_bwd(pad(do), pad(q), pad(k), pad(v), pad(out), lse,
                                                    kv_index, cnt, G, scale)]
    torch.cuda.synchronize()
    fwd_ms = bench(fwd, reps)
    torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated()
    bwd()
    torch.cuda.synchronize()
    peak_extra = (torch.cuda.max_memory_allocated() - base_mem) / 2**20
    bwd_ms = bench(bwd, reps)
    if PROFILE and not PROFILED.get(dist):
        PROFILED[dist] = True
        profile_bwd(fwd=fwd, bwd=bwd,
                    title=f"S={S} D={D} G={G} sparsity={sparsity} {dist}")
    rec = dict(S=S, H=H, D=D, run_D=dim, G=G, B=B, sparsity=sparsity, dist=dist,
               dtype=str(dtype).split(".")[-1],
               K=K, estimate=est_name, est_ms=est_ms, fwd_ms=fwd_ms, bwd_ms=bwd_ms,
               fwdbwd_ms=fwd_ms + bwd_ms, total_ms=est_ms + fwd_ms + bwd_ms,
               km_ratio_median=float(ratio.median()), km_heads=int((ratio <= KM_RATIO).sum()),
               pair_reductions_g=pair_red, bwd_reductions_g=bwd_red,
               peak_extra_bwd_mib=peak_extra)
    flops = 4.0 * S * K * H * D * B
    rec["fwd_tflops"] = flops / fwd_ms / 1e9
    rec["fwdbwd_tflops"] = 3.5 * flops / (fwd_ms + bwd_ms) / 1e9
    del q, k, v, do, out, lse, kv_index
    torch.cuda.empty_cache()
    return rec


NATIVE_HEAD_DIMS = False  # --native-head-dims: every head dim on its own kernels, unpadded


def run_head_dim(D):
    """The head dim dsv_ext.sparse_attention runs a head of D at on this GPU (padded: 96 runs
    as 128 where the wgmma kernels are on; ops._run_head_dim), or D itself with
    --native-head-dims or without the built extension (kernels through DSV_ATTN_LIB)."""
    if NATIVE_HEAD_DIMS:
        return D
    try:
        from dsv_ext import ops
    except Exception:  # noqa: BLE001
        return D
    return ops._run_head_dim(torch.device("cuda", torch.cuda.current_device()), D)


PROFILE = False
PROFILED = {}
KM_RATIO = 1.15  # the kernels' key-major ratio (the device's kernel tuning, set in main)
TUNING = {"km_ratio": KM_RATIO, "merge": 0.75, "wgmma": 1, "g128": 1}  # set in main


def profile_bwd(fwd, bwd, title):
    """Per-kernel CUDA time of one forward and one backward (default path choice), for
    'where the backward time goes'."""
    from torch.profiler import ProfilerActivity, profile
    fwd()
    bwd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd()
        bwd()
        torch.cuda.synchronize()
    print(f"--- kernels, {title} ---")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def write_outputs(records, outdir, meta):
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "kernels.json"), "w") as f:
        # a JSON list, one record per shape; the run's date, commit, card and settings in each
        json.dump([dict(r, **{"run_" + k: v for k, v in meta.items()}) for r in records], f, indent=1)
    cols = ["S", "D", "G", "sparsity", "dist", "K", "est_ms", "fwd_ms", "bwd_ms",
            "bwd_reductions_g", "cudnn_fwdbwd_ms", "flash_fwdbwd_ms", "flex_fwdbwd_ms",
            "fwdbwd_tflops",
            "speedup_vs_cudnn_fwdbwd", "speedup_vs_flex_fwdbwd", "peak_extra_bwd_mib"]
    lines = [f"# Kernel benchmark ({meta['date']}, commit {meta['commit']}, {meta['card']})", "",
             f"H={meta['H']}, B=1, {meta['dtype']}, estimate: {meta['estimate']}. Times in ms "
             "(median of CUDA-event timings). speedup = dense fwd+bwd / (est + fwd + bwd). "
             f"Kernel tuning: {meta.get('kernel_tuning', 'device defaults')}.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        row = []
        for c in cols:
            x = r.get(c)
            row.append("-" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x)))
        lines.append("| " + " | ".join(row) + " |")
    with open(os.path.join(outdir, "kernels.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        series = {}
        for r in records:
            series.setdefault((r["S"], r["D"], r["G"], r["dist"]), []).append(
                (r["sparsity"], r.get("speedup_vs_cudnn_fwdbwd")))
        for (S, D, G, dist), pts in sorted(series.items()):
            pts = [(s, y) for s, y in sorted(pts) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        label=f"S={S // 1024}k D={D} G={G} {dist}")
        ax.axhline(3.0, color="gray", ls="--", lw=1, label="3x bar")
        ax.set_xlabel("sparsity")
        ax.set_ylabel("cuDNN dense fwd+bwd / ours (est+fwd+bwd)")
        ax.set_title(f"dsv-ext sparse attention, {meta['card']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, "kernels.png"), dpi=120)
    except Exception as e:  # noqa: BLE001
        print(f"plot skipped: {e}")


def deterministic_cost(Ss, Ds, Gs, sps, dists, reps, outdir):
    """--deterministic: backward time with sparse_attention(..., deterministic=True) against
    the default, per shape (dsv_ext raw ops; lists from topk_estimate), and whether 3 runs of
    the deterministic backward are bit-identical. Writes deterministic.json under --out."""
    import dsv_ext
    B, H, dtype = 1, 24, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    rows = []
    for S in Ss:
        for dist in dists:
            ql, kl = (t.to(dtype) for t in lowrank_inputs(dist, B, S, H, gen, "cuda"))
            for D in Ds:
                q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=dtype) for _ in range(4))
                for G in Gs:
                    for sp in sps:
                        K = keys_for(S, sp)
                        cnt = torch.full((B, H), K, dtype=torch.int32, device="cuda")
                        idx = dsv_ext.topk_estimate(ql, kl, cnt, G, K)
                        out, lse = torch.ops.dsv.sparse_attention_fwd(q, k, v, idx, cnt, G, 1 / math.sqrt(D))
                        ms = {}
                        for det in (False, True):
                            fn = lambda det=det: torch.ops.dsv.sparse_attention_bwd(  # noqa: E731
                                do, q, k, v, out, lse, idx, cnt, G, 1 / math.sqrt(D), det)
                            ms[det] = bench(fn, reps)
                        ref = torch.ops.dsv.sparse_attention_bwd(do, q, k, v, out, lse, idx, cnt, G, 1 / math.sqrt(D), True)
                        same = all(all(torch.equal(a, b) for a, b in zip(ref, torch.ops.dsv.sparse_attention_bwd(
                            do, q, k, v, out, lse, idx, cnt, G, 1 / math.sqrt(D), True))) for _ in range(2))
                        r = dict(S=S, D=D, G=G, sparsity=sp, dist=dist, bwd_ms=ms[False],
                                 bwd_deterministic_ms=ms[True], cost=ms[True] / ms[False], bit_identical=same)
                        rows.append(r)
                        print(json.dumps(r), flush=True)
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "deterministic.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\nS D G sparsity dist | bwd ms | deterministic ms | cost | bit-identical")
    for r in rows:
        print(f"{r['S']} {r['D']} {r['G']} {r['sparsity']} {r['dist']} | {r['bwd_ms']:.2f} | "
              f"{r['bwd_deterministic_ms']:.2f} | {r['cost']:.2f}x | {r['bit_identical']}")


def _blk_call(lib, M, q, k, v, idx, cnt, G, scale, blk, bufs):
    """One forward + backward of the C API with preallocated outputs and workspaces (bufs)."""
    out, lse, dq, dk, dv, do, wf, wb = bufs
    stream = torch.cuda.current_stream().cuda_stream
    sh = M._shape(q, idx, G, scale, blk)
    st = lib.dsv_sparse_attention_fwd_cuda(
        ctypes.byref(sh), T._bshd(q), T._bshd(k), T._bshd(v), idx.data_ptr(), cnt.data_ptr(),
        T._bshd(out), lse.data_ptr(), wf.data_ptr(), wf.numel(), stream)
    if st != 0:
        raise RuntimeError(f"forward returned {st}")
    if dq is None:
        return
    st = lib.dsv_sparse_attention_bwd_cuda(
        ctypes.byref(sh), T._bshd(q), T._bshd(k), T._bshd(v), T._bshd(out), T._bshd(do),
        lse.data_ptr(), idx.data_ptr(), cnt.data_ptr(), T._bshd(dq), T._bshd(dk), T._bshd(dv),
        wb.data_ptr(), wb.numel(), stream)
    if st != 0:
        raise RuntimeError(f"backward returned {st}")


def block_estimate_ms(S, H, G, blk, K, reps, rank=16, gen=None):
    """Time of the block-list estimation (dsv_ext.topk_estimate with kv_block: pooled low-rank
    keys, a [groups x blocks] score matrix and its top-K) at one shape; None without dsv_ext or
    its CUDA kernels (the attention kernels may come from DSV_ATTN_LIB alone)."""
    try:
        import dsv_ext
    except ImportError:
        return None
    if not dsv_ext.has_cuda_kernels():
        return None
    ql, kl = (torch.randn(1, S, H, rank, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    cnt = torch.full((1, H), K, dtype=torch.int32, device="cuda")
    return bench(lambda: dsv_ext.topk_estimate(ql, kl, cnt, G, kv_block=blk), reps)


def random_block_lists(B, S, H, G, sparsity, blk, gen):
    """(kv_index, kv_count) on the GPU: each group its own sorted set of round((1 - sparsity)
    ceil(S / blk)) distinct random key blocks."""
    NG, nblk = -(-S // G), -(-S // blk)
    K = max(1, round((1 - sparsity) * nblk))
    idx = torch.rand(B, H, NG, nblk, generator=gen).argsort(dim=-1)[..., :K]
    idx = idx.sort(dim=-1).values.to(torch.int32).cuda()
    return idx, torch.full((B, H), K, dtype=torch.int32, device="cuda")


def block_workspaces(lib, M, q, idx, G, scale, blk):
    """The forward and backward workspaces of the C API for these lists."""
    sh = M._shape(q, idx, G, scale, blk)
    return tuple(torch.empty(max(1, n), dtype=torch.uint8, device="cuda")
                 for n in (lib.dsv_sparse_attention_fwd_workspace_cuda(ctypes.byref(sh)),
                           lib.dsv_sparse_attention_bwd_workspace_cuda(ctypes.byref(sh))))


def block_case(lib, M, bufs, G, sparsity, blk, reps, gen, token=True):
    """One block-list case on preallocated [B, S, H, D] tensors bufs = (q, k, v, do, out, lse, dq,
    dk, dv): random block lists (each group its own sorted set of round((1 - sparsity) ceil(S /
    b)) distinct blocks) timed on the block kernels (fwd_ms, fwdbwd_ms) and, with token=True, on
    the token kernels with the same lists expanded (token_fwd_ms, token_fwdbwd_ms)."""
    q, k, v, do, out, lse, dq, dk, dv = bufs
    B, S, H, D = q.shape
    idx, cnt = random_block_lists(B, S, H, G, sparsity, blk, gen)
    K = int(cnt[0, 0])
    scale = 1 / math.sqrt(D)
    r = dict(S=S, D=D, G=G, sparsity=sparsity, kv_block=blk, K_blocks=K)
    cases = [("", blk, idx, cnt)]
    if token:
        cases.append(("token_", 1) + tuple(M.expand_blocks(idx, cnt, S, blk)))
    for name, b, ix, cn in cases:
        ix, cn = ix.cuda(), cn.cuda()
        wf, wb = block_workspaces(lib, M, q, ix, G, scale, b)
        fwd = (out, lse, None, None, None, do, wf, wb)
        both = (out, lse, dq, dk, dv, do, wf, wb)
        r[name + "fwd_ms"] = bench(lambda: _blk_call(lib, M, q, k, v, ix, cn, G, scale, b, fwd), reps)
        r[name + "fwdbwd_ms"] = bench(lambda: _blk_call(lib, M, q, k, v, ix, cn, G, scale, b, both), reps)
        if PROFILE and not name:
            profile_bwd(fwd=lambda: None, bwd=lambda: _blk_call(lib, M, q, k, v, ix, cn, G, scale, b, both),
                        title=f"S={S} D={D} G={G} sparsity={sparsity} kv_block={b}")
        del wf, wb
    return r


def block_buffers(S, H, D, dtype=torch.bfloat16):
    """(q, k, v, do, out, lse, dq, dk, dv) of block_case at one shape (B = 1)."""
    q, k, v, do = (torch.randn(1, S, H, D, device="cuda", dtype=dtype) for _ in range(4))
    out, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    return q, k, v, do, out, torch.empty(1, H, S, device="cuda"), dq, dk, dv


def block_lib():
    """(the C API library with the block kernels, the block-kernel test module) or exit."""
    import test_kv_block_kernels_cuda as M
    lib = M._get_lib()
    if lib is None:
        sys.exit("no CUDA kernels: build dsv_ext with CUDA or set DSV_ATTN_LIB")
    return lib, M


def kv_block_times(blocks, Ss, Ds, Gs, sps, reps, flex, outdir):
    """--kv-block: per shape and block size b, block_case (block kernels and the same lists on
    the token kernels) and, with --flex, FlexAttention's 128 x 128 block-sparse kernels at the
    same density."""
    lib, M = block_lib()
    H, dtype = 24, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    rows = []
    for S in Ss:
        for D in Ds:
            bufs = block_buffers(S, H, D, dtype)
            for sp in sps:
                fx = {}
                if flex:
                    try:
                        fx = flex_times(1, S, H, D, dtype, 1 - sp, reps, gen)
                    except Exception as e:  # noqa: BLE001
                        print(f"  flex failed: {type(e).__name__}: {str(e)[:200]}")
                for G in Gs:
                    for blk in blocks:
                        r = block_case(lib, M, bufs, G, sp, blk, reps, gen)
                        r.update(fx)
                        rows.append(r)
                        print(json.dumps(r), flush=True)
            del bufs
            torch.cuda.empty_cache()
    write_kv_block(rows, outdir, {"provenance": provenance(), "device": torch.cuda.get_device_name(),
                                  "torch": torch.__version__, "heads": H, "dtype": "bf16"})


def write_kv_block(rows, outdir, meta):
    """kv_block.json ({meta, "records": rows}) and kv_block.md: block lists against the same lists
    as token lists and FlexAttention at the same density."""
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "kv_block.json"), "w") as f:
        json.dump(dict(meta, records=rows), f, indent=1)
    lines = [f"# Block lists vs FlexAttention ({provenance_line(meta)})", "",
             f"H={meta['heads']}, B=1, {meta['dtype']}, random block lists (no estimation), "
             "FlexAttention block-sparse 128 x 128 at the same density in the same run; ms, medians.", "",
             "| S | D | G | sparsity | kv_block | forward | forward + backward | same lists as tokens: "
             "forward | forward + backward | Flex forward | Flex forward + backward | "
             "fwd+bwd vs Flex |", "|---" * 12 + "|"]
    for r in rows:
        fx = r.get("flex_fwdbwd_ms")
        lines.append(f"| {r['S']} | {r['D']} | {r['G']} | {r['sparsity']} | {r['kv_block']} | "
                     f"{r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | {r['token_fwd_ms']:.2f} | "
                     f"{r['token_fwdbwd_ms']:.2f} | {r.get('flex_fwd_ms') or float('nan'):.2f} | "
                     f"{fx or float('nan'):.2f} | {(fx / r['fwdbwd_ms']) if fx else float('nan'):.2f}x |")
    with open(os.path.join(outdir, "kv_block.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="target shape and a small subset")
    ap.add_argument("--flex", action="store_true", help="also time FlexAttention (compiles)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dense", nargs="*", default=["cudnn", "flash"], help="dense baselines")
    ap.add_argument("--profile", action="store_true", help="per-kernel times (torch.profiler)")
    ap.add_argument("--native-head-dims", action="store_true",
                    help="run every head dim on its own kernels (default: as dsv_ext.sparse_attention "
                         "does, e.g. 96 zero-padded to 128 where the wgmma kernels run)")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="only merge kernels.json files of earlier runs into one table/plot in --out")
    ap.add_argument("--S", type=int, nargs="*")
    ap.add_argument("--D", type=int, nargs="*")
    ap.add_argument("--G", type=int, nargs="*")
    ap.add_argument("--sparsity", type=float, nargs="*")
    ap.add_argument("--dist", nargs="*")
    ap.add_argument("--deterministic", action="store_true",
                    help="only measure the cost of the deterministic backward (deterministic.json)")
    ap.add_argument("--kv-block", type=int, nargs="+", metavar="B",
                    help="only time block lists of these kv_block sizes (kv_block.json)")
    args = ap.parse_args()
    global PROFILE
    PROFILE = args.profile
    if args.kv_block:
        kv_block_times(args.kv_block, args.S or [65536], args.D or [128], args.G or [64],
                       args.sparsity or [0.9], args.reps, args.flex, args.out)
        return
    if args.deterministic:
        deterministic_cost(args.S or [16384, 65536], args.D or [64, 128], args.G or [64],
                           args.sparsity or [0.9], args.dist or ["random", "smooth"], args.reps, args.out)
        return
    if args.merge:
        records = []
        for path in args.merge:
            with open(path) as f:
                records += json.load(f)
        first = records[0]
        meta = {k[4:]: v for k, v in first.items() if k.startswith("run_")}
        runs = sorted({(r.get("run_date"), r.get("run_commit")) for r in records})
        if len(runs) > 1:
            meta["date"] = ", ".join(sorted({d for d, _ in runs if d}))
            meta["commit"] = ", ".join(sorted({c for _, c in runs if c}))
        records = [{k: v for k, v in r.items() if not k.startswith("run_")} for r in records]
        write_outputs(records, args.out, meta)
        print(f"merged {len(records)} records into {args.out}")
        return
    if T.backend() is None:
        sys.exit("no CUDA kernels: build dsv_ext with CUDA or set DSV_ATTN_LIB")
    H, B, dtype = 24, 1, torch.bfloat16
    if args.quick:
        Ss, Ds, Gs, sps, dists = [65536], [128], [64], [0.9, 0.95], ["random", "smooth"]
    else:
        Ss, Ds, Gs = [16384, 32768, 65536, 131072], [64, 128], [32, 64]
        sps, dists = [0.8, 0.9, 0.95, 0.98], ["random", "smooth"]
    Ss = args.S or Ss
    Ds = args.D or Ds
    Gs = args.G or Gs
    sps = args.sparsity or sps
    dists = args.dist or dists
    global KM_RATIO, NATIVE_HEAD_DIMS
    NATIVE_HEAD_DIMS = args.native_head_dims
    if T.backend() == "ops":
        from dsv_ext.ops import kernel_tuning
        TUNING.update(kernel_tuning())
        KM_RATIO = float(TUNING.get("km_ratio", KM_RATIO))
    gen = torch.Generator().manual_seed(0)
    est_name, est = estimate_fn()
    print(f"backend={T.backend()} estimate={est_name}")
    records = []
    cache = {}
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                commit=git_commit(), card=torch.cuda.get_device_name(), H=H, dtype="bf16",
                estimate=est_name, torch=torch.__version__,
                env={k: v for k, v in os.environ.items() if k.startswith("DSV_")})
    if T.backend() == "ops":
        from dsv_ext.ops import kernel_tuning
        meta["kernel_tuning"] = ",".join(f"{k}={v}" for k, v in kernel_tuning().items())
    for S in Ss:
        for D in Ds:
            dense = dense_times(B, S, H, D, dtype, max(3, args.reps // 2), tuple(args.dense))
            print(f"S={S} D={D} dense: {dense}", flush=True)
            flex_cache = {}
            for dist in dists:
                for G in Gs:
                    for sp in sps:
                        rec = run_shape(B, S, H, D, G, sp, dist, dtype, args.reps, gen, est_name,
                                        est, cache)
                        rec.update(dense)
                        if args.flex:
                            if sp not in flex_cache:
                                try:
                                    flex_cache[sp] = flex_times(B, S, H, D, dtype, 1 - sp, args.reps, gen)
                                except Exception as e:  # noqa: BLE001
                                    print(f"  flex failed: {type(e).__name__}: {str(e)[:200]}")
                                    flex_cache[sp] = {"flex_fwd_ms": None, "flex_fwdbwd_ms": None}
                            rec.update(flex_cache[sp])
                        c = rec.get("cudnn_fwdbwd_ms")
                        rec["speedup_vs_cudnn_fwdbwd"] = c / rec["total_ms"] if c else None
                        fx = rec.get("flex_fwdbwd_ms")
                        rec["speedup_vs_flex_fwdbwd"] = fx / rec["total_ms"] if fx else None
                        records.append(rec)
                        print(json.dumps(rec), flush=True)
                        write_outputs(records, args.out, meta)
    print("\nS D G sparsity dist | est fwd bwd | cudnn fwdbwd | speedup")
    for r in records:
        print(f"{r['S']} {r['D']} {r['G']} {r['sparsity']} {r['dist']} | {r['est_ms']:.2f} "
              f"{r['fwd_ms']:.2f} {r['bwd_ms']:.2f}"
              f" | {r.get('cudnn_fwdbwd_ms')} | {r.get('speedup_vs_cudnn_fwdbwd')}")


if __name__ == "__main__":
    main()
