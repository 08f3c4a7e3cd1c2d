"""The quality frontier on real video in one figure, from the committed results (measures nothing).

    python3 benchmarks/plot_frontier.py        # -> benchmarks/results/frontier-small-video.png

Per recall target, the validation loss change of DSV on `configs/small-video.yaml`:
- paired evaluation (`results/evaluate-small-video/`): one checkpoint evaluated with every block
  sparse against full attention, same videos and noise (+- 2 standard errors);
- sparse training, three seeds (`results/compare-seeds-sparse-small-video*/`): each seed's DSV run
  trained sparse after the switch against its DSV run that stayed dense (same stage 1; 95%
  interval with the noise pooled over the targets), and against full attention (95% intervals,
  Student's t).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from make_performance import RESULTS, SPARSE_SEED_RUNS, _frontier, _load, _pooled_half_width, _sparse_vs_dense_dsv  # noqa: E402

OUT = os.path.join(RESULTS, "frontier-small-video.png")


def frontier_points():
    """{series: [(target, value, half-width of its interval)]}, values as relative changes."""
    ev = _load("evaluate-small-video/evaluate.json")
    sd = _load("compare-seeds-small-video/compare_seeds.json")
    pts = {"paired evaluation, every block sparse (+- 2 s.e.)":
           [(t, a["rel"], 2 * a["rel_se"]) for t, a, _, _ in _frontier(ev)],
           "sparse training vs the same seeds' dense-after-switch runs (95%, noise pooled over the targets)": [],
           "sparse training vs full attention (95%)": []}
    names = list(pts)
    runs = [(t, _load(name + "/compare_seeds.json")) for t, name in SPARSE_SEED_RUNS]
    h = _pooled_half_width([_sparse_vs_dense_dsv(sd, r, values=True) for _, r in runs])
    for t, r in runs:
        m, _ = _sparse_vs_dense_dsv(sd, r)
        pts[names[1]].append((t, m, h))
        g = r["rel_gap"]
        pts[names[2]].append((t, g["mean"], (g["ci95"][1] - g["ci95"][0]) / 2))
    return pts


def main(out=OUT):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, (label, p) in enumerate(frontier_points().items()):
        x = [t + (i - 1) * 0.003 for t, _, _ in p]  # side by side at each target
        ax.errorbar(x, [100 * v for _, v, _ in p], yerr=[100 * h for _, _, h in p], fmt="o-", capsize=3,
                    label=label)
    ax.axhline(1.0, ls="--", lw=0.8, color="gray", label="+1%")
    ax.axhline(0.0, lw=0.6, color="black")
    ax.set_xlabel("recall target")
    ax.set_ylabel("validation loss change (%)")
    ax.set_title("DSV on real video (configs/small-video.yaml, 16k tokens)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
