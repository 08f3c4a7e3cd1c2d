"""Tensors on different devices: every public op raises a ValueError that names the argument
that is not on q's (or src's) device; every raw op (torch.ops.dsv.*) raises a RuntimeError
naming it, whichever dispatch key (CPU or CUDA) the dispatcher picked from the mix.

On a machine without a GPU the public functions are checked with "meta" as the other device;
the raw-op and CUDA cases run where a GPU and the CUDA kernels are present."""
import re

import pytest
import torch

import dsv_ext
from dsv_ext.reference import make_qkv, random_index

# D = 64: a head dim the CUDA attention kernels take (64, 96, 128, 256)
B, S, H, D, G, KM, R = 2, 24, 2, 64, 4, 6, 4


def _inputs(device, dtype):
    g = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(B, S, H, D, dtype, generator=g)
    ql, kl = make_qkv(B, S, H, R, dtype, generator=g, n=2)
    idx, cnt = random_index(B, H, S, G, KM, KM - 2, generator=g)
    rows = torch.tensor([0, 9, 23], dtype=torch.int32)
    src, index = torch.randn(7, 8, generator=g).to(dtype), torch.tensor([0, 6, 2, 2])
    x = dict(q=q, k=k, v=v, q_lr=ql, k_lr=kl, kv_index=idx, kv_count=cnt, rows=rows, src=src, index=index)
    return {name: t.to(device) for name, t in x.items()}


# (op, the tensor arguments, the argument every other one must share the device with)
PUBLIC = [
    ("sparse_attention", ("q", "k", "v", "kv_index", "kv_count"), "q"),
    ("topk_estimate", ("q_lr", "k_lr", "kv_count"), "q_lr"),
    ("predictor_loss", ("q", "k", "q_lr", "k_lr", "rows"), "q"),
    ("profile_attention", ("q", "k", "rows", "kv_index", "kv_count"), "q"),
    ("gather_rows", ("src", "index"), "src"),
    ("scatter_add_rows", ("src", "index"), "src"),
]
PUBLIC_CASES = [(op, name, ref) for op, names, ref in PUBLIC for name in names]
EXTRA = dict(sparse_attention=dict(group_size=G), topk_estimate=dict(group_size=G, kmax=KM),
             profile_attention=dict(group_size=G), scatter_add_rows=dict(num_rows=7))


def _call_public(op, x, names):
    args = {n: x[n] for n in names}
    if op == "scatter_add_rows":  # one row of src per index entry
        args["src"] = args["src"][:len(x["index"])]
    return getattr(dsv_ext, op)(**args, **EXTRA.get(op, {}))


def _check_public(op, names, ref, moved, x, other):
    """Move argument `moved` to device `other`: the error names it (or, when `moved` is the
    reference, the first argument checked against it)."""
    x = dict(x, **{moved: x[moved].to(other)})
    with pytest.raises(ValueError) as info:
        _call_public(op, x, names)
    msg = str(info.value)
    if moved == ref:
        named = names[1] if names[0] == ref else names[0]
        assert msg.startswith(f"{named}: on "), msg
        assert f"but {ref} is on {other}" in msg, msg
    else:  # k_lr is compared with q_lr, the others with the reference
        assert re.match(rf"{moved}: on {x[moved].device}, but \w+ is on {x[ref].device}", msg), msg


@pytest.mark.parametrize("op,moved,ref", PUBLIC_CASES, ids=[f"{c[0]}-{c[1]}" for c in PUBLIC_CASES])
def test_public_ops_name_the_argument_on_another_device(op, moved, ref):
    names = dict((o, n) for o, n, _ in PUBLIC)[op]
    x = _inputs("cpu", torch.float32)
    _call_public(op, x, names)  # the unmodified inputs are accepted
    _check_public(op, names, ref, moved, x, "meta")


# ---------------------------------------------------------------------------------------------
# CUDA: the public functions, and the raw ops, whose CUDA implementation receives the mix

def _need_cuda_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not dsv_ext.has_cuda_kernels():
        pytest.skip("needs a CUDA build of dsv_ext")


