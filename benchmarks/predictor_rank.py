"""How much predictor rank a model's heads need: the density that group lists of a low-rank
predictor need for an attention recall, by rank, on attention captured from a checkpoint.

For each attention core of the checkpoint's model (q and k captured on held-out clips as in
bench_equal_recall.py) and each head, the lists of G queries (cube order) ranked by

- ``exact``: the group's exact softmax mass per key (the best any list of G queries can do),
- ``trained``: the checkpoint's own predictors (its DSV rank), where it has them,
- ``fit r=R``: the rank-R bilinear form q^T Wq Wk^T k nearest to the logit scale * q . k over
  all query / key pairs of the block's captures (least squares, closed form: it depends on the
  second moments of q and k alone, whitened, then the R largest singular directions),

and the density (listed keys / S) each needs for the mean recall of the sampled rows to reach
each target. A rotary model's heads turn q and k by position: a rank-R form whose scores depend
on the displacement alone can keep at most R / 2 of the head's rotation frequencies, so the
fitted ranks tell whether more rank would let its predictors find local heads' keys.

    python benchmarks/predictor_rank.py --checkpoint runs/init-rope/dsv-slim.pt --out OUT
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def fit_low_rank(cq: torch.Tensor, ck: torch.Tensor, rank: int, scale: float):
    """(wq, wk) [D, rank] minimising sum over pairs (q^T wq wk^T k - scale q . k)^2 for queries
    and keys of second moments cq = E[q q^T], ck = E[k k^T] (float64 [D, D])."""
    D = cq.shape[0]
    eps = 1e-9 * float(torch.diagonal(cq).mean() + torch.diagonal(ck).mean()) + 1e-30
    lq = torch.linalg.cholesky(cq + eps * torch.eye(D, dtype=cq.dtype))
    lk = torch.linalg.cholesky(ck + eps * torch.eye(D, dtype=ck.dtype))
    # sum (q^T (M - sI) k)^2 = S_q S_k ||lq^T (M - sI) lk||_F^2: the best rank-r lq^T M lk is
    # the truncated SVD of s lq^T lk
    u, s, vh = torch.linalg.svd(scale * lq.T @ lk)
    r = min(rank, D)
    root = s[:r].sqrt()
    wq = torch.linalg.solve_triangular(lq.T, u[:, :r] * root, upper=True)
    wk = torch.linalg.solve_triangular(lk.T, vh[:r].T * root, upper=True)
    return wq, wk


def density_table(curves: Dict[str, Dict[str, torch.Tensor]], targets: Sequence[float], S: int,
                  k_multiple: int) -> Dict[str, Dict[str, List[float]]]:
    """method -> target -> density per head (name order of ``curves``)."""
    from bench_equal_recall import density_for

    out: Dict[str, Dict[str, List[float]]] = {}
    for head, per in curves.items():
        for m, c in per.items():
            kpi = 1 if m == "exact" else k_multiple
            for tg in targets:
                out.setdefault(m, {}).setdefault(str(tg), []).append(density_for(c, kpi, S, tg))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a training checkpoint or its slim copy")
    ap.add_argument("--videos", type=int, default=1, help="held-out clips to capture")
    ap.add_argument("--timesteps", type=float, nargs="+", default=[0.5])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--group", type=int, default=128, help="queries per list (G)")
    ap.add_argument("--rows", type=int, default=2048, help="sampled query rows per capture")
    ap.add_argument("--targets", type=float, nargs="+", default=[0.9, 0.95])
    ap.add_argument("--fit-timesteps", type=float, nargs="+", default=None,
                    help="fit on the captures at these timesteps only and measure on the others "
                         "(out of sample; default: fit and measure on all)")
    ap.add_argument("--cube", type=int, nargs=3, default=None, metavar=("T", "H", "W"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "predictor_rank"))
    a = ap.parse_args(argv)
    if min(a.ranks) < 1 or a.group < 1 or a.rows < 1:
        ap.error("--ranks, --group and --rows: positive integers")
    from bench_common import provenance
    from bench_equal_recall import head_curves, load_and_capture
    from dsv_ext.grouping import cube_permutation
    from dsv_ext.recall import recall_curve

    a.no_per_query, a.train_steps, a.config = True, 0, None
    source, n_clips, captures, ts, cube = load_and_capture(a, ap, torch.device(a.device))
    fit_ts = None if a.fit_timesteps is None else {round(t, 6) for t in a.fit_timesteps}
    if fit_ts is not None and (not fit_ts <= set(ts) or fit_ts >= set(ts)):
        ap.error(f"--fit-timesteps: a part of --timesteps {a.timesteps}, not all of them")
    fit_on = [fit_ts is None or t in fit_ts for t in ts]
    # second moments per (block, head) over the block's captures to fit on
    moments: Dict[str, List[torch.Tensor]] = {}
    for (name, q, k, grid, mod), use in zip(captures, fit_on):
        if not use:
            continue
        B, S, H, D = q.shape
        qd, kd = q.double().reshape(-1, H, D), k.double().reshape(-1, H, D)
        m = [torch.einsum("nhd,nhe->hde", qd, qd), torch.einsum("nhd,nhe->hde", kd, kd), qd.shape[0]]
        old = moments.get(name)
        moments[name] = m if old is None else [old[0] + m[0], old[1] + m[1], old[2] + m[2]]
    fits = {}
    for name, (cq, ck, n) in moments.items():
        H, D = cq.shape[0], cq.shape[1]
        for r in a.ranks:
            w = [fit_low_rank(cq[h] / n, ck[h] / n, r, 1.0 / math.sqrt(D)) for h in range(H)]
            fits[(name, r)] = (torch.stack([x[0] for x in w]).float(), torch.stack([x[1] for x in w]).float())
    curves: Dict[str, Dict[str, torch.Tensor]] = {}
    counts: Dict[str, int] = {}
    t0 = time.perf_counter()
    for ci, (name, q, k, grid, mod) in enumerate(captures):
        if fit_ts is not None and fit_on[ci]:
            continue  # measured out of sample only
        B, S, H, D = q.shape
        if S % a.group:
            ap.error(f"--group: {a.group} does not divide the sequence length {S}")
        perm = cube_permutation(grid, cube, S, q.device)[0]
        scale = 1.0 / math.sqrt(D)
        # whole groups, evenly spaced: the runs head_curves(sample=n_runs) takes for the exact lists
        n_runs = max(1, min(a.rows // a.group, S // a.group))
        runs = torch.linspace(0, S // a.group - 1, n_runs).round().long().unique()
        rows = (runs[:, None] * a.group + torch.arange(a.group)).flatten().to(q.device)
        qc, kc = q.index_select(1, perm).float(), k.index_select(1, perm).float()
        preds = {f"fit r={r}": fits[(name, r)] for r in a.ranks}
        if mod is not None:
            preds[f"trained r={mod.predictor.rank}"] = (mod.predictor.wq.float(), mod.predictor.wk.float())
        for b in range(B):
            per_m = {m: recall_curve(qc[b:b + 1], kc[b:b + 1], wq, wk, rows, group_size=a.group,
                                     k_multiple=16, scale=scale)[0].double() for m, (wq, wk) in preds.items()}
            for h in range(H):
                ex = head_curves(q[b, :, h], k[b, :, h], perm, scale, groups=(a.group,), blocks=(),
                                 block_groups=(a.group,), tile=a.group, per_query=False,
                                 sample=n_runs)[f"token G={a.group}"][1]
                key = f"{name}:{h}"
                acc = curves.setdefault(key, {})
                for m, c in [("exact", ex)] + [(m, c[h]) for m, c in per_m.items()]:
                    acc[m] = acc[m] + c if m in acc else c.clone()
                counts[key] = counts.get(key, 0) + 1
        print(f"  capture {ci + 1}/{len(captures)} ({name}): {time.perf_counter() - t0:.0f} s", flush=True)
    for key, per in curves.items():
        for m in per:
            per[m] /= counts[key]
    dens = density_table(curves, a.targets, S, 16)
    p = provenance()
    res = {"source": source, "checkpoint": a.checkpoint, "inputs": n_clips, "timesteps": a.timesteps,
           "fit_timesteps": a.fit_timesteps,
           "group": a.group, "rows": a.rows, "cube": list(cube), "seq_len": S, "heads": list(curves),
           "densities": dens, "provenance": {"date": p.get("date"), "commit": p.get("commit"),
                                             "device": a.device}}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "predictor_rank.json"), "w") as f:
        json.dump(res, f, indent=1)
    methods = ["exact"] + sorted((m for m in dens if m.startswith("trained")), key=str) + \
        [f"fit r={r}" for r in a.ranks]
    lines = [f"# Predictor rank: list density for recall, {source}",
             "",
             f"{res['provenance']['date']}, commit {res['provenance']['commit']}, {a.device}; {n_clips} held-out "
             f"inputs ({a.videos} clip(s) x timesteps {a.timesteps}); lists of G = {a.group} queries (cube {list(cube)}), "
             f"{rows.numel()} sampled rows per capture; S = {S}. Fits "
             + ("on all captures" if fit_ts is None else f"on the captures at timesteps {a.fit_timesteps}, "
                "measured on the others (out of sample)")
             + ". Density: listed keys / S for the mean recall to reach the target (1.000: not reached).", ""]
    for tg in a.targets:
        lines += [f"Recall {tg}:", "", "| head | " + " | ".join(methods) + " |",
                  "|---|" + "---|" * len(methods)]
        for i, head in enumerate(curves):
            lines.append(f"| {head} | " + " | ".join(f"{dens[m][str(tg)][i]:.3f}" for m in methods) + " |")
        lines.append("")
    with open(os.path.join(a.out, "predictor_rank.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
