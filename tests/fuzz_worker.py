"""Bad-input and edge-case matrix of every public op and every raw torch.ops.dsv op.

``cases(device, seed)`` builds a seeded list of cases; each is (name, kind, fn):
  kind "reject": fn must raise ValueError / TypeError whose message starts with one of the
                 argument names listed in the case name after "!" (e.g. "sa/q-int32!q");
  kind "accept": fn runs the op on valid (odd) input and checks it against the float64
                 reference itself (NaN patterns included), raising AssertionError on a mismatch;
  kind "raw":    a direct torch.ops.dsv.* call: any Python exception is fine, a crash is not.

Run as a worker: ``python tests/fuzz_worker.py DEVICE SEED FIRST LAST`` runs cases FIRST..LAST-1
and prints one line per case, ``start <i>`` before it and ``<i> <status> <message>`` after it
(flushed), so that the parent (tests/test_fuzz.py) can tell which case killed the process.
tests/sanitizer_driver.py runs the CUDA matrix in-process under compute-sanitizer.
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import dsv_ext  # noqa: E402
from dsv_ext import reference as ref  # noqa: E402

RAW = torch.ops.dsv
NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------------------------
# comparison helpers

def _tol(dtype):
    return {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]


def close(name, got, want, dtype, nan_subset=False):
    """Every element: the NaN patterns agree, infinities agree, finite values within the dtype's
    tolerance (relative to the magnitude of the reference)."""
    got = got.detach().to(torch.float64).cpu()
    want = want.detach().to(torch.float64).cpu()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    gn, wn = torch.isnan(got), torch.isnan(want)
    if not torch.equal(gn, wn):
        bad = (gn != wn).nonzero()[0].tolist()
        raise AssertionError(f"{name}: NaN pattern differs at {bad}: got {got[tuple(bad)]}, want {want[tuple(bad)]}")
    fin = ~wn
    if fin.any():
        g, w = got[fin], want[fin]
        t = _tol(dtype) * max(1.0, float(w[torch.isfinite(w)].abs().max()) if torch.isfinite(w).any() else 1.0)
        inf_ok = torch.equal(torch.isinf(g), torch.isinf(w)) and torch.equal(g[torch.isinf(w)], w[torch.isinf(w)])
        assert inf_ok, f"{name}: infinities differ"
        fw = torch.isfinite(w)
        err = float((g[fw] - w[fw]).abs().max()) if fw.any() else 0.0
        assert err <= t, f"{name}: max error {err:.3g} > {t:.3g}"


def as_dtype(t, dtype):
    """t converted on the CPU (CUDA casts to the unsigned types are not guaranteed), then moved
    back: the case gets a tensor of that dtype on t's device."""
    return t.cpu().to(dtype).to(t.device)


# ---------------------------------------------------------------------------------------------
# float64 references with the kernels' NaN contract (a row is NaN where its softmax is)

def attention_ref(q, k, v, idx, cnt, G, scale, dout):
    """Sparse attention and its gradients in float64, written out per (query, key) pair so that
    only listed pairs take part (a NaN in a key no row lists reaches nothing; torch.where never
    multiplies an unlisted product in): out, dq, dk, dv. Softmax over each row's list, keys
    listed twice count twice, zeros for empty lists; NaN where the row's softmax is NaN."""
    B, S, H, D = q.shape
    qh, kh, vh, gh = (t.detach().to(torch.float64).cpu().permute(0, 2, 1, 3) for t in (q, k, v, dout))
    if S == 0 or B == 0 or H == 0:
        z = torch.zeros(B, S, H, D, dtype=torch.float64)
        return z, z, z, z
    mult = ref._expand_groups(ref.key_multiplicity(idx.cpu(), cnt.cpu(), S), S, G)  # [B, H, S, S]
    L = mult > 0
    L5 = L[..., None]
    s = scale * (qh[:, :, :, None, :] * kh[:, :, None, :, :]).sum(-1)  # [B, H, S, S]
    logit = torch.where(L, s + torch.log(mult.clamp(min=1.0)), torch.full_like(s, -INF))
    p = torch.where(L, torch.softmax(logit, dim=-1), torch.zeros_like(s))
    zero5 = torch.zeros(1, dtype=torch.float64)
    out = torch.where(L5, p[..., None] * vh[:, :, None, :, :], zero5).sum(3)
    dP = torch.where(L, (gh[:, :, :, None, :] * vh[:, :, None, :, :]).sum(-1), torch.zeros_like(s))
    Di = (gh * out).sum(-1, keepdim=True)
    dS = torch.where(L, p * (dP - Di), torch.zeros_like(s))
    dq = scale * torch.where(L5, dS[..., None] * kh[:, :, None, :, :], zero5).sum(3)
    dk = scale * torch.where(L5, dS[..., None] * qh[:, :, :, None, :], zero5).sum(2)
    dv = torch.where(L5, p[..., None] * gh[:, :, :, None, :], zero5).sum(2)
    return tuple(t.permute(0, 2, 1, 3) for t in (out, dq, dk, dv))


def make_act(B, S, H, D, dtype, device, gen, layout="packed"):
    if layout == "packed":
        t = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
    elif layout == "bhsd":  # a [B, H, S, D] buffer viewed as [B, S, H, D]
        t = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64).transpose(1, 2)
    elif layout == "padded":  # every row inside a wider buffer
        t = torch.randn(B, S, H, D + 8, generator=gen, dtype=torch.float64)[..., :D]
    elif layout == "expanded":  # batch broadcast with stride 0
        t = torch.randn(1, S, H, D, generator=gen, dtype=torch.float64).expand(B, S, H, D)
    else:
        raise ValueError(layout)
    return t.to(device=device, dtype=dtype)


