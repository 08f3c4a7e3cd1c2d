"""Training checkpoints that cannot be silently corrupted (used by dsv_ext.app.train and dsv_ext.app.sample).

A checkpoint is the ``torch.save`` file of the state dict (so ``torch.load`` still reads it)
whose zip end-of-archive comment holds a checksum of everything before it::

    <the bytes torch.save wrote, N of them>  DSVCKPT1 {"format": "dsv_ext.checkpoint", "version": 1,
                                                      "payload_bytes": N, "sha256": "..."}

(the 2-byte comment length at the end of the N bytes is counted as 0 in the hash). The checksum
lives in the same file, so it survives copying the checkpoint around; :func:`load_checkpoint`
verifies it before unpickling anything (and unpickles ``weights_only``). The payload is hashed
while it is written, never held twice in memory. Writes are atomic: a temporary file in the
same folder, fsynced, renamed over the target, then the folder fsynced, so a crash or a kill at
any moment leaves either the old or the new checkpoint, never a mix.

Every failure to load (missing, empty, truncated, corrupted, not a checkpoint) raises
:class:`CheckpointError` (a ValueError) with one line naming the file and what is wrong.
Files written by earlier versions (no checksum) still load, unverified, with a warning.
:class:`StopOnSignal` is the training loop's SIGINT / SIGTERM handling (finish the step, save,
stop; a second signal aborts).

    python -m dsv_ext.app.checkpoint runs/tiny-dsv/ckpt_last.pt      # verify and describe
    python -m dsv_ext.app.checkpoint runs/tiny-dsv/ckpt_last.pt --slim tiny.pt   # weights only

:func:`slim_checkpoint` keeps what evaluation, sampling and attention analysis read (the weights
they use -- the moving average where the run kept one --, the trained predictors, the config,
the step), in bfloat16 by default: 2 bytes a parameter against 16 in a checkpoint with AdamW
state and a weight average, small enough to copy between machines. It cannot resume training.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import warnings
from typing import Any, Dict, Optional, Sequence

import torch

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "verify_checkpoint", "slim_checkpoint",
           "config_diff", "StopOnSignal"]

MAGIC = b"DSVCKPT1 "
_ZIP_LOCAL = b"PK\x03\x04"
_ZIP_EOCD = b"PK\x05\x06"
_TAIL = 1024  # the trailer is ~170 bytes
_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message is one line naming the file."""


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:  # e.g. platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _HashingWriter:
    """File-like sink for torch.save: writes through to ``f``, hashing and counting the bytes
    (the payload is streamed, never held in memory twice)."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        n = self.f.write(b)
        self.n += n
        return n

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(state: Dict[str, Any], path: str) -> str:
    """Write ``state`` (tensors and plain Python containers) to ``path`` atomically, with the
    SHA-256 of the payload in the zip comment. Returns the hex digest."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "w+b") as f:
            w = _HashingWriter(f)
            torch.save(state, w)
            f.flush()
            f.seek(w.n - 22)
            if w.n < 22 or f.read(4) != _ZIP_EOCD:
                raise RuntimeError("torch.save did not end its file with a plain zip end-of-archive record")
            digest = w.sha.hexdigest()
            trailer = MAGIC + json.dumps({"format": "dsv_ext.checkpoint", "version": 1,
                                          "payload_bytes": w.n, "sha256": digest}).encode()
            f.seek(w.n - 2)
            f.write(struct.pack("<H", len(trailer)) + trailer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(folder)
    return digest


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    s = s[0] if s else type(e).__name__
    return s if len(s) <= 200 else s[:197] + "..."


def verify_checkpoint(path: str) -> Dict[str, Any]:
    """Check that ``path`` is a complete, uncorrupted checkpoint without unpickling it. Returns
    the trailer (``payload_bytes``, ``sha256``, ``verified``: True; ``{"verified": False}`` for an
    older file without a checksum); raises :class:`CheckpointError` otherwise."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint: {path}: is a folder, not a checkpoint file")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint: {path}: no such file")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise CheckpointError(f"checkpoint: {path}: empty file (0 bytes)")
            head = f.read(16)
            f.seek(max(0, size - _TAIL))
            tail = f.read()
            t = tail.rfind(MAGIC)  # with a trailer, any damage before it is a checksum mismatch
            if t < 0:
                if not head.startswith(_ZIP_LOCAL):
                    raise CheckpointError(f"checkpoint: {path}: not a dsv_ext checkpoint (starts with {head!r})")
                if tail.endswith(b"\0\0") and tail[-22:-18] == _ZIP_EOCD:
                    return {"verified": False}  # a plain torch.save file (before checksums)
                raise CheckpointError(f"checkpoint: {path}: truncated or damaged (no end-of-archive "
                                      "record; an interrupted copy?)")
            t_abs = size - len(tail) + t
            try:
                h, end = json.JSONDecoder().raw_decode(tail[t + len(MAGIC):].decode())
                extra = len(tail[t + len(MAGIC):].decode()[end:].encode())
                ok = (isinstance(h, dict) and h.get("format") == "dsv_ext.checkpoint"
                      and isinstance(h.get("payload_bytes"), int) and isinstance(h.get("sha256"), str))
            except (UnicodeDecodeError, ValueError):
                ok, extra = False, 0
            if ok and extra:
                raise CheckpointError(f"checkpoint: {path}: {extra} unexpected bytes after the checksum "
                                      "trailer")
            if not ok:
                raise CheckpointError(f"checkpoint: {path}: damaged checksum trailer (truncated or corrupted)")
            if h.get("version") != 1:
                raise CheckpointError(f"checkpoint: {path}: format version {h.get('version')!r} is newer "
                                      "than this dsv_ext reads (version 1); update dsv_ext")
            want = h["payload_bytes"]
            if want != t_abs:
                raise CheckpointError(f"checkpoint: {path}: {t_abs} payload bytes where the trailer "
                                      f"says {want}: the file is corrupted")
            f.seek(want - 2)
            if f.read(2) != struct.pack("<H", size - t_abs):
                raise CheckpointError(f"checkpoint: {path}: damaged checksum trailer (its length field)")
            f.seek(0)
            sha = hashlib.sha256()
            left = want - 2
            while left:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    break
                sha.update(chunk)
                left -= len(chunk)
            sha.update(b"\0\0")
    except OSError as e:
        raise CheckpointError(f"checkpoint: {path}: cannot read ({_first_line(e)})") from None
    if sha.hexdigest() != h["sha256"]:
        raise CheckpointError(f"checkpoint: {path}: checksum mismatch (sha256 {sha.hexdigest()[:16]}... "
                              f"!= stored {h['sha256'][:16]}...): the file is corrupted")
    h["verified"] = True
    return h


def load_checkpoint(path: str, map_location=None,
                    required: Sequence[str] = ("step", "model", "config")) -> Dict[str, Any]:
    """Verify and load a dsv_ext.app.train checkpoint (tensors and plain containers only:
    ``weights_only`` unpickling). Raises :class:`CheckpointError` with one line naming the file
    and the problem; ``required`` keys must be present."""
    path = os.fspath(path)
    h = verify_checkpoint(path)
    try:
        ck = torch.load(path, map_location=map_location, weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # unpickling errors of all kinds: one line, no traceback
        what = "unreadable" if h["verified"] else "not a readable checkpoint"
        raise CheckpointError(f"checkpoint: {path}: {what} ({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(ck, dict):
        raise CheckpointError(f"checkpoint: {path}: holds a {type(ck).__name__}, not a dsv_ext.app.train checkpoint")
    missing = [k for k in required if k not in ck]
    if missing:
        raise CheckpointError(f"checkpoint: {path}: no {', '.join(map(repr, missing))} entry "
                              "(not a dsv_ext.app.train checkpoint)")
    if not h["verified"]:
        warnings.warn(f"checkpoint: {path}: written without a checksum (older dsv_ext): not verified",
                      stacklevel=2)
    return ck


def slim_checkpoint(src: str, dst: str, dtype: Optional[torch.dtype] = torch.bfloat16) -> Dict[str, Any]:
    """Write ``dst``: the checkpoint ``src`` without what only resuming needs (optimizer, RNG
    states, metrics window). Its ``model`` entry holds the weights evaluation uses (the moving
    average where the run kept one, as ``inference_state_dict``), floating-point tensors cast to
    ``dtype`` (None: kept as stored); the controller's predictors and the config stay. Returns a
    summary (step, tensors, bytes). Loads where a checkpoint does for evaluation and sampling
    (``build_model`` then ``load_state_dict`` casts the weights back); ``"slim": True`` marks it."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype: expected a floating-point torch.dtype or None, got {dtype!r}")
    from .common import inference_state_dict

    ck = load_checkpoint(src, map_location="cpu")
    sd = inference_state_dict(ck)
    cast = (lambda t: t.to(dtype) if dtype is not None and torch.is_tensor(t) and t.is_floating_point() else t)
    state = {"step": ck["step"], "model": {n: cast(t) for n, t in sd.items()},
             "controller": ck.get("controller"), "ema": None, "config": ck["config"],
             "attention": ck.get("attention"), "history_tail": ck.get("history_tail"), "slim": True}
    save_checkpoint(state, dst)
    return {"path": os.fspath(dst), "step": ck["step"], "tensors": len(state["model"]),
            "bytes": os.path.getsize(dst), "source_bytes": os.path.getsize(src)}


