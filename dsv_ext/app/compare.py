"""Full attention vs DSV on the same model, data, seed and steps.

    python -m dsv_ext.app.compare --config configs/small.yaml [--out DIR] [--steps N] [--device cuda]
        [--resume] [--time-limit SECONDS] [--samples N] [--sample-steps N] [--keep-checkpoints]
        [--arms both|dense|dsv] [--seeds N] [--report-only] [--init CKPT]

Trains the config twice with :func:`dsv_ext.app.train.train` (``attention=dense``: plain SDPA, and
``attention=dsv``: DSVAttention under a DSVController), then writes into ``--out`` (default
``runs/compare-<config name>``):

- ``compare.md``: validation loss of both runs (final and at every step both validated) and
  their relative gap, throughput (tokens/s over the whole run, before the switch: DSV's stage-1
  overhead, after it: DSV's stage-2 steps against the dense run's same steps, and over the last
  tenth of the steps, once DSV's blocks have turned sparse), training time
  until each run's validation loss reaches full attention's final one, per-block sparsity,
  predictor loss, recall and dispatch decision (sparse or dense) of the DSV run;
- ``compare_samples.png`` (``--samples N``, default 2): frames of held-out clips and of both
  models' samples from the same noise;
- ``compare.png``: training loss (and validation points) of both runs, their validation loss
  against training time, and DSV's per-block sparsity and predictor recall over the steps, with
  the stage-2 switch marked;
- ``compare.json``: the numbers behind the table; ``dense/`` and ``dsv/``: the two runs
  (metrics, config, summary, ``samples.npz``: the run's rows of the sample strip, written when
  it finishes; their checkpoints are deleted unless ``--keep-checkpoints``).

Long runs in time-limited chunks: ``--time-limit S`` stops the current run with a checkpoint
before S seconds have passed and exits (exit code 0, "incomplete" printed); the same command with
``--resume`` continues it exactly where it stopped (runs already finished are skipped), and the
call that finishes both runs writes the report from the metrics of all chunks.

Two GPUs: ``--arms dense --device cuda:0`` and ``--arms dsv --device cuda:1`` in two processes
with the same ``--out`` train the arms side by side (same init, data, noise and seed: the runs do
not depend on each other); the one that finishes last finds both runs done and writes the report
and the sample strip (or run ``--resume`` once both are done). The arms may also finish on
different machines: a finished run's folder without its checkpoint (metrics, summary,
``samples.npz``) counts as done.

With ``--seeds N`` (N >= 2; 3 or more for a usable interval) the pair is trained N times, seed
``train.seed + i`` for run i (model init, data order, noise), each pair into ``seed<i>/`` as
above, and ``compare_seeds.md`` / ``compare_seeds.json`` report per arm the mean, standard
deviation and 95% confidence interval of the final validation loss over the seeds, the paired
relative gap (DSV / full - 1 per seed) with its interval, the validation set's own standard error
(``train.val_videos`` x ``train.val_timesteps`` samples; raise ``--val-videos`` until it is small
against the seed spread), and whether the gap is resolved relative to 1% (:func:`compare_seeds`, ``dsv_ext/app/seeds.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from .cli import check_numeric_args, run_command
from .common import load_config
from .evaluate import paired_stats, provenance
from .report import fmt, scalar
from .seeds import gap_verdict, seed_stats, write_seeds_table
from .train import train

__all__ = ["compare", "compare_seeds", "write_table", "write_plot", "main"]


def _switch_step(history: List[Dict[str, Any]]) -> Optional[int]:
    for r in history:
        if r.get("stage", 1) == 2:
            return r["step"]
    return None


def _tps_after(history: List[Dict[str, Any]], step: Optional[int]) -> Optional[float]:
    """Mean tokens/s of the logged windows after ``step`` (time-weighted)."""
    if step is None:
        return None
    rows = [r for r in history if r["step"] > step and r.get("tokens_per_s")]
    if not rows:
        return None
    # windows are equal-length, so tokens/time == harmonic mean of the window rates
    return len(rows) / sum(1.0 / r["tokens_per_s"] for r in rows)


def _read_metrics(run_dir: str):
    """The whole run's train and val records from ``metrics.jsonl`` (all resumed chunks)."""
    hist, vals = [], []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                (vals if r.get("kind") == "val" else hist).append(r)
    return hist, vals


def _cumulative_time(history: List[Dict[str, Any]]) -> List[tuple]:
    """``(step, seconds of training steps up to it)`` at every logged step, from (0, 0)."""
    pts, prev, t = [(0, 0.0)], 0, 0.0
    for r in history:
        if r.get("step_time_ms") is None:
            continue
        t += r["step_time_ms"] / 1000.0 * (r["step"] - prev)
        prev = r["step"]
        pts.append((prev, t))
    return pts


def _time_at(pts: List[tuple], step: int) -> Optional[float]:
    for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
        if s0 <= step <= s1:
            return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1)
    return None


def _tps(rows: List[Dict[str, Any]]) -> Optional[float]:
    rows = [r for r in rows if r.get("tokens_per_s")]
    return len(rows) / sum(1.0 / r["tokens_per_s"] for r in rows) if rows else None


