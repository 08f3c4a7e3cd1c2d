"""The statistics of full attention vs DSV over several seeds: mean, spread and 95% intervals per
arm and of the paired gap, a verdict against 1%, and the ``compare_seeds.md`` table
(``python -m dsv_ext.app.compare --seeds N``, docs/QUALITY.md).

The runs themselves are :func:`dsv_ext.app.compare.compare_seeds`: seed i trains both arms with
``train.seed + i`` (model init, data order, noise) into ``out_dir/seed<seed>``.
"""
from __future__ import annotations

from typing import Any, Dict, Sequence

from .report import fmt

__all__ = ["seed_stats", "gap_verdict", "write_seeds_table"]


# two-sided 95% quantiles of Student's t by degrees of freedom (larger df: the next lower entry)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def _t975(df: int) -> float:
    return _T975[max(k for k in _T975 if k <= df)] if df >= 1 else float("nan")


def seed_stats(xs: Sequence[float]) -> Dict[str, Any]:
    """Mean, sample standard deviation and 95% t confidence interval of the mean of ``xs``
    (std and interval None for fewer than two values)."""
    xs = [float(x) for x in xs]
    n = len(xs)
    if n == 0:
        raise ValueError("xs: expected at least one value")
    m = sum(xs) / n
    if n < 2:
        return {"n": n, "mean": m, "std": None, "ci95": None, "values": xs}
    sd = (sum((x - m) ** 2 for x in xs) / (n - 1)) ** 0.5
    h = _t975(n - 1) * sd / n ** 0.5
    return {"n": n, "mean": m, "std": sd, "ci95": [m - h, m + h], "values": xs}


def gap_verdict(ci, bound: float = 0.01) -> str:
    """Plain-words verdict on a relative gap's 95% interval against +-``bound``."""
    if ci is None:
        return "not resolved: one seed gives no interval (use --seeds 3 or more)"
    lo, hi = ci
    pct = f"[{100 * lo:+.2f}%, {100 * hi:+.2f}%]"
    if hi < bound:
        return (f"resolved: the 95% interval of the gap {pct} lies below +{100 * bound:.0f}%, so DSV is "
                f"within {100 * bound:.0f}% of full attention")
    if lo > bound:
        return f"resolved: the 95% interval of the gap {pct} lies above +{100 * bound:.0f}%: DSV is worse by more than that"
    return (f"not resolved: the 95% interval of the gap {pct} includes +{100 * bound:.0f}% "
            "(more seeds, longer runs or more validation videos needed)")


def write_seeds_table(res: Dict[str, Any], path: str) -> None:
    def ci(st, nd=4, pct=False):
        if st.get("ci95") is None:
            return "-"
        f = (lambda v: f"{100 * v:+.2f}%") if pct else (lambda v: f"{v:.{nd}f}")
        return f"[{f(st['ci95'][0])}, {f(st['ci95'][1])}]"

    d, s, g = res["arms"]["dense"], res["arms"]["dsv"], res["rel_gap"]
    L = [f"# Full attention vs DSV over {len(res['seeds'])} seeds: `{res['config']}`", "",
         f"Seeds {', '.join(map(str, res['seeds']))} (each: model init, data order, noise); {res['steps']} steps, "
         f"{res['tokens_per_sample']} tokens per video, device `{res['device']}`; validation on "
         f"{fmt(res['val_videos'])} videos x {len(res['val_timesteps'] or [])} timesteps."
         + (" Measured {date}, commit {commit}, {device_name}.".format(**res["provenance"])
            if res.get("provenance") else ""), "",
         "| | full attention | DSV |", "|---|---|---|",
         f"| validation loss, mean over seeds | {fmt(d['mean'])} | {fmt(s['mean'])} |",
         f"| standard deviation over seeds | {fmt(d['std'])} | {fmt(s['std'])} |",
         f"| 95% interval of the mean | {ci(d)} | {ci(s)} |",
         f"| evaluation's own standard error (mean over seeds) | {fmt(d['eval_se'])} | {fmt(s['eval_se'])} |",
         f"| per seed | {', '.join(fmt(x) for x in d['values'])} | {', '.join(fmt(x) for x in s['values'])} |",
         "",
         f"Relative gap DSV / full - 1 (paired by seed): mean {100 * g['mean']:+.2f}%"
         + (f", standard deviation {100 * g['std']:.2f}%, 95% interval {ci(g, pct=True)}" if g["std"] is not None else "")
         + f"; per seed {', '.join(f'{100 * x:+.2f}%' for x in g['values'])}.", "",
         f"**Gap against 1%: {res['verdict']}.**", ""]
    g2 = res.get("stage2_rel_gap")
    if g2:
        L += [f"Mean validation loss over the validations after the switch (every one both runs made), "
              f"DSV / full - 1: mean {100 * g2['mean']:+.2f}%"
              + (f", 95% interval {ci(g2, pct=True)}" if g2["std"] is not None else "")
              + f"; per seed {', '.join(f'{100 * x:+.2f}%' for x in g2['values'])}. "
              f"Against 1%: {res['stage2_verdict']}.", ""]
    sp = res.get("speedup_after_switch") or {}
    if sp.get("mean") == sp.get("mean"):  # not NaN
        L += [f"DSV speed after its switch: {sp['mean']:.2f}x full attention (mean over seeds); mean sparsity "
              f"{', '.join(fmt(x, 3) for x in res['dsv_sparsity'])}, recall "
              f"{', '.join(fmt(x, 3) for x in res['dsv_recall'])} per seed.", ""]
    nsp = res.get("dsv_sparse_blocks") or []
    if nsp and all(n is not None for n in nsp):
        L += [f"Blocks running sparse at the end of DSV's run: {', '.join(str(n) for n in nsp)} per seed."
              + (" **No block ran sparse in any seed: the gap compares two runs that both trained "
                 "with dense attention** (it measures training noise, not sparse attention)."
                 if not any(nsp) else ""), ""]
    ev = max([x for x in (d["eval_se"], s["eval_se"]) if x is not None], default=None)
    spread = max([x for x in (d["std"], s["std"]) if x is not None], default=None)
    if ev is not None and spread is not None and ev > 0.5 * spread:
        L += [f"Note: the evaluation's standard error ({ev:.4f}) is not small against the spread over "
              f"seeds ({spread:.4f}): raise --val-videos.", ""]
    L += ["Each seed's own table: `seed<N>/compare.md`.", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))