class StopOnSignal:
    """SIGINT / SIGTERM set ``signal`` (the training loop then finishes its step, saves
    ckpt_last.pt and returns); a second one raises KeyboardInterrupt at once. Installed only in
    the main thread; the previous handlers come back on exit."""

    def __init__(self, log):
        self.signal: Optional[str] = None
        self.log = log
        self._old = {}

    def _handler(self, signum, frame):
        import signal as _signal

        name = _signal.Signals(signum).name
        if self.signal is not None:
            raise KeyboardInterrupt(f"second {name}: aborted without saving")
        self.signal = name
        self.log(f"{name}: finishing the current step, then saving a checkpoint "
                 "(send it again to abort at once)")

    def __enter__(self):
        import signal as _signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (_signal.SIGINT, _signal.SIGTERM):
                self._old[sig] = _signal.signal(sig, self._handler)
        return self

    def requested(self, world: int = 1, device=None) -> bool:
        """Whether to stop now; with several context-parallel ranks, whether any rank was
        signalled (all ranks must stop after the same step)."""
        if world <= 1:
            return self.signal is not None
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.signal is not None else 0.0], device=device)
        dist.all_reduce(flag)
        if flag.item() > 0 and self.signal is None:
            self.signal = "SIGTERM"
        return flag.item() > 0

    def __exit__(self, *exc):
        import signal as _signal

        for sig, old in self._old.items():
            _signal.signal(sig, old)
        return False


