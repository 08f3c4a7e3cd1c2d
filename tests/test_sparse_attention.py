"""Sparse grouped attention (forward + backward) on every device against the float64 dense
masked-softmax reference of dsv_ext.reference, with the tolerance rule of tests/helpers.py (at
most a small multiple of PyTorch's own error in the same dtype) and the derived bounds beside it.

Each test runs on "cpu" and "cuda" (skipped without a GPU): the CPU kernels in float32 / float64,
the CUDA kernels in bfloat16 / float16. Properties only the CUDA kernels have (backward paths,
key-tile configurations, coherent 64-key blocks, NaN propagation, the deterministic mode) are in
test_sparse_attention_cuda.py, whose test_backward_path also runs the CUDA cases of this file
once per backward path.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import (ATTN_DTYPES, CUDA_TOL, DEVICES, assert_close, assert_pt_bound, attn_bwd,
                     attn_fwd, check_attention, check_close, counts_for, dense_attention_ref,
                     device_cases, device_dtypes, have_ops, import_dsv_ext, index_lists,
                     make_qkv, need_backend, need_ops, random_index)

dsv_ext = import_dsv_ext()

DEVICE_DTYPES = device_dtypes(ATTN_DTYPES)

# Shapes (B, S, H, D, G) per device. CPU: B > 1, S not a multiple of G (partial last group) and
# S a multiple of G, D 16 / 64 / 96 / 128, B*H = 1 (backward through per-thread dk / dv buffers)
# and B*H >= threads (per-(b, h) tasks). CUDA: every head dim (64 / 96 / 128 / 256) with every
# group size (32 / 64 / 128) at S = 3 G + 17 (a partial last group, S not a multiple of the
# 64-key tile, several key tiles).
SHAPES = {
    "cpu": [(2, 45, 3, 16, 8), (2, 37, 2, 64, 16), (1, 50, 2, 96, 7), (2, 33, 2, 128, 32),
            (1, 40, 1, 64, 5)],
    "cuda": [(2, 3 * G + 17, 3, D, G) for D in (64, 96, 128, 256) for G in (32, 64, 128)],
}
# list length kmax as a fraction of S (counts per head in [1, kmax], kmax on the first head; a
# head with count 0, one with count 1 and one with a whole 64-key tile where there are enough)
DENSITY = {"cpu": [0.2, 0.5, 1.0], "cuda": [0.3, 1.0]}
# the strided layouts take turns over the cases (every CPU shape sees each); on CUDA the full
# lists (density 1) take separate contiguous tensors
LAYOUTS = ["packed", "bhsd", "packed_d"]


def _shape_id(c):
    (B, S, H, D, G), density = c
    return f"B{B}_S{S}_H{H}_D{D}_G{G}_k{density:g}"


CASES = device_cases({dev: (ATTN_DTYPES[dev], [(s, d) for s in SHAPES[dev] for d in DENSITY[dev]])
                      for dev in ("cpu", "cuda")}, _shape_id)


def _device_ok(device):
    need_backend(device, "DSV_ATTN_LIB")


@pytest.mark.parametrize("device,dtype,case", CASES)
def test_matches_reference(device, dtype, case, gen):
    _device_ok(device)
    (B, S, H, D, G), density = case
    KM = max(1, round(density * S))
    layout = LAYOUTS[(SHAPES[device].index(case[0]) + DENSITY[device].index(density)) % 3]
    if device == "cuda" and density == 1.0:
        layout = "contiguous"
    q, k, v = make_qkv(B, S, H, D, dtype, layout=layout, generator=gen, device=device)
    if device == "cpu":
        assert not q.is_contiguous() or (layout == "bhsd" and H == 1)  # [B,1,S,D]^T is contiguous
    # unused entries after each count hold arbitrary in-range positions the kernels must ignore
    cnt = counts_for(B, H, KM, gen, zero=True, one=True)
    idx, cnt = index_lists(B, H, S, G, KM, gen, counts=cnt, pad="random")
    check_attention(q, k, v, idx, cnt, G, gen=gen)


LIST_SHAPES = {"cpu": (2, 45, 2, 64, 8), "cuda": (1, 500, 3, 128, 64)}


@pytest.mark.parametrize("kind", ["smooth", "duplicates", "padded"])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_list_kinds(device, dtype, kind, gen):
    """Runs of neighbouring keys, keys listed twice (they count twice), lists shorter than the
    count padded with trailing -1 (the last group without keys, as the query rows that
    dsv_ext.parallel's SCP pads): the kernels trim the padding and agree with the reference,
    which skips those entries."""
    _device_ok(device)
    B, S, H, D, G = LIST_SHAPES[device]
    KM = max(2, S // 3)
    q, k, v = make_qkv(B, S, H, D, dtype, generator=gen, device=device)
    # padded lists: every count is the full length, so the padding is inside every count
    cnt = torch.full((B, H), KM, dtype=torch.int32) if kind == "padded" else None
    idx, cnt = index_lists(B, H, S, G, KM, gen, kind=kind, counts=cnt, pad=-1)
    if kind == "padded" and H > 1:
        idx[:, 1, 1::2] = -1  # and every other group of one head
    check_attention(q, k, v, idx, cnt, G, gen=gen, check_index=kind != "padded")


STRIDED = {"cpu": [(2, 60, 2, 16, 8, 20), (2, 60, 2, 64, 8, 20)],
           "cuda": [(2, 300, 2, 64, 64, 96), (2, 300, 2, 128, 64, 96)]}


@pytest.mark.parametrize("layout", ["packed", "packed_d", "bhsd"])
@pytest.mark.parametrize("device,dtype,case", device_cases(
    {"cpu": ([torch.float32], STRIDED["cpu"]), "cuda": ([torch.bfloat16], STRIDED["cuda"])},
    lambda c: "S{1}_D{3}_G{4}_K{5}".format(*c)))
def test_strided_inputs(device, dtype, case, layout, gen):
    """q, k, v as views with only the last dim contiguous (sequence / head strides of packed
    projections and of [B, H, S, D] tensors), scale 0.7 / sqrt(D)."""
    _device_ok(device)
    B, S, H, D, G, kmax = case
    kv_index, kv_count = random_index(B, H, S, G, kmax, generator=gen)
    q, k, v = make_qkv(B, S, H, D, dtype, layout=layout, generator=gen, device=device)
    check_attention(q, k, v, kv_index, kv_count, G, 0.7 / math.sqrt(D), gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype, gen):
    """Half inputs on the CPU (computed in float32, rounded once; the CUDA kernels' dtypes are
    the device cases of every other test)."""
    need_backend("cpu")
    B, S, H, D, G, KM = 2, 41, 2, 64, 8, 16
    q, k, v = make_qkv(B, S, H, D, dtype, layout="packed", generator=gen)
    idx, cnt = random_index(B, H, S, G, KM, None, generator=gen)
    check_attention(q, k, v, idx, cnt, G, gen=gen)


# (S, G, kmax): one group of size 1 per query, G > S (a single partial group), G = S, a partial
# last group; on CUDA also G = 128 with S just above it and a G that is no power of two
GROUPS = {"cpu": [(29, 1, 7), (29, 64, 7), (29, 29, 7), (30, 4, 7)],
          "cuda": [(5, 32, 5), (130, 128, 130), (70, 17, 33), (29, 1, 7), (30, 4, 7)]}
GROUP_SCALE = {"cpu": 0.37, "cuda": 0.125}


@pytest.mark.parametrize("device,dtype,case", device_cases(
    {dev: (ATTN_DTYPES[dev], GROUPS[dev]) for dev in ("cpu", "cuda")},
    lambda c: "S{}_G{}_K{}".format(*c)))
def test_group_sizes_and_tiny_seq(device, dtype, case, gen):
    _device_ok(device)
    S, G, kmax = case
    D = 16 if device == "cpu" else 64
    q, k, v = make_qkv(2, S, 2, D, dtype, layout="packed_d", generator=gen, device=device)
    idx, cnt = random_index(2, 2, S, G, kmax, None, generator=gen)
    check_attention(q, k, v, idx, cnt, G, scale=GROUP_SCALE[device], gen=gen)


@pytest.mark.parametrize("scale", [-0.2, 0.0, 2.0])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_any_scale(device, dtype, scale, gen):
    """Negative, zero and large scales, forward and backward (the CUDA forward keeps its running
    max on raw scores for a positive scale and on scaled ones for a negative scale)."""
    _device_ok(device)
    B, H, G, D, kmax = (1, 2, 8, 32, 12) if device == "cpu" else (1, 2, 64, 64, 100)
    S = 2 * G + 9
    kv_index, kv_count = random_index(B, H, S, G, kmax, counts=[[kmax, 37 * kmax // 100]],
                                      generator=gen, pad="random")
    q, k, v = make_qkv(B, S, H, D, dtype, generator=gen, device=device)
    check_attention(q, k, v, kv_index, kv_count, G, scale, gen)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_full_index_equals_dense_sdpa(device, dtype, gen):
    """With every key in every list (K = S), sparse attention is dense attention: against the
    float64 dense reference, PyTorch's SDPA in the same dtype being the baseline of the rule."""
    _device_ok(device)
    need_ops(device)
    B, S, H, D, G = (2, 53, 3, 64, 16) if device == "cpu" else (2, 300, 3, 128, 64)
    q, k, v = make_qkv(B, S, H, D, dtype, layout="packed", generator=gen, device=device,
                       requires_grad=True)
    NG = -(-S // G)
    idx = torch.arange(S, dtype=torch.int32, device=device).expand(B, H, NG, S).contiguous()
    cnt = torch.full((B, H), S, dtype=torch.int32, device=device)
    out = dsv_ext.sparse_attention(q, k, v, idx, cnt, G)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2)).transpose(1, 2)
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    want = dense_attention_ref(q64, k64, v64)
    assert_pt_bound("out vs float64 dense", out, want, sdpa, dtype)
    if device == "cpu":
        assert_close(out, want, dtype, "out vs float64 dense")
        # SDPA in the input dtype has its own round-off: compare at the float32 level
        assert_close(out, sdpa, torch.float32 if dtype == torch.float32 else torch.float64,
                     "out vs SDPA")
    else:
        check_close("out vs float64 dense", out, want.detach(), CUDA_TOL[dtype])
    dout = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
    want.backward(dout)
    dout = dout.to(device=device, dtype=dtype)
    g1 = torch.autograd.grad(out, (q, k, v), dout)
    g2 = torch.autograd.grad(sdpa, (q, k, v), dout)
    for name, a, b, r in zip(("dq", "dk", "dv"), g1, g2, (q64.grad, k64.grad, v64.grad)):
        assert_pt_bound(name + " vs float64 dense", a, r, b, dtype)
        if device == "cpu":
            assert_close(a, b, dtype, name + " vs SDPA", grad=True)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_zero_count_head(device, dtype, gen):
    """A head with count 0 gives out = 0, lse = -inf, zero gradients; other heads unaffected."""
    _device_ok(device)
    B, S, H, D, G, KM = (2, 30, 2, 16, 8, 6) if device == "cpu" else (2, 130, 2, 64, 64, 40)
    q, k, v = make_qkv(B, S, H, D, dtype, generator=gen, device=device)
    idx, cnt = random_index(B, H, S, G, KM, [[0, KM], [3, 0]], generator=gen, pad="random")
    check_attention(q, k, v, idx, cnt, G, gen=gen)
    idx, cnt = idx.to(device), cnt.to(device)
    out, lse = attn_fwd(q, k, v, idx, cnt, G, 0.25)
    assert torch.all(out[0, :, 0] == 0) and torch.all(out[1, :, 1] == 0)
    assert torch.all(lse[0, 0] == float("-inf")) and torch.all(lse[1, 1] == float("-inf"))
    assert torch.isfinite(lse[0, 1]).all() and torch.isfinite(lse[1, 0]).all()
    dout = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)
    grads = attn_bwd(dout, q, k, v, out, lse, idx, cnt, G, 0.25)
    if device == "cpu" or have_ops():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        grads = grads + torch.autograd.grad(
            dsv_ext.sparse_attention(qg, kg, vg, idx, cnt, G).sum(), (qg, kg, vg))
    for g_ in grads:
        assert torch.all(g_[0, :, 0] == 0) and torch.all(g_[1, :, 1] == 0)


