"""The up-to-date check of .ci/install (dsv_ext/_buildcheck.py): skip the build only when the
recorded build matches the sources and the wanted settings."""
import json
import os
import re
import subprocess
import sys

import pytest

import dsv_ext
from dsv_ext import _buildcheck as bc

ARCH = bc.DEFAULT_CUDA_ARCH


def _tree(tmp_path):
    """A minimal checkout: csrc/ with a C file and a header, setup.py, pyproject.toml."""
    (tmp_path / "csrc" / "cpu").mkdir(parents=True)
    (tmp_path / "csrc" / "cpu" / "a.c").write_text("int a(void) { return 1; }\n")
    (tmp_path / "csrc" / "dsv.h").write_text("int a(void);\n")
    (tmp_path / "setup.py").write_text("# setup\n")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tmp_path / "dsv_ext").mkdir()
    return tmp_path


def test_source_files_and_digest(tmp_path):
    root = _tree(tmp_path)
    assert bc.source_files(str(root)) == ["csrc/cpu/a.c", "csrc/dsv.h", "pyproject.toml", "setup.py"]
    d0 = bc.source_digest(str(root))
    assert re.fullmatch(r"[0-9a-f]{64}", d0)
    assert bc.source_digest(str(root)) == d0  # deterministic
    # editor / cache droppings do not count
    (root / "csrc" / ".a.c.swp").write_text("x")
    (root / "csrc" / "__pycache__").mkdir()
    (root / "csrc" / "__pycache__" / "x.pyc").write_text("x")
    assert bc.source_digest(str(root)) == d0
    # every change to what the build reads does
    changes = [
        lambda: (root / "csrc" / "cpu" / "a.c").write_text("int a(void) { return 2; }\n"),
        lambda: (root / "csrc" / "cuda").mkdir() or (root / "csrc" / "cuda" / "k.cu").write_text("\n"),
        lambda: (root / "setup.py").write_text("# setup, changed\n"),
        lambda: (root / "pyproject.toml").write_text("[project]\nname = 'y'\n"),
        lambda: (root / "csrc" / "cuda" / "k.cu").rename(root / "csrc" / "cuda" / "j.cu"),
    ]
    seen = {d0}
    for change in changes:
        change()
        d = bc.source_digest(str(root))
        assert d not in seen
        seen.add(d)


def test_digest_separates_names_and_contents(tmp_path):
    # moving bytes between two files or names changes the digest
    (tmp_path / "a").write_text("xy")
    (tmp_path / "b").write_text("")
    d1 = bc.source_digest(str(tmp_path), ["a", "b"])
    (tmp_path / "a").write_text("x")
    (tmp_path / "b").write_text("y")
    assert bc.source_digest(str(tmp_path), ["a", "b"]) != d1


@pytest.mark.parametrize("cuda", [False, True])
def test_stale_reason(cuda):
    rec = bc.build_record("d" * 64, cuda, ARCH, True, "2.14.1", "13.0")
    assert bc.stale_reason(rec, "d" * 64, cuda, ARCH) is None
    assert "sources" in bc.stale_reason(rec, "e" * 64, cuda, ARCH)
    assert "CUDA kernels" in bc.stale_reason(rec, "d" * 64, not cuda, ARCH)
    assert "no build record" in bc.stale_reason(None, "d" * 64, cuda, ARCH)
    old = {k: v for k, v in rec.items() if k != "source_digest"}  # an older setup.py's record
    assert "no build record" in bc.stale_reason(old, "d" * 64, cuda, ARCH)
    other = "-gencode=arch=compute_80,code=sm_80"
    if cuda:
        assert "CUDA targets" in bc.stale_reason(rec, "d" * 64, True, other)
    else:  # the targets do not matter to a CPU-only build
        assert bc.stale_reason(rec, "d" * 64, False, other) is None


def test_build_record_fields():
    rec = bc.build_record("d" * 64, False, ARCH, True, "2.14.1", None)
    assert rec == {"cuda_kernels": False, "cuda_arch": None, "wgmma": False, "torch": "2.14.1",
                   "torch_cuda": None, "source_digest": "d" * 64}
    rec = bc.build_record("d" * 64, True, ARCH, True, "2.14.1", "13.0")
    assert rec["cuda_arch"] == ARCH and rec["wgmma"] is True


def test_want_cuda():
    ok = dict(torch_cuda="13.0", cuda_home="/usr/local/cuda", nvcc=True)
    for setting in (None, "auto", " AUTO "):
        assert bc.want_cuda(setting, **ok) is True
        assert bc.want_cuda(setting, **dict(ok, nvcc=False)) is False
        assert bc.want_cuda(setting, **dict(ok, torch_cuda=None)) is False
    for setting in ("0", "off", "no"):
        assert bc.want_cuda(setting, **ok) is False
    assert bc.want_cuda("1", **ok) is True
    with pytest.raises(RuntimeError, match="DSV_BUILD_CUDA=1"):
        bc.want_cuda("1", **dict(ok, cuda_home=None))
    with pytest.raises(ValueError, match="^DSV_BUILD_CUDA"):
        bc.want_cuda("maybe", **ok)


def test_missing_requirements():
    requires = ['torch>=2.10', 'numpy', 'PyYAML', 'tqdm', 'matplotlib; extra == "plots"',
                'av; extra == "video"', 'pytest; extra == "test"', "diffusers ; extra == 'test'",
                'typing-extensions>=4; python_version < "3.12"']
    have = {"torch", "numpy", "PyYAML", "tqdm", "pytest", "diffusers", "typing-extensions"}
    assert bc.missing_requirements(requires, have.__contains__) == []
    # extras other than test are not needed; a missing base or test requirement is reported
    assert bc.missing_requirements(requires, (have - {"numpy", "diffusers"}).__contains__) == ["numpy", "diffusers"]


def test_check_reports_why(tmp_path, monkeypatch):
    root = _tree(tmp_path)
    monkeypatch.delenv("DSV_REBUILD", raising=False)
    assert "no build record" in bc.check(str(root))
    rec = bc.build_record(bc.source_digest(str(root)), False, ARCH, False, "2.14.1", None)
    (root / "dsv_ext" / bc.BUILD_INFO).write_text(json.dumps(rec))
    # the record matches the sources; this tree is not what `import dsv_ext` finds (or the
    # settings differ): never "up to date"
    why = bc.check(str(root))
    assert why is not None and "sources" not in why
    (root / "csrc" / "cpu" / "a.c").write_text("int a(void) { return 3; }\n")
    assert "sources" in bc.check(str(root))
    monkeypatch.setenv("DSV_REBUILD", "1")
    assert bc.check(str(root)) == "DSV_REBUILD is set"


def test_this_build_record_matches_the_loaded_library():
    """The record setup.py wrote for this build (skipped for a build by an older setup.py)."""
    here = os.path.dirname(os.path.abspath(dsv_ext.__file__))
    rec = bc.read_record(here)
    if rec is None or "source_digest" not in rec:
        pytest.skip("no build record with a source digest (extension built by an older setup.py)")
    assert re.fullmatch(r"[0-9a-f]{64}", rec["source_digest"])
    assert rec["cuda_kernels"] == dsv_ext.has_cuda_kernels()


def test_script_exit_status_and_message():
    """Run as .ci/install runs it: exit 1 and a reason when a build is needed."""
    env = dict(os.environ, DSV_REBUILD="1")
    p = subprocess.run([sys.executable, bc.__file__], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout.startswith("[install] dsv-ext needs a build: DSV_REBUILD is set")
    assert p.stderr == ""
