"""Plan solver for sparsity-aware context parallelism.

Given N ranks, the per-head sparsity of one attention block (from the profiler) and the sequence
length, :func:`solve_plan` chooses the factorisation ``N = g_h x g_s`` (``g_h`` ranks share the
heads of one sequence segment through head-wise all-to-all, ``g_s`` segments exchange critical
K/V rows sequence-wise) and the head assignment inside a head group, minimising

    max over ranks of (attention compute time + communication time)

subject to a per-rank memory limit. Times come from :class:`CostModel`, a small parametric model
(kernel throughput by length and sparsity, all-to-all bandwidth and latency) with defaults
measured on an H200 for this project (see docs/PERFORMANCE.md) and a
:meth:`CostModel.calibrate` that re-measures it on the current device. Heads are assigned by longest-processing-time first (LPT) on their modelled
cost, which is proportional to ``1 - s_h`` for sparse heads (a dense head costs 1).

:class:`Planner` caches one plan per block and re-solves only when the profiled sparsity moved
by more than ``tol`` (or the length / world size changed, or the cached plan no longer fits the
memory limit at the new sparsity).

Everything here is plain Python (no collectives): every rank computes the same plan from the
same inputs, and :mod:`dsv_ext.parallel` checks collectively that the plans agree.
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "CostModel",
    "Plan",
    "Planner",
    "lpt_assign",
    "naive_assign",
    "head_costs",
    "assignment_loads",
    "solve_plan",
]


# ----------------------------------------------------------------------------------------------
# Head assignment
# ----------------------------------------------------------------------------------------------
def head_costs(sparsity: Sequence[float], dense_threshold: float = 0.0) -> List[float]:
    """Relative attention cost of each head: ``1 - s_h``; heads with sparsity below
    ``dense_threshold`` run dense and cost 1."""
    out = []
    for h, s in enumerate(sparsity):
        s = float(s)
        if not (0.0 <= s <= 1.0) or math.isnan(s):
            raise ValueError(f"sparsity: entry {h} must be in [0, 1], got {s}")
        out.append(1.0 if s < dense_threshold else 1.0 - s)
    return out


def lpt_assign(costs: Sequence[float], num_ranks: int) -> Tuple[Tuple[int, ...], ...]:
    """Longest-processing-time-first assignment of heads (jobs) to ``num_ranks`` ranks.

    Heads are taken in decreasing cost (ties: lower head first) and each goes to the currently
    least-loaded rank (ties: fewer heads, then lower rank). Returns, per rank, its heads in
    ascending order. Guarantees: max load <= (4/3 - 1/(3 n)) x optimum (Graham), and
    max load <= mean load + max single cost.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks: must be >= 1, got {num_ranks}")
    order = sorted(range(len(costs)), key=lambda h: (-float(costs[h]), h))
    loads = [0.0] * num_ranks
    heads: List[List[int]] = [[] for _ in range(num_ranks)]
    for h in order:
        j = min(range(num_ranks), key=lambda r: (loads[r], len(heads[r]), r))
        loads[j] += float(costs[h])
        heads[j].append(h)
    return tuple(tuple(sorted(x)) for x in heads)


def naive_assign(num_heads: int, num_ranks: int) -> Tuple[Tuple[int, ...], ...]:
    """Plain Ulysses assignment: contiguous, equal head counts (the sparsity-unaware baseline)."""
    base, extra = divmod(num_heads, num_ranks)
    out, h = [], 0
    for j in range(num_ranks):
        n = base + (1 if j < extra else 0)
        out.append(tuple(range(h, h + n)))
        h += n
    return tuple(out)


def assignment_loads(assignment: Sequence[Sequence[int]], costs: Sequence[float]) -> List[float]:
    return [sum(float(costs[h]) for h in hs) for hs in assignment]


