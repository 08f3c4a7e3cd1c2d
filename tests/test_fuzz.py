"""Seeded bad-input / edge-case fuzz of every public op and every raw torch.ops.dsv op
(tests/fuzz_worker.py holds the cases): zero crashes, every rejection a ValueError / TypeError
whose message starts with the argument's name, every accepted input matching the float64
reference (NaN patterns included).

The cases run in worker subprocesses, many per process: a worker prints "start i" before case i
and its result after it, so when a worker dies (a crash: segfault, abort, a hang killed by the
timeout) the case it was running is recorded as a crash and a new worker continues with the
next case. On CUDA (when a GPU is present) the same matrix runs on CUDA tensors.
"""
import os
import subprocess
import sys

import pytest
import torch

import dsv_ext

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fuzz_worker.py")
SEEDS = (0, 1)


def _run_matrix(device: str, seed: int, timeout: float = 300.0):
    """{case index: (status, line)} over every case; a dead worker marks its case 'crash'."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    results, first, total = {}, 0, None
    while total is None or first < total:
        try:
            proc = subprocess.run([sys.executable, WORKER, device, str(seed), str(first), str(10**9)],
                                  capture_output=True, text=True, timeout=timeout, env=env)
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = "", "timeout"
        running = None
        for line in out.splitlines():
            if line.startswith("start "):
                running = int(line.split()[1])
            elif line.startswith("done "):
                total = int(line.split()[1])
                running = None
            elif line and line[0].isdigit():
                i, status = line.split()[:2]
                results[int(i)] = (status, line)
                running = None
        if running is not None:  # the worker died inside case `running`
            results[running] = ("crash", f"{running} crash (rc {rc}) {err[-400:]}")
            first = running + 1
            continue
        if total is None:
            raise AssertionError(f"fuzz worker failed to start (rc {rc}): {err[-2000:]}")
        first = total
    return results


def _check(results):
    bad = [line for status, line in results.values() if status != "ok"]
    assert not bad, f"{len(bad)} of {len(results)} fuzz cases failed:\n" + "\n".join(bad[:40])
    assert len(results) > 200


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_cpu(seed):
    _check(_run_matrix("cpu", seed))


@pytest.mark.skipif(not torch.cuda.is_available() or not dsv_ext.has_cuda_kernels(),
                    reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_cuda(seed):
    _check(_run_matrix("cuda", seed))


def test_crash_is_detected(tmp_path, monkeypatch):
    """The harness itself: a worker that dies inside a case is reported as a crash of that case
    and the remaining cases still run."""
    fake = tmp_path / "worker.py"
    fake.write_text(
        "import os, sys\n"
        "first = int(sys.argv[3])\n"
        "for i in range(first, 5):\n"
        "    print(f'start {i}', flush=True)\n"
        "    if i == 2:\n"
        "        os.abort()\n"
        "    print(f'{i} ok case{i} |', flush=True)\n"
        "print('done 5', flush=True)\n")
    monkeypatch.setattr(sys.modules[__name__], "WORKER", str(fake))
    res = _run_matrix("cpu", 0, timeout=60)
    assert sorted(res) == [0, 1, 2, 3, 4]
    assert res[2][0] == "crash" and all(res[i][0] == "ok" for i in (0, 1, 3, 4))
