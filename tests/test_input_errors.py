"""Bad input to every public op raises ValueError / TypeError whose message starts with the
name of the offending argument; bad input to the raw ops raises (RuntimeError) instead of
touching memory. Nothing here may crash the process."""
import os
import re
import subprocess
import sys

import pytest
import torch

import dsv_ext
from dsv_ext.reference import make_qkv, random_index

B, S, H, D, G, KM, R = 2, 20, 2, 16, 4, 6, 4


def _inputs():
    g = torch.Generator().manual_seed(1)
    q, k, v = make_qkv(B, S, H, D, torch.float32, generator=g)
    ql, kl = make_qkv(B, S, H, R, torch.float32, generator=g, n=2)
    idx, cnt = random_index(B, H, S, G, KM, KM - 1, generator=g)
    return dict(q=q, k=k, v=v, ql=ql, kl=kl, idx=idx, cnt=cnt, rows=torch.tensor([0, 5, 19]))


X = _inputs()
NC = torch.randn(B, S, H, 2 * D)[..., ::2]  # last dim not contiguous
META = torch.empty(B, S, H, D, device="meta")


def _sa(**kw):
    a = dict(q=X["q"], k=X["k"], v=X["v"], kv_index=X["idx"], kv_count=X["cnt"], group_size=G)
    a.update(kw)
    return lambda: dsv_ext.sparse_attention(**a)


def _tk(**kw):
    a = dict(q_lr=X["ql"], k_lr=X["kl"], kv_count=X["cnt"], group_size=G)
    a.update(kw)
    return lambda: dsv_ext.topk_estimate(**a)


def _pl(**kw):
    a = dict(q=X["q"], k=X["k"], q_lr=X["ql"], k_lr=X["kl"], rows=X["rows"])
    a.update(kw)
    return lambda: dsv_ext.predictor_loss(**a)


def _pa(**kw):
    a = dict(q=X["q"], k=X["k"], rows=X["rows"], theta=0.9, kv_index=X["idx"],
             kv_count=X["cnt"], group_size=G)
    a.update(kw)
    return lambda: dsv_ext.profile_attention(**a)


def _idx_with(pos, value):
    t = X["idx"].clone()
    t[pos] = value
    return t


