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
