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


def test_build_log_progress_lines(tmp_path):
    """.ci/build_log.py: one console line per compiled file, the build's own lines and compiler
    diagnostics; the workplace's pip index notes dropped; everything kept in the log."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".ci", "build_log.py")
    if not os.path.exists(script):
        pytest.skip("not a checkout (.ci/ absent)")
    pip_lines = [
        "Collecting pytest (from dsv-ext==0.1.0)",
        "Collecting pluggy (from pytest->dsv-ext==0.1.0)",
        "WARNING: Location 'file:///opt/x/simple/y/' is ignored: it is neither a file nor a directory.",
        "  gcc -pthread -fPIC -Icsrc -c csrc/cpu/rows.c -o build/temp/csrc/cpu/rows.o -std=c11",
        "  csrc/cpu/rows.c:12:5: warning: unused variable 'x' [-Wunused-variable]",
        "  dsv-ext: compiling csrc/dsv_ops.cpp and 6 CUDA files (DSV_BUILD_CUDA=1, MAX_JOBS=2)",
        "  [1/7] /usr/local/cuda/bin/nvcc -MD -MF x.o.d -c -c /abs/csrc/cuda/rows.cu -o /tmp/b/rows.o -O3",
        "  [2/7] c++ -MMD -MF y.o.d -I/abs/csrc -c -c /abs/csrc/dsv_ops.cpp -o /tmp/b/dsv_ops.o",
        "  copying build/lib/dsv_ext/_C.abi3.so -> dsv_ext",
        "Installing collected packages: dsv-ext",
    ]
    log = tmp_path / "install.log"
    p = subprocess.run([sys.executable, script, str(log)], input="\n".join(pip_lines) + "\n",
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    shown = [re.sub(r"^\[install\]\s+\d+ s  ", "", l) for l in p.stdout.splitlines()]
    assert shown == [
        "resolving the requirements",
        "compiling csrc/cpu/rows.c",
        "csrc/cpu/rows.c:12:5: warning: unused variable 'x' [-Wunused-variable]",
        "compiling csrc/dsv_ops.cpp and 6 CUDA files (DSV_BUILD_CUDA=1, MAX_JOBS=2)",
        "[1/7] compiled csrc/cuda/rows.cu",
        "[2/7] compiled csrc/dsv_ops.cpp",
        "Installing collected packages: dsv-ext",
    ], p.stdout
    assert log.read_text().splitlines() == pip_lines


def test_source_commit(tmp_path, monkeypatch):
    """The commit a measurement records: HEAD of the checkout, "+changes" once a tracked file
    differs from it (a copy of a newer tree over an older history), DSV_COMMIT above both,
    "unknown" outside git."""
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True,
                       env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})

    monkeypatch.delenv("DSV_COMMIT", raising=False)
    monkeypatch.setattr(bc, "ROOT", str(tmp_path))
    assert bc.source_commit() == "unknown"
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "a")
    head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, text=True).strip()
    assert bc.source_commit() == head
    (tmp_path / "new.py").write_text("untracked\n")  # untracked files do not count
    assert bc.source_commit() == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert bc.source_commit() == head + "+changes"
    monkeypatch.setenv("DSV_COMMIT", "abc1234")
    assert bc.source_commit() == "abc1234"
