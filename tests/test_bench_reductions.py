"""The kernel benchmark's count of dK / dV reductions (benchmarks/bench_kernels.py
reduction_stats) against a plain count over Python sets of the same lists, by the backward's
rules: key-major heads none, merged 128-query blocks once per key of their union, the rest once
per (group, key)."""
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_kernels as BK  # noqa: E402


def _plain(idx, cnt, G, D, tun):
    B, H, NG, KM = idx.shape
    S = NG * G
    M = 128 // G if G in (16, 32, 64) and D in (64, 128) and tun["merge"] > 0 else 1
    pairs = done = 0
    for b in range(B):
        for h in range(H):
            lists = [[int(x) for x in idx[b, h, g, :int(cnt[b, h])] if x >= 0] for g in range(NG)]
            n = sum(len(l) for l in lists)
            pairs += n
            entries = sum(len({x // 64 for x in l}) for l in lists)
            ratio = entries * 64 / (NG * max(int(cnt[b, h]), 1))
            if ratio <= tun["km_ratio"] and D <= 128:
                continue  # key-major: no reductions
            if M == 1 or ratio > 4.0:
                done += n
                continue
            cap = min(S, math.ceil(tun["merge"] * M * KM))
            for u in range(0, NG, M):
                union = set().union(*lists[u:u + M])
                done += len(union) if len(union) <= cap else sum(len(l) for l in lists[u:u + M])
    return pairs * 2 * D / 1e9, done * 2 * D / 1e9


def _lists(B, H, NG, K, S, kind, gen):
    """scattered: random keys; window: a window of keys near the group, shared with its
    neighbours (merged blocks); blocks: whole 64-key blocks near the group (key-major heads)."""
    out = torch.empty(B, H, NG, K, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for g in range(NG):
                jitter = int(torch.randint(-8, 9, (1,), generator=gen))
                lo = min(S - K, max(0, g * (S // NG) - K // 2 + jitter))
                if kind == "scattered":
                    keys = torch.randperm(S, generator=gen)[:K].sort().values
                elif kind == "window":
                    keys = torch.arange(lo, lo + K)
                else:
                    keys = torch.arange(lo // 64 * 64, lo // 64 * 64 + K)
                out[b, h, g] = keys.to(torch.int32)
    return out


@pytest.mark.parametrize("G", [16, 32, 64, 128])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("kind", ["scattered", "window", "blocks"])
def test_reduction_stats_match_a_plain_count(G, D, kind):
    gen = torch.Generator().manual_seed(G * 7 + D + len(kind))
    S, K, B, H = 1024, 128, 1, 3
    NG = S // G
    idx = _lists(B, H, NG, K, S, kind, gen)
    cnt = torch.full((B, H), K, dtype=torch.int32)
    cnt[0, 1] = K - 5            # a shorter count: entries past it are not reduced
    idx[0, 2, :, -3:] = -1       # -1 padding
    for tun in ({"km_ratio": 1.15, "merge": 0.75, "wgmma": 1, "g128": 1},
                {"km_ratio": 0.0, "merge": 0.75, "wgmma": 1, "g128": 1},
                {"km_ratio": 0.0, "merge": 0.0, "wgmma": 1, "g128": 1}):
        got = BK.reduction_stats(idx, cnt, G, D, tun)
        want = _plain(idx, cnt, G, D, tun)
        assert got == pytest.approx(want, rel=1e-12, abs=0), (tun, got, want)
    # with merging off and no key-major heads every pair is one reduction
    p, d = BK.reduction_stats(idx, cnt, G, D, {"km_ratio": 0.0, "merge": 0.0})
    assert p == d > 0
    # the lists the test makes take the rules' branches: merged windows, key-major blocks
    d = BK.reduction_stats(idx, cnt, G, D, {"km_ratio": 1.15, "merge": 0.75})[1]
    if kind == "window" and G < 128 and D <= 128:
        assert d < p
    if kind == "blocks" and D <= 128:
        assert d < p / 2  # heads 0 and 2 whole blocks: key-major