BAD = {"cpu": (2, 27, 2, 16, 5, 6), "cuda": (1, 200, 4, 64, 32, 80)}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_kernel_guards_on_invalid_index(device, dtype, gen):
    """The raw kernels clamp counts to [0, Kmax], skip entries outside [0, S), take unsorted
    lists and count a key listed twice twice (what the reference's multiplicity weights model).
    The public op reports such input instead; check_index=False passes it through."""
    _device_ok(device)
    B, S, H, D, G, KM = BAD[device]
    q, k, v = make_qkv(B, S, H, D, dtype, generator=gen, device=device)
    # targeted: one kind of bad entry per head
    idx, _ = random_index(B, H, S, G, KM, KM, generator=gen)
    idx = idx.view(B * H, -1, KM)
    idx[0, :, 1] = -7              # out of range: skipped
    idx[1, :, 2] = S + 3           # out of range: skipped
    idx[-2, :, 3] = idx[-2, :, 0]  # duplicate: counts twice
    idx[-1, 2, :] = -1             # a list with no valid entry (group 2 only)
    idx = idx.view(B, H, -1, KM)
    cnt = torch.tensor([KM + 5, 4] + [KM] * (B * H - 4) + [KM, -3],
                       dtype=torch.int32).view(B, H)  # clamped to [0, Kmax]
    check_attention(q, k, v, idx, cnt, G, gen=gen, check_index=False)
    # random: unsorted entries in [-20, S + 20), duplicates, counts outside [0, Kmax]
    ridx = torch.randint(-20, S + 20, idx.shape, generator=gen).to(torch.int32)
    ridx[0, -1, :, 5] = ridx[0, -1, :, 4]
    rcnt = torch.randint(0, KM + 1, (B, H), generator=gen).to(torch.int32)
    rcnt.view(-1)[:2] = torch.tensor([-3, KM + 50])
    check_attention(q, k, v, ridx, rcnt, G, gen=gen, check_index=False)
    if device == "cpu" or have_ops():
        idx, cnt = idx.to(device), cnt.to(device)
        with pytest.raises(ValueError, match="kv_count"):
            dsv_ext.sparse_attention(q, k, v, idx, cnt, G)
        out = dsv_ext.sparse_attention(q, k, v, idx, cnt, G, check_index=False)
        assert not torch.isnan(out).any()


