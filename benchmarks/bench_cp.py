"""Context-parallel attention benchmark: DSV HCP / SCP / hybrid / solver plan vs dense Ulysses.

One command (2 GPUs, about 3-5 minutes including start-up; 4/8 GPUs the same with more ranks):

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=2 benchmarks/bench_cp.py

Per sequence length (default 64k and 128k tokens), head-sparsity profile (``uniform``: every
head at --sparsity; ``skewed``: mean --sparsity, densities spread 0.3x-2.2x, heavy heads first so
the plain contiguous head split is unbalanced) and index distribution (``smooth``: low-rank
inputs smooth over the cube-reordered (T, H, W) grid, coherent keys as in video, but periodic,
so one group's keys lie all over the clip; ``local``: spatio-temporally local heads, each group
selects the keys nearest to it in (t, y, x) with per-head axis weights, the 3D-window pattern of
video DiT heads; ``random``: scattered keys, the worst case for SCP), and method:

* ``ulysses``   dense Ulysses: all-to-all to head layout, cuDNN SDPA, all-to-all back;
* ``hcp_naive`` DSV HCP with the plain contiguous head split;
* ``hcp``       DSV HCP with the LPT head assignment (uneven all-to-all);
* ``scp``       DSV SCP (sparse all-to-all of critical K/V rows);
* ``scp_budget`` SCP with ``remote_budget = 1 - sparsity`` (the most requested remote keys only);
* ``hybrid``    DSV hybrid with g_h = N/2 (N >= 4 only);
* ``plan``      the plan solver's choice (g_h, g_s and assignment), run through cp_attention;

it reports the time of one attention layer forward+backward (max over ranks of the mean over
--iters; estimation and index building included), bytes each rank sends (forward+backward), the
per-rank attention compute time (the rank's kernel calls replayed alone) and its imbalance
(max/mean - 1), and peak memory. Rank 0 writes JSON and Markdown to benchmarks/results/
(bench_cp_<N>gpu.json / .md). B = 1, bf16, 2.7B-shaped blocks (16 heads, head dim 128), group
size 64, rank 16.

CPU smoke test (gloo, tiny shapes): torchrun --nproc_per_node=2 benchmarks/bench_cp.py --device cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dsv_ext  # noqa: E402
from bench_common import provenance  # noqa: E402
import dsv_ext.parallel as P  # noqa: E402
from dsv_ext.parallel import local as _local  # noqa: E402


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seqlens", default=None, help="comma list (default 65536,131072; cpu: 1024)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--profiles", default="uniform,skewed")
    ap.add_argument("--index", default="smooth,local,random")
    ap.add_argument("--methods", default="ulysses,hcp_naive,hcp,scp,scp_budget,hybrid,plan")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--calibrate", type=int, default=None,
                    help="1: calibrate the plan solver's cost model on this machine first (rank 0 measures, all use "
                         "it; default 1 on cuda, 0 on cpu)")
    return ap.parse_args()


# ----------------------------------------------------------------------------------------------
def head_sparsity(profile: str, H: int, s: float):
    if profile == "uniform":
        return [s] * H
    # densities (1 - s) x w_h with w spread 0.3..2.2, mean 1, heaviest heads first
    w = [0.3 + 1.9 * ((H - 1 - h) / max(1, H - 1)) ** 2 for h in range(H)]
    m = sum(w) / H
    return [min(0.98, max(0.0, 1.0 - (1.0 - s) * x / m)) for x in w]


def grid_for(S: int):
    # (T, H, W) with H = W = 64 where possible (the paper's 32^3 / 40x56x56 style grids)
    for hw in (64, 32, 16, 8, 4):
        if S % (hw * hw) == 0 and S // (hw * hw) >= 2:
            return (S // (hw * hw), hw, hw)
    return (S, 1, 1)


def make_inputs(S, n, me, H, D, r, dist_kind, dtype, device, seed=0):
    """This rank's shard of q, k, v, q_lr, k_lr (the global tensors are the concatenation)."""
    L = S // n
    g = torch.Generator(device="cpu").manual_seed(seed * 1000 + me)
    q, k, v = (torch.randn(1, L, H, D, generator=g).to(device, dtype) for _ in range(3))
    if dist_kind == "random":
        q_lr = torch.randn(1, L, H, r, generator=g).to(device, dtype)
        k_lr = torch.randn(1, L, H, r, generator=g).to(device, dtype)
        return q, k, v, q_lr, k_lr
    grid = grid_for(S)
    from dsv_ext.grouping import cube_permutation

    perm, _ = cube_permutation(grid, (2, 4, 4), seq_len=S, device=torch.device("cpu"))
    pos = perm[me * L:(me + 1) * L]
    T, Hh, W = grid
    coord = torch.stack([pos // (Hh * W), (pos // W) % Hh, pos % W], 1).double()  # [L, 3]
    gh = torch.Generator(device="cpu").manual_seed(seed + 7)  # the same on every rank
    if dist_kind == "local":
        # spatio-temporally local heads: q_lr . k_lr = sum over axes c of w_hc cos(pi (x_c - y_c) / E_c)
        # (E_c = the grid extent: one half period, so the score falls monotonically with the
        # distance along each axis), per-head axis weights w in [1, 4] (some heads reach further
        # in time, others in space), the other r - 6 components small per-token noise
        ext = torch.tensor([T, Hh, W], dtype=torch.float64)
        w = 1.0 + 3.0 * torch.rand(H, 3, generator=gh, dtype=torch.float64)  # [H, 3]
        ang = math.pi * coord / ext  # [L, 3]
        cs = torch.cat([ang.cos(), ang.sin()], 1)  # [L, 6]: cos_t, cos_y, cos_x, sin_t, sin_y, sin_x
        wq = torch.cat([w, w], 1).sqrt()  # [H, 6]
        feat = cs.unsqueeze(1) * wq.unsqueeze(0)  # [L, H, 6]: feat_q . feat_k = sum w cos(delta)
        rest = 0.1 * torch.randn(L, H, r - 6, generator=g, dtype=torch.float64)
        q_lr = torch.cat([feat, rest], -1).unsqueeze(0)
        k_lr = torch.cat([feat, 0.1 * torch.randn(L, H, r - 6, generator=g, dtype=torch.float64)], -1).unsqueeze(0)
        return q, k, v, q_lr.to(device, dtype), k_lr.to(device, dtype)
    # smooth: random Fourier features of the (t, y, x) position of each cube-ordered token
    nf = r // 2
    freq = torch.randn(H, nf, 3, generator=gh, dtype=torch.float64) * torch.tensor([1.0 / T, 1.0 / Hh, 1.0 / W]) * 6.0
    phase = torch.rand(H, nf, generator=gh, dtype=torch.float64) * 2 * math.pi
    amp = 2.0 + 2.0 * torch.rand(H, 1, generator=gh, dtype=torch.float64)
    th = torch.einsum("lc,hfc->lhf", coord, freq) + phase  # [L, H, nf]
    feat = torch.cat([th.cos(), th.sin()], -1) * amp.sqrt()  # [L, H, r]
    noise = 0.1
    q_lr = (feat + noise * torch.randn(feat.shape, generator=g, dtype=torch.float64)).unsqueeze(0)
    k_lr = (feat + noise * torch.randn(feat.shape, generator=g, dtype=torch.float64)).unsqueeze(0)
    return q, k, v, q_lr.to(device, dtype), k_lr.to(device, dtype)


# ----------------------------------------------------------------------------------------------
def ulysses(q, k, v, group=None):
    n = dist.get_world_size(group)
    asg = P.naive_assign(q.shape[2], n)
    qh, kh, vh = P.seq_to_head([q, k, v], asg, group)
    with cudnn_first(q.is_cuda):
        o = _local._sdpa(qh, kh, vh, None)  # [B, S, a, D] in and out (recorded by Recorder)
    (out,) = P.head_to_seq([o], asg, group)
    return out


class cudnn_first:
    """Prefer cuDNN SDPA (then FlashAttention) on the GPU, for every dense attention here."""

    def __init__(self, on):
        self.ctx = None
        if on:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.ctx = sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *a):
        if self.ctx is not None:
            self.ctx.__exit__(*a)


class Recorder:
    """Records this rank's attention kernel calls during one step, to replay them alone."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self._sa, self._tk, self._sd = dsv_ext.sparse_attention, dsv_ext.topk_estimate, _local._sdpa
        rec = self

        def sa(q, k, v, idx, cnt, G, scale=None, check_index=True):
            rec.calls.append(("sparse", (q.detach(), k.detach(), v.detach(), idx, cnt, G, scale)))
            return rec._sa(q, k, v, idx, cnt, G, scale=scale, check_index=check_index)

        def tk(q_lr, k_lr, cnt, G, kmax=None):
            rec.calls.append(("topk", (q_lr.detach(), k_lr.detach(), cnt, G, kmax)))
            return rec._tk(q_lr, k_lr, cnt, G, kmax=kmax)

        def sd(q, k, v, scale):
            rec.calls.append(("dense", (q.detach(), k.detach(), v.detach(), scale)))
            return rec._sd(q, k, v, scale)

        dsv_ext.sparse_attention, dsv_ext.topk_estimate, _local._sdpa = sa, tk, sd
        return self

    def __exit__(self, *a):
        dsv_ext.sparse_attention, dsv_ext.topk_estimate, _local._sdpa = self._sa, self._tk, self._sd

    def replay_time(self, sync, reps=2):
        total = 0.0
        for kind, a in self.calls:
            if kind == "topk":
                fn = lambda a=a: self._tk(a[0], a[1], a[2], a[3], kmax=a[4])
            elif kind == "sparse":
                q, k, v = (t.clone().requires_grad_(True) for t in a[:3])

                def fn(q=q, k=k, v=v, a=a):
                    o = self._sa(q, k, v, a[3], a[4], a[5], scale=a[6], check_index=False)
                    o.backward(torch.ones_like(o))
            else:
                q, k, v = (t.clone().requires_grad_(True) for t in a[:3])

                def fn(q=q, k=k, v=v, a=a):
                    with cudnn_first(q.is_cuda):
                        o = self._sd(q, k, v, a[3])
                        o.backward(torch.ones_like(o))
            fn()
            sync()
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                sync()
                best = min(best, time.perf_counter() - t0)
            total += best
        return total


def main():
    args = parse()
    dev_kind = args.device
    if dev_kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        # a rank that fails mid-step leaves the others in a collective: fail after 3 minutes, not 30
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=3))
        device = torch.device("cuda", local)
        dtype = torch.bfloat16
        sync = lambda: torch.cuda.synchronize(device)
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
        device = torch.device("cpu")
        dtype = torch.float32
        sync = lambda: None
        torch.set_num_threads(1)
    n, me = dist.get_world_size(), dist.get_rank()
    seqlens = [int(x) for x in (args.seqlens or ("65536,131072" if dev_kind == "cuda" else "1024")).split(",")]
    H, D, r, G = args.heads, args.head_dim, args.rank, args.group_size
    if dev_kind == "cpu" and args.seqlens is None:
        H, D, G = min(H, 4), min(D, 16), min(G, 16)
    methods = [m for m in args.methods.split(",") if m and (m != "hybrid" or n >= 4)]
    e = torch.empty((), dtype=dtype).element_size()
    records = []
    cost = P.CostModel(bytes_per_elem=e)
    if args.calibrate if args.calibrate is not None else dev_kind == "cuda":
        t0 = time.time()
        cost.calibrate(device=device, head_dim=D, group_size=G, rank=r, dtype=dtype, group=dist.group.WORLD)
        obj = [cost.to_dict()]
        dist.broadcast_object_list(obj, src=0)  # one model for all ranks: the plans must agree
        cost = P.CostModel.from_dict(obj[0])
        if me == 0:
            print(f"[bench_cp] calibrated cost model in {time.time() - t0:.1f} s: {cost.to_dict()}", flush=True)

    def log(*a):
        if me == 0:
            print(*a, flush=True)

    log(f"[bench_cp] N={n} device={dev_kind} dtype={dtype} H={H} D={D} G={G} r={r} seqlens={seqlens} methods={methods}")
    t_start = time.time()
    prov = provenance() if me == 0 else {}
    def write_results():
        """Rank 0 writes JSON + Markdown of what ran so far (called after every record)."""
        # speedups against dense Ulysses of the same configuration
        base = {(x["S"], x["profile"], x["index"]): x["step_ms"] for x in records if x.get("ok") and x["method"] == "ulysses"}
        for x in records:
            b = base.get((x["S"], x["profile"], x["index"]))
            if x.get("ok") and b:
                x["speedup_vs_ulysses"] = b / x["step_ms"]
        if me == 0:
            os.makedirs(args.out, exist_ok=True)
            name = f"bench_cp_{n}gpu{args.tag}" if dev_kind == "cuda" else f"bench_cp_cpu_{n}rank{args.tag}"
            meta = dict(cost_model=cost.to_dict(), world=n, device=torch.cuda.get_device_name(device) if dev_kind == "cuda" else platform.processor(),
                        torch=torch.__version__, dtype=str(dtype), heads=H, head_dim=D, group_size=G, rank=r,
                        sparsity=args.sparsity, iters=args.iters, warmup=args.warmup,
                        date=datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z",
                        wall_s=time.time() - t_start, provenance=prov)
            with open(os.path.join(args.out, name + ".json"), "w") as f:
                json.dump(dict(meta=meta, records=records), f, indent=1)
            lines = [f"# bench_cp: {n} x {meta['device']}, B=1, H={H}, D={D}, {dtype}, G={G}, r={r}, target sparsity {args.sparsity}",
                     "",
                     "Time of one attention layer forward+backward (all-to-alls, estimation and index building included; "
                     "max over ranks). compute/rank: the rank's attention kernels replayed alone; imbalance = max/mean - 1 "
                     "of that. sent: bytes one rank sends, forward+backward (max over ranks). SCP kv/dense: K/V row bytes "
                     "sent / K/V bytes of dense sequence parallelism (all-gather). kept: fraction of the exact "
                     "top-K list entries the lists keep (1 for exact SCP; scp_budget fetches at most 1 - sparsity "
                     "of each other rank's keys per head, the most requested, and drops the rest from the lists).",
                     "",
                     "| S | profile | index | method | step ms | vs Ulysses | compute ms/rank | imbalance | sent MiB/rank | peak GiB | plan | SCP union | SCP kv/dense | kept |",
                     "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for x in records:
                if not x.get("ok"):
                    lines.append(f"| {x['S']} | {x['profile']} | {x['index']} | {x['method']} | failed: {x['error'][:80]} ||||||||||")
                    continue
                pl = f"g_h={x['plan']['g_h']} g_s={x['plan']['g_s']}" if "plan" in x else ""
                un = f"{max(x['scp_union_fraction']):.2f}" if "scp_union_fraction" in x else ""
                kr = f"{x['scp_kv_bytes_ratio']:.3f}" if "scp_kv_bytes_ratio" in x else ""
                kf = f"{min(x['scp_kept_fraction']):.3f}" if "scp_kept_fraction" in x else ""
                lines.append(f"| {x['S']} | {x['profile']} | {x['index']} | {x['method']} | {x['step_ms']:.2f} | "
                             f"{x.get('speedup_vs_ulysses', float('nan')):.2f}x | "
                             f"{' / '.join('%.1f' % c for c in x['compute_ms_per_rank'])} | {x['imbalance'] * 100:.1f}% | "
                             f"{max(x['bytes_sent_per_rank']) / 2**20:.1f} | {x['peak_mem_gb']:.2f} | {pl} | {un} | {kr} | {kf} |")
            lines.append("")
            lines.append(f"wall time {meta['wall_s']:.0f} s, {meta['date']}, torch {meta['torch']}, "
                         f"commit {prov.get('commit', '?')} (csrc {prov.get('csrc', '?')})")
            with open(os.path.join(args.out, name + ".md"), "w") as f:
                f.write("\n".join(lines) + "\n")
                return os.path.join(args.out, name)

    for S in seqlens:
        if S % (n * G):
            log(f"skip S={S}: not a multiple of N*G")
            continue
        L = S // n
        for profile in args.profiles.split(","):
            sp = head_sparsity(profile, H, args.sparsity)
            counts = [min(S, max(-(-int(math.ceil((1 - s) * S)) // G) * G, -(-int(0.02 * S) // G) * G, G)) for s in sp]
            kv_count = torch.tensor([counts], dtype=torch.int32, device=device)
            real_sp = [1 - c / S for c in counts]
            for idx_kind in args.index.split(","):
                q0, k0, v0, ql, kl = make_inputs(S, n, me, H, D, r, idx_kind, dtype, device)
                grad = torch.randn_like(q0)
                union = None  # measured per-head SCP union fractions (from the scp run), fed to the plan
                for method in methods:
                    plan = None
                    stats = {}
                    if method == "ulysses":
                        fn = lambda q, k, v, **kw: ulysses(q, k, v)
                    elif method == "hcp_naive":
                        asg = P.naive_assign(H, n)
                        fn = lambda q, k, v, asg=asg, **kw: P.hcp_attention(q, k, v, ql, kl, kv_count, G, assignment=asg, **kw)
                    elif method == "hcp":
                        fn = lambda q, k, v, **kw: P.hcp_attention(q, k, v, ql, kl, kv_count, G, **kw)
                    elif method == "scp":
                        fn = lambda q, k, v, **kw: P.scp_attention(q, k, v, ql, kl, kv_count, G, **kw)
                    elif method == "scp_budget":
                        bud = 1.0 - args.sparsity
                        fn = lambda q, k, v, bud=bud, **kw: P.scp_attention(q, k, v, ql, kl, kv_count, G,
                                                                            remote_budget=bud, **kw)
                    elif method == "hybrid":
                        fn = lambda q, k, v, **kw: P.hybrid_attention(q, k, v, ql, kl, kv_count, G, g_h=n // 2, **kw)
                    elif method == "plan":
                        plan = P.solve_plan(real_sp, n, S, D, cost=cost, group_size=G, rank=r, union=union)
                        fn = lambda q, k, v, plan=plan, **kw: P.cp_attention(q, k, v, ql, kl, kv_count, G, plan, **kw)
                    else:
                        raise SystemExit(f"unknown method {method}")
                    q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
                    rec = None
                    try:
                        if dev_kind == "cuda":
                            torch.cuda.empty_cache()
                            torch.cuda.reset_peak_memory_stats(device)
                        # first step: validated, with stats and the kernel-call recorder
                        with Recorder() as rec, cudnn_first(dev_kind == "cuda"):
                            kw = {} if method == "ulysses" else {"stats": stats}
                            out = fn(q, k, v, **kw)
                            out.backward(grad)
                        sync()
                        times = []
                        for it in range(args.warmup + args.iters):
                            q.grad = k.grad = v.grad = None
                            dist.barrier()
                            sync()
                            t0 = time.perf_counter()
                            kw = {} if method == "ulysses" else {"validate": False}
                            with cudnn_first(dev_kind == "cuda"):
                                out = fn(q, k, v, **kw)
                                out.backward(grad)
                            sync()
                            if it >= args.warmup:
                                times.append(time.perf_counter() - t0)
                        ok = True
                        err = ""
                    except Exception as exc:  # noqa: BLE001 - recorded (e.g. out of memory), run continues
                        ok, err, times = False, f"{type(exc).__name__}: {str(exc)[:300]}", [float("nan")]
                    ok_t = torch.tensor([0.0 if ok else 1.0], device=device)
                    dist.all_reduce(ok_t)
                    if ok_t.item() > 0:
                        log(f"  S={S} {profile} {idx_kind} {method}: FAILED on some rank {err}")
                        records.append(dict(S=S, profile=profile, index=idx_kind, method=method, ok=False, error=err))
                        if dev_kind == "cuda":
                            torch.cuda.empty_cache()
                        continue
                    step = sum(times) / len(times)
                    comp = rec.replay_time(sync) if rec is not None else float("nan")
                    peak = torch.cuda.max_memory_allocated(device) if dev_kind == "cuda" else 0
                    if method == "ulysses":
                        a = H // n
                        sent = 2 * L * (H - a) * 4 * D * e  # q,k,v,out forward; dout,dq,dk,dv backward
                    else:
                        sent = sum(stats.get(k_, 0) for k_ in ("hcp_bytes_sent_fwd", "hcp_bytes_sent_bwd",
                                                                 "scp_kv_bytes_sent_fwd", "scp_kv_bytes_sent_bwd",
                                                                 "scp_index_bytes_sent", "scp_klr_bytes_sent"))
                    vec = torch.tensor([step, comp, float(sent), float(peak),
                                        float(stats.get("scp_kv_bytes_sent_fwd", 0)),
                                        float(stats.get("scp_dense_kv_bytes", 0)),
                                        float(stats.get("scp_union_fraction", float("nan"))),
                                        float(stats.get("scp_query_pad", float("nan"))),
                                        float(stats.get("scp_kept_fraction", float("nan")))], dtype=torch.float64, device=device)
                    allv = [torch.empty_like(vec) for _ in range(n)]
                    dist.all_gather(allv, vec)
                    allv = torch.stack(allv).cpu()
                    comps = allv[:, 1].tolist()
                    if method == "scp" and "scp_union_per_head" in stats:
                        u = torch.tensor(stats["scp_union_per_head"], dtype=torch.float64, device=device)
                        dist.all_reduce(u, op=dist.ReduceOp.MAX)
                        union = u.tolist()
                    mean_c = sum(comps) / n
                    rec_d = dict(S=S, profile=profile, index=idx_kind, method=method, ok=True, world=n,
                                 sparsity=real_sp, counts=counts,
                                 step_ms=float(allv[:, 0].max()) * 1e3,
                                 compute_ms_per_rank=[c * 1e3 for c in comps],
                                 imbalance=(max(comps) / mean_c - 1) if mean_c > 0 else 0.0,
                                 bytes_sent_per_rank=allv[:, 2].tolist(),
                                 peak_mem_gb=float(allv[:, 3].max()) / 2**30)
                    if method in ("scp", "scp_budget", "hybrid", "plan") and float(allv[:, 5].sum()) > 0:
                        rec_d["scp_kv_bytes_ratio"] = float(allv[:, 4].sum() / allv[:, 5].sum())
                        rec_d["scp_union_fraction"] = allv[:, 6].tolist()
                        rec_d["scp_query_pad"] = allv[:, 7].tolist()
                        rec_d["scp_kept_fraction"] = allv[:, 8].tolist()
                    if plan is not None:
                        rec_d["plan"] = dict(g_h=plan.g_h, g_s=plan.g_s, assignment=[list(x) for x in plan.assignment],
                                             model_ms=plan.max_time * 1e3, mode=plan.mode,
                                             union_measured=union is not None,
                                             candidates=[list(c) for c in plan.candidates])
                    if "hcp_assignment" in stats:
                        rec_d["assignment"] = [list(x) for x in stats["hcp_assignment"]]
                    records.append(rec_d)
                    log(f"  S={S} {profile:7s} {idx_kind:6s} {method:9s} step {rec_d['step_ms']:9.2f} ms  "
                        f"compute/rank {['%.1f' % c for c in rec_d['compute_ms_per_rank']]} "
                        f"imbalance {rec_d['imbalance'] * 100:5.1f}%  sent/rank {max(rec_d['bytes_sent_per_rank']) / 2**20:8.1f} MiB"
                        + (f"  plan g_h={plan.g_h} g_s={plan.g_s}" if plan is not None else "")
                        + (f"  union {max(rec_d['scp_union_fraction']):.2f} kv-bytes/dense {rec_d['scp_kv_bytes_ratio']:.3f}"
                           f" kept {min(rec_d['scp_kept_fraction']):.3f}"
                           if "scp_kv_bytes_ratio" in rec_d else ""))
                    write_results()  # a run cut short keeps what it measured
                    del out, rec
                del q0, k0, v0, ql, kl, grad
    path = write_results()
    if me == 0:
        print(f"[bench_cp] wrote {path}.json/.md in {time.time() - t_start:.0f} s", flush=True)
    P.clear_group_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
