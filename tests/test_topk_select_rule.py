"""The selection rule of csrc/cuda/topk_estimate.cu, emulated on the CPU pass by pass on the
uint32 score keys, against a stable sort: the list must be the exact top-K (ties towards the
lower position, ascending) for every score distribution, whatever the sample suggests.

The emulation mirrors the kernel's arithmetic (sample ranks, 8 + 8-bit sample select, band bins,
boundary-bin search from the top, window updates, collect, generic 256-bin passes, the
compaction's tie rule), so the cases that make the sample mislead (scores of the sampled
positions shifted up or down), that defeat the collect pass (more than TK_CAP equal keys at the
boundary), ties everywhere, NaN / +-inf, K = 0 / 1 / S - 1 / S / above S exercise the kernel's
fallbacks here, with the sample (kernel tuning tk_sample = 1, the default) and without it
(generic radix passes from the full key range), in one CTA and split over a cluster of CTAs
(tk_split: each CTA's own counts place its part of the list); tests/test_topk_paths_cuda.py
checks the kernel itself on a GPU. Scores are float32 as the kernel's; selections are exact, so no tolerance
applies.
"""
import math

import pytest
import torch

M32 = 0xFFFFFFFF
STRIDE, MIN_S, CAP, MAX_PASSES, BINS = 16, 4096, 256, 6, 256
OFF, HIST, BAND, COLLECT = 0, 1, 2, 3