def _run_state(run_dir: str, steps: int) -> str:
    """``done`` (summary says complete at ``steps``), ``partial`` (a checkpoint to resume) or
    ``new``."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            s = json.load(f)
        if s.get("complete", True) and s.get("steps") == steps and s.get("last_step", steps) == steps:
            return "done"
    except (OSError, ValueError):
        pass
    return "partial" if os.path.exists(os.path.join(run_dir, "ckpt_last.pt")) else "new"


ARMS = ("dense", "dsv")


def compare(cfg: Dict[str, Any], out_dir: str, steps: Optional[int] = None,
            device: Optional[str] = None, progress: bool = True,
            keep_checkpoints: bool = False, resume: bool = False,
            time_limit_s: Optional[float] = None, samples: int = 0,
            sample_steps: int = 20, min_chunk_s: float = 30.0,
            arms: Sequence[str] = ARMS, init: Optional[str] = None) -> Dict[str, Any]:
    """Train ``cfg`` with full attention and with DSV into ``out_dir``/dense and /dsv, then write
    the report (see the module docstring). Returns the report dict; ``res["complete"]`` is False
    when ``time_limit_s`` ran out first (then only the checkpoints are written: call again with
    ``resume=True`` to continue; runs already finished are not trained again). A run is not
    started or continued with less than ``min_chunk_s`` seconds (or a quarter of the limit) left.
    ``arms``: train only these of "dense" / "dsv" (e.g. one per GPU, two processes on the same
    ``out_dir``); the report is written by the call that finds both runs finished, so a call for
    one arm reports only when the other is already done (else it returns incomplete, keeping the
    checkpoints that the sample strip needs). ``init``: both runs start from this checkpoint's
    weights (and the DSV run from its predictors, where it has them: ``train(init=...)``), e.g. a
    comparison on longer clips than a model was trained on."""
    import time

    arms = tuple(arms)
    if not arms or any(a not in ARMS for a in arms):
        raise ValueError(f"arms: expected a non-empty subset of {ARMS}, got {arms}")
    t_start = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    target = int(steps if steps is not None else (cfg.get("train") or {}).get("steps", 500))
    runs = {}
    complete = True
    for att in ARMS:
        run_dir = os.path.join(out_dir, att)
        state = _run_state(run_dir, target) if (resume or att not in arms) else "new"
        if state == "done":
            runs[att] = None
            continue
        if att not in arms:  # the other process's arm: not finished yet
            complete = False
            continue
        left = None if time_limit_s is None else time_limit_s - (time.perf_counter() - t_start)
        if left is not None and left < min(min_chunk_s, 0.25 * time_limit_s):
            complete = False
            break
        ck = os.path.join(run_dir, "ckpt_last.pt") if state == "partial" else None
        runs[att] = train(cfg, out_dir=run_dir, steps=target, attention=att, device=device,
                          progress=progress, resume=ck, time_limit_s=left, init=init)
        stopped = runs[att]["summary"].get("stopped_by")
        if stopped:  # SIGINT / SIGTERM: keep the checkpoint, run nothing more
            raise KeyboardInterrupt(f"{stopped}: the {att} run stopped at step "
                                    f"{runs[att]['summary']['stopped_at_step']}; its checkpoint is "
                                    f"{os.path.join(run_dir, 'ckpt_last.pt')}")
        if not runs[att]["summary"].get("complete", True):
            complete = False
            break
        if samples > 0:  # the arm's part of the sample strip, while its checkpoint is here
            try:
                write_arm_samples(out_dir, att, num=samples, steps=sample_steps, device=device)
            except ImportError as e:
                print(f"compare: no samples of the {att} run ({e})", file=sys.stderr)
    if not complete:
        done = {a: _read_metrics(os.path.join(out_dir, a))[0] for a in ARMS}
        at = {a: (h[-1]["step"] if h else 0) for a, h in done.items()}
        mine_done = all(_run_state(os.path.join(out_dir, a), target) == "done" for a in arms)
        why = ("the other arm is not finished: the call that finds both finished (or --report-only "
               "for the runs as they stand) writes the report" if mine_done else
               "time limit reached; run the same command with --resume to continue")
        print(f"compare: full attention at step {at['dense']}/{target}, DSV at step "
              f"{at['dsv']}/{target}: {why}", file=sys.stderr)
        return {"complete": False, "steps": target, "progress": at}
    lock = os.path.join(out_dir, ".report.lock")
    if len(arms) < len(ARMS):  # two processes may both find both runs done: one reports
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            note = "both runs are done; the other arm's process writes the report"
            print(f"compare: {note}", file=sys.stderr)
            return {"complete": False, "steps": target, "progress": {a: target for a in ARMS},
                    "note": note}
    res = build_report(cfg, out_dir, _summaries(out_dir))
    # each arm's samples: its samples.npz for this num / steps, else its checkpoint to draw them
    have_parts = all(_arm_samples(out_dir, a, samples, sample_steps) is not None or
                     os.path.exists(os.path.join(out_dir, a, "ckpt_last.pt")) for a in ARMS)
    if samples > 0 and not have_parts:  # a finished comparison reported again: keep its samples
        try:
            with open(os.path.join(out_dir, "compare.json")) as f:
                old = json.load(f).get("samples")
            if old and os.path.exists(os.path.join(out_dir, old["path"])):
                res["samples"] = old
        except (OSError, ValueError):
            pass
    elif samples > 0:
        try:
            res["samples"] = write_sample_strip(out_dir, os.path.join(out_dir, "compare_samples.png"),
                                                num=samples, steps=sample_steps, device=device)
        except ImportError as e:  # Pillow missing
            print(f"compare: no sample strip ({e}); pip install pillow", file=sys.stderr)
    write_report(res, out_dir)
    if not keep_checkpoints:  # keep the folder small enough to commit
        for att in ARMS:
            for f in os.listdir(os.path.join(out_dir, att)):
                if f.startswith("ckpt_") and f.endswith(".pt"):
                    os.remove(os.path.join(out_dir, att, f))
    if os.path.exists(lock):
        os.remove(lock)
    return res


def _summaries(out_dir: str) -> Dict[str, Dict[str, Any]]:
    out = {}
    for att in ("dense", "dsv"):
        path = os.path.join(out_dir, att, "summary.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"--out: no {att} run in {out_dir} ({path} is missing): "
                                    "train both runs first (python -m dsv_ext.app.compare without --report-only)")
        with open(path) as f:
            out[att] = json.load(f)
    return out


def _provenance_line(res: Dict[str, Any]) -> str:
    """'Reported <date> UTC; trained at commit X' (or the commit of each run when they differ:
    runs trained in chunks at different times, see dsv_ext.app.train's summary)."""
    c = res.get("commits") or {}
    cd, cs = c.get("dense"), c.get("dsv")
    if cd and cs and cd != cs:
        code = (f"trained at commit {cd} (full attention) and {cs} (DSV): the tokens/s compare two trees "
                "(a change between them outside attention moves one arm's step time alone; train both "
                "arms at one commit to compare speed)")
    else:
        code = f"trained at commit {cd or cs}" if (cd or cs) else "commit not recorded"
    return f"Reported {res.get('date_utc')} UTC; {code}."


def write_report(res: Dict[str, Any], out_dir: str) -> None:
    """compare.md, compare.png (with matplotlib) and compare.json of a report into out_dir."""
    write_table(res, os.path.join(out_dir, "compare.md"))
    try:
        write_plot(res, os.path.join(out_dir, "compare.png"))
    except ImportError as e:  # matplotlib missing: the table is still written
        print(f"compare: no plot ({e}); pip install matplotlib", file=sys.stderr)
    with open(os.path.join(out_dir, "compare.json"), "w") as f:
        json.dump(res, f, indent=1)


def report_runs(cfg: Dict[str, Any], out_dir: str) -> Dict[str, Any]:
    """The report of the two runs in out_dir as they stand, finished or not (``--report-only``):
    an unfinished pair is compared at the last step both validated (``res["complete"]`` False);
    no training, no samples (an earlier report's strip is kept), checkpoints kept."""
    res = build_report(cfg, out_dir, _summaries(out_dir))
    try:
        with open(os.path.join(out_dir, "compare.json")) as f:
            old = json.load(f).get("samples")
    except (OSError, ValueError):
        old = None
    if old and os.path.exists(os.path.join(out_dir, old.get("path", "compare_samples.png"))):
        res["samples"] = old
    write_report(res, out_dir)
    return res


def stage2_val_gap(run: Dict[str, Any]) -> Optional[float]:
    """DSV / full - 1 of the mean validation loss over every validation both runs of a pair made
    after DSV's switch (``val_at_equal_steps``, steps > ``switch_step``): the validation losses of
    one run move by several evaluation errors from one validation to the next late in training,
    so the mean over the sparse stage resolves a gap better than the last one alone. None when
    no validation followed the switch."""
    sw = run.get("switch_step")
    pts = [e for e in run.get("val_at_equal_steps") or [] if sw is not None and e["step"] > sw]
    if not pts:
        return None
    dense = sum(e["dense"] for e in pts) / len(pts)
    return sum(e["dsv"] for e in pts) / len(pts) / dense - 1 if dense else None


def compare_seeds(cfg: Dict[str, Any], out_dir: str, seeds: int, steps: Optional[int] = None,
                  device: Optional[str] = None, progress: bool = True,
                  keep_checkpoints: bool = False, **kw) -> Dict[str, Any]:
    """:func:`compare` (``kw``: its further options) for ``seeds`` consecutive seeds
    (``train.seed + i``) into ``out_dir/seed<i>``, then mean, spread and 95% intervals per arm and
    of the paired gap (``compare_seeds.md/json``; statistics of :mod:`dsv_ext.app.seeds`).

        res = compare_seeds(load_config("configs/small.yaml"), "runs/compare-small-seeds", 3, device="cuda")
    """
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise ValueError(f"seeds: expected an integer >= 1, got {seeds!r}")
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
    late = [stage2_val_gap(r) for r in runs]
    late_gap = seed_stats([g for g in late if g is not None]) if all(g is not None for g in late) else None
    dsv = [r["dsv"] for r in runs]
    res = {
        "config": cfg.get("name"), "seeds": [base + i for i in range(seeds)], "steps": runs[0]["steps"],
        "device": runs[0]["device"], "tokens_per_sample": runs[0]["tokens_per_sample"],
        "val_videos": (cfg.get("train") or {}).get("val_videos"),
        "val_timesteps": (cfg.get("train") or {}).get("val_timesteps"),
        "arms": arms, "rel_gap": gap, "verdict": gap_verdict(gap["ci95"]),
        "stage2_rel_gap": late_gap,
        "stage2_verdict": gap_verdict(late_gap["ci95"]) if late_gap else None,
        "switch_steps": [r["switch_step"] for r in runs],
        "speedup_after_switch": seed_stats([r["dsv_tokens_per_s_after_switch"] / r["dense_tokens_per_s_after_switch"]
                                            for r in runs if r["dsv_tokens_per_s_after_switch"]
                                            and r["dense_tokens_per_s_after_switch"]] or [float("nan")]),
        "dsv_sparsity": [scalar(d.get("dsv_sparsity")) for d in dsv],
        "dsv_recall": [scalar(d.get("dsv_recall")) for d in dsv],
        "dsv_sparse_blocks": [d.get("dsv_sparse_blocks") for d in dsv],
        "runs": runs,
    }
    res["provenance"] = provenance(runs[0]["device"])
    write_seeds_table(res, os.path.join(out_dir, "compare_seeds.md"))
    with open(os.path.join(out_dir, "compare_seeds.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def _paired_gap(val: Dict[str, List[Dict[str, Any]]], step: Optional[int]) -> Optional[Dict[str, Any]]:
    """DSV minus full attention, video by video, at the validation of ``step`` (both runs saw
    the same held-out clips, timesteps and noise): the mean difference relative to full
    attention's loss and its standard error over the videos, which leaves out how much the
    videos differ from each other (the same in both runs). None where a run did not record its
    per-video losses or there is one video."""
    rec = {a: next((r for r in val[a] if r["step"] == step), None) for a in ("dense", "dsv")}
    pv = {a: (r or {}).get("val_loss_per_video") for a, r in rec.items()}
    if step is None or not pv["dense"] or not pv["dsv"] or len(pv["dense"]) != len(pv["dsv"]) or len(pv["dense"]) < 2:
        return None
    import torch

    st = paired_stats(torch.tensor(pv["dense"], dtype=torch.float64), torch.tensor(pv["dsv"], dtype=torch.float64), 1)
    return {"step": step, **{k: st[k] for k in ("videos", "diff", "diff_se", "rel", "rel_se")}}


def _trained_on(out_dir: str, d: Dict[str, Any], s: Dict[str, Any], key: str) -> Optional[str]:
    """``card`` or ``torch`` of the two runs' training: their summaries' (runs of this version;
    two values: both), else the run folder's meta.json (benchmarks/compare_long.sh) or an earlier
    report's, else this machine's (a card only where it reports on CUDA runs on CUDA)."""
    vals = {x.get(key) for x in (d, s) if x.get(key)}
    if vals:
        return " / ".join(sorted(vals))
    cuda_runs = str(d.get("device", "")).startswith("cuda")
    if key == "card" and not cuda_runs:
        return None
    for f in ("meta.json", "compare.json"):
        try:
            with open(os.path.join(out_dir, f)) as fh:
                v = json.load(fh).get(key)
        except (OSError, ValueError):
            continue
        if v:
            return v
    import torch

    if key == "torch":
        return torch.__version__
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def build_report(cfg: Dict[str, Any], out_dir: str, summaries: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The numbers of ``compare.json`` from the two runs' folders (metrics of every chunk)."""
    hist, val = {}, {}
    for att in ("dense", "dsv"):
        hist[att], val[att] = _read_metrics(os.path.join(out_dir, att))
    d, s = summaries["dense"], summaries["dsv"]
    sw = _switch_step(hist["dsv"])  # first logged stage-2 line: windows after it are all stage 2
    switch = s.get("dsv_switch_step")  # the controller's actual switch step
    ctime = {a: _cumulative_time(hist[a]) for a in ("dense", "dsv")}
    tokens = d["tokens_per_sample"] * d["batch_size"]
    # whole-run throughput over every chunk of a resumed run
    total_t = {a: (ctime[a][-1][1] if len(ctime[a]) > 1 else None) for a in ("dense", "dsv")}
    tps = {a: (ctime[a][-1][0] * tokens / total_t[a] if total_t[a] else None) for a in ("dense", "dsv")}
    # stage 1 (before the switch): windows logged in stage 1, the first (warm-up) left out
    s1_steps = [r["step"] for r in hist["dsv"] if r.get("stage", 1) == 1][1:]
    before = {a: _tps([r for r in hist[a] if r["step"] in s1_steps]) for a in ("dense", "dsv")}
    after = {a: _tps_after(hist[a], sw) for a in ("dense", "dsv")}
    # the last tenth of the steps both runs logged: stage 2 once the blocks have turned sparse
    # (the average after the switch also holds the steps before they did)
    both = min(hist[a][-1]["step"] for a in ("dense", "dsv")) if hist["dense"] and hist["dsv"] else 0
    end_from = int(0.9 * both) if sw is not None and int(0.9 * both) >= sw else None
    end = {a: (_tps([r for r in hist[a] if end_from < r["step"] <= both]) if end_from is not None else None)
           for a in ("dense", "dsv")}
    # validation loss at the steps both runs validated
    vd = {r["step"]: r["val_loss"] for r in val["dense"]}
    vs = {r["step"]: r["val_loss"] for r in val["dsv"]}
    equal = [{"step": k, "dense": vd[k], "dsv": vs[k], "rel_gap": vs[k] / vd[k] - 1 if vd[k] else None}
             for k in sorted(set(vd) & set(vs))]
    final_d = val["dense"][-1]["val_loss"] if val["dense"] else d.get("final_val_loss")
    final_s = val["dsv"][-1]["val_loss"] if val["dsv"] else s.get("final_val_loss")
    # the gap at the last step both runs validated (their final step once both are complete)
    gap_at = equal[-1] if equal else (
        {"step": None, "rel_gap": final_s / final_d - 1} if final_d and final_s is not None else None)
    paired = _paired_gap(val, None if gap_at is None else gap_at["step"])
    last = {a: x.get("last_step", x.get("steps")) for a, x in (("dense", d), ("dsv", s))}
    complete = all(x.get("complete", True) and x.get("last_step", x.get("steps")) == x.get("steps") for x in (d, s))
    # wall-clock (training steps) until the validation loss reaches full attention's final one
    reach = {}
    for a in ("dense", "dsv"):
        hit = next((r for r in val[a] if final_d is not None and r["val_loss"] <= final_d), None)
        reach[a] = None if hit is None else {"step": hit["step"], "time_s": _time_at(ctime[a], hit["step"])}
    import time

    res = {
        "config": cfg.get("name"),
        "complete": complete,
        "last_steps": last,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commits": {"dense": d.get("commit"), "dsv": s.get("commit")},
        "card": _trained_on(out_dir, d, s, "card"),
        "torch": _trained_on(out_dir, d, s, "torch"),
        "steps": d["steps"],
        "device": d["device"],
        "tokens_per_sample": d["tokens_per_sample"],
        "dense": dict(d, final_val_loss=final_d, tokens_per_s=tps["dense"], train_time_s=total_t["dense"]),
        "dsv": dict(s, final_val_loss=final_s, tokens_per_s=tps["dsv"], train_time_s=total_t["dsv"]),
        "switch_step": switch if switch is not None else sw,
        "init_from": d.get("init_from") or s.get("init_from"),
        "val_loss_rel_gap": None if gap_at is None else gap_at["rel_gap"],
        "val_loss_gap_step": None if gap_at is None else gap_at["step"],
        "val_loss_paired": paired,
        "val_at_equal_steps": equal,
        "dense_tokens_per_s_before_switch": before["dense"],
        "dsv_tokens_per_s_before_switch": before["dsv"],
        "stage1_overhead": (None if not before["dense"] or not before["dsv"]
                            else before["dense"] / before["dsv"] - 1),
        "dense_tokens_per_s_after_switch": after["dense"],
        "dsv_tokens_per_s_after_switch": after["dsv"],
        "end_steps": None if end_from is None else [end_from + 1, both],
        "dense_tokens_per_s_end": end["dense"],
        "dsv_tokens_per_s_end": end["dsv"],
        "time_to_dense_final_val": reach,
        "blocks": (hist["dsv"][-1].get("blocks") if hist["dsv"] else None) or [],
        "dispatch": {k: (cfg.get("dsv") or {}).get(k) for k in
                     ("use_calibration", "auto_calibrate", "dispatch_threshold")},
        "history": hist,
        "val": val,
    }
    return res


ARM_SAMPLES = "samples.npz"


def write_arm_samples(out_dir: str, att: str, num: int = 2, steps: int = 20,
                      device: Optional[str] = None, frames_shown: int = 4) -> Dict[str, Any]:
    """One arm's rows of the sample strip, from ``<out_dir>/<att>/ckpt_last.pt`` into
    ``<att>/samples.npz`` (small: frames at the latent resolution), so that the strip can be
    drawn after the checkpoint is gone (each arm finished in its own job or on its own
    machine): ``frames_shown`` frames, evenly spaced in time, of ``num`` held-out data clips
    and of the model's samples from ``num`` noises (a fixed generator: the same noises for
    both arms; ``steps`` Euler steps). Returns the arm's entry (mode, num, steps)."""
    import numpy as np
    import torch

    from .data import make_dataset
    from .sample import latents_to_frames, load_for_sampling, sample_latents

    sm = load_for_sampling(os.path.join(out_dir, att, "ckpt_last.pt"), device)
    cfg = sm.config
    src = (cfg.get("data") or {}).get("source", "procedural")
    norm = "joint" if src in ("video", "folder") or (cfg.get("data") or {}).get("mode") == "pixels" else "channel"
    c, t, h, w = (cfg["data"].get("channels", 4), cfg["data"]["frames"], cfg["data"]["height"],
                  cfg["data"]["width"])
    vcfg = dict(cfg["data"])
    if src in ("procedural", "video"):
        vcfg["num_val"] = max(num, 1)
    val = make_dataset(vcfg, "val", seed=int(cfg["train"].get("seed", 0)))
    g = torch.Generator().manual_seed(1234)
    sel = np.linspace(0, t - 1, min(frames_shown, t)).round().astype(int)
    prec = cfg["train"].get("precision", "auto")
    data, model = [], []
    for i in range(num):
        noise = torch.randn(1, c, t, h, w, generator=g)
        if i < len(val):
            data.append(latents_to_frames(val[i], normalize=norm, scale=1)[sel])
        with torch.no_grad():
            z = sample_latents(sm.model, noise.to(sm.device), steps, precision=prec)[0]
        model.append(latents_to_frames(z, normalize=norm, scale=1)[sel])
    info = {"mode": sm.mode, "num": num, "steps": steps, "frames_shown": [int(x) for x in sel]}
    del sm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    np.savez_compressed(os.path.join(out_dir, att, ARM_SAMPLES),
                        data=np.stack(data) if data else np.zeros((0,), np.uint8),
                        model=np.stack(model), info=json.dumps(info))
    return info


def _arm_samples(out_dir: str, att: str, num: int, steps: int):
    """``(info, data frames, model frames)`` of an arm's samples.npz written for ``num`` noises
    and ``steps`` Euler steps, else None."""
    import numpy as np

    path = os.path.join(out_dir, att, ARM_SAMPLES)
    if not os.path.exists(path):
        return None
    with np.load(path) as z:
        info = json.loads(str(z["info"]))
        if info.get("num") != num or info.get("steps") != steps:
            return None
        return info, z["data"], z["model"]


def write_sample_strip(out_dir: str, path: str, num: int = 2, steps: int = 20,
                       device: Optional[str] = None, frames_shown: int = 4,
                       min_height: int = 128) -> Dict[str, Any]:
    """A PNG: for ``num`` starting noises, ``frames_shown`` frames of a held-out data clip, then
    of the full-attention model's sample, then of DSV's (same noise, ``steps`` Euler steps), one
    row each, from each arm's samples.npz (write_arm_samples; written here from the arm's
    ``ckpt_last.pt`` where it is missing), upscaled to at least ``min_height`` pixels."""
    import numpy as np
    from PIL import Image, ImageDraw

    parts = {}
    for att in ARMS:
        parts[att] = _arm_samples(out_dir, att, num, steps)
        if parts[att] is None:
            write_arm_samples(out_dir, att, num=num, steps=steps, device=device,
                              frames_shown=frames_shown)
            parts[att] = _arm_samples(out_dir, att, num, steps)
    data = parts["dense"][1]
    rows, labels = [], []
    for i in range(num):
        if i < len(data):
            rows.append(data[i])
            labels.append(f"data {i}")
        for att in ARMS:
            rows.append(parts[att][2][i])
            labels.append(("full attn" if att == "dense" else "DSV") + f" {i}")
    sc = max(1, -(-min_height // rows[0].shape[1]))
    rows = [r.repeat(sc, axis=1).repeat(sc, axis=2) for r in rows]
    nsel = rows[0].shape[0]
    fh, fw = rows[0].shape[1:3]
    gap, margin = 2, 70
    img = np.full((len(rows) * (fh + gap), margin + nsel * (fw + gap), 3), 255, np.uint8)
    for r, fr in enumerate(rows):
        for j in range(nsel):
            y, x = r * (fh + gap), margin + j * (fw + gap)
            img[y:y + fh, x:x + fw] = fr[j]
    im = Image.fromarray(img)
    draw = ImageDraw.Draw(im)
    for r, lab in enumerate(labels):
        draw.text((3, r * (fh + gap) + fh // 2 - 5), lab, fill=(0, 0, 0))
    im.save(path)
    info = {"num": num, "steps": steps, "solver": "euler",
            "dense_mode": parts["dense"][0]["mode"], "dsv_mode": parts["dsv"][0]["mode"],
            "path": os.path.basename(path), "frames_shown": parts["dense"][0]["frames_shown"]}
    return info


def write_table(res: Dict[str, Any], path: str) -> None:
    d, s = res["dense"], res["dsv"]
    partial = not res.get("complete", True)
    last = res.get("last_steps") or {}
    gap_step = res.get("val_loss_gap_step")
    gap = res["val_loss_rel_gap"]
    vs_full = "-" if gap is None else f"{100 * gap:+.2f}% vs full"
    if partial:  # a report of unfinished runs (--report-only): compare at the last common step
        eq = {e["step"]: e for e in res.get("val_at_equal_steps") or []}.get(gap_step)
        lv = {a: (res.get("val") or {}).get(a) or [] for a in ("dense", "dsv")}
        val_rows = [f"| validation loss at step {fmt(gap_step)} (the last both runs validated) | "
                    f"{fmt(eq['dense'] if eq else None)} | {fmt(eq['dsv'] if eq else None)} ({vs_full}) |",
                    "| validation loss at the last validation | " + " | ".join(
                        f"{fmt(v[-1]['val_loss'])} (step {v[-1]['step']})" if v else "-"
                        for v in (lv["dense"], lv["dsv"])) + " |"]
    else:
        val_rows = [f"| validation loss | {fmt(d['final_val_loss'])} | {fmt(s['final_val_loss'])} ({vs_full}) |"]
    steps_txt = (f"Unfinished runs: full attention at step {last.get('dense')}, DSV at step {last.get('dsv')} "
                 f"of {res['steps']}" if partial else f"{res['steps']} steps")
    L = [f"# Full attention vs DSV: `{res['config']}`", "",
         f"{steps_txt}, {res['tokens_per_sample']} tokens per video, "
         f"batch {d['batch_size']}, device `{res['device']}`"
         + (f" ({res['card']})" if res.get("card") else "") + "; same model init"
         + (f" (the weights of `{os.path.basename(res['init_from'])}`)" if res.get("init_from") else "")
         + ", data, noise "
         f"and seed. DSV switched to stage 2 at step {fmt(res['switch_step'])}. {_provenance_line(res)}", "",
         "| | full attention | DSV |", "|---|---|---|"] + val_rows + [
         f"| final training loss (last log window) | {fmt(d['final_train_loss'])} | {fmt(s['final_train_loss'])} |",
         f"| throughput, whole run (tokens/s) | {fmt(d['tokens_per_s'], 0)} | {fmt(s['tokens_per_s'], 0)} |",
         f"| throughput before the switch (tokens/s; DSV stage 1) | "
         f"{fmt(res.get('dense_tokens_per_s_before_switch'), 0)} | "
         f"{fmt(res.get('dsv_tokens_per_s_before_switch'), 0)}"
         + (f" ({100 * res['stage1_overhead']:+.1f}% step time) |" if res.get("stage1_overhead") is not None else " |"),
         f"| throughput after the switch (tokens/s) | {fmt(res['dense_tokens_per_s_after_switch'], 0)} "
         f"| {fmt(res['dsv_tokens_per_s_after_switch'], 0)} |",
         f"| speed-up after the switch | 1.00x | "
         + (f"{res['dsv_tokens_per_s_after_switch'] / res['dense_tokens_per_s_after_switch']:.2f}x |"
            if res["dsv_tokens_per_s_after_switch"] and res["dense_tokens_per_s_after_switch"] else "- |"),
         ] + ([f"| throughput over the last tenth of the steps (tokens/s; steps {res['end_steps'][0]}-"
               f"{res['end_steps'][1]}) | {fmt(res['dense_tokens_per_s_end'], 0)} | {fmt(res['dsv_tokens_per_s_end'], 0)} "
               f"({res['dsv_tokens_per_s_end'] / res['dense_tokens_per_s_end']:.2f}x) |"]
              if res.get("dsv_tokens_per_s_end") and res.get("dense_tokens_per_s_end") else []) + [
         "| training time (s) | " + " | ".join(
             fmt(x["train_time_s"], 1) + (f" ({last.get(a)} steps)" if partial else "")
             for a, x in (("dense", d), ("dsv", s))) + " |",
         f"| training time to full attention's final validation loss (s) | "
         + " | ".join(_reach(res, a) for a in ("dense", "dsv")) + " |",
         f"| validation loss standard error (over videos) | {fmt(d.get('final_val_loss_se'))} "
         f"| {fmt(s.get('final_val_loss_se'))} |"]
    pg = res.get("val_loss_paired")
    if pg and pg.get("rel") is not None:
        L.append(f"| validation loss, DSV minus full attention video by video (step {pg['step']}, "
                 f"{pg['videos']} videos) | - | {100 * pg['rel']:+.2f}% +- {100 * pg['rel_se']:.2f}% "
                 "(standard error of the paired difference) |")
    L += [f"| mean sparsity (EMA, theta=0.9) | - | {fmt(scalar(s.get('dsv_sparsity')), 3)} |",
          f"| predictor recall | - | {fmt(scalar(s.get('dsv_recall')), 3)} |", ""]
    equal = res.get("val_at_equal_steps") or []
    if equal:
        L += ["Validation loss at equal steps:", "", "| step | full attention | DSV | DSV vs full |",
              "|---|---|---|---|"]
        for e in equal:
            gap = e.get("rel_gap")
            L.append(f"| {e['step']} | {fmt(e['dense'])} | {fmt(e['dsv'])} | "
                     f"{'-' if gap is None else f'{100 * gap:+.2f}%'} |")
        L.append("")
    blocks = res.get("blocks") or []
    if blocks:
        L += ["Per block (DSV run, end of training):", "",
              "| block | sparsity | predictor loss | recall | runs sparse | mean K / S |",
              "|---|---|---|---|---|---|"]
        for i, b in enumerate(blocks):
            L.append(f"| {i} (`{b.get('name', '')}`) | {fmt(b.get('sparsity'), 3)} | "
                     f"{fmt(b.get('pred_loss'), 4)} | {fmt(b.get('recall'), 3)} | "
                     f"{fmt(b.get('sparse'))} | {_k_frac(b, res.get('tokens_per_sample'))} |")
        L.append("")
    disp = res.get("dispatch") or {}
    if disp.get("use_calibration") is not False:
        L += ["Dispatcher: it chose per block (calibrated dense vs sparse time on this "
              "device where a table exists, else the sparsity threshold "
              f"{fmt(disp.get('dispatch_threshold') if disp.get('dispatch_threshold') is not None else 0.8, 2)}); "
              "blocks it kept dense run full attention in stage 2.", ""]
    if disp.get("use_calibration") is False:
        thr = disp.get("dispatch_threshold")
        L += [f"Dispatch: this config turns the calibrated speed model off and runs a block sparse "
              f"whenever its measured sparsity is at least {fmt(thr if thr is not None else 0.8, 2)}, "
              "so the speed-up above shows that rule (chosen to test quality), not what the "
              "dispatcher would pick for speed.", ""]
    smp = res.get("samples")
    if smp:
        L += [f"Samples: `{smp['path']}`: per row, frames {smp['frames_shown']} of a held-out clip, "
              f"then the full-attention and the DSV model's samples from the same noise "
              f"({smp['steps']} Euler steps; DSV samples {smp.get('dsv_mode')}).", ""]
    L += ["Training time sums the step times (no validation, start-up or checkpoints); throughput "
          "before the switch leaves the first logged window (warm-up) out.",
          "Throughput counts forward + backward + optimizer + DSV controller work per step; "
          "stage 1 of DSV includes predictor training and profiling on top of dense attention.",
          "Sparsity: fraction of keys outside the critical set (softmax mass 0.9) from the profiler's "
          "sampled rows; recall: exact attention mass covered by the predicted top-K index.", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def _k_frac(block: Dict[str, Any], seq_len: Optional[int]) -> str:
    ks = block.get("head_k") or []
    if not ks or not seq_len or not block.get("sparse"):
        return "-"
    return f"{sum(ks) / len(ks) / seq_len:.3f}"


def _reach(res: Dict[str, Any], att: str) -> str:
    r = (res.get("time_to_dense_final_val") or {}).get(att)
    if not r:
        return "not reached"
    return f"{fmt(r['time_s'], 1)} (step {r['step']})"


def write_plot(res: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a4, a2, a3) = plt.subplots(1, 4, figsize=(21, 4.2))
    for att, color in (("dense", "tab:blue"), ("dsv", "tab:orange")):
        pts = _cumulative_time(res["history"][att])
        v = [(_time_at(pts, r["step"]), r["val_loss"]) for r in res["val"][att]]
        v = [(t, l) for t, l in v if t is not None]
        if v:
            a4.plot(*zip(*v), "o-", color=color,
                    label="full attention" if att == "dense" else "DSV")
    a4.set_xlabel("training time (s, steps only)")
    a4.set_ylabel("validation loss")
    a4.set_title("validation loss vs time")
    a4.legend(fontsize=8)
    for att, color in (("dense", "tab:blue"), ("dsv", "tab:orange")):
        h = res["history"][att]
        a1.plot([r["step"] for r in h], [r["loss"] for r in h], color=color, alpha=0.6,
                label=f"{'full attention' if att == 'dense' else 'DSV'} (train)")
        v = res["val"][att]
        a1.plot([r["step"] for r in v], [r["val_loss"] for r in v], "o--", color=color,
                label=f"{'full attention' if att == 'dense' else 'DSV'} (validation)")
    sw = res.get("switch_step")
    for ax in (a1, a2, a3):
        if sw is not None:
            ax.axvline(sw, color="gray", ls=":", label="DSV stage 2")
    a1.set_xlabel("step")
    a1.set_ylabel("flow-matching loss")
    a1.legend(fontsize=8)
    a1.set_title("loss")
    h = res["history"]["dsv"]
    nblk = max((len(r.get("blocks") or []) for r in h), default=0)
    for i in range(nblk):
        pts = [(r["step"], r["blocks"][i].get("sparsity")) for r in h
               if len(r.get("blocks") or []) > i and r["blocks"][i].get("sparsity") is not None]
        if pts:
            a2.plot(*zip(*pts), label=f"block {i}")
    if nblk == 0:
        pts = [(r["step"], scalar(r.get("sparsity"))) for r in h if scalar(r.get("sparsity")) is not None]
        if pts:
            a2.plot(*zip(*pts), label="mean")
    a2.set_xlabel("step")
    a2.set_ylabel("sparsity (theta = 0.9)")
    a2.set_ylim(0, 1)
    a2.set_title("DSV per-block sparsity")
    a2.legend(fontsize=8, ncol=2)
    for i in range(nblk):
        pts = [(r["step"], r["blocks"][i].get("recall")) for r in h
               if len(r.get("blocks") or []) > i and r["blocks"][i].get("recall") is not None]
        if pts:
            a3.plot(*zip(*pts), label=f"block {i}")
    a3.axhline(0.9, color="black", lw=0.8, ls="--", label="target 0.9")
    a3.set_xlabel("step")
    a3.set_ylabel("attention mass covered by the predicted index")
    a3.set_ylim(0, 1.02)
    a3.set_title("DSV predictor recall")
    a3.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv_ext.app.compare",
                                description="Train with full attention and with DSV; compare.")
    p.add_argument("--config", required=True)
    p.add_argument("--out", default=None, help="output folder (default runs/compare-<name>)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SEC.KEY=VALUE")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep dense/ckpt_last.pt and dsv/ckpt_last.pt (deleted by default)")
    p.add_argument("--resume", action="store_true",
                   help="continue the runs found in --out (finished runs are not trained again)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop with checkpoints before this wall time; continue with --resume")
    p.add_argument("--samples", type=int, default=2,
                   help="noises sampled by both models for compare_samples.png (0: none)")
    p.add_argument("--sample-steps", type=int, default=20, help="Euler steps per sample")
    p.add_argument("--seeds", type=int, default=1,
                   help="train each arm with this many seeds (train.seed + i) and report mean, spread and "
                        "95%% intervals (compare_seeds.md); 3 or more for an interval worth reading")
    p.add_argument("--report-only", action="store_true",
                   help="write compare.md / .png / .json from the runs in --out as they stand (also "
                        "unfinished ones: compared at the last step both validated); trains nothing")
    p.add_argument("--arms", choices=("both",) + ARMS, default="both",
                   help="train only one arm (e.g. --arms dense --device cuda:0 and --arms dsv "
                        "--device cuda:1 in two processes on the same --out); the call that finds "
                        "both runs finished writes the report")
    p.add_argument("--val-videos", type=int, default=None,
                   help="validation videos (overrides train.val_videos; each at every train.val_timesteps)")
    p.add_argument("--init", default=None, metavar="CKPT",
                   help="both runs start from this checkpoint's weights (the DSV run also from its "
                        "predictors; python -m dsv_ext.app.train --init), e.g. with --set data.frames=32 "
                        "after a model trained on 16 frames")
    a = p.parse_args(argv)

    def body() -> int:
        check_numeric_args(a, ints={"steps": 1, "samples": 0}, numbers={"time_limit": 0})
        if a.seeds < 1:
            raise ValueError(f"--seeds: expected an integer >= 1, got {a.seeds}")
        ov = list(a.overrides)
        if a.val_videos is not None:
            if a.val_videos < 1:
                raise ValueError(f"--val-videos: expected an integer >= 1, got {a.val_videos}")
            ov.append(f"train.val_videos={a.val_videos}")
        cfg = load_config(a.config, ov)
        out = a.out or os.path.join("runs", f"compare-{cfg.get('name', 'run')}")
        if a.report_only:
            if a.seeds > 1:
                raise ValueError("--report-only: reports one pair (--seeds 1)")
            report_runs(cfg, out)
            print(open(os.path.join(out, "compare.md")).read())
            print(f"outputs in {out}")
            return 0
        arms = ARMS if a.arms == "both" else (a.arms,)
        if a.seeds > 1 and a.arms != "both":
            raise ValueError("--arms: one arm at a time trains one pair (--seeds 1)")
        if a.seeds > 1:  # the pair per seed, then the statistics over seeds (dsv_ext/app/seeds.py)
            r = compare_seeds(cfg, out, a.seeds, steps=a.steps, device=a.device,
                              progress=not a.no_progress, keep_checkpoints=a.keep_checkpoints,
                              resume=a.resume, time_limit_s=a.time_limit, samples=a.samples,
                              sample_steps=a.sample_steps, init=a.init)
            return report(r, out, "compare_seeds.md")
        res = compare(cfg, out, steps=a.steps, device=a.device, progress=not a.no_progress,
                      keep_checkpoints=a.keep_checkpoints, resume=a.resume,
                      time_limit_s=a.time_limit, samples=a.samples, sample_steps=a.sample_steps,
                      arms=arms, init=a.init)
        return report(res, out, "compare.md")

    def report(res, out: str, md: str) -> int:
        if not res.get("complete", True):
            print(res.get("note") or f"incomplete: {json.dumps(res['progress'])} of {res['steps']} "
                  f"steps; continue with --resume --out {out}")
            return 0
        print(open(os.path.join(out, md)).read())
        print(f"outputs in {out}")
        return 0

    def guarded() -> int:
        try:
            return body()
        except KeyboardInterrupt as e:
            print(f"{p.prog}: interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
            return 143 if str(e).startswith("SIGTERM") else 130

    return run_command(p.prog, guarded)


if __name__ == "__main__":
    sys.exit(main())
