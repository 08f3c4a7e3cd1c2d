"""What this installation of dsv-ext contains and which kernels it will run here.

``python -m dsv_ext.info`` (or ``python -m dsv_ext``) prints a report: versions, the build (CUDA
kernels or CPU only, nvcc targets, whether the Hopper wgmma forward was compiled), the GPUs and
the attention kernels each will get with the kernel tuning chosen for it
(``dsv_ext.ops.kernel_tuning``), and the dispatcher's calibration entries for them. Use it
first when sparse attention is slower than expected: a build without CUDA kernels runs the C
reference kernels, a build for another target than sm_90a runs the mma.sync forward on an
H100 / H200, and a GPU without calibration entries falls back to the sparsity threshold.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from typing import Dict, List, Optional, Sequence

import torch

from . import __version__
from .ops import has_cuda_kernels, kernel_tuning

__all__ = ["build_info", "environment", "main"]

_BUILD_INFO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build_info.json")


def build_info() -> Dict[str, object]:
    """The settings the extension was built with (written by setup.py): ``cuda_kernels``,
    ``cuda_arch`` (nvcc target flags), ``wgmma`` (the sm_90a warpgroup-MMA forward compiled),
    ``torch`` and ``torch_cuda`` (the PyTorch it was built against). ``cuda_kernels`` is what the
    loaded library actually registers; the other keys are None when the build wrote no record
    (an extension built by an older setup.py)."""
    info: Dict[str, object] = {"cuda_arch": None, "wgmma": None, "torch": None, "torch_cuda": None}
    try:
        with open(_BUILD_INFO) as f:
            info.update(json.load(f))
    except (OSError, ValueError):
        pass
    info["cuda_kernels"] = has_cuda_kernels()
    if not info["cuda_kernels"]:
        info["wgmma"] = False
    return info


def _forward_kernel(build: Dict[str, object], capability) -> str:
    if not build["cuda_kernels"]:
        return "none (CPU-only build: tensors on this GPU raise)"
    if build["wgmma"] and tuple(capability) == (9, 0):
        return ("wgmma (sm_90a) for head dim 64 / 128 and group size >= 64 (heads of 65-127 run "
                "padded to 128), mma.sync otherwise")
    if build["wgmma"] is None:
        return "unknown (no build record)"
    return "mma.sync"


def _tuning(build: Dict[str, object], index: Optional[int]):
    """The kernel tuning of GPU `index` (dsv_ext.ops.kernel_tuning; None: the current device),
    or why there is none."""
    if not build["cuda_kernels"]:
        return kernel_tuning()  # {"cuda_kernels": 0}
    try:
        return kernel_tuning(index)
    except (RuntimeError, ValueError) as e:
        return f"unavailable: {e}"


def _calibration_entries(name: str) -> List[str]:
    from .control.dispatch import Dispatcher, builtin_table, default_calibration_path

    rows = []
    for source, table in (("user", Dispatcher.load(default_calibration_path())), ("built-in", builtin_table())):
        for e in (table or {}).get("entries", []):
            if e.get("device") == name:
                rows.append(f"{source}: G={e.get('group_size')} S={e.get('seq_len')} "
                            f"H={e.get('heads')} D={e.get('head_dim')} {e.get('dtype')}")
    return rows


def environment() -> Dict[str, object]:
    """The report of ``python -m dsv_ext.info`` as a dict."""
    build = build_info()
    env: Dict[str, object] = {
        "dsv_ext": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "build": build,
        "cpu_threads": torch.get_num_threads(),
        "kernel_tuning": _tuning(build, None),  # the current device's (each GPU's: "gpus")
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(i)
            cap = torch.cuda.get_device_capability(i)
            env["gpus"].append({
                "index": i, "name": name, "capability": f"{cap[0]}.{cap[1]}",
                "attention_forward": _forward_kernel(build, cap),
                "kernel_tuning": _tuning(build, i),
                "calibration": _calibration_entries(name),
            })
    return env


def _report(env: Dict[str, object]) -> str:
    b = env["build"]
    lines = [
        f"dsv-ext {env['dsv_ext']}  (python {env['python']}, torch {env['torch']}, "
        f"torch CUDA {env['torch_cuda'] or 'none'})",
        f"build: CUDA kernels {'yes' if b['cuda_kernels'] else 'no (CPU reference kernels only)'}"
        + (f", nvcc targets {b['cuda_arch']}" if b.get("cuda_arch") else "")
        + (f", wgmma forward {'compiled' if b['wgmma'] else 'not compiled'}" if b["cuda_kernels"] else "")
        + (f"; built against torch {b['torch']}" if b.get("torch") else ""),
        f"CPU threads: {env['cpu_threads']}",
    ]
    if not b["cuda_kernels"]:
        lines.append("kernel tuning: none (no CUDA kernels built)")
    if not env["gpus"]:
        lines.append("GPUs: none visible (the C kernels run on the CPU)")
        if b["cuda_kernels"]:
            lines.append("kernel tuning: filled per GPU from its properties when one is visible")
    for g in env["gpus"]:
        lines.append(f"GPU {g['index']}: {g['name']} (compute capability {g['capability']})")
        lines.append(f"  attention forward: {g['attention_forward']}")
        t = g["kernel_tuning"]
        lines.append("  kernel tuning: " + (",".join(f"{k}={v}" for k, v in t.items()) if isinstance(t, dict) else t)
                     + (" (DSV_KERNEL_TUNING set)" if os.environ.get("DSV_KERNEL_TUNING") else ""))
        cal = g["calibration"]
        lines.append(f"  dispatcher calibration: {len(cal)} entries" if cal else
                     "  dispatcher calibration: none for this GPU (blocks go sparse from "
                     "DSVConfig.dispatch_threshold; `python -m dsv_ext.control.dispatch` measures a table)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dsv_ext.info", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    env = environment()
    print(json.dumps(env, indent=1) if a.json else _report(env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