def float_keys(x):
    """dsv_float_key: order-preserving uint32 keys (as int64) of float32 scores; NaN ranks with
    -inf."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & M32
    k = torch.where(u >= 0x80000000, u ^ M32, u ^ 0x80000000)
    return torch.where(torch.isnan(x), torch.full_like(k, 0x007FFFFF), k)


def sample_positions(ns, S):
    """dsv_tk_sample_key: sample row i is key min(16 i + h(i), S - 1), h(i) the top 4 bits of
    the 32-bit product i * 0x9E3779B1."""
    i = torch.arange(ns, dtype=torch.int64)
    j = i * STRIDE + (((i * 0x9E3779B1) & M32) >> 28)
    return torch.clamp(j, max=S - 1)


def find(c, need):
    """Highest bin b with sum(c[b:]) >= need: (b, count above b, c[b]) (dsv_tk_find)."""
    suffix = torch.flip(torch.cumsum(torch.flip(c, [0]), 0), [0])
    ok = torch.nonzero(suffix >= need).flatten()
    assert ok.numel() > 0, "need above the slab's total"
    b = int(ok[-1])
    return b, int(suffix[b] - c[b]), int(c[b])


def plan(st):
    """dsv_tk_plan: collect when the window holds <= CAP keys, else a 256-bin histogram."""
    if st["cnt"] <= CAP:
        st.update(mode=COLLECT, s=0)
    else:
        bits = (st["hi"] - st["lo"]).bit_length()
        st.update(mode=HIST, s=max(bits - 8, 0))
    st["top"] = st["hi"]


def buffer_on(S, K):
    """The band buffer is used where the band (the sample ranks' +-4 sigma, in keys) holds at most
    1/20 of the keys."""
    ns = -(-S // STRIDE)
    mu = K * ns / S
    sd = math.sqrt(mu)
    m_lo = min(ns, math.ceil(mu + 4 * sd + 2))
    m_hi = max(0, math.floor(mu - 4 * sd - 2))
    return (m_lo - m_hi) * STRIDE * 20 <= S


def sample_band(keys, K):
    """Stage 0: T_lo, T_hi from one key in STRIDE (8-bit sample passes: the top 8 bits of both,
    then the next 8 of T_lo and of T_hi when in the same top-8-bit bin; else, with the band
    buffer, a third pass for T_hi's, and without it T_hi is the top of its 8-bit bin)."""
    S = keys.numel()
    ns = -(-S // STRIDE)
    samp = keys[sample_positions(ns, S)]
    mu = K * ns / S
    sd = math.sqrt(mu)
    m_lo = min(ns, math.ceil(mu + 4 * sd + 2))
    m_hi = max(0, math.floor(mu - 4 * sd - 2))
    c = torch.bincount(samp >> 24, minlength=BINS)
    bl, al, _ = find(c, m_lo)
    bh, ah = find(c, m_hi)[:2] if m_hi > 0 else (0, 0)
    lo = bl << 24
    sneed_lo = m_lo - al
    sneed_hi = m_hi - (al if bh == bl else ah) if m_hi > 0 else 0

    def second(base, need):  # the next 8 bits in the top-8-bit bin at base
        w = samp[(samp >= base) & (samp <= (base | 0xFFFFFF))]
        return base + (find(torch.bincount((w - base) >> 16, minlength=BINS), need)[0] << 16)

    t_lo = second(lo, sneed_lo)
    if m_hi == 0:
        t_hi = M32
    elif bh == bl or buffer_on(S, K):
        t_hi = second(bh << 24, sneed_hi) + 0xFFFF
    else:
        t_hi = (bh << 24) | 0xFFFFFF
    assert t_lo <= t_hi
    return t_lo, t_hi


def select(keys, K, sample=True, CL=1, kmax=None):
    """The kernel's list for one group: (positions, full passes before the compaction); sample:
    the kernel tuning tk_sample (False: generic passes from the full key range); CL: the CTAs
    that share the group (tk_split). CTA r scores the keys of its range (whole 64-key tiles, the
    CTAs in order), the decisions come from the summed histograms, and each CTA keeps its own
    counts above and in the window; the list is each CTA's part (its keys above T and its share
    of the ties at T, the first ones in position order) at the offset of what the CTAs before it
    select. Where the band holds at most 1/20 of the keys (buffer_on), the band pass also stores
    its keys in the list row (kmax entries, default K): each CTA's part, 4 segments, one per lane
    of the quad (the lane of key j: (j % 8) // 2); when the window is a bin of the band and no
    segment overflowed, the collect step reads them and makes no pass over the keys."""
    S = keys.numel()
    kmax = K if kmax is None else kmax
    K = min(max(K, 0), S)
    if K == 0:
        return torch.empty(0, dtype=torch.int64), 0
    tile = 64
    kt = -(-(-(-S // tile)) // CL) * tile
    ranges = [(min(S, r * kt), min(S, (r + 1) * kt)) for r in range(CL)]
    own = [keys[b:e] for b, e in ranges]
    if K == S:
        return torch.cat([torch.arange(b, e) for b, e in ranges]), 0
    above = [0] * CL
    wcnt = [e - b for b, e in ranges]
    if sample and S >= MIN_S:
        t_lo, t_hi = sample_band(keys, K)  # the summed sample histograms: select's
        s = 0
        while ((t_hi - t_lo) >> s) > 253:
            s += 1
        st = dict(mode=BAND, lo=t_lo, hi=M32, top=min(t_lo + (254 << s) - 1, t_hi), s=s, need=K,
                  cnt=S, done=0)
    else:
        st = dict(lo=0, hi=M32, need=K, cnt=S, done=0)
        plan(st)
    passes = 0
    while not st["done"]:
        assert passes < MAX_PASSES, "no resolution within the pass bound"
        passes += 1
        lo, hi, top, s, mode, need = (st[x] for x in ("lo", "hi", "top", "s", "mode", "need"))
        if mode == COLLECT:
            passes -= int(st.get("bufok", False))  # from the band buffers
            parts = [k[(k >= lo) & (k <= hi)] for k in own]
            vals = torch.cat(parts)
            assert vals.numel() == st["cnt"] <= CAP
            T = int(torch.sort(vals, descending=True).values[need - 1])
            st.update(lo=T, need=need - int((vals > T).sum()), done=1)
            for r in range(CL):
                above[r] += int((parts[r] > T).sum())
                wcnt[r] = int((parts[r] == T).sum())
            continue
        off = 1 if mode == BAND else 0
        cs = []
        for r, k in enumerate(own):
            inw = (k >= lo) & (k <= hi)
            h = inw & (k <= top)
            c = torch.bincount(off + ((k[h] - lo) >> s), minlength=BINS)
            if mode == BAND:
                c[BINS - 1] = int((inw & (k > top)).sum())
                c[0] = wcnt[r] - int(c.sum())  # own keys below the band (the window is all keys)
            cs.append(c)
        c = sum(cs)
        if mode == BAND:
            assert int(c[0]) == S - int(c[1:].sum())
        b, above_all, cnt = find(c, need)
        for r in range(CL):
            above[r] += int(cs[r][b + 1:].sum())
            wcnt[r] = int(cs[r][b])
        if mode == BAND and b == 0:
            nlo, nhi = 0, lo - 1
        elif mode == BAND and b == BINS - 1:
            nlo, nhi = top + 1, hi
        else:
            nlo = lo + ((b - off) << s)
            nhi = min(nlo + (1 << s) - 1, top)
        if mode == BAND:  # the band buffers: every lane segment within kmax // CL // 4 entries
            seg = kmax // CL // 4
            lanes = [(torch.arange(b0, e0) % 8) // 2 for b0, e0 in ranges]
            fill = max(int(((k >= lo) & (k <= top) & (ln == j)).sum())
                       for k, ln in zip(own, lanes) for j in range(4))
            st["bufok"] = buffer_on(S, K) and 1 <= b <= BINS - 2 and fill <= seg
        nneed = need - above_all
        st.update(lo=nlo, hi=nhi, need=nneed, cnt=cnt)
        assert sum(above) == K - nneed and sum(wcnt) == cnt
        if cnt == nneed:
            st["done"] = 2
        elif nlo == nhi:
            st["done"] = 1
        else:
            plan(st)
    T, need = st["lo"], st["need"]
    out, base, ties_before = [], 0, 0
    for r, (b, e) in enumerate(ranges):
        k = own[r]
        if st["done"] == 2:
            q, sel = S, above[r] + wcnt[r]
        else:
            q = min(max(need - ties_before, 0), wcnt[r])
            sel = above[r] + q
            ties_before += wcnt[r]
        eq = k == T
        part = torch.nonzero((k > T) | (eq & (torch.cumsum(eq.to(torch.int64), 0) <= q))).flatten()
        assert part.numel() == sel and base == sum(p.numel() for p in out)
        out.append(part + b)
        base += sel
    assert base == K
    return torch.cat(out), passes


def reference(keys, K):
    K = min(max(K, 0), keys.numel())
    order = torch.sort(keys, descending=True, stable=True).indices[:K]
    return torch.sort(order).values


def check(keys, K):
    got, passes = select(keys, K)
    ref = reference(keys, K)
    assert torch.equal(got, ref), f"S={keys.numel()} K={K}: list differs from the exact top-K"
    radix, rpasses = select(keys, K, sample=False)
    assert torch.equal(radix, ref), f"S={keys.numel()} K={K}: list without the sample differs"
    assert rpasses <= MAX_PASSES - 1  # generic passes from the full range + one collect
    for CL, smp in ((2, True), (2, False), (3, True), (4, True), (8, True), (8, False)):
        got, _ = select(keys, K, sample=smp, CL=CL)
        assert torch.equal(got, ref), f"S={keys.numel()} K={K}: a cluster of {CL} differs"
    return passes


def test_float_keys_order():
    x = torch.tensor([float("-inf"), -3.0, -0.0, 0.0, 1e-30, 2.0, float("inf")])
    k = float_keys(x)
    assert (k[1:] >= k[:-1]).all() and k[2] < k[3]
    assert float_keys(torch.tensor([float("nan")]))[0] == k[0]  # NaN ties with -inf


@pytest.mark.parametrize("S", [300, 4096, 5000, 20000])
@pytest.mark.parametrize("frac", [0.05, 0.1, 0.2])
def test_random_scores(S, frac, gen):
    for _ in range(3):
        keys = float_keys(torch.randn(S, generator=gen))
        check(keys, math.ceil(frac * S))


def test_typical_case_takes_band_and_collect(gen):
    """Continuous scores at S = 64k, K = 10% / 5%, also centred on 0 (T_lo and T_hi in different
    top-8-bit bins): the band pass alone, its keys within the list row so that the collect step
    reads them, no fallback (what the kernel's prediction assumes); K = 46% (a band of 8.6% of
    the keys): no buffer, exact lists (the pass count then depends on the boundary bin)."""
    S = 65536
    for frac, on in ((0.1, True), (0.05, True), (0.46, False)):
        K = math.ceil(frac * S)
        assert buffer_on(S, K) == on
        for shift in (0.5, 0.0):
            keys = float_keys(torch.randn(S, generator=gen) * 3.0 + shift)
            for passes in (check(keys, K), select(keys, K, CL=2)[1]):
                assert passes == 1 or not on
    # a score pattern of period 16 (e.g. a frame row width): the hashed sample is not fooled
    x = torch.randn(S, generator=gen)
    x[torch.arange(S) % 16 == 0] += 2.0
    assert check(float_keys(x), S // 10) == 1


def test_band_buffer_overflow_falls_back(gen):
    """A list row too short for the band (kmax = K with a band of ~32 sqrt(K) keys against K / 4
    per lane segment): the collect pass runs, and the list is still exact."""
    S = 65536
    keys = float_keys(torch.randn(S, generator=gen))
    for K in (40, 60):
        assert buffer_on(S, K)
        got, passes = select(keys, K)  # the collect step is a pass (after a generic one where
        assert passes >= 2 and torch.equal(got, reference(keys, K))  # its window is wide)


def test_edge_counts(gen):
    for S in (1, 7, 300, 4096, 9000):
        keys = float_keys(torch.randn(S, generator=gen))
        for K in (0, 1, 2, S - 1, S, S + 5, -3):
            check(keys, K)


@pytest.mark.parametrize("S", [300, 6000])
def test_ties(S, gen):
    """All equal; two values; few distinct values with the boundary inside a run of more than
    CAP equal keys (the collect pass cannot take it: generic passes, then T = one value)."""
    for K in (1, S // 10, S // 2, S - 1):
        check(float_keys(torch.zeros(S)), K)
        two = torch.where(torch.rand(S, generator=gen) < 0.3, 1.0, -1.0)
        check(float_keys(two), K)
        few = torch.randint(0, 5, (S,), generator=gen).float()
        check(float_keys(few), K)


def test_nan_and_inf(gen):
    S = 8192
    x = torch.randn(S, generator=gen)
    x[torch.randperm(S, generator=gen)[:500]] = float("nan")
    x[torch.randperm(S, generator=gen)[:300]] = float("inf")
    x[torch.randperm(S, generator=gen)[:300]] = float("-inf")
    for K in (1, 200, 819, 4000, S - 600, S - 1):
        check(float_keys(x), K)
    check(float_keys(torch.full((S,), float("nan"))), 100)


def test_misleading_samples(gen):
    """The sampled positions scored far above or below the rest: the K-th largest falls below
    T_lo (bin 0) or above the band (bin 255); the fallback passes must still give the exact
    list."""
    S = 16384
    idx = torch.arange(S)
    sampled = torch.zeros(S, dtype=torch.bool)
    sampled[sample_positions(-(-S // STRIDE), S)] = True
    for shift in (10.0, -10.0, 0.3, -0.3):
        x = torch.randn(S, generator=gen)
        x[sampled] += shift
        for K in (S // 20, S // 10, S // 5):
            check(float_keys(x), K)
    # a narrow band of ties around the K-th value, away from the sample's values
    x = torch.randn(S, generator=gen)
    x[~sampled & (idx % 3 == 0)] = 1.25
    check(float_keys(x), S // 10)


def test_pass_bound_worst_cases(gen):
    """Adversarial spreads (scores over many binades, denormals, huge values) stay within the
    kernel's TK_MAX_PASSES (asserted in select)."""
    S = 12000
    x = torch.randn(S, generator=gen) * torch.exp2(torch.randint(-140, 120, (S,), generator=gen)
                                                    .float())
    for K in (1, 3, S // 10, S - 2):
        check(float_keys(x), K)
    y = torch.randn(S, generator=gen)
    y[sample_positions(-(-S // STRIDE), S)] = float("-inf")
    check(float_keys(y), S // 10)
