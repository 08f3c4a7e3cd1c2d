"""The README's runnable Python examples run as written (CPU).

Blocks that are fragments of a user's own training loop (they call names the user defines, such
as ``compute_loss`` or ``loader``) are skipped; every other ```python block of README.md runs in a
fresh namespace.
"""
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAGMENT_MARKERS = ("compute_loss", "for batch in loader", "path/to/")


def _blocks(path):
    text = open(os.path.join(ROOT, path)).read()
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
            if not any(m in b for m in FRAGMENT_MARKERS)]


BLOCKS = _blocks("README.md")


def test_readme_has_runnable_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i, capsys):
    torch.manual_seed(0)
    exec(compile(BLOCKS[i], f"README.md python block {i}", "exec"), {"__name__": "__readme__"})


ADOPTION_BLOCKS = _blocks("docs/ADOPTION.md")


@pytest.mark.parametrize("i", range(len(ADOPTION_BLOCKS)))
def test_adoption_doc_example_runs(i, capsys):
    if "diffusers" in ADOPTION_BLOCKS[i]:
        pytest.importorskip("diffusers")
    torch.manual_seed(0)
    exec(compile(ADOPTION_BLOCKS[i], f"docs/ADOPTION.md python block {i}", "exec"), {"__name__": "__doc__"})
    out = capsys.readouterr().out
    assert ("2 3" in out) if "from_pretrained" in ADOPTION_BLOCKS[i] else ("True" in out)


# ---------------------------------------------------------------- generated performance numbers
def test_performance_doc_is_up_to_date(tmp_path):
    """docs/PERFORMANCE.md and the README's results table are what benchmarks/make_performance.py
    makes of the committed result JSON (regenerated into tmp_path and compared)."""
    import subprocess
    import sys
    out, readme = tmp_path / "PERFORMANCE.md", tmp_path / "README.md"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "make_performance.py"),
                    "--out", str(out), "--readme", str(readme)], check=True)
    for generated, committed in ((out, "docs/PERFORMANCE.md"), (readme, "README.md")):
        with open(os.path.join(ROOT, committed)) as f:
            assert generated.read_text() == f.read(), (
                f"{committed} is out of date: run python3 benchmarks/make_performance.py")


def test_frontier_figure(tmp_path):
    """benchmarks/plot_frontier.py: one point per recall target of each committed measurement,
    the figure written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_frontier", os.path.join(ROOT, "benchmarks", "plot_frontier.py"))
    pf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pf)
    pts = pf.frontier_points()
    paired, vs_dense, vs_full = pts.values()
    assert [t for t, _, _ in paired] == [0.85, 0.9, 0.95, 0.98]
    assert [t for t, _, _ in vs_dense] == [t for t, _, _ in vs_full] == [0.85, 0.9, 0.95, 0.98]
    assert all(h > 0 for p in pts.values() for _, _, h in p)
    pytest.importorskip("matplotlib")
    pf.main(str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 10000


def test_pooled_interval():
    """make_performance._pooled_half_width: the variance averaged over groups of 3 seeds, Student's
    t with 2 degrees of freedom per group (2.776 for two groups, 2.306 for four)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_performance",
                                                  os.path.join(ROOT, "benchmarks", "make_performance.py"))
    mp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp)
    # variances 1 and 3: pooled 2; the mean of 3 seeds has variance 2 / 3
    assert mp._pooled_half_width([[0.0, 1.0, 2.0], [0.0, 0.0, 3.0]]) == pytest.approx(2.776445 * (2 / 3) ** 0.5)
    assert mp._pooled_half_width([[1.0, 2.0, 3.0]] * 4) == pytest.approx(2.306004 * (1 / 3) ** 0.5)


def test_performance_doc_names_every_run():
    """Every table of PERFORMANCE.md comes with the date, commit and card of its run."""
    text = open(os.path.join(ROOT, "docs", "PERFORMANCE.md")).read()
    sections = re.split(r"\n(?=##+ )", text)
    for sec in sections:
        if "\n|" in sec and not sec.startswith("# ") and not sec.startswith("## Summary"):
            assert re.search(r"Measured [^\n]*20\d\d-\d\d-\d\d[^\n]*, commit [0-9a-f]{7}", sec), sec[:80]


# ---------------------------------------------------------------- links
SKIP_DIRS = {"build", "dist", "runs", "samples", "node_modules", "__pycache__"}


def _slug(heading):
    """GitHub's anchor of a Markdown heading."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path):
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    seen, out = {}, set()
    for h in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        a = _slug(h)
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def _markdown_files(root):
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".") and x not in SKIP_DIRS
                   and not x.endswith(".egg-info")]
        for f in files:
            if f.endswith(".md"):
                yield os.path.join(d, f)


def broken_links(root):
    """(file, link, why) for every relative Markdown link under root that does not resolve to an
    existing file, or to an existing heading when it names an anchor in a Markdown file."""
    bad = []
    for path in _markdown_files(root):
        text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        for link in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
                continue
            target, _, anchor = link.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
            rel = os.path.relpath(path, root)
            if not os.path.exists(dest):
                bad.append((rel, link, "no such file"))
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                bad.append((rel, link, "no such heading"))
    return bad


def test_relative_links_resolve():
    assert broken_links(ROOT) == []


def test_link_check_can_fail(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## A section\n\n[ok](b.md#b-two) [ok](#a-section) "
                                   "[web](https://example.com) `[code](nowhere.md)`\n"
                                   "[bad](missing.md) [bad anchor](b.md#nope) ![img](c.png)\n")
    (tmp_path / "b.md").write_text("# B\n\n## B `two`\n")
    assert sorted((l, why) for _, l, why in broken_links(str(tmp_path))) == [
        ("b.md#nope", "no such heading"), ("c.png", "no such file"), ("missing.md", "no such file")]