CASES = [
    # sparse_attention
    ("q", _sa(q=X["q"].to(torch.int32))),
    ("q", _sa(q="not a tensor")),
    ("q", _sa(q=X["q"][0])),
    ("q", _sa(q=NC)),
    ("k", _sa(k=X["k"].double())),
    ("k", _sa(k=META)),
    ("k", _sa(k=X["k"][:, :-1])),            # S mismatch
    ("v", _sa(v=torch.randn(B + 1, S, H, D))),  # B mismatch
    ("v", _sa(v=torch.randn(B, S, H + 1, D))),  # H mismatch
    ("v", _sa(v=torch.randn(B, S, H, D + 1))),  # D mismatch
    ("v", _sa(v=NC)),
    ("group_size", _sa(group_size=0)),
    ("group_size", _sa(group_size=-3)),
    ("group_size", _sa(group_size=2.5)),
    ("kv_index", _sa(kv_index=X["idx"].float())),
    ("kv_index", _sa(kv_index=X["idx"][:, :, :-1])),       # wrong number of groups
    ("kv_index", _sa(kv_index=X["idx"][0])),
    ("kv_index", _sa(kv_index=_idx_with((1, 1, 2, 0), S))),     # out of range
    ("kv_index", _sa(kv_index=_idx_with((0, 1, 0, 3), -1))),    # negative inside the count
    ("kv_index", _sa(kv_index=X["idx"].to("meta"))),
    ("kv_count", _sa(kv_count=torch.full((B, H), KM + 1, dtype=torch.int32))),  # > Kmax
    ("kv_count", _sa(kv_count=torch.full((B, H), -1, dtype=torch.int32))),
    ("kv_count", _sa(kv_count=X["cnt"][:1])),
    ("kv_count", _sa(kv_count=X["cnt"].float())),
    ("scale", _sa(scale="big")),
    ("scale", _sa(scale=float("nan"))),
    # topk_estimate
    ("q_lr", _tk(q_lr=X["ql"].to(torch.int64))),
    ("q_lr", _tk(q_lr=X["ql"][..., 0])),
    ("k_lr", _tk(k_lr=X["kl"][:, :, :1])),
    ("k_lr", _tk(k_lr=torch.randn(B, S, H, R + 1))),
    ("k_lr", _tk(k_lr=META[..., :R])),
    ("k_lr", _tk(k_lr=torch.randn(B, S, H, 2 * R)[..., ::2])),
    ("group_size", _tk(group_size=0)),
    ("kv_count", _tk(kv_count=torch.full((B, H), S + 1, dtype=torch.int32))),
    ("kv_count", _tk(kv_count=X["cnt"].view(-1))),
    ("kmax", _tk(kmax=S + 1)),
    ("kmax", _tk(kmax=-1)),
    ("kmax", _tk(kmax=3.0)),
    # predictor_loss
    ("q", _pl(q=X["q"].to(torch.int16))),
    ("k", _pl(k=X["k"][:, :, :1])),
    ("q_lr", _pl(q_lr=torch.randn(B, S - 1, H, R))),
    ("q_lr", _pl(q_lr=X["ql"].double())),
    ("k_lr", _pl(k_lr=torch.randn(B, S, H, R + 2))),
    ("k_lr", _pl(k_lr=torch.randn(B, S, H, 2 * R)[..., ::2])),
    ("rows", _pl(rows=torch.tensor([0, S]))),
    ("rows", _pl(rows=torch.tensor([-1]))),
    ("rows", _pl(rows=torch.tensor([[0, 1]]))),
    ("rows", _pl(rows=torch.tensor([0.5]))),
    # profile_attention
    ("q", _pa(q=NC)),
    ("k", _pa(k=META)),
    ("rows", _pa(rows=torch.tensor([S + 3]))),
    ("theta", _pa(theta=0.0)),
    ("theta", _pa(theta=1.5)),
    ("theta", _pa(theta="x")),
    ("kv_index", _pa(kv_index=_idx_with((0, 0, 0, 0), 1000))),
    ("kv_count", _pa(kv_count=torch.full((B, H), KM + 2, dtype=torch.int32))),
    ("group_size", _pa(group_size=0)),
    ("kv_index", _pa(kv_index=None)),    # partial index arguments
    # review regressions: bool group size, int64 values that wrap in the int32 conversion,
    # empty row sets (the mean over no rows: a NaN sparsity, a zero loss)
    ("group_size", _sa(group_size=True)),
    ("group_size", _tk(group_size=True)),
    ("kv_index", _sa(kv_index=_idx_with((0, 0, 0, 0), 0).long().index_fill_(3, torch.tensor([0]), 2**32))),
    ("kv_count", _sa(kv_count=torch.full((B, H), 2**32 + 2, dtype=torch.int64))),
    ("rows", _pl(rows=torch.tensor([2**32 + 1]))),
    ("rows", _pa(rows=torch.tensor([-(2**32) + 3]))),
    ("rows", _pl(rows=torch.tensor([], dtype=torch.int64))),
    ("rows", _pa(rows=torch.tensor([], dtype=torch.int64))),
    # gather_rows / scatter_add_rows
    ("src", lambda: dsv_ext.gather_rows(torch.randn(5), torch.tensor([0]))),
    ("src", lambda: dsv_ext.gather_rows(torch.arange(10).view(5, 2), torch.tensor([0]))),
    ("src", lambda: dsv_ext.gather_rows(torch.randn(5, 8)[:, ::2], torch.tensor([0]))),
    ("index", lambda: dsv_ext.gather_rows(torch.randn(5, 2), torch.tensor([5]))),
    ("index", lambda: dsv_ext.gather_rows(torch.randn(5, 2), torch.tensor([0.0]))),
    ("index", lambda: dsv_ext.gather_rows(torch.randn(5, 2), torch.tensor([0], device="meta"))),
    ("index", lambda: dsv_ext.scatter_add_rows(torch.randn(3, 2), torch.tensor([0, 1]), 4)),
    ("index", lambda: dsv_ext.scatter_add_rows(torch.randn(2, 2), torch.tensor([0, 4]), 4)),
    ("num_rows", lambda: dsv_ext.scatter_add_rows(torch.randn(2, 2), torch.tensor([0, 1]), -1)),
]