def test_gradcheck_float64(gen):
    need_backend("cpu")
    B, S, H, D, G, KM = 2, 7, 2, 4, 3, 4
    q, k, v = make_qkv(B, S, H, D, torch.float64, layout="packed", generator=gen,
                       requires_grad=True)
    idx, cnt = random_index(B, H, S, G, KM, [[4, 2], [0, 3]], generator=gen)
    assert torch.autograd.gradcheck(
        lambda q_, k_, v_: dsv_ext.sparse_attention(q_, k_, v_, idx, cnt, G, scale=0.8),
        (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("what", ["out", "lse", "dq", "dk", "dv"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_check_can_fail(device, what, gen):
    """check_attention rejects a result with one element off by a small fraction of the
    largest value: 1e-5 in float32 (the rule's bound is a few 1e-6 there, the derived TOL /
    GRAD_TOL allow 2e-5 / 5e-5 plus a relative part), 2^-3 in bfloat16."""
    _device_ok(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    B, S, H, D, G, KM = (2, 45, 2, 64, 8, 20) if device == "cpu" else (1, 150, 2, 64, 64, 80)
    q, k, v = make_qkv(B, S, H, D, dtype, generator=gen, device=device)
    idx, cnt = index_lists(B, H, S, G, KM, gen)
    off = 1e-5 if dtype == torch.float32 else 2.0 ** -3

    def tamper(name, t):
        if name != what:
            return t
        t = t.clone()
        t.view(-1)[t.numel() // 3] += off * max(1.0, t.double().abs().max().item())
        return t

    with pytest.raises(AssertionError, match=what):
        check_attention(q, k, v, idx, cnt, G, gen=gen, tamper=tamper)