@pytest.mark.cuda
@pytest.mark.parametrize("op,moved,ref", PUBLIC_CASES, ids=[f"{c[0]}-{c[1]}" for c in PUBLIC_CASES])
def test_public_ops_cuda_with_a_cpu_argument(op, moved, ref):
    _need_cuda_kernels()
    names = dict((o, n) for o, n, _ in PUBLIC)[op]
    x = _inputs("cuda", torch.bfloat16)
    _call_public(op, x, names)
    _check_public(op, names, ref, moved, x, "cpu")


def _raw_args(x):
    """The arguments of every raw op, on x's device (bfloat16 activations)."""
    with torch.no_grad():
        out, lse = torch.ops.dsv.sparse_attention_fwd(x["q"], x["k"], x["v"], x["kv_index"], x["kv_count"], G, 0.25)
        loss, stats = torch.ops.dsv.predictor_loss_fwd(x["q"], x["k"], x["q_lr"], x["k_lr"], x["rows"],
                                                       0.25, 0.95, 0.05)
    return {
        "sparse_attention_fwd": dict(q=x["q"], k=x["k"], v=x["v"], kv_index=x["kv_index"], kv_count=x["kv_count"],
                                     group_size=G, scale=0.25),
        "sparse_attention_bwd": dict(dout=torch.randn_like(out), q=x["q"], k=x["k"], v=x["v"], out=out, lse=lse,
                                     kv_index=x["kv_index"], kv_count=x["kv_count"], group_size=G, scale=0.25),
        "topk_estimate": dict(q_lr=x["q_lr"], k_lr=x["k_lr"], kv_count=x["kv_count"], group_size=G, kmax=KM),
        "predictor_loss_fwd": dict(q=x["q"], k=x["k"], q_lr=x["q_lr"], k_lr=x["k_lr"], rows=x["rows"], scale=0.25,
                                   cos_weight=0.95, norm_weight=0.05),
        "predictor_loss_bwd": dict(dloss=torch.ones_like(loss), q=x["q"], k=x["k"], q_lr=x["q_lr"], k_lr=x["k_lr"],
                                   rows=x["rows"], row_stats=stats, scale=0.25, cos_weight=0.95, norm_weight=0.05),
        "profile_attention": dict(q=x["q"], k=x["k"], rows=x["rows"], theta=0.9, scale=0.25,
                                  kv_index=x["kv_index"], kv_count=x["kv_count"], group_size=G),
        "gather_rows": dict(src=x["src"], index=x["index"]),
        "scatter_add_rows": dict(src=x["src"][:4], index=x["index"], num_rows=7),
    }


RAW_REF = dict(topk_estimate="q_lr", gather_rows="src", scatter_add_rows="src")


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["sparse_attention_fwd", "sparse_attention_bwd", "topk_estimate",
                                "predictor_loss_fwd", "predictor_loss_bwd", "profile_attention",
                                "gather_rows", "scatter_add_rows"])
def test_raw_ops_cuda_with_a_cpu_argument(op):
    """Each tensor argument in turn on the CPU, the others on the GPU: the CUDA implementation
    runs (CUDA is dispatched before CPU) and refuses the mix, naming the argument."""
    _need_cuda_kernels()
    args = _raw_args(_inputs("cuda", torch.bfloat16))[op]
    getattr(torch.ops.dsv, op)(**args)  # the unmodified arguments are accepted
    ref = RAW_REF.get(op, "q")
    tensors = [n for n, a in args.items() if isinstance(a, torch.Tensor)]
    # with the reference itself on the CPU, the first argument compared with it is named
    first = next(n for n in tensors if n not in (ref, "dout", "dloss"))
    for moved in tensors:
        mixed = dict(args, **{moved: args[moved].cpu()})
        with pytest.raises(RuntimeError) as info:
            getattr(torch.ops.dsv, op)(**mixed)
        named = first if moved == ref else moved
        assert re.search(rf"\b{named}: device differs from q's", str(info.value)), \
            f"{op} with {moved} on the CPU: {info.value}"
