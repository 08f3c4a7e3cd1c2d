"""Does the built extension match its sources? (used by setup.py and .ci/install)

setup.py records, after every successful build, a digest of everything the build reads (csrc/,
setup.py, pyproject.toml) and the settings it used in ``dsv_ext/_build_info.json`` next to the
built ``_C`` library. ``.ci/install`` runs this file first::

    python3 dsv_ext/_buildcheck.py        # exit 0: up to date, 1: a (re)build is needed

and skips ``pip install`` when the record matches the sources and the wanted settings, the
package is installed from this directory with its requirements, and the extension loads. Set
``DSV_REBUILD=1`` to build anyway.

Only the standard library at import time: setup.py loads this file by path, before the package
(and its compiled library) can be imported.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from typing import Dict, Iterable, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_INFO = "_build_info.json"
DEFAULT_CUDA_ARCH = "-gencode=arch=compute_90a,code=sm_90a"
# What the build reads besides csrc/ (a change to the requirements in pyproject.toml also needs pip).
BUILD_FILES = ("setup.py", "pyproject.toml")


def source_files(root: str = ROOT) -> List[str]:
    """The files the build depends on, relative to root, sorted: every file under csrc/ (hidden
    files and __pycache__ excluded) and BUILD_FILES."""
    out = [f for f in BUILD_FILES if os.path.isfile(os.path.join(root, f))]
    for d, dirs, files in os.walk(os.path.join(root, "csrc")):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x != "__pycache__")
        for f in files:
            if not f.startswith("."):
                out.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return sorted(out)


def source_digest(root: str = ROOT, files: Optional[Iterable[str]] = None) -> str:
    """sha256 over the names and contents of source_files(root) (or `files`)."""
    h = hashlib.sha256()
    for rel in (source_files(root) if files is None else sorted(files)):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        h.update(str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def source_commit() -> str:
    """The commit the package's code comes from, for the provenance of measurements: the
    environment variable DSV_COMMIT, else ``git rev-parse --short HEAD`` of the checkout this file
    lives in, with "+changes" when its tracked files differ from that commit (uncommitted edits,
    or a copy of a newer tree over an older history), else "unknown" (an installed copy, or no
    git)."""
    import subprocess

    commit = os.environ.get("DSV_COMMIT")
    if commit:
        return commit
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, cwd=ROOT,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001 - not a git checkout, or no git
        return "unknown"
    if not head:
        return "unknown"
    same = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0
    return head if same else head + "+changes"


def want_cuda(setting: Optional[str], torch_cuda: Optional[str], cuda_home: Optional[str],
              nvcc: bool) -> bool:
    """Whether the build compiles the CUDA kernels, from DSV_BUILD_CUDA (`setting`: auto, the
    default / 1 / 0): auto builds them when torch has CUDA, CUDA_HOME is known and nvcc exists;
    1 raises RuntimeError when that is impossible."""
    s = (setting or "auto").strip().lower()
    possible = torch_cuda is not None and cuda_home is not None and bool(nvcc)
    if s in ("0", "false", "no", "off"):
        return False
    if s in ("1", "true", "yes", "on"):
        if not possible:
            raise RuntimeError(
                "DSV_BUILD_CUDA=1 but CUDA kernels cannot be built: torch.version.cuda="
                f"{torch_cuda}, CUDA_HOME={cuda_home}, nvcc={'found' if nvcc else 'missing'}")
        return True
    if s != "auto":
        raise ValueError(f"DSV_BUILD_CUDA: expected auto, 1 or 0, got {setting!r}")
    return possible


def build_record(digest: str, cuda: bool, cuda_arch: str, wgmma: bool, torch_version: str,
                 torch_cuda: Optional[str]) -> Dict[str, object]:
    """The content of _build_info.json (also read by dsv_ext.info.build_info)."""
    return {"cuda_kernels": cuda, "cuda_arch": cuda_arch if cuda else None, "wgmma": bool(cuda and wgmma),
            "torch": torch_version, "torch_cuda": torch_cuda, "source_digest": digest}


def read_record(pkg_dir: str) -> Optional[Dict[str, object]]:
    try:
        with open(os.path.join(pkg_dir, BUILD_INFO)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def stale_reason(record: Optional[Dict[str, object]], digest: str, cuda: bool,
                 cuda_arch: str) -> Optional[str]:
    """None when a build recorded as `record` is what a build now would produce (same sources,
    CUDA kernels or not, same nvcc targets); otherwise why not, in words."""
    if record is None or "source_digest" not in record:
        return "no build record (never built here, or built by an older setup.py)"
    if record.get("source_digest") != digest:
        return "the sources (csrc/, setup.py, pyproject.toml) changed since the last build"
    if bool(record.get("cuda_kernels")) != cuda:
        return ("the last build has " + ("no " if cuda else "") + "CUDA kernels, this one "
                + ("wants them" if cuda else "does not (DSV_BUILD_CUDA)"))
    if cuda and record.get("cuda_arch") != cuda_arch:
        return f"the CUDA targets changed ({record.get('cuda_arch')} -> {cuda_arch})"
    return None


def _req_name(req: str) -> Optional[str]:
    """The distribution name of a Requires-Dist entry when it applies to the base package or to
    its `test` extra; None for other extras."""
    spec, _, marker = req.partition(";")
    if "extra" in marker and not re.search(r"""extra\s*==\s*["']test["']""", marker):
        return None
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    return m.group(1) if m else None


def missing_requirements(requires: Iterable[str], installed) -> List[str]:
    """The names among `requires` (Requires-Dist strings: base + test extra) for which
    installed(name) is false."""
    names = [n for n in (_req_name(r) for r in requires) if n]
    return [n for n in names if not installed(n)]


def _installed(name: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def find_cuda_home() -> Optional[str]:
    """setup.py's CUDA_HOME: /usr/local/cuda when it has nvcc, else torch.utils.cpp_extension's
    guess (computed here without importing that module, which warns on a machine without a GPU)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        home = "/usr/local/cuda"
    if home is None:
        nvcc = shutil.which("nvcc")
        home = os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda"
        if not nvcc and not os.path.exists(home):
            home = None
    return home


def check(root: str = ROOT) -> Optional[str]:
    """None when .ci/install can skip pip for the checkout at `root`; otherwise why not."""
    if os.environ.get("DSV_REBUILD", "").strip() not in ("", "0"):
        return "DSV_REBUILD is set"
    pkg = os.path.join(root, "dsv_ext")
    record = read_record(pkg)
    digest = source_digest(root)
    if record is None or record.get("source_digest") != digest:
        return stale_reason(record, digest, False, "")
    # before importing torch (which warns when numpy, a requirement, is missing)
    from importlib import metadata

    try:
        requires = metadata.requires("dsv-ext") or []
    except metadata.PackageNotFoundError:
        return "dsv-ext is not installed"
    missing = missing_requirements(requires, _installed)
    if missing:
        return "requirements not installed: " + ", ".join(missing)
    # the same CUDA decision as setup.py (the CUDA_HOME guess included)
    try:
        import torch
    except ImportError as e:
        return f"torch does not import ({e})"
    cuda_home = find_cuda_home()
    nvcc = bool(shutil.which("nvcc") or (cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc"))))
    cuda_arch = os.environ.get("DSV_CUDA_ARCH", DEFAULT_CUDA_ARCH)
    try:
        cuda = want_cuda(os.environ.get("DSV_BUILD_CUDA"), torch.version.cuda, cuda_home, nvcc)
    except (RuntimeError, ValueError) as e:
        return str(e)
    why = stale_reason(record, digest, cuda, " ".join(cuda_arch.split()))
    if why:
        return why
    try:
        import dsv_ext
    except Exception as e:  # a stale or broken library: ImportError, OSError, RuntimeError
        return f"the extension does not load ({type(e).__name__}: {e})"
    where = os.path.dirname(os.path.abspath(dsv_ext.__file__))
    if os.path.realpath(where) != os.path.realpath(pkg):
        return f"`import dsv_ext` finds {where}, not this checkout"
    if dsv_ext.has_cuda_kernels() != cuda:
        return "the loaded library " + ("lacks" if cuda else "has") + " CUDA kernels"
    return None


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    # run as a script, sys.path[0] is dsv_ext/: its modules must not shadow top-level ones
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.realpath(here)]
    why = check(ROOT)
    if why:
        print(f"[install] dsv-ext needs a build: {why}", flush=True)
        return 1
    rec = read_record(os.path.join(ROOT, "dsv_ext")) or {}
    kind = f"CUDA kernels ({rec.get('cuda_arch')})" if rec.get("cuda_kernels") else "CPU kernels only"
    import torch

    print(f"[install] torch {torch.__version__}; dsv-ext is up to date ({kind}, sources "
          f"{str(rec.get('source_digest'))[:12]}): build skipped (DSV_REBUILD=1 forces one)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