class Env:
    def __init__(self, device, seed):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.gen = torch.Generator().manual_seed(seed)
        self.dtypes = [torch.bfloat16, torch.float16] if self.cuda else \
            [torch.float32, torch.float64, torch.float32, torch.bfloat16, torch.float16]
        self.head_dims = [64, 72, 128] if self.cuda else [1, 3, 8, 16]  # 72: run zero-padded

    def ri(self, lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=self.gen))

    def pick(self, xs):
        return xs[self.ri(0, len(xs) - 1)]

    def attn_args(self, B=None, S=None, H=None, D=None, G=None, dtype=None, layout="packed"):
        B = self.ri(1, 2) if B is None else B
        S = self.ri(1, 40) if S is None else S
        H = self.ri(1, 3) if H is None else H
        D = self.pick(self.head_dims) if D is None else D
        G = self.pick([1, 2, 3, 4, 8, 16, 64]) if G is None else G
        dtype = self.pick(self.dtypes) if dtype is None else dtype
        q, k, v = (make_act(B, S, H, D, dtype, self.device, self.gen, layout) for _ in range(3))
        kmax = max(1, min(S, self.ri(1, 12))) if S else 1
        if S:
            idx, cnt = ref.random_index(B, H, S, min(G, S), kmax, generator=self.gen)
        else:
            idx = torch.zeros(B, H, 0, kmax, dtype=torch.int32)
            cnt = torch.zeros(B, H, dtype=torch.int32)
        return dict(q=q, k=k, v=v, kv_index=idx.to(self.device), kv_count=cnt.to(self.device), group_size=G)


# ---------------------------------------------------------------------------------------------
# accepted-input checks

def check_attention(a, scale=None, backward=True, deterministic=None):
    q, k, v = (a[n].detach().clone().requires_grad_(True) for n in "qkv")
    G, idx, cnt = a["group_size"], a["kv_index"], a["kv_count"]
    D = q.shape[3]
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    kw = {} if deterministic is None else {"deterministic": deterministic}
    out = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, scale=scale, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(q.dtype)
    want = attention_ref(q, k, v, idx.to(torch.int64), cnt, int(min(G, max(q.shape[1], 1))), sc, dout)
    close("out", out, want[0], q.dtype)
    if not backward:
        return
    out.backward(dout.to(out.device))
    for n, t, r in (("dq", q, want[1]), ("dk", k, want[2]), ("dv", v, want[3])):
        close(n, t.grad, r, q.dtype)