@pytest.mark.parametrize("name,call", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_public_ops_name_the_argument(name, call):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    msg = str(info.value)
    assert re.match(rf"^[\w, ]*\b{re.escape(name)}\b", msg), f"message does not start with {name!r}: {msg}"


def test_valid_baseline_runs():
    """The unmodified inputs are accepted (so each case above fails for its one change)."""
    _sa()()
    _tk()()
    _pl()()
    _pa()()


RAW_CASES = [
    lambda: torch.ops.dsv.sparse_attention_fwd(X["q"], X["k"][:, :-1], X["v"], X["idx"], X["cnt"], G, 0.25),
    lambda: torch.ops.dsv.sparse_attention_fwd(X["q"], X["k"], X["v"], X["idx"][:, :, :-1], X["cnt"], G, 0.25),
    lambda: torch.ops.dsv.sparse_attention_fwd(X["q"], X["k"], X["v"], X["idx"], X["cnt"], 0, 0.25),
    lambda: torch.ops.dsv.sparse_attention_fwd(X["q"], X["k"], X["v"], X["idx"].long(), X["cnt"], G, 0.25),
    lambda: torch.ops.dsv.sparse_attention_fwd(NC, X["k"], X["v"], X["idx"], X["cnt"], G, 0.25),
    lambda: torch.ops.dsv.sparse_attention_bwd(X["q"][:, :-1], X["q"], X["k"], X["v"], X["q"],
                                               torch.zeros(B, H, S), X["idx"], X["cnt"], G, 0.25),
    lambda: torch.ops.dsv.topk_estimate(X["ql"], X["kl"], X["cnt"], G, -1),
    lambda: torch.ops.dsv.topk_estimate(X["ql"], X["kl"][..., :2], X["cnt"], G, 3),
    lambda: torch.ops.dsv.predictor_loss_fwd(X["q"], X["k"], X["ql"], X["kl"], X["rows"].long(), 0.25, 0.95, 0.05),
    lambda: torch.ops.dsv.predictor_loss_fwd(X["q"], X["k"], X["ql"], X["kl"][:, :3], X["rows"].int(), 0.25, 0.95, 0.05),
    lambda: torch.ops.dsv.profile_attention(X["q"], X["k"][:1], X["rows"].int(), 0.9, 0.25, None, None, 1),
    lambda: torch.ops.dsv.gather_rows(torch.randn(4, 3), torch.tensor([0], dtype=torch.int32)),
    lambda: torch.ops.dsv.scatter_add_rows(torch.randn(4, 3), torch.tensor([0, 1]), 4),
]


def _run_raw_cases(first=0):
    """Child-process side: run the raw cases from `first` on, one report line each (flushed)."""
    for i, call in enumerate(RAW_CASES):
        if i < first:
            continue
        print(f"start {i}", flush=True)
        try:
            call()
            print(f"case {i} returned", flush=True)
        except (RuntimeError, ValueError, TypeError):
            print(f"case {i} raised", flush=True)
        except Exception as e:  # noqa: BLE001 - reported as a failure below
            print(f"case {i} other {type(e).__name__}", flush=True)


_RAW_REPORT = {}


def _raw_report():
    """Run the raw cases in child processes, so that a crash (a C++ exception that cannot cross
    into Python, an invalid access) fails the test that caused it instead of ending the run; after
    a crash the remaining cases run in a new child."""
    if not _RAW_REPORT:
        here = os.path.dirname(os.path.abspath(__file__))
        lines, crashes, first = [], {}, 0
        while first < len(RAW_CASES):
            code = (f"import sys; sys.path.insert(0, {here!r}); import test_input_errors as T; "
                    f"T._run_raw_cases({first})")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
            out = proc.stdout.splitlines()
            lines += out
            started = [int(l.split()[1]) for l in out if l.startswith("start ")]
            if proc.returncode == 0 or not started:
                break
            crashes[started[-1]] = f"exit code {proc.returncode}:\n{proc.stderr[-2000:]}"
            first = started[-1] + 1
        _RAW_REPORT.update(lines=lines, crashes=crashes)
    return _RAW_REPORT


@pytest.mark.parametrize("i", range(len(RAW_CASES)))
def test_raw_ops_raise(i):
    rep = _raw_report()
    if i in rep["crashes"]:
        pytest.fail(f"raw case {i} crashed the process ({rep['crashes'][i]})")
    if f"case {i} raised" not in rep["lines"]:
        outcome = next((l for l in rep["lines"] if l.startswith(f"case {i} ")), "not reached")
        pytest.fail(f"raw case {i}: expected RuntimeError/ValueError/TypeError, got: {outcome}")


def test_raw_ops_survive_bad_index_values():
    """Out-of-range values inside the used part of an index are skipped by the kernels."""
    idx = X["idx"].clone()
    idx[0, 0, 0, :] = 10**6
    idx[1, 1, :, 0] = -(10**6)
    out, lse = torch.ops.dsv.sparse_attention_fwd(X["q"], X["k"], X["v"], idx, X["cnt"], G, 0.25)
    assert torch.all(out[0, :G, 0] == 0) and torch.isfinite(out).all()
    rows = torch.tensor([0, 1], dtype=torch.int32)
    sp, rec = torch.ops.dsv.profile_attention(X["q"], X["k"], rows, 0.9, 0.25, idx, X["cnt"], G)
    assert torch.isfinite(sp).all() and torch.isfinite(rec).all()
