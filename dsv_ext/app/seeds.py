"""Full attention vs DSV over several seeds: mean, spread and 95% intervals per arm and of the
paired gap, and a verdict against 1% (``python -m dsv_ext.compare --seeds N``, docs/QUALITY.md).

    res = compare_seeds(load_config("configs/small.yaml"), "runs/compare-small-seeds", 3, device="cuda")

Seed i trains both arms with ``train.seed + i`` (model init, data order, noise) through
:func:`dsv_ext.compare.compare` into ``out_dir/seed<seed>``; ``compare_seeds.md`` / ``.json`` hold
the statistics over the seeds.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, Optional, Sequence

from .compare import _fmt, _scalar

__all__ = ["compare_seeds", "seed_stats", "gap_verdict", "write_seeds_table"]


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


def compare_seeds(cfg: Dict[str, Any], out_dir: str, seeds: int, steps: Optional[int] = None,
                  device: Optional[str] = None, progress: bool = True,
                  keep_checkpoints: bool = False, **kw) -> Dict[str, Any]:
    """:func:`dsv_ext.compare.compare` (``kw``: its further options) for ``seeds`` consecutive seeds (``train.seed + i``) into ``out_dir/seed<i>``,
    then mean, spread and 95% intervals per arm and of the paired gap (``compare_seeds.md/json``)."""
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise ValueError(f"seeds: expected an integer >= 1, got {seeds!r}")
    from .compare import compare

    base = int((cfg.get("train") or {}).get("seed", 0))
    runs = []
    for i in range(seeds):
        c = copy.deepcopy(cfg)
        c["train"]["seed"] = base + i
        r = compare(c, os.path.join(out_dir, f"seed{base + i}"), steps=steps, device=device,
                    progress=progress, keep_checkpoints=keep_checkpoints, **kw)
        if not r.get("complete", True):  # a time limit stopped this seed's pair: report nothing yet
            return r
        runs.append(r)
        r.pop("history", None)
        r.pop("val", None)
    arms = {}
    for att in ("dense", "dsv"):
        arms[att] = seed_stats([r[att]["final_val_loss"] for r in runs])
        ses = [r[att].get("final_val_loss_se") for r in runs]
        arms[att]["eval_se"] = (sum(ses) / len(ses)) if all(x is not None for x in ses) else None
    gaps = [r["val_loss_rel_gap"] for r in runs]
    gap = seed_stats(gaps)
    dsv = [r["dsv"] for r in runs]
    res = {
        "config": cfg.get("name"), "seeds": [base + i for i in range(seeds)], "steps": runs[0]["steps"],
        "device": runs[0]["device"], "tokens_per_sample": runs[0]["tokens_per_sample"],
        "val_videos": (cfg.get("train") or {}).get("val_videos"),
        "val_timesteps": (cfg.get("train") or {}).get("val_timesteps"),
        "arms": arms, "rel_gap": gap, "verdict": gap_verdict(gap["ci95"]),
        "switch_steps": [r["switch_step"] for r in runs],
        "speedup_after_switch": seed_stats([r["dsv_tokens_per_s_after_switch"] / r["dense_tokens_per_s_after_switch"]
                                            for r in runs if r["dsv_tokens_per_s_after_switch"]
                                            and r["dense_tokens_per_s_after_switch"]] or [float("nan")]),
        "dsv_sparsity": [_scalar(d.get("dsv_sparsity")) for d in dsv],
        "dsv_recall": [_scalar(d.get("dsv_recall")) for d in dsv],
        "runs": runs,
    }
    from .evaluate import provenance

    res["provenance"] = provenance(runs[0]["device"])
    write_seeds_table(res, os.path.join(out_dir, "compare_seeds.md"))
    with open(os.path.join(out_dir, "compare_seeds.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


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
         f"{_fmt(res['val_videos'])} videos x {len(res['val_timesteps'] or [])} timesteps."
         + (" Measured {date}, commit {commit}, {device_name}.".format(**res["provenance"])
            if res.get("provenance") else ""), "",
         "| | full attention | DSV |", "|---|---|---|",
         f"| validation loss, mean over seeds | {_fmt(d['mean'])} | {_fmt(s['mean'])} |",
         f"| standard deviation over seeds | {_fmt(d['std'])} | {_fmt(s['std'])} |",
         f"| 95% interval of the mean | {ci(d)} | {ci(s)} |",
         f"| evaluation's own standard error (mean over seeds) | {_fmt(d['eval_se'])} | {_fmt(s['eval_se'])} |",
         f"| per seed | {', '.join(_fmt(x) for x in d['values'])} | {', '.join(_fmt(x) for x in s['values'])} |",
         "",
         f"Relative gap DSV / full - 1 (paired by seed): mean {100 * g['mean']:+.2f}%"
         + (f", standard deviation {100 * g['std']:.2f}%, 95% interval {ci(g, pct=True)}" if g["std"] is not None else "")
         + f"; per seed {', '.join(f'{100 * x:+.2f}%' for x in g['values'])}.", "",
         f"**Gap against 1%: {res['verdict']}.**", ""]
    sp = res.get("speedup_after_switch") or {}
    if sp.get("mean") == sp.get("mean"):  # not NaN
        L += [f"DSV speed after its switch: {sp['mean']:.2f}x full attention (mean over seeds); mean sparsity "
              f"{', '.join(_fmt(x, 3) for x in res['dsv_sparsity'])}, recall "
              f"{', '.join(_fmt(x, 3) for x in res['dsv_recall'])} per seed.", ""]
    ev = max([x for x in (d["eval_se"], s["eval_se"]) if x is not None], default=None)
    spread = max([x for x in (d["std"], s["std"]) if x is not None], default=None)
    if ev is not None and spread is not None and ev > 0.5 * spread:
        L += [f"Note: the evaluation's standard error ({ev:.4f}) is not small against the spread over "
              f"seeds ({spread:.4f}): raise --val-videos.", ""]
    L += ["Each seed's own table: `seed<N>/compare.md`.", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))