def check_topk(q_lr, k_lr, cnt, G, kmax=None):
    got = dsv_ext.topk_estimate(q_lr, k_lr, cnt, G, kmax)
    B, S, H, _ = q_lr.shape
    scores = ref.topk_scores_ref(q_lr, k_lr, int(min(G, max(S, 1)))).cpu() if S else None
    c = cnt.to(torch.int64).cpu()
    km = (int(c.max()) if c.numel() else 0) if kmax is None else int(kmax)
    NG = -(-S // int(min(G, max(S, 1)))) if S else 0
    want = torch.full((B, H, NG, km), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            K = min(max(int(c[b, h]), 0), km, S)
            if K == 0 or NG == 0:
                continue
            s = scores[b, h].clone()
            s[torch.isnan(s)] = -INF  # NaN ranks last; ties towards the lower position
            order = torch.sort(-s, dim=-1, stable=True).indices[:, :K]
            want[b, h, :, :K] = order.sort(dim=-1).values.to(torch.int32)
    assert got.dtype == torch.int32 and tuple(got.shape) == tuple(want.shape), f"topk shape {tuple(got.shape)}"
    if not torch.equal(got.cpu(), want):
        # float32 / half scores may order near-ties differently from float64: the chosen keys
        # must then score within tolerance of the reference's
        for b in range(B):
            for h in range(H):
                for g in range(NG):
                    gs, ws = got[b, h, g].cpu(), want[b, h, g]
                    if torch.equal(gs, ws):
                        continue
                    s = scores[b, h, g]
                    a_, w_ = s[gs[gs >= 0].long()].sort().values, s[ws[ws >= 0].long()].sort().values
                    # float32 CPU scores: 1e-4; CUDA scores from half-precision group means: 3e-2
                    tol = 1e-4 if q_lr.dtype in (torch.float32, torch.float64) and not q_lr.is_cuda else 3e-2
                    if torch.isnan(s).any() or (a_ - w_).abs().max() > tol * (1 + s.abs().max()):
                        raise AssertionError(f"topk list ({b}, {h}, {g}) differs: {gs.tolist()} vs {ws.tolist()}")


def check_predictor(q, k, q_lr, k_lr, rows, backward=True, **kw):
    ql = q_lr.detach().clone().requires_grad_(True)
    kl = k_lr.detach().clone().requires_grad_(True)
    got = dsv_ext.predictor_loss(q, k, ql, kl, rows, **kw)
    qr = q_lr.detach().to(torch.float64).requires_grad_(True)
    kr = k_lr.detach().to(torch.float64).requires_grad_(True)
    kw.pop("check_rows", None)
    want = ref.predictor_loss_ref(q, k, qr, kr, rows.to(torch.int64), **kw)
    close("loss", got, want, q.dtype if q.dtype != torch.float32 else torch.float32)
    if backward and torch.isfinite(want).all():
        w = torch.randn(got.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        (got * w.to(got.dtype).to(got.device)).sum().backward()
        (want * w.to(want.device)).sum().backward()
        close("dq_lr", ql.grad, qr.grad, q.dtype)
        close("dk_lr", kl.grad, kr.grad, q.dtype)


def check_profile(q, k, rows, theta, idx=None, cnt=None, G=None):
    got = dsv_ext.profile_attention(q, k, rows, theta, idx, cnt, G)
    B, S, H, D = q.shape
    rows64 = rows.to(torch.int64)
    Gc = None if G is None else int(min(G, max(S, 1)))
    want = ref.profile_ref(q, k, rows64, theta, idx, cnt, Gc)
    # rows whose scores contain NaN / +inf (or are all -inf): NaN for their (b, h)
    qh = q.to(torch.float64).permute(0, 2, 1, 3)[:, :, rows64]
    kh = k.to(torch.float64).permute(0, 2, 1, 3)
    z = qh @ kh.transpose(-1, -2) / math.sqrt(D)
    bad = (torch.isnan(z) | (z == INF)).any(-1) | (z == -INF).all(-1)
    bad = bad.any(-1)
    ws = torch.where(bad, torch.full_like(want.sparsity, NAN), want.sparsity)
    # the size of the critical set is an integer: at float32 a cumulative sum may cross theta
    # one key earlier or later than in float64 -> allow one key of difference per row
    tol = 1.0 / S + 1e-6
    gs = got.sparsity.to(torch.float64).cpu()
    assert torch.equal(torch.isnan(gs), torch.isnan(ws.cpu())), f"sparsity NaN pattern: {gs} vs {ws}"
    fin = ~torch.isnan(gs)
    assert (gs[fin] - ws.cpu()[fin]).abs().max().item() <= tol if fin.any() else True, f"sparsity {gs} vs {ws}"
    if idx is not None:
        wr = torch.where(bad, torch.full_like(want.recall, NAN), want.recall)
        close("recall", got.recall, wr, torch.float32 if q.dtype != torch.float64 else torch.float64)


# ---------------------------------------------------------------------------------------------
# the cases

def cases(device="cpu", seed=0):
    E = Env(device, seed)
    dev = E.device
    C = []

    def rej(name, fn):
        C.append((name, "reject", fn))

    def acc(name, fn):
        C.append((name, "accept", fn))

    def raw(name, fn):
        C.append((name, "raw", fn))

    # ---- sparse_attention -----------------------------------------------------------------
    def sa(a, **kw):
        a = dict(a)
        a.update(kw)
        return lambda: dsv_ext.sparse_attention(**a)

    base = E.attn_args(B=2, S=20, H=2, G=4, D=E.head_dims[-1])
    for n in "qkv":
        rej(f"sa/{n}-int32!{n}", sa(base, **{n: base[n].to(torch.int32)}))
        rej(f"sa/{n}-bool!{n}", sa(base, **{n: base[n] > 0}))
        rej(f"sa/{n}-complex!{n}", sa(base, **{n: base[n].to(torch.float32).to(torch.complex64)}))
        rej(f"sa/{n}-3d!{n}", sa(base, **{n: base[n][0]}))
        rej(f"sa/{n}-5d!{n}", sa(base, **{n: base[n][None]}))
        rej(f"sa/{n}-list!{n}", sa(base, **{n: base[n].tolist()}))
        rej(f"sa/{n}-lastdim-strided!{n}", sa(base, **{n: torch.cat([base[n], base[n]], -1)[..., ::2]}))
    rej("sa/k-shape!k", sa(base, k=base["k"][:, :-1]))
    rej("sa/v-heads!v", sa(base, v=base["v"][:, :, :1]))
    rej("sa/k-dtype-differs!k", sa(base, k=base["k"].to(torch.float64 if base["q"].dtype != torch.float64 else torch.float32)))
    rej("sa/q-headdim0!q", sa(base, q=base["q"][..., :0], k=base["k"][..., :0], v=base["v"][..., :0]))
    idx, cnt = base["kv_index"], base["kv_count"]
    rej("sa/index-float!kv_index", sa(base, kv_index=idx.float()))
    rej("sa/index-double!kv_index", sa(base, kv_index=idx.double()))
    rej("sa/index-bool!kv_index", sa(base, kv_index=idx > 0))
    for ut in (torch.uint16, torch.uint32, torch.uint64):
        rej(f"sa/index-{ut}!kv_index", sa(base, kv_index=as_dtype(idx.to(torch.int64).clamp(min=0), ut)))
        rej(f"sa/count-{ut}!kv_count", sa(base, kv_count=as_dtype(cnt.to(torch.int64), ut)))
    rej("sa/index-2**32+3!kv_index", sa(base, kv_index=idx.to(torch.int64) + 2**32))
    rej("sa/index-negative!kv_index", sa(base, kv_index=torch.full_like(idx, -5)))
    rej("sa/index-S!kv_index", sa(base, kv_index=torch.full_like(idx, 20)))
    rej("sa/index-3d!kv_index", sa(base, kv_index=idx[0]))
    rej("sa/index-groups!kv_index", sa(base, kv_index=idx[:, :, :-1]))
    rej("sa/index-list!kv_index", sa(base, kv_index=idx.tolist()))
    rej("sa/count-negative!kv_count", sa(base, kv_count=torch.full_like(cnt, -1)))
    rej("sa/count-above-kmax!kv_count", sa(base, kv_count=cnt + 100))
    rej("sa/count-2**32+3!kv_count", sa(base, kv_count=cnt.to(torch.int64) + 2**32))
    rej("sa/count-shape!kv_count", sa(base, kv_count=cnt[:1]))
    rej("sa/count-float!kv_count", sa(base, kv_count=cnt.float()))
    for g in (0, -1, -2**63, 2.0, "4", True, None, 4.5):
        rej(f"sa/group_size-{g!r}!group_size", sa(base, group_size=g))
    for g in (2**62, 2**63 - 1, 2**80):  # one group: kv_index of shape [B, H, 4, ...] is wrong
        rej(f"sa/group_size-{g}-shape!kv_index", sa(base, group_size=g))
    for s_ in (NAN, INF, -INF, "x", [1.0]):
        rej(f"sa/scale-{s_!r}!scale", sa(base, scale=s_))
    rej("sa/deterministic-str!deterministic", sa(base, deterministic="yes"))
    rej("sa/deterministic-2!deterministic", sa(base, deterministic=2))
    if E.cuda:
        rej("sa/cuda-float32!q", sa({**base, **{n: base[n].float() for n in "qkv"}}))
        rej("sa/index-on-cpu!kv_index", sa(base, kv_index=idx.cpu()))
    else:
        rej("sa/meta!k", sa(base, k=torch.empty(base["k"].shape, dtype=base["k"].dtype, device="meta")))

    # accepted: odd shapes, layouts, dtypes, int-like arguments, NaN / inf, empty tensors
    for i in range(10):
        a = E.attn_args()
        acc(f"sa/valid-{i}", lambda a=a: check_attention(a))
    for layout in ("bhsd", "padded", "expanded"):
        a = E.attn_args(layout=layout)
        acc(f"sa/layout-{layout}", lambda a=a: check_attention(a))
    a = E.attn_args(S=20, G=4)
    for it in (torch.int64, torch.int16, torch.uint8):
        acc(f"sa/index-{it}", lambda a=a, it=it: check_attention({**a, "kv_index": as_dtype(a["kv_index"].clamp(min=0), it),
                                                                    "kv_count": as_dtype(a["kv_count"], it)}))
    acc("sa/index-noncontig", lambda a=a: check_attention({**a, "kv_index": torch.stack([a["kv_index"]] * 2, -1)[..., 0]}))
    acc("sa/group_size-np", lambda a=a: check_attention({**a, "group_size": np.int64(4)}))
    acc("sa/scale-np", lambda a=a: check_attention(a, scale=np.float32(0.3)))
    acc("sa/deterministic", lambda a=a: check_attention(a, deterministic=True))
    for g in (2**62, 2**63 - 1, 2**80):
        a1 = E.attn_args(S=20, G=20)
        acc(f"sa/group_size-{g}", lambda a1=a1, g=g: check_attention({**a1, "group_size": g}))
    for where in ("q", "k", "v"):
        for val in ((NAN, INF, -INF) if where != "v" else (NAN,)):
            a = E.attn_args(S=24, G=4, H=2)
            t = a[where].clone()
            t[0, E.ri(0, 23), E.ri(0, 1), 0] = val
            acc(f"sa/{where}-{val}", lambda a=a, where=where, t=t: check_attention({**a, where: t}))
    a = E.attn_args(S=24, G=4, H=2)
    a["q"] = a["q"].clone()
    a["q"][0, 5, 0, :] = INF  # scores of +-inf and NaN (inf * 0 never: randn is nonzero)
    acc("sa/q-row-inf", lambda a=a: check_attention(a))
    for shape in ((0, 8, 2), (2, 0, 2), (2, 8, 0), (0, 0, 0)):
        a = E.attn_args(B=shape[0], S=shape[1], H=shape[2], G=4)
        acc(f"sa/empty-{shape}", lambda a=a: check_attention(a))
    def unchecked(a):
        bad = a["kv_index"].clone()
        bad[..., ::2] = torch.randint(-50, 50, bad[..., ::2].shape, generator=E.gen).to(bad.dtype).to(bad.device)
        bad[0, 0, 0, :] = 40  # a list with no valid entry
        q, k, v = (a[n].detach().clone().requires_grad_(True) for n in "qkv")
        out = dsv_ext.sparse_attention(q, k, v, bad, a["kv_count"], a["group_size"], check_index=False)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(out.dtype)
        want = attention_ref(q, k, v, bad.long(), a["kv_count"], a["group_size"], 1 / math.sqrt(q.shape[3]), dout)
        close("out", out, want[0], q.dtype)
        out.backward(dout.to(out.device))
        for n, t, r in (("dq", q, want[1]), ("dk", k, want[2]), ("dv", v, want[3])):
            close(n, t.grad, r, q.dtype)
    for i in range(2):
        a = E.attn_args(S=24, G=4)
        acc(f"sa/check_index-false-{i}", lambda a=a: unchecked(a))
    a = E.attn_args(S=16, G=4)
    acc("sa/counts-zero", lambda a=a: check_attention({**a, "kv_count": torch.zeros_like(a["kv_count"])}))
    acc("sa/kmax-zero", lambda a=a: check_attention({**a, "kv_index": a["kv_index"][..., :0],
                                                      "kv_count": torch.zeros_like(a["kv_count"])}))

    # ---- topk_estimate ----------------------------------------------------------------------
    R = 16 if E.cuda else 4
    tdt = E.dtypes[0]
    ql, kl = (make_act(2, 20, 2, R, tdt, dev, E.gen) for _ in range(2))
    tc = torch.tensor([[3, 5], [0, 7]], dtype=torch.int32, device=dev)

    def tk(**kw):
        a = dict(q_lr=ql, k_lr=kl, kv_count=tc, group_size=4)
        a.update(kw)
        return lambda: dsv_ext.topk_estimate(**a)

    rej("tk/q_lr-int!q_lr", tk(q_lr=ql.to(torch.int32)))
    rej("tk/k_lr-shape!k_lr", tk(k_lr=kl[:, :5]))
    rej("tk/q_lr-3d!q_lr", tk(q_lr=ql[0]))
    rej("tk/count-float!kv_count", tk(kv_count=tc.float()))
    rej("tk/count-uint64!kv_count", tk(kv_count=as_dtype(tc.to(torch.int64), torch.uint64)))
    rej("tk/count-negative!kv_count", tk(kv_count=-tc - 1))
    rej("tk/count-above-S!kv_count", tk(kv_count=tc + 50))
    if not E.cuda:
        rej("tk/count-negative-kmax!kv_count", tk(kv_count=-tc - 1, kmax=8))
        rej("tk/count-above-kmax!kv_count", tk(kv_count=tc, kmax=4))
    for km in (-1, 21, 2**62, 2**70):
        rej(f"tk/kmax-{km}!kmax", tk(kmax=km))
    for km in (2.0, "8", True):
        rej(f"tk/kmax-{km!r}!kmax", tk(kmax=km))
    for g in (0, -3, 1.5, False):
        rej(f"tk/group_size-{g!r}!group_size", tk(group_size=g))
    acc("tk/valid", lambda: check_topk(ql, kl, tc, 4))
    acc("tk/kmax-np", lambda: check_topk(ql, kl, tc, 4, np.int32(9)))
    acc("tk/group-huge", lambda: check_topk(ql, kl, tc, 2**62, 7))
    acc("tk/group-np", lambda: check_topk(ql, kl, tc, np.int64(3)))
    acc("tk/count-int64", lambda: check_topk(ql, kl, tc.to(torch.int64), 4))
    acc("tk/noncontig", lambda: check_topk(make_act(2, 20, 2, R, tdt, dev, E.gen, "bhsd"),
                                           make_act(2, 20, 2, R, tdt, dev, E.gen, "padded"), tc, 5))
    for val in (NAN, INF):
        qn = ql.clone()
        qn[0, 3, 1, 0] = val
        kn = kl.clone()
        kn[1, 7, 0, 1] = val
        acc(f"tk/nan-{val}", lambda qn=qn, kn=kn: check_topk(qn, kn, tc, 4))
    for shape in ((0, 20, 2), (2, 0, 2), (2, 20, 0)):
        B_, S_, H_ = shape
        acc(f"tk/empty-{shape}", lambda B_=B_, S_=S_, H_=H_: check_topk(
            make_act(B_, S_, H_, R, tdt, dev, E.gen), make_act(B_, S_, H_, R, tdt, dev, E.gen),
            torch.zeros(B_, H_, dtype=torch.int32, device=dev), 4, 0 if S_ == 0 else None))

    # ---- predictor_loss ---------------------------------------------------------------------
    Dp = E.head_dims[-1]
    pq, pk = (make_act(2, 20, 2, Dp, tdt, dev, E.gen) for _ in range(2))
    pql, pkl = (make_act(2, 20, 2, R, tdt, dev, E.gen) for _ in range(2))
    rows = torch.tensor([0, 5, 19, 5], device=dev)

    def pl(**kw):
        a = dict(q=pq, k=pk, q_lr=pql, k_lr=pkl, rows=rows)
        a.update(kw)
        return lambda: dsv_ext.predictor_loss(**a)

    rej("pl/rows-float!rows", pl(rows=rows.float()))
    rej("pl/rows-uint64!rows", pl(rows=as_dtype(rows, torch.uint64)))
    rej("pl/rows-2**32!rows", pl(rows=rows + 2**32))
    rej("pl/rows-negative!rows", pl(rows=rows - 10))
    rej("pl/rows-2d!rows", pl(rows=rows[None]))
    rej("pl/rows-empty!rows", pl(rows=rows[:0]))
    rej("pl/rows-list!rows", pl(rows=[0, 1]))
    rej("pl/q_lr-shape!q_lr", pl(q_lr=pql[:, :3]))
    rej("pl/k_lr-rank!k_lr", pl(k_lr=pkl[..., :2]))
    rej("pl/k-dtype!k", pl(k=pk.to(torch.int32)))
    for w in (NAN, INF, "x", None, True):
        rej(f"pl/cos_weight-{w!r}!cos_weight", pl(cos_weight=w))
        rej(f"pl/norm_weight-{w!r}!norm_weight", pl(norm_weight=w))
    rej("pl/scale-nan!scale", pl(scale=NAN))
    acc("pl/valid", lambda: check_predictor(pq, pk, pql, pkl, rows))
    acc("pl/rows-int16", lambda: check_predictor(pq, pk, pql, pkl, rows.to(torch.int16)))
    acc("pl/weights-np", lambda: check_predictor(pq, pk, pql, pkl, rows, cos_weight=np.float64(0.5),
                                                 norm_weight=np.float32(0.25)))
    acc("pl/noncontig", lambda: check_predictor(make_act(2, 20, 2, Dp, tdt, dev, E.gen, "bhsd"), pk,
                                                make_act(2, 20, 2, R, tdt, dev, E.gen, "padded"), pkl, rows))

    def pl_unchecked():
        bad = torch.tensor([0, 25], device=dev)
        loss = dsv_ext.predictor_loss(pq, pk, pql, pkl, bad, check_rows=False)
        assert torch.isnan(loss).all(), f"a row outside [0, S) must give NaN, got {loss}"
    acc("pl/rows-unchecked-out-of-range", pl_unchecked)
    for val in (NAN, INF):
        qn = pq.clone()
        qn[1, 5, 0, 0] = val
        acc(f"pl/q-{val}", lambda qn=qn: check_predictor(qn, pk, pql, pkl, rows))
        kln = pkl.clone()
        kln[0, 2, 1, 0] = val
        acc(f"pl/k_lr-{val}", lambda kln=kln: check_predictor(pq, pk, pql, kln, rows))
    for shape in ((0, 20, 2), (2, 20, 0)):
        B_, S_, H_ = shape
        acc(f"pl/empty-{shape}", lambda B_=B_, S_=S_, H_=H_: check_predictor(
            make_act(B_, S_, H_, Dp, tdt, dev, E.gen), make_act(B_, S_, H_, Dp, tdt, dev, E.gen),
            make_act(B_, S_, H_, R, tdt, dev, E.gen), make_act(B_, S_, H_, R, tdt, dev, E.gen), rows))

    # ---- profile_attention ------------------------------------------------------------------
    pidx, pcnt = ref.random_index(2, 2, 20, 4, 6, generator=E.gen)
    pidx, pcnt = pidx.to(dev), pcnt.to(dev)

    def pa(**kw):
        a = dict(q=pq, k=pk, rows=rows, theta=0.9)
        a.update(kw)
        return lambda: dsv_ext.profile_attention(**a)

    for th in (0.0, -0.5, 1.5, NAN, INF, "x", None, True):
        rej(f"pa/theta-{th!r}!theta", pa(theta=th))
    rej("pa/rows-float!rows", pa(rows=rows.double()))
    rej("pa/rows-uint32!rows", pa(rows=as_dtype(rows, torch.uint32)))
    rej("pa/rows-S!rows", pa(rows=rows + 20))
    rej("pa/index-partial!kv_index", pa(kv_index=pidx))
    rej("pa/index-uint64!kv_index", pa(kv_index=as_dtype(pidx.to(torch.int64).clamp(min=0), torch.uint64),
                                       kv_count=pcnt, group_size=4))
    rej("pa/count-negative!kv_count", pa(kv_index=pidx, kv_count=-pcnt - 1, group_size=4))
    rej("pa/group_size-0!group_size", pa(kv_index=pidx, kv_count=pcnt, group_size=0))
    rej("pa/k-shape!k", pa(k=pk[:, :4]))
    rej("pa/scale-nan!scale", pa(scale=NAN))
    rej("pa/scale-str!scale", pa(scale="0.1"))
    acc("pa/valid", lambda: check_profile(pq, pk, rows, 0.9))
    acc("pa/valid-index", lambda: check_profile(pq, pk, rows, 0.5, pidx, pcnt, 4))
    acc("pa/index-group-np", lambda: check_profile(pq, pk, rows, np.float32(0.75), pidx, pcnt, np.int64(4)))
    for shape in ((0, 20, 2), (2, 20, 0)):
        B_, S_, H_ = shape
        acc(f"pa/empty-{shape}", lambda B_=B_, S_=S_, H_=H_: check_profile(
            make_act(B_, S_, H_, Dp, tdt, dev, E.gen), make_act(B_, S_, H_, Dp, tdt, dev, E.gen), rows, 0.9))
    for val in (NAN, INF, -INF):
        qn = pq.clone()
        qn[1, 5, 0, 0] = val
        acc(f"pa/q-{val}", lambda qn=qn: check_profile(qn, pk, rows, 0.9, pidx, pcnt, 4))
        kn = pk.clone()
        kn[0, 3, 1, 1] = val
        acc(f"pa/k-{val}", lambda kn=kn: check_profile(pq, kn, rows, 0.9))

    # ---- gather_rows / scatter_add_rows -----------------------------------------------------
    src = torch.randn(10, 6, generator=E.gen).to(device=dev, dtype=tdt)
    gi = torch.tensor([3, 0, 9, 3], device=dev)

    def gr(s=src, i=gi, **kw):
        return lambda: dsv_ext.gather_rows(s, i, **kw)

    def sc(s=src[:4], i=gi, n=10, **kw):
        return lambda: dsv_ext.scatter_add_rows(s, i, n, **kw)

    for f, nm in ((gr, "gr"), (sc, "sc")):
        rej(f"{nm}/index-float!index", f(i=gi.float()))
        rej(f"{nm}/index-uint64!index", f(i=as_dtype(gi, torch.uint64)))
        rej(f"{nm}/index-uint32!index", f(i=as_dtype(gi, torch.uint32)))
        rej(f"{nm}/index-bool!index", f(i=gi > 2))
        rej(f"{nm}/index-2d!index", f(i=gi[None]))
        rej(f"{nm}/index-negative!index", f(i=gi - 5))
        rej(f"{nm}/index-big!index", f(i=gi + 2**40))
        rej(f"{nm}/index-list!index", f(i=[0, 1, 2, 3]))
        rej(f"{nm}/src-int!src", f(s=src[:4].to(torch.int32)))
        rej(f"{nm}/src-3d!src", f(s=src[None, :4]))
        rej(f"{nm}/src-strided!src", f(s=torch.cat([src[:4]] * 2, 1)[:, ::2]))
    for n in (-1, 2**62, 2**80, 2.0, "10", True, None):
        rej(f"sc/num_rows-{n!r}!num_rows", sc(n=n))
    rej("sc/index-length!index", sc(i=gi[:3]))

    def check_gather(s, i):
        sg = s.detach().clone().requires_grad_(True)
        out = dsv_ext.gather_rows(sg, i)
        close("gather", out, ref.gather_rows_ref(s, i), s.dtype)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        (out * w.to(out.dtype).to(out.device)).sum().backward()
        close("gather grad", sg.grad, ref.scatter_add_rows_ref(w.to(s.device), i, s.shape[0]), s.dtype)

    def check_scatter(s, i, n):
        sg = s.detach().clone().requires_grad_(True)
        out = dsv_ext.scatter_add_rows(sg, i, n)
        close("scatter", out, ref.scatter_add_rows_ref(s, i, int(n)), s.dtype)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
        (out * w.to(out.dtype).to(out.device)).sum().backward()
        close("scatter grad", sg.grad, ref.gather_rows_ref(w.to(s.device), i), s.dtype)

    acc("gr/valid", lambda: check_gather(src, gi))
    acc("gr/int32-index", lambda: check_gather(src, gi.to(torch.int32)))
    acc("gr/strided-rows", lambda: check_gather(torch.cat([src, src], 1)[:, :6], gi))
    acc("gr/expanded", lambda: check_gather(src[:1].expand(10, 6), gi))
    acc("gr/empty-index", lambda: check_gather(src, gi[:0]))
    acc("gr/empty-src", lambda: check_gather(src[:0], gi[:0]))
    acc("gr/zero-dim", lambda: check_gather(src[:, :0], gi))
    nsrc = src.clone()
    nsrc[3, 2] = NAN
    nsrc[0, 1] = INF
    acc("gr/nan", lambda: check_gather(nsrc, gi))
    acc("sc/valid", lambda: check_scatter(src[:4], gi, 10))

    def unchecked_rows():
        bi = torch.tensor([3, -1, 12, 2**40], device=dev)
        close("gather", dsv_ext.gather_rows(src, bi, check_index=False), ref.gather_rows_ref(src, bi), src.dtype)
        close("scatter", dsv_ext.scatter_add_rows(src[:4], bi, 10, check_index=False),
              ref.scatter_add_rows_ref(src[:4], bi, 10), src.dtype)
    acc("gr/check_index-false", unchecked_rows)
    acc("sc/num_rows-np", lambda: check_scatter(src[:4], gi, np.int64(12)))
    acc("sc/empty", lambda: check_scatter(src[:0], gi[:0], 0))
    acc("sc/nan", lambda: check_scatter(nsrc[:4], gi, 10))

    # ---- raw ops: any exception, never a crash ----------------------------------------------
    a = E.attn_args(B=1, S=20, H=1, G=4)
    q, k, v, idx, cnt = a["q"], a["k"], a["v"], a["kv_index"], a["kv_count"]
    q = q if not E.cuda else q.to(torch.bfloat16)
    k, v = k.to(q.dtype), v.to(q.dtype)
    sc_ = 0.3
    for g in (-1, 0, 1, 2**31, 2**62, 2**63 - 1, -2**63):
        raw(f"raw/fwd-group-{g}", lambda g=g: RAW.sparse_attention_fwd(q, k, v, idx, cnt, g, sc_))
    big = torch.full_like(idx, 2**31 - 1)
    raw("raw/fwd-index-big", lambda: RAW.sparse_attention_fwd(q, k, v, big, cnt, 4, sc_))
    raw("raw/fwd-index-neg", lambda: RAW.sparse_attention_fwd(q, k, v, -big - 1, cnt, 4, sc_))
    raw("raw/fwd-count-big", lambda: RAW.sparse_attention_fwd(q, k, v, idx, cnt + 2**30, 4, sc_))
    raw("raw/fwd-count-int64", lambda: RAW.sparse_attention_fwd(q, k, v, idx, cnt.long(), 4, sc_))
    raw("raw/fwd-index-int64", lambda: RAW.sparse_attention_fwd(q, k, v, idx.long(), cnt, 4, sc_))
    raw("raw/fwd-index-shape", lambda: RAW.sparse_attention_fwd(q, k, v, idx[:, :, :2], cnt, 4, sc_))
    raw("raw/fwd-index-noncontig", lambda: RAW.sparse_attention_fwd(q, k, v, torch.cat([idx] * 2, -1)[..., ::2], cnt, 4, sc_))
    raw("raw/fwd-q-int", lambda: RAW.sparse_attention_fwd(q.to(torch.int32), k, v, idx, cnt, 4, sc_))
    raw("raw/fwd-k-shape", lambda: RAW.sparse_attention_fwd(q, k[:, :3], v, idx, cnt, 4, sc_))
    raw("raw/fwd-scale-nan", lambda: RAW.sparse_attention_fwd(q, k, v, idx, cnt, 4, NAN))
    raw("raw/fwd-neg-stride", lambda: RAW.sparse_attention_fwd(q, k.flip(1), v, idx, cnt, 4, sc_))
    raw("raw/fwd-lastdim", lambda: RAW.sparse_attention_fwd(q, torch.cat([k, k], -1)[..., ::2], v, idx, cnt, 4, sc_))
    raw("raw/fwd-deterministic", lambda: RAW.sparse_attention_fwd(q, k, v, idx, cnt, 4, sc_, True))

    def raw_bwd(**kw):
        out, lse = RAW.sparse_attention_fwd(q, k, v, idx, cnt, 4, sc_)
        args = dict(dout=torch.ones_like(out), q=q, k=k, v=v, out=out, lse=lse, kv_index=idx,
                    kv_count=cnt, group_size=4, scale=sc_)
        args.update(kw)
        return RAW.sparse_attention_bwd(*args.values())
    raw("raw/bwd-lse-shape", lambda: raw_bwd(lse=torch.zeros(1, 1, 3, device=dev)))
    raw("raw/bwd-lse-dtype", lambda: raw_bwd(lse=torch.zeros(1, 1, 20, device=dev, dtype=torch.float16)))
    raw("raw/bwd-lse-nan", lambda: raw_bwd(lse=torch.full((1, 1, 20), NAN, device=dev)))
    raw("raw/bwd-dout-shape", lambda: raw_bwd(dout=torch.ones(1, 2, 1, q.shape[3], device=dev, dtype=q.dtype)))
    raw("raw/bwd-group-huge", lambda: raw_bwd(group_size=2**63 - 1))
    raw("raw/bwd-group-neg", lambda: raw_bwd(group_size=-4))
    rq, rk = ql[:1], kl[:1]
    rc = tc[:1]
    for km in (-1, 0, 21, 2**40):
        raw(f"raw/topk-kmax-{km}", lambda km=km: RAW.topk_estimate(rq, rk, rc, 4, km))
    for g in (-1, 0, 2**62, 2**63 - 1):
        raw(f"raw/topk-group-{g}", lambda g=g: RAW.topk_estimate(rq, rk, rc, g, 5))
    raw("raw/topk-count-int64", lambda: RAW.topk_estimate(rq, rk, rc.long(), 4, 5))
    raw("raw/topk-count-neg", lambda: RAW.topk_estimate(rq, rk, -rc - 100, 4, 5))
    r32 = rows.to(torch.int32)
    raw("raw/pl-rows-int64", lambda: RAW.predictor_loss_fwd(pq, pk, pql, pkl, rows, 0.1, 0.9, 0.1))
    raw("raw/pl-rows-big", lambda: RAW.predictor_loss_fwd(pq, pk, pql, pkl, r32 + 2**30, 0.1, 0.9, 0.1))
    raw("raw/pl-rows-neg", lambda: RAW.predictor_loss_fwd(pq, pk, pql, pkl, r32 - 2**30, 0.1, 0.9, 0.1))
    raw("raw/pl-bwd-stats-shape", lambda: RAW.predictor_loss_bwd(torch.ones(2, 2, device=dev), pq, pk, pql, pkl, r32,
                                                                 torch.zeros(2, 2, 1, 3, device=dev), 0.1, 0.9, 0.1))
    raw("raw/pl-bwd-rows-big", lambda: RAW.predictor_loss_bwd(torch.ones(2, 2, device=dev), pq, pk, pql, pkl,
                                                              r32 + 2**30, torch.zeros(2, 2, 4, 3, device=dev),
                                                              0.1, 0.9, 0.1))
    raw("raw/pa-theta-0", lambda: RAW.profile_attention(pq, pk, r32, 0.0, 0.1, None, None, 1))
    raw("raw/pa-rows-big", lambda: RAW.profile_attention(pq, pk, r32 + 2**30, 0.9, 0.1, None, None, 1))
    raw("raw/pa-index-only", lambda: RAW.profile_attention(pq, pk, r32, 0.9, 0.1, pidx, None, 4))
    raw("raw/pa-group-huge", lambda: RAW.profile_attention(pq, pk, r32, 0.9, 0.1, pidx, pcnt, 2**63 - 1))
    raw("raw/pa-group-neg", lambda: RAW.profile_attention(pq, pk, r32, 0.9, 0.1, pidx, pcnt, -1))
    raw("raw/pa-index-big", lambda: RAW.profile_attention(pq, pk, r32, 0.9, 0.1, pidx + 2**30, pcnt + 2**30, 4))
    raw("raw/gr-index-big", lambda: RAW.gather_rows(src, gi + 2**62))
    raw("raw/gr-index-int32", lambda: RAW.gather_rows(src, gi.to(torch.int32)))
    raw("raw/gr-neg-stride", lambda: RAW.gather_rows(src.flip(0), gi))
    raw("raw/sc-num_rows-neg", lambda: RAW.scatter_add_rows(src[:4], gi, -1))
    raw("raw/sc-num_rows-huge", lambda: RAW.scatter_add_rows(src[:4], gi, 2**62))
    raw("raw/sc-index-big", lambda: RAW.scatter_add_rows(src[:4], gi - 2**62, 10))
    raw("raw/sc-index-length", lambda: RAW.scatter_add_rows(src[:4], gi[:2], 10))
    return C


def run_case(case):
    """(status, message): ok / wrong-error / no-error / mismatch / error."""
    name, kind, fn = case
    try:
        fn()
        if kind == "reject":
            return "no-error", "accepted bad input"
        return "ok", ""
    except (ValueError, TypeError) as e:
        msg = str(e)
        if kind == "reject":
            names = name.split("!", 1)[1].split(",")
            if any(msg.startswith(n) and msg[len(n):len(n) + 1] in (":", " ", ",") for n in names):
                return "ok", msg.splitlines()[0][:100]
            return "wrong-error", f"{type(e).__name__}: {msg.splitlines()[0][:200]}"
        if kind == "raw":
            return "ok", msg.splitlines()[0][:100] if msg else ""
        return "error", f"{type(e).__name__}: {msg.splitlines()[0][:200]}"
    except AssertionError as e:
        return "mismatch", str(e)[:300]
    except Exception as e:  # noqa: BLE001 - RuntimeError of a raw op is fine, elsewhere not
        if kind == "raw":
            return "ok", f"{type(e).__name__}"
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def main(argv):
    device, seed, first, last = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    cs = cases(device, seed)
    last = min(last, len(cs))
    for i in range(first, last):
        print(f"start {i}", flush=True)
        status, msg = run_case(cs[i])
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"{i} {status} {cs[i][0]} | {msg}".replace("\n", " "), flush=True)
    print(f"done {len(cs)}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    main(sys.argv[1:])
