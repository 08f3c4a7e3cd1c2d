"""Times both tile-loop variants of the CUDA top-K estimation (DSV_TOPK_TWO_PHASE=0 / 1) and
checks that they return identical lists.   python benchmarks/topk_variants.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch, dsv_ext, statistics
torch.manual_seed(0)
for S, H in ((65536, 24), (131072, 24)):
    G = 64
    for frac in (0.1, 0.2):
        K = int(frac * S) // 64 * 64
        ql = torch.randn(1, S, H, 16, device="cuda", dtype=torch.bfloat16)
        kl = torch.randn(1, S, H, 16, device="cuda", dtype=torch.bfloat16)
        cnt = torch.full((1, H), K, dtype=torch.int32, device="cuda")
        res = {}
        for v in ("0", "1"):
            os.environ["DSV_TOPK_TWO_PHASE"] = v
            idx = dsv_ext.topk_estimate(ql, kl, cnt, G, K)
            ts = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); dsv_ext.topk_estimate(ql, kl, cnt, G, K); b.record(); torch.cuda.synchronize()
                ts.append(a.elapsed_time(b))
            res[v] = (statistics.median(ts), idx)
        same = torch.equal(res["0"][1], res["1"][1])
        print(f"topk S={S} H={H} K={K}: block-at-a-time {res['0'][0]:.2f} ms, two-phase {res['1'][0]:.2f} ms, identical lists: {same}", flush=True)
