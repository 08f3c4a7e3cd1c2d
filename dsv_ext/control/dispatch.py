"""Op dispatcher: per attention block, run sparse only where it pays.

Decision for one block (made on the host by the controller when the sparsity estimates change,
never inside the forward):
  1. Cost model. With a calibration table for this device, sparse is chosen when the predicted
     sparse time (estimation + sparse forward + backward, interpolated at the block's mean
     density) is below (1 - dispatch_margin) x the dense time at the same sequence length.
     Without a table (or on devices it was not measured on), sparse is chosen when the block's
     mean head sparsity >= config.dispatch_threshold (0.8).
  2. Memory. On CUDA, blocks are kept dense once the extra memory of the sparse path over all
     sparse blocks (index lists, cube-ordered q, low-rank projections) would exceed
     config.memory_fraction of the free device memory.

The table is measured once by `calibrate()` (or `python -m dsv_ext.control.dispatch`) on the GPU and
cached as JSON (default ~/.cache/dsv_ext/calibration.json, or config.calibration_path /
$DSV_EXT_CACHE); for devices that file has no entries for, the tables shipped in
dsv_ext/control/calibration/ are used (an H200's). The format:

    {"version": 1, "entries": [{"device": "NVIDIA H200", "dtype": "bfloat16", "heads": 16,
      "head_dim": 128, "group_size": 64, "seq_len": 32768, "dense_ms": ..,
      "sparse_ms": {"0.5": .., "0.8": .., "0.9": .., "0.95": ..}, "measured": "YYYY-MM-DD HH:MM UTC",
      "torch": ..}, ...]}

Times are per block forward+backward at batch 1; lookups scale linearly with batch x heads and
interpolate linearly in log(seq_len) and in density (1 - sparsity). An entry with "kv_block": b
(16 or 64) times block lists of that size (K = density x S keys as ceil(K / b) blocks); entries
without the key are token lists.

Key granularity (DSVConfig.kv_block "auto", `choose_kv_block`): per head, among the granularities
whose density for the recall target is within recall_max_density, the one with the lowest
predicted time; where the table has no entries for a block size, its time is the token lists'
time at its density times the measured per-key cost ratio of that block size at the config's group
size (block_cost_ratio, BLOCK_COST_RATIOS).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, List, Optional, Sequence

import torch

from .._buildcheck import source_commit
from ..config import KV_BLOCKS, DSVConfig

__all__ = ["Dispatcher", "default_calibration_path", "calibrate", "BLOCK_COST_RATIO", "BLOCK_COST_RATIOS",
           "block_cost_ratio"]

# Cost per key of block lists relative to token lists, used where the calibration table has no
# entries for a block size (calibrate(kv_blocks=...) adds measured entries, which then take over).
# Per group size G: the token lists' cost per key falls as G grows (one dK / dV reduction per key
# and group), the 64-key lists' key-major backward does not depend on G. Measured on the H200 at
# S = 64k, H = 24, D = 128, density 0.1, random lists, forward + backward (benchmarks/results:
# kv_block/ for the 64-key lists, kernels.json for the token lists, one build): G = 64 token lists
# 72.6 ms (the 64-row backward's line reductions, PERF_LOG v34), 64-key lists 61.4 ms; G = 128
# token lists 54.5 ms (the 128-row backward), 64-key lists 61.2 ms. 16-key lists run as token
# lists on CUDA (faster there than their block kernels): 1.07 (PERF_LOG kernels v14, 101.9
# against 95.3 ms at G = 64), taken for both sizes.
BLOCK_COST_RATIOS = {64: {1: 1.0, 16: 1.07, 64: 0.85}, 128: {1: 1.0, 16: 1.07, 64: 1.12}}
BLOCK_COST_RATIO = BLOCK_COST_RATIOS[128]  # the default group size's


def block_cost_ratio(kv_block: int, group_size: int) -> float:
    """Cost per key of ``kv_block``-key lists relative to token lists at ``group_size``: the
    measured table of the largest G <= group_size; below every measured G, the smallest one's
    (smaller groups make token lists dearer still, so blocks are then costed conservatively)."""
    gs = sorted(BLOCK_COST_RATIOS)
    g = max([x for x in gs if x <= group_size] or gs[:1])
    return BLOCK_COST_RATIOS[g][kv_block]


def default_calibration_path() -> str:
    root = os.environ.get("DSV_EXT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dsv_ext")
    return os.path.join(root, "calibration.json")


def _device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation, linear extrapolation outside (clamped to >= 0)."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and xs[i] < x:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y0
    return max(y, 0.0)


BUILTIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration")


def builtin_table() -> Optional[dict]:
    """The calibration tables shipped with the package (dsv_ext/control/calibration/*.json, measured on
    the GPUs their entries name), merged; None when there are none."""
    entries = []
    if os.path.isdir(BUILTIN_DIR):
        for f in sorted(os.listdir(BUILTIN_DIR)):
            if f.endswith(".json"):
                t = Dispatcher.load(os.path.join(BUILTIN_DIR, f))
                entries += t["entries"] if t else []
    return {"version": 1, "entries": entries} if entries else None


class Dispatcher:
    """Cost model + memory check deciding sparse vs dense per block.

    Timing tables: ``table`` (given, or the user's file at config.calibration_path /
    default_calibration_path(), written by calibrate()) first; for a device that table has no
    entry for, the tables shipped in dsv_ext/control/calibration/ (an H200's, bf16, 16 heads of dim 128,
    G = 32 and 64, 4k-128k tokens), unless a table was passed explicitly."""

    def __init__(self, config: Optional[DSVConfig] = None, table: Optional[dict] = None):
        self.config = config if config is not None else DSVConfig()
        self.path = self.config.calibration_path or default_calibration_path()
        self.table = table
        self.builtin = None
        if table is None and self.config.use_calibration:
            self.table = self.load(self.path)
            self.builtin = builtin_table()

    # ---------------------------------------------------------------- table io
    @staticmethod
    def load(path: str) -> Optional[dict]:
        try:
            with open(path) as f:
                t = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(t, dict) or not isinstance(t.get("entries"), list):
            return None
        return t

    def save(self, path: Optional[str] = None) -> str:
        path = path or self.path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.table or {"version": 1, "entries": []}, f, indent=1)
        os.replace(tmp, path)
        return path

    # ---------------------------------------------------------------- cost model
    def _entries(self, device, dtype: torch.dtype, head_dim: int, kv_block: int = 1) -> List[dict]:
        name, dt = _device_name(device), str(dtype).replace("torch.", "")
        es = []
        for t in (self.table, self.builtin):  # the user's measurements first
            es = [e for e in (t or {}).get("entries", []) if e.get("device") == name and e.get("dtype") == dt
                  and e.get("kv_block", 1) == kv_block]
            if es:
                break
        if not es:
            return []
        hd = min({e["head_dim"] for e in es}, key=lambda d: abs(d - head_dim))
        es = [e for e in es if e["head_dim"] == hd]
        # kernel times depend on the group size (on the H200, G = 32 is about 2x slower than 64):
        # use the entries measured with this config's group size, else the nearest one measured
        G = self.config.group_size
        gs = {e.get("group_size", G) for e in es}
        g = min(gs, key=lambda x: (abs(math.log2(max(x, 1)) - math.log2(max(G, 1))), x))
        return sorted((e for e in es if e.get("group_size", G) == g), key=lambda e: e["seq_len"])

    def has_entry(self, device, dtype: torch.dtype, heads: int, head_dim: int, seq_len: int) -> bool:
        """Whether the table holds a measurement for exactly this device/dtype/shape and the
        config's group size."""
        name, dt = _device_name(device), str(dtype).replace("torch.", "")
        G = self.config.group_size
        return any(e.get("device") == name and e.get("dtype") == dt and e.get("heads") == heads
                   and e.get("head_dim") == head_dim and e.get("seq_len") == seq_len
                   and e.get("group_size", G) == G and e.get("kv_block", 1) == 1
                   for e in (self.table or {}).get("entries", []))

    def predict_ms(self, seq_len: int, heads: int, head_dim: int, density: float, device,
                   dtype: torch.dtype = torch.bfloat16, batch: int = 1,
                   kv_block: int = 1) -> Optional[Dict[str, float]]:
        """{"dense": ms, "sparse": ms} for one block from the table (entries of lists of kv_block
        keys per entry), or None without a table."""
        es = self._entries(device, dtype, head_dim, kv_block)
        if not es:
            return None
        dens, spar = [], []
        for e in es:
            pts = sorted((1.0 - float(s), float(ms)) for s, ms in e["sparse_ms"].items())
            spar.append(_interp([p[0] for p in pts], [p[1] for p in pts], density) / e["heads"])
            dens.append(float(e["dense_ms"]) / e["heads"])
        if len(es) == 1:  # one length measured: attention time ~ S^2
            r = (seq_len / es[0]["seq_len"]) ** 2
            d_ms, s_ms = dens[0] * r, spar[0] * r
        else:  # piecewise-linear in log(time) vs log(S), extrapolated at the ends
            xs = [math.log(e["seq_len"]) for e in es]
            x = math.log(max(seq_len, 1))
            i = 1
            while i < len(xs) - 1 and xs[i] < x:
                i += 1

            def loglin(ys):
                y0, y1 = math.log(max(ys[i - 1], 1e-9)), math.log(max(ys[i], 1e-9))
                return math.exp(y0 + (y1 - y0) * (x - xs[i - 1]) / (xs[i] - xs[i - 1]))

            d_ms, s_ms = loglin(dens), loglin(spar)
        f = batch * heads
        return {"dense": d_ms * f, "sparse": s_ms * f}

    def head_cost(self, density: float, kv_block: int, seq_len: int, head_dim: int, device,
                  dtype: torch.dtype = torch.bfloat16, batch: int = 1) -> float:
        """Relative time of one head's sparse attention with lists of ``kv_block`` keys per entry
        at ``density`` (K / S): the table's time for this block size where it has entries, else
        block_cost_ratio(kv_block, G) x the token lists' time (x the density without a table). The
        values compare granularities; the unit is ms where a table exists."""
        if self.config.use_calibration:
            p = self.predict_ms(seq_len, 1, head_dim, density, device, dtype, batch, kv_block)
            if p is not None:
                return p["sparse"]
            p = self.predict_ms(seq_len, 1, head_dim, density, device, dtype, batch)
            if p is not None:
                return block_cost_ratio(kv_block, self.config.group_size) * p["sparse"]
        return block_cost_ratio(kv_block, self.config.group_size) * density

    def choose_kv_block(self, densities: Sequence[Sequence[float]], seq_len: int, heads: int, head_dim: int,
                        device, dtype: torch.dtype = torch.bfloat16, batch: int = 1) -> List[int]:
        """Per head, the list granularity of KV_BLOCKS to run: ``densities[g][h]`` is the density
        (K / S) head h needs with granularity KV_BLOCKS[g] to reach the recall target. Among the
        granularities that reach it within config.recall_max_density, the one of the lowest
        head_cost (ties: the smaller block); 1 when none does (the head then attends to all
        keys)."""
        if len(densities) != len(KV_BLOCKS) or any(len(d) != heads for d in densities):
            raise ValueError(f"densities: expected {len(KV_BLOCKS)} lists of {heads} values (one per granularity "
                             f"{list(KV_BLOCKS)})")
        out = []
        for h in range(heads):
            best = None
            for b, dens in zip(KV_BLOCKS, densities):
                d = float(dens[h])
                if d > self.config.recall_max_density:
                    continue
                c = self.head_cost(d, b, seq_len, head_dim, device, dtype, batch)
                if best is None or c < best[0]:
                    best = (c, b)
            out.append(1 if best is None else best[1])
        return out

    def sparse_extra_bytes(self, batch: int, seq_len: int, heads: int, head_dim: int, kmax: int,
                           dtype: torch.dtype = torch.bfloat16, kv_block: Optional[Sequence[int]] = None) -> int:
        """Extra memory of one sparse block held for the backward (index, reordered q, q_lr/k_lr;
        with block lists (kv_block: per-head sizes) also the cube-ordered k and v of those heads).
        The index is counted at kmax keys per list (block lists expanded to token lists take that
        much, as 16-key lists do on CUDA; 64-key lists run there as blocks and take less)."""
        es = torch.empty((), dtype=dtype).element_size()
        G = self.config.group_size
        ng = -(-seq_len // G)
        index = batch * heads * ng * kmax * 4
        qp = batch * seq_len * heads * head_dim * es
        lowrank = 2 * batch * seq_len * heads * self.config.rank * es
        block_heads = sum(1 for b in kv_block if b != 1) if kv_block else 0
        kv = 2 * batch * seq_len * block_heads * head_dim * es
        return index + qp + lowrank + kv

    def decide(self, sparsity: Sequence[float], seq_len: int, heads: int, head_dim: int, device,
               dtype: torch.dtype = torch.bfloat16, batch: int = 1,
               density: Optional[Sequence[float]] = None, kv_block: Optional[Sequence[int]] = None) -> bool:
        """True = run this block sparse (cost model only; memory is checked by `plan`).
        density: the per-head K / S the block would run with, when K does not follow from the
        sparsity by config.head_k (the recall K rule); the threshold rule then reads 1 - density.
        The calibrated rule costs each head at its own density (without density: head_k of its
        sparsity / S), a head at K = S (1.0) at the dense time (it runs dense).
        kv_block: per-head list granularity (None: token lists); block heads are costed by
        head_cost, and the threshold rule reads their density times block_cost_ratio."""
        if not sparsity:
            return False
        if kv_block is not None and any(b != 1 for b in kv_block):
            return self._decide_blocks(sparsity, seq_len, heads, head_dim, device, dtype, batch, density,
                                       kv_block)
        s_mean = float(sum(sparsity)) / len(sparsity)
        if density:
            s_mean = 1.0 - float(sum(density)) / len(density)
        if self.config.use_calibration and seq_len > 0:
            # per head, at the K it runs with (without density: head_k of its sparsity); a head
            # with K = S runs dense (SparseAttention), the others sparse. A block whose heads mix
            # both is not costed at their mean density: one head on all keys would then price
            # the block as if every head ran the sparse kernel near K = S.
            dens = [float(d) for d in density] if density else \
                [self.config.head_k(s, seq_len) / seq_len for s in sparsity]
            p = self.block_ms(dens, seq_len, heads, head_dim, device, dtype, batch)
            if p is not None:
                return p["sparse"] < (1.0 - self.config.dispatch_margin) * p["dense"]
        return s_mean >= self.config.dispatch_threshold

    def block_ms(self, density: Sequence[float], seq_len: int, heads: int, head_dim: int, device,
                 dtype: torch.dtype = torch.bfloat16, batch: int = 1) -> Optional[Dict[str, float]]:
        """{"dense": ms, "sparse": ms} of one block's attention (forward + backward) from the table,
        sparse with each head at its density (K / S), a head at K = S at the dense time (it runs
        dense); None without a table entry."""
        ps = [self.predict_ms(seq_len, heads, head_dim, min(float(d), 1.0), device, dtype, batch) for d in density]
        if not ps or any(p is None for p in ps):
            return None
        return {"dense": ps[0]["dense"],
                "sparse": sum(p["dense"] if d >= 1.0 else p["sparse"] for p, d in zip(ps, density)) / len(ps)}

    def _decide_blocks(self, sparsity, seq_len, heads, head_dim, device, dtype, batch, density, kv_block) -> bool:
        dens = [float(d) for d in density] if density else \
            [self.config.head_k(s, seq_len) / seq_len for s in sparsity]
        if self.config.use_calibration:
            p = self.predict_ms(seq_len, heads, head_dim, sum(dens) / len(dens), device, dtype, batch)
            if p is not None:
                sparse = sum(p["dense"] / heads if d >= 1.0 else  # a head at K = S runs dense
                             self.head_cost(d, b, seq_len, head_dim, device, dtype, batch)
                             for d, b in zip(dens, kv_block))
                return sparse < (1.0 - self.config.dispatch_margin) * p["dense"]
        G = self.config.group_size
        eff = sum(block_cost_ratio(b, G) * d for d, b in zip(dens, kv_block)) / len(dens)
        return 1.0 - eff >= self.config.dispatch_threshold

    def plan(self, blocks: Sequence[dict], device) -> List[bool]:
        """Decide every block. blocks: dicts with sparsity (list), seq_len, heads, head_dim, kmax,
        (optional) density (per-head K / S, see decide),
        dtype, batch. Blocks the cost model picks are kept in order while the memory lasts."""
        choice = [self.decide(b["sparsity"], b["seq_len"], b["heads"], b["head_dim"], device,
                              b.get("dtype", torch.bfloat16), b.get("batch", 1), b.get("density"),
                              b.get("kv_block"))
                  for b in blocks]
        dev = torch.device(device)
        if dev.type == "cuda" and any(choice):
            try:
                free, _ = torch.cuda.mem_get_info(dev)
            except Exception:  # pragma: no cover
                return choice
            budget = self.config.memory_fraction * free
            used = 0
            for i, b in enumerate(blocks):
                if not choice[i]:
                    continue
                need = self.sparse_extra_bytes(b.get("batch", 1), b["seq_len"], b["heads"], b["head_dim"],
                                               b["kmax"], b.get("dtype", torch.bfloat16), b.get("kv_block"))
                if used + need > budget:
                    choice[i] = False
                else:
                    used += need
        return choice

    # ---------------------------------------------------------------- calibration
    @torch.enable_grad()  # it times backward passes; callers (controller.step) may run under no_grad
    def calibrate(self, device="cuda", seq_lens: Sequence[int] = (4096, 16384, 32768, 65536),
                  sparsities: Sequence[float] = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98), heads: int = 16,
                  head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, repeats: int = 3,
                  save: bool = True, verbose: bool = False, kv_blocks: Sequence[int] = (1,)) -> dict:
        """Measure dense (SDPA) vs sparse (estimation + sparse attention) forward+backward time per
        (seq_len, sparsity) on `device`, store them in the table (replacing entries of the same
        device/dtype/heads/head_dim/seq_len/kv_block) and save it as JSON. kv_blocks: the list
        granularities to time (entries of block sizes > 1 carry "kv_block")."""
        bad = [b for b in kv_blocks if b not in KV_BLOCKS]
        if bad or not kv_blocks:
            raise ValueError(f"kv_blocks: expected values in {list(KV_BLOCKS)}, got {list(kv_blocks)}")
        from ..functional.attention import dense_core, sparse_core
        from ..grouping import cube_permutation

        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device: CUDA is not available for calibration")
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        G, r = self.config.group_size, self.config.rank
        name, dt = _device_name(dev), str(dtype).replace("torch.", "")
        commit = source_commit()  # the provenance of every entry measured here
        table = self.table or {"version": 1, "entries": []}

        def timed(fn) -> float:
            fn()
            sync()
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                sync()
                best = min(best, time.perf_counter() - t0)
            return best * 1e3

        for S in seq_lens:
            q, k, v = (torch.randn(1, S, heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            do = torch.randn(1, S, heads, head_dim, device=dev, dtype=dtype)
            wq = torch.randn(heads, head_dim, r, device=dev) / math.sqrt(head_dim)
            wk = torch.randn(heads, head_dim, r, device=dev) / math.sqrt(head_dim)
            side = round(S ** (1 / 3))
            grid = (max(S // (side * side), 1), side, side)
            perm, inv = cube_permutation(grid, self.config.cube, S, dev) if grid[0] * side * side <= S else (None, None)

            def dense():
                o = dense_core(q, k, v, None, self.config.dense_backend)
                torch.autograd.grad(o, (q, k, v), do)

            dense_ms = timed(dense)
            for kb in kv_blocks:
                sp: Dict[str, float] = {}
                for s in sparsities:
                    K = self.config.head_k(s, S)
                    cnt = torch.full((heads,), K, dtype=torch.int32, device=dev)

                    def sparse():
                        o = sparse_core(q, k, v, wq, wk, perm, inv, cnt, K, G, None, kv_block=kb)
                        torch.autograd.grad(o, (q, k, v), do)

                    sp[str(s)] = timed(sparse)
                entry = {"device": name, "dtype": dt, "heads": heads, "head_dim": head_dim, "group_size": G,
                         "seq_len": S, "dense_ms": dense_ms, "sparse_ms": sp,
                         "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                         "commit": commit}
                if kb != 1:
                    entry["kv_block"] = kb
                if verbose:
                    print(json.dumps(entry))
                table["entries"] = [e for e in table["entries"] if not (
                    e.get("device") == name and e.get("dtype") == dt and e.get("heads") == heads
                    and e.get("head_dim") == head_dim and e.get("seq_len") == S
                    and e.get("group_size", G) == G and e.get("kv_block", 1) == kb)] + [entry]
            del q, k, v, do
        self.table = table
        if save:
            self.save()
        return table


def calibrate(config: Optional[DSVConfig] = None, **kw) -> dict:
    """Measure and cache the calibration table (see Dispatcher.calibrate)."""
    return Dispatcher(config, table=None).calibrate(**kw)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m dsv_ext.control.dispatch``: measure this GPU's calibration table (dense vs sparse
    forward+backward per length and sparsity) for one group size and head shape, merge it into
    the table file and print the sparsity from which sparse pays at each length."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dsv_ext.control.dispatch", description=main.__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--group-size", type=int, default=DSVConfig.group_size)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    p.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9, 0.95, 0.98])
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"), default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-blocks", type=int, nargs="+", default=[1],
                   help="list granularities to time: 1 (token lists), 16, 64 (key blocks)")
    p.add_argument("--out", default=None, help=f"table file (default {default_calibration_path()})")
    a = p.parse_args(argv)
    for name, vals in (("--seq-lens", a.seq_lens), ("--heads", [a.heads]), ("--head-dim", [a.head_dim]),
                       ("--repeats", [a.repeats])):
        if any(v < 1 for v in vals):
            p.error(f"{name}: expected integers >= 1, got {vals}")
    if any(b not in KV_BLOCKS for b in a.kv_blocks):
        p.error(f"--kv-blocks: expected values in {list(KV_BLOCKS)}, got {a.kv_blocks}")
    if any(not 0.0 <= s < 1.0 for s in a.sparsities):
        p.error(f"--sparsities: expected values in [0, 1), got {a.sparsities}")
    try:
        dev = torch.device(a.device)
    except RuntimeError as e:
        p.error(f"--device: {e}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error("--device: CUDA is not available here (use --device cpu to measure the CPU kernels)")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cfg = DSVConfig(group_size=a.group_size, calibration_path=a.out)
    d = Dispatcher(cfg)
    print(f"calibrating {_device_name(dev)} {str(dtype).replace('torch.', '')}: G={a.group_size}, "
          f"{a.heads} heads x {a.head_dim}, lengths {a.seq_lens} -> {d.path}", flush=True)
    d.calibrate(dev, seq_lens=a.seq_lens, sparsities=a.sparsities, heads=a.heads, head_dim=a.head_dim,
                dtype=dtype, repeats=a.repeats, verbose=True, save=True, kv_blocks=a.kv_blocks)  # a line per length
    for kb in a.kv_blocks:
        for e in d._entries(dev, dtype, a.head_dim, kb):
            if e["heads"] != a.heads or e["seq_len"] not in a.seq_lens:
                continue
            pays = [float(s) for s, ms in sorted(e["sparse_ms"].items(), key=lambda x: float(x[0]))
                    if ms < e["dense_ms"]]
            where = f"sparse pays from sparsity {min(pays):.2f}" if pays else "sparse never pays"
            print(f"  S={e['seq_len']}" + (f" kv_block={kb}" if kb != 1 else "") + f": dense {e['dense_ms']:.2f} ms; "
                  + ", ".join(f"{s}: {ms:.2f}" for s, ms in e["sparse_ms"].items()) + f" ms; {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