def _flatten(cfg: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for sec, v in (cfg or {}).items():
        if isinstance(v, dict):
            for k, x in v.items():
                out[f"{sec}.{k}"] = list(x) if isinstance(x, tuple) else x
        else:
            out[sec] = v
    return out


def config_diff(stored: Dict[str, Any], given: Dict[str, Any],
                ignore: Sequence[str] = ()) -> Dict[str, tuple]:
    """``{"section.key": (stored value, given value)}`` for every value that differs between two
    configs (``"<unset>"`` where one side lacks the key); keys in ``ignore`` are skipped."""
    a, b = _flatten(stored), _flatten(given)
    out = {}
    for k in sorted(set(a) | set(b)):
        if k in ignore:
            continue
        va, vb = a.get(k, "<unset>"), b.get(k, "<unset>")
        if va != vb:
            out[k] = (va, vb)
    return out


def format_diff(diff: Dict[str, tuple]) -> str:
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    from .cli import run_command

    p = argparse.ArgumentParser(prog="python -m dsv_ext.app.checkpoint",
                                description="Verify dsv_ext.app.train checkpoints and print what they hold.")
    p.add_argument("paths", nargs="+", metavar="CKPT")
    p.add_argument("--slim", metavar="DST", help="write the weights-only copy of the (one) CKPT to DST "
                   "(evaluation weights, predictors, config; no optimizer state)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "keep"),
                   help="the slim copy's floating-point weights (default bfloat16; keep: as stored)")
    a = p.parse_args(argv)
    if a.slim and len(a.paths) != 1:
        p.error(f"--slim: takes one CKPT, got {len(a.paths)}")

    def body() -> int:
        if a.slim:
            dt = None if a.dtype == "keep" else getattr(torch, a.dtype)
            print(json.dumps(slim_checkpoint(a.paths[0], a.slim, dt)))
            return 0
        for path in a.paths:
            ck = load_checkpoint(path, map_location="cpu")
            h = verify_checkpoint(path)
            cfg = ck.get("config") or {}
            print(json.dumps({"path": path, "ok": True, "checksum": h.get("sha256") or "none (older file)",
                              "step": ck.get("step"), "attention": ck.get("attention"),
                              "name": cfg.get("name") if isinstance(cfg, dict) else None,
                              "dsv_stage": ck["controller"].get("stage")
                              if isinstance(ck.get("controller"), dict) else None}))
        return 0

    return run_command(p.prog, body)


if __name__ == "__main__":
    sys.exit(main())
