#!/usr/bin/env python3
"""Compare the machine code of the shipped CUDA kernels between a git revision and the working
tree, kernel by kernel: for a refactor that only moves code, every kernel must stay identical.

  python3 csrc/dev/sass_diff.py [BASE_REV] [--arch sm_90a] [--jobs 2] [--keep DIR]

Both trees' csrc/cuda/*.cu are compiled with setup.py's nvcc flags (without -lineinfo, whose
line tables would differ wherever code moved), `cuobjdump -sass` is split at "Function :" and the
kernels are matched by mangled name across all files (a kernel may move to another file). The
report lists kernels identical / differing / only in one tree; the exit status is 1 when any
kernel differs or is missing from one side. BASE_REV defaults to main.
"""
import argparse
import concurrent.futures
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def nvcc_flags(arch):
    flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr",
             f"-gencode=arch=compute_{arch[3:]},code={arch}", "-DDSV_WITH_CUDA", "-Xcompiler", "-fPIC",
             "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
             "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]
    if arch.endswith("a") and arch.startswith("sm_90"):
        flags.append("-DDSV_WGMMA")
    return flags


def find_cuobjdump():
    """cuobjdump from PATH, the CUDA toolkit, or the copy that ships inside triton's wheel."""
    for cand in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")):
        if cand and os.path.exists(cand):
            return cand
    try:
        import importlib.util
        spec = importlib.util.find_spec("triton")
        if spec and spec.submodule_search_locations:
            cand = os.path.join(spec.submodule_search_locations[0], "backends", "nvidia", "bin", "cuobjdump")
            if os.path.exists(cand):
                return cand
    except ImportError:
        pass
    return None


def compile_one(args):
    src, inc, obj, flags = args
    r = subprocess.run(["nvcc", *flags, "-I", inc, "-c", src, "-o", obj], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvcc failed on {src}:\n{r.stderr}")
    return obj


def sass_by_kernel(objs, cuobjdump):
    """{mangled kernel name: SASS text without addresses}"""
    out = {}
    for obj in objs:
        text = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True, check=True).stdout
        for chunk in re.split(r"\n\s*Function : ", text)[1:]:
            name, _, body = chunk.partition("\n")
            lines = []
            for ln in body.splitlines():
                if ln.strip().startswith(".....") or ln.strip().startswith("Fatbin"):
                    break
                # without the address column; whitespace collapsed (cuobjdump pads the columns
                # by the longest line of the file)
                ln = " ".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", ln).split())
                if ln:
                    lines.append(ln)
            out[name.strip()] = "\n".join(lines).strip()
    return out


def build_tree(csrc, outdir, arch, jobs, stamp=None):
    """Objects of csrc/cuda/*.cu in outdir; with a stamp (the base tree's id), objects of an
    earlier run with the same stamp are reused."""
    srcs = sorted(glob.glob(os.path.join(csrc, "cuda", "*.cu")))
    stamp_file = os.path.join(outdir, "STAMP")
    if stamp and os.path.exists(stamp_file) and open(stamp_file).read() == stamp:
        return [os.path.join(outdir, os.path.basename(s) + ".o") for s in srcs]
    shutil.rmtree(outdir, ignore_errors=True)
    os.makedirs(outdir, exist_ok=True)
    work = [(s, csrc, os.path.join(outdir, os.path.basename(s) + ".o"), nvcc_flags(arch)) for s in srcs]
    with concurrent.futures.ThreadPoolExecutor(jobs) as ex:
        objs = list(ex.map(compile_one, work))
    if stamp:
        with open(stamp_file, "w") as f:
            f.write(stamp)
    return objs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", nargs="?", default="main", help="git revision to compare against (default main)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--keep", help="keep objects and SASS in this folder (a later run with the same "
                    "folder and base reuses the base's objects)")
    ap.add_argument("-v", "--verbose", action="store_true", help="list identical kernels too")
    a = ap.parse_args()
    cuobjdump = find_cuobjdump()
    if not shutil.which("nvcc") or not cuobjdump:
        sys.exit("nvcc and cuobjdump are needed (CUOBJDUMP=path names the latter)")
    tmp = a.keep or tempfile.mkdtemp(prefix="dsv_sass_")
    tree = subprocess.run(["git", "-C", ROOT, "rev-parse", f"{a.base}:csrc"], capture_output=True, text=True)
    if tree.returncode:
        sys.exit(f"no csrc/ in {a.base}")
    stamp = f"{tree.stdout.strip()} {' '.join(nvcc_flags(a.arch))}"
    base_src = os.path.join(tmp, "base_src")
    shutil.rmtree(base_src, ignore_errors=True)
    os.makedirs(base_src)
    arch_cmd = subprocess.Popen(["git", "-C", ROOT, "archive", a.base, "csrc"], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", base_src], stdin=arch_cmd.stdout, check=True)
    if arch_cmd.wait():
        sys.exit(f"git archive {a.base} failed")
    print(f"compiling {a.base} and the working tree for {a.arch} ...", flush=True)
    base = sass_by_kernel(build_tree(os.path.join(base_src, "csrc"), os.path.join(tmp, "base_obj"), a.arch, a.jobs,
                                     stamp),
                          cuobjdump)
    new = sass_by_kernel(build_tree(os.path.join(ROOT, "csrc"), os.path.join(tmp, "new_obj"), a.arch, a.jobs),
                         cuobjdump)
    same = sorted(k for k in base if k in new and base[k] == new[k])
    diff = sorted(k for k in base if k in new and base[k] != new[k])
    only_base = sorted(k for k in base if k not in new)
    only_new = sorted(k for k in new if k not in base)

    def demangle(names):
        if not names or not shutil.which("c++filt"):
            return names
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        return r.stdout.splitlines() if r.returncode == 0 else names

    print(f"kernels: {len(base)} in {a.base}, {len(new)} in the working tree; identical {len(same)}, "
          f"different {len(diff)}, only in {a.base} {len(only_base)}, only in the working tree {len(only_new)}")
    for title, names in ((f"different", diff), (f"only in {a.base}", only_base),
                         ("only in the working tree", only_new), *((("identical", same),) if a.verbose else ())):
        for n in demangle(names):
            print(f"  {title}: {n}")
    for k in diff:
        bl, nl = base[k].splitlines(), new[k].splitlines()
        print(f"  {k}: {len(bl)} vs {len(nl)} SASS lines")
    if a.keep:
        for tag, d in (("base", base), ("new", new)):
            with open(os.path.join(tmp, f"{tag}.sass"), "w") as f:
                for k in sorted(d):
                    f.write(f"Function : {k}\n{d[k]}\n\n")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if diff or only_base or only_new else 0


if __name__ == "__main__":
    sys.exit(main())