# ----------------------------------------------------------------------------------------------
# Cost model
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class CostModel:
    """Time (seconds) of attention forward+backward and of collectives; bytes of memory.

    Attention of one head with ``sq`` queries, ``sk`` keys and ``kv`` selected keys per query:

    * dense:  ``overhead + 14 sq sk d / dense_flops``            (4 sq sk d per forward, x3.5)
    * sparse: ``overhead + 14 sq kv d / sparse_flops + 2 (sq/G) sk r / estimate_flops``

    A head runs sparse when its density ``1 - s`` is at most ``sparse_max_density`` (and the
    modelled sparse time is lower), else dense. Collectives move ``bytes / a2a_bandwidth`` plus
    ``a2a_latency`` per call. ``union_factor``: the fraction of a remote segment's keys that a
    rank's query groups need together (SCP) is modelled as ``min(1, union_factor x (1 - s))``.
    The default 20 is deliberately pessimistic: with 64-query groups each selecting 5-10% of
    the keys, the union over a rank's hundreds of groups covers 94-100% of the remote keys for
    both scattered and spatially smooth indices (measured at 64k tokens, 2 and 8 ranks). The
    benchmark measures it (``scp`` stats ``union_fraction``) and :meth:`Planner.observe_union`
    feeds the measurement back. ``scp_query_padding``: the sparse kernel takes one length for
    queries and keys, so SCP pads a rank's L queries up to its key-table length (about
    ``union x S`` when that exceeds L); the padded rows hold memory (q, out and their
    gradients) but no compute (their lists are empty and the kernels trim them).

    Defaults: H200 numbers measured for this project, see docs/PERFORMANCE.md (cuDNN dense
    560 TFLOP/s fwd+bwd; sparse kernels at about 350 TFLOP/s of useful work; NVLink all-to-all
    about 150 GB/s per rank and direction).
    """

    dense_flops: float = 560e12
    sparse_flops: float = 350e12
    estimate_flops: float = 60e12
    overhead: float = 30e-6
    a2a_bandwidth: float = 150e9
    a2a_latency: float = 30e-6
    union_factor: float = 20.0
    sparse_max_density: float = 0.5
    scp_query_padding: bool = True
    bytes_per_elem: int = 2
    index_bytes: int = 4

    # -- attention ---------------------------------------------------------------------------
    def dense_time(self, sq: float, sk: float, d: int) -> float:
        return self.overhead + 14.0 * sq * sk * d / self.dense_flops

    def sparse_time(self, sq: float, sk: float, kv: float, d: int, group_size: int, rank: int) -> float:
        est = 2.0 * (sq / group_size) * sk * rank / self.estimate_flops
        return self.overhead + 14.0 * sq * kv * d / self.sparse_flops + est

    def head_time(self, sparsity: float, sq: float, sk: float, d: int, group_size: int, rank: int) -> float:
        density = max(1.0 - float(sparsity), 0.0)
        dense = self.dense_time(sq, sk, d)
        if density > self.sparse_max_density:
            return dense
        return min(dense, self.sparse_time(sq, sk, density * sk, d, group_size, rank))

    def union_fraction(self, sparsity: float) -> float:
        return min(1.0, self.union_factor * max(1.0 - float(sparsity), 0.0))

    # -- communication -----------------------------------------------------------------------
    def comm_time(self, nbytes: float, calls: int = 1) -> float:
        return calls * self.a2a_latency + nbytes / self.a2a_bandwidth

    # -- persistence -------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, float]) -> "CostModel":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"cost model: unknown fields {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CostModel":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    # -- calibration -------------------------------------------------------------------------
    def calibrate(self, device=None, seqlens=None, head_dim: int = 128, heads: Optional[int] = None,
                  densities=(0.05, 0.1), group_size: int = 64, rank: int = 16, dtype=None,
                  group=None, repeats: int = 3) -> "CostModel":
        """Measure the kernel throughputs (and, when ``group`` has more than one rank, the
        all-to-all bandwidth) on ``device`` and update this model in place. Takes a few
        seconds on a GPU; on CPU it measures the CPU kernels (useful only for tests).

        ``seqlens`` / ``heads`` default to (16384, 65536) x 16 heads on a GPU, sizes that fill
        an H100/H200, and (1024, 4096) x 4 on the CPU. (The earlier default, 4 heads of 4k-16k
        tokens, measured rates 2x (sparse) to 20x (estimation) below the kernels' rates at 64k+
        on the H200; the per-head estimation cost then looked large and the same for every head,
        the likely reason why the plan's head assignment was 5-6% off balance on skewed heads
        where LPT on the kernel work was within ~1%: benchmarks/results/bench_cp_2gpu.md.)"""
        import time

        import torch

        import dsv_ext

        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if seqlens is None:
            seqlens = (16384, 65536) if device.type == "cuda" else (1024, 4096)
        if heads is None:
            heads = 16 if device.type == "cuda" else 4
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)

        @torch.enable_grad()  # the timed passes run backwards: also when the caller is under no_grad
        def timeit(fn):
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - t0)
            return best

        dense_rates, sparse_rates, est_rates = [], [], []
        for s in seqlens:
            q, k, v = (torch.randn(1, s, heads, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            ql = torch.randn(1, s, heads, rank, device=device, dtype=dtype)
            kl = torch.randn(1, s, heads, rank, device=device, dtype=dtype)

            def dense():
                o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
                o.sum().backward()

            t = timeit(dense)
            dense_rates.append(14.0 * s * s * head_dim * heads / max(t, 1e-9))
            for dens in densities:
                kv = max(group_size, int(dens * s) // group_size * group_size)
                cnt = torch.full((1, heads), kv, dtype=torch.int32, device=device)
                idx = dsv_ext.topk_estimate(ql, kl, cnt, group_size, kmax=kv)

                def sparse():
                    o = dsv_ext.sparse_attention(q, k, v, idx, cnt, group_size, check_index=False)
                    o.sum().backward()

                t = timeit(sparse)
                sparse_rates.append(14.0 * s * kv * head_dim * heads / max(t, 1e-9))
                t = timeit(lambda: dsv_ext.topk_estimate(ql, kl, cnt, group_size, kmax=kv))
                est_rates.append(2.0 * (s / group_size) * s * rank * heads / max(t, 1e-9))
        self.dense_flops = sorted(dense_rates)[len(dense_rates) // 2]
        self.sparse_flops = sorted(sparse_rates)[len(sparse_rates) // 2]
        self.estimate_flops = sorted(est_rates)[len(est_rates) // 2]
        self.bytes_per_elem = torch.empty((), dtype=dtype).element_size()
        if group is not None:
            import torch.distributed as dist

            n = dist.get_world_size(group)
            if n > 1:
                nbytes = 64 << 20
                numel = (nbytes // 2) // n * n  # all_to_all_single splits dim 0 evenly over n ranks
                x = torch.empty(numel, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
                y = torch.empty_like(x)
                dist.all_to_all_single(y, x, group=group)
                t_big = timeit(lambda: dist.all_to_all_single(y, x, group=group))
                xs = x[: 1024 * n]
                ys = torch.empty_like(xs)
                t_small = timeit(lambda: dist.all_to_all_single(ys, xs, group=group))
                moved = x.numel() * x.element_size() * (n - 1) / n
                self.a2a_latency = t_small
                self.a2a_bandwidth = moved / max(t_big - t_small, 1e-9)
        return self


# ----------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    """A context-parallel plan for one attention block.

    ``assignment[j]``: the heads that rank ``j`` of every head group computes (the same in every
    head group, which is what lets sequence-wise exchange run between ranks with equal ``j``).
    Rank ``r`` of the CP group is head-group rank ``r % g_h`` of segment ``r // g_h``.
    """

    world_size: int
    g_h: int
    g_s: int
    assignment: Tuple[Tuple[int, ...], ...]
    rank_time: Tuple[float, ...] = ()
    rank_compute: Tuple[float, ...] = ()
    rank_comm: Tuple[float, ...] = ()
    rank_memory: Tuple[float, ...] = ()
    candidates: Tuple[Tuple[int, int, float, float, bool], ...] = ()  # (g_h, g_s, max_time, max_mem, fits)

    @property
    def mode(self) -> str:
        if self.world_size == 1:
            return "local"
        if self.g_s == 1:
            return "hcp"
        if self.g_h == 1:
            return "scp"
        return "hybrid"

    @property
    def max_time(self) -> float:
        return max(self.rank_time) if self.rank_time else float("nan")

    @property
    def imbalance(self) -> float:
        """max / mean - 1 of the modelled per-rank compute time."""
        if not self.rank_compute:
            return float("nan")
        mean = sum(self.rank_compute) / len(self.rank_compute)
        return max(self.rank_compute) / mean - 1.0 if mean > 0 else 0.0

    def key(self) -> int:
        """A checksum of what every rank must agree on (used by the collective validation)."""
        return zlib.crc32(repr((self.world_size, self.g_h, self.g_s, self.assignment)).encode())

    def describe(self) -> str:
        lines = [f"plan: N={self.world_size} g_h={self.g_h} g_s={self.g_s} ({self.mode}), "
                 f"max rank time {self.max_time * 1e3:.3f} ms, compute imbalance {self.imbalance * 100:.1f}%"]
        for j, hs in enumerate(self.assignment):
            t = self.rank_time[j] * 1e3 if self.rank_time else float("nan")
            lines.append(f"  head-rank {j}: heads {list(hs)}  time {t:.3f} ms")
        return "\n".join(lines)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate(world_size: int, g_h: int, assignment: Sequence[Sequence[int]], sparsity: Sequence[float],
             seqlen: int, head_dim: int, cost: CostModel, group_size: int = 64, rank: int = 16,
             batch: int = 1, union: Optional[Sequence[float]] = None):
    """Modelled (compute, comm, memory) per head-group rank j for a given factorisation."""
    n, H, S, D = world_size, len(sparsity), seqlen, head_dim
    g_s = n // g_h
    L = S / g_s  # tokens of a segment (what a rank holds in head layout)
    Ls = S / n  # tokens of a shard (sequence layout)
    e = cost.bytes_per_elem
    comp, comm, mem = [], [], []
    for hs in assignment:
        a = len(hs)
        pad = 1.0
        if g_s > 1 and cost.scp_query_padding and hs:
            u_max = max(union[h] if union is not None else cost.union_fraction(sparsity[h]) for h in hs)
            pad = max(1.0, u_max * g_s)
        c = sum(cost.head_time(sparsity[h], L, S, D, group_size, rank) for h in hs) * batch
        nb = 0.0
        calls = 0
        if g_h > 1:
            # forward: q,k,v,q_lr,k_lr seq->head; out head->seq; backward: dout seq->head, dq,dk,dv head->seq
            send = Ls * (H - a) * (3 * D + 2 * rank) + Ls * (g_h - 1) * a * D
            recv = Ls * (g_h - 1) * a * (3 * D + 2 * rank) + Ls * (H - a) * D
            send_b = Ls * (H - a) * D + Ls * (g_h - 1) * a * 3 * D
            recv_b = Ls * (g_h - 1) * a * D + Ls * (H - a) * 3 * D
            nb += (max(send, recv) + max(send_b, recv_b)) * e * batch
            calls += 4
        ext = 0.0
        if g_s > 1:
            rows = 0.0
            for h in hs:
                u = union[h] if union is not None else cost.union_fraction(sparsity[h])
                rows += u * (g_s - 1) * L
            # k_lr all-gather, request lists (int64), K/V rows forward, dK/dV rows backward
            nb += ((g_s - 1) * L * a * rank * e + rows * 8 + 2 * rows * 2 * D * e) * batch
            calls += 4
            ext = rows
        # memory: sequence-layout q,k,v,out + grads; head-layout q,k,v,out + grads; K/V extension
        # (+grad); SCP's padded query rows (q, out and their grads at pad x L); index; gathered k_lr.
        m = 8 * Ls * H * D * e + 8 * L * a * D * e + 4 * ext * D * e
        m += 4 * (pad - 1.0) * L * a * D * e
        m += sum(L / group_size * max(1.0 - sparsity[h], 0.0) * S for h in hs) * cost.index_bytes
        m += S * a * rank * e
        comp.append(c)
        comm.append(cost.comm_time(nb, calls) if calls else 0.0)
        mem.append(m * batch)
    return comp, comm, mem


def solve_plan(sparsity: Sequence[float], world_size: int, seqlen: int, head_dim: int = 128,
               cost: Optional[CostModel] = None, memory_limit: Optional[float] = None,
               group_size: int = 64, rank: int = 16, batch: int = 1, modes: Sequence[str] = ("hcp", "scp", "hybrid"),
               union: Optional[Sequence[float]] = None) -> Plan:
    """Choose (g_h, g_s) and the head assignment for one block (see the module docstring).

    ``sparsity``: per-head sparsity (the profiler's, in [0, 1]); ``seqlen``: the global sequence
    length; ``memory_limit``: bytes per rank (None: unlimited); ``modes``: which of
    ``"hcp"`` (g_s = 1), ``"scp"`` (g_h = 1), ``"hybrid"`` may be chosen. ``union``: measured
    per-head SCP union fractions (None: the cost model's estimate).
    Raises ValueError when no allowed factorisation fits the memory limit.
    """
    cost = cost or CostModel()
    H = len(sparsity)
    if H < 1:
        raise ValueError("sparsity: needs at least one head")
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    if seqlen % world_size:
        raise ValueError(f"seqlen: {seqlen} is not divisible by world_size {world_size}")
    cands = []
    best = None
    for g_h in _divisors(world_size):
        g_s = world_size // g_h
        if g_h > H:
            continue  # a head group needs at least one head per rank
        mode = "hcp" if g_s == 1 else ("scp" if g_h == 1 else "hybrid")
        if world_size > 1 and mode not in modes:
            continue
        L = seqlen / g_s
        costs = [cost.head_time(s, L, seqlen, head_dim, group_size, rank) for s in sparsity]
        assignment = lpt_assign(costs, g_h)
        comp, comm, mem = evaluate(world_size, g_h, assignment, sparsity, seqlen, head_dim, cost,
                                   group_size, rank, batch, union)
        times = [c + m for c, m in zip(comp, comm)]
        tmax, mmax = max(times), max(mem)
        fits = memory_limit is None or mmax <= memory_limit
        cands.append((g_h, g_s, tmax, mmax, fits))
        if fits and (best is None or tmax < best[0] * (1 - 1e-9)):
            best = (tmax, g_h, g_s, assignment, times, comp, comm, mem)
    if best is None:
        if not cands:
            raise ValueError(f"modes: none of {tuple(modes)} is possible with {H} heads on {world_size} ranks")
        lo = min(c[3] for c in cands)
        raise ValueError(f"memory_limit: no plan fits {memory_limit:.3e} bytes per rank "
                         f"(smallest needs {lo:.3e}); use more ranks or a shorter sequence")
    _, g_h, g_s, assignment, times, comp, comm, mem = best
    return Plan(world_size, g_h, g_s, assignment, tuple(times), tuple(comp), tuple(comm), tuple(mem), tuple(cands))


class Planner:
    """Caches a plan per block and re-solves when the profile changes.

    >>> planner = Planner(world_size=8, seqlen=131072, head_dim=128)
    >>> plan = planner.plan("block3", sparsity)   # same plan back until sparsity moves > tol
    """

    def __init__(self, world_size: int, seqlen: int, head_dim: int = 128, cost: Optional[CostModel] = None,
                 memory_limit: Optional[float] = None, group_size: int = 64, rank: int = 16, batch: int = 1,
                 modes: Sequence[str] = ("hcp", "scp", "hybrid"), tol: float = 0.02):
        self.world_size, self.seqlen, self.head_dim = world_size, seqlen, head_dim
        self.cost = cost or CostModel()
        self.memory_limit, self.group_size, self.rank, self.batch = memory_limit, group_size, rank, batch
        self.modes, self.tol = tuple(modes), tol
        self._plans: Dict[object, Tuple[Tuple[float, ...], int, Plan]] = {}
        self._union: Dict[object, List[float]] = {}
        self.replans = 0

    def observe_union(self, block, union_fraction: Sequence[float]) -> None:
        """Feed back measured SCP union fractions per head (forces a re-plan of ``block``)."""
        self._union[block] = [float(u) for u in union_fraction]
        self._plans.pop(block, None)

    def plan(self, block, sparsity: Sequence[float], seqlen: Optional[int] = None) -> Plan:
        s = tuple(float(x) for x in sparsity)
        seqlen = self.seqlen if seqlen is None else seqlen
        old = self._plans.get(block)
        if old is not None and old[1] == seqlen and len(old[0]) == len(s) and \
                max(abs(a - b) for a, b in zip(old[0], s)) <= self.tol and self._fits(block, old[2], s, seqlen):
            return old[2]
        p = solve_plan(s, self.world_size, seqlen, self.head_dim, self.cost, self.memory_limit,
                       self.group_size, self.rank, self.batch, self.modes, self._union.get(block))
        self._plans[block] = (s, seqlen, p)
        self.replans += 1
        return p

    def _fits(self, block, p: Plan, sparsity: Sequence[float], seqlen: int) -> bool:
        """Whether a cached plan still fits the memory limit at the new sparsity (denser heads
        need larger indices)."""
        if self.memory_limit is None:
            return True
        mem = evaluate(p.world_size, p.g_h, p.assignment, sparsity, seqlen, self.head_dim, self.cost,
                       self.group_size, self.rank, self.batch, self._union.get(block))[2]
        return max(mem) <= self.memory_limit
