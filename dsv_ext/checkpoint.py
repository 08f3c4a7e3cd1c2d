"""Training checkpoints that cannot be silently corrupted (used by dsv_ext.train and dsv_ext.sample).

A checkpoint file is one header line (JSON padded with spaces to 256 bytes, written last)
followed by the ``torch.save`` bytes of the state dict, streamed and hashed as they are written::

    DSVCKPT1 {"format": "dsv_ext.checkpoint", "version": 1, "payload_bytes": N, "sha256": "..."}   \\n
    <N bytes written by torch.save>

The SHA-256 of the payload lives in the same file, so it survives copying the checkpoint
around; :func:`load_checkpoint` verifies it before unpickling anything. Writes are atomic: the
bytes go to a temporary file in the same folder, which is fsynced, renamed over the target and
the folder fsynced, so a crash or a kill at any moment leaves either the old or the new
checkpoint, never a mix.

Every failure to load (missing, empty, truncated, corrupted, not a checkpoint) raises
:class:`CheckpointError` (a ValueError) with one line naming the file and what is wrong.
Files written by earlier versions (plain ``torch.save``, no header) still load, unverified,
with a warning.

:class:`StopOnSignal` is the training loop's SIGINT / SIGTERM handling (finish the step, save,
stop; a second signal aborts).

    python -m dsv_ext.checkpoint runs/tiny-dsv/ckpt_last.pt      # verify and describe
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import warnings
from typing import Any, Dict, Optional, Sequence

import torch

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "verify_checkpoint", "config_diff",
           "StopOnSignal"]

MAGIC = b"DSVCKPT1 "
_HEADER_MAX = 4096
_HEADER_LEN = 256  # bytes, newline included (space-padded JSON)
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
    """Write ``state`` (tensors and plain Python containers) to ``path`` atomically, with a
    SHA-256 of the payload in the header. Returns the hex digest."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(b" " * (_HEADER_LEN - 1) + b"\n")  # the header is written last
            w = _HashingWriter(f)
            torch.save(state, w)
            digest = w.sha.hexdigest()
            header = MAGIC + json.dumps({"format": "dsv_ext.checkpoint", "version": 1,
                                         "payload_bytes": w.n, "sha256": digest}).encode()
            f.seek(0)
            f.write(header.ljust(_HEADER_LEN - 1) + b"\n")
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


class _Window(io.RawIOBase):
    """Read-only view of a file from ``offset`` on (torch.load seeks to absolute positions)."""

    def __init__(self, f, offset: int, size: int):
        self.f, self.offset, self.size, self.pos = f, offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.size - self.pos))
        if n == 0:
            return 0
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    s = s[0] if s else type(e).__name__
    return s if len(s) <= 200 else s[:197] + "..."


def _read_header(path: str, f) -> Optional[Dict[str, Any]]:
    """The parsed header, or None for a headerless (older) torch.save file."""
    head = f.read(_HEADER_MAX)
    if not head:
        raise CheckpointError(f"checkpoint: {path}: empty file (0 bytes)")
    if not head.startswith(MAGIC):
        if head.startswith(b"PK\x03\x04"):
            return None  # a plain torch.save zip (checkpoints before the checksum header)
        if b"dsv_ext.checkpoint" in head[:200]:  # our header with its first bytes damaged
            raise CheckpointError(f"checkpoint: {path}: corrupted header")
        raise CheckpointError(f"checkpoint: {path}: not a dsv_ext checkpoint (starts with {head[:16]!r})")
    end = head.find(b"\n")
    if end < 0:
        raise CheckpointError(f"checkpoint: {path}: corrupted header (no end of header line)")
    try:
        h = json.loads(head[len(MAGIC):end].decode())
        ok = (isinstance(h, dict) and h.get("format") == "dsv_ext.checkpoint"
              and isinstance(h.get("payload_bytes"), int) and isinstance(h.get("sha256"), str))
    except (UnicodeDecodeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"checkpoint: {path}: corrupted header")
    if h.get("version") != 1:
        raise CheckpointError(f"checkpoint: {path}: format version {h.get('version')!r} is newer than "
                              "this dsv_ext reads (version 1); update dsv_ext")
    h["offset"] = end + 1
    return h


def verify_checkpoint(path: str) -> Dict[str, Any]:
    """Check that ``path`` is a complete, uncorrupted checkpoint without unpickling it. Returns
    the header (``payload_bytes``, ``sha256``, ``offset``; ``{"verified": False}`` for an older
    file without a header); raises :class:`CheckpointError` otherwise."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint: {path}: is a folder, not a checkpoint file")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint: {path}: no such file")
    try:
        with open(path, "rb") as f:
            h = _read_header(path, f)
            if h is None:
                return {"verified": False}
            size = os.fstat(f.fileno()).st_size - h["offset"]
            want = h["payload_bytes"]
            if size < want:
                raise CheckpointError(f"checkpoint: {path}: truncated ({size} of {want} payload bytes "
                                      "present; an interrupted copy?)")
            if size > want:
                raise CheckpointError(f"checkpoint: {path}: {size - want} unexpected bytes after the "
                                      f"payload ({want} bytes)")
            f.seek(h["offset"])
            sha = hashlib.sha256()
            left = want
            while left:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    break
                sha.update(chunk)
                left -= len(chunk)
    except OSError as e:
        raise CheckpointError(f"checkpoint: {path}: cannot read ({_first_line(e)})") from None
    if sha.hexdigest() != h["sha256"]:
        raise CheckpointError(f"checkpoint: {path}: checksum mismatch (sha256 {sha.hexdigest()[:16]}... "
                              f"!= stored {h['sha256'][:16]}...): the file is corrupted")
    h["verified"] = True
    return h


def load_checkpoint(path: str, map_location=None,
                    required: Sequence[str] = ("step", "model", "config")) -> Dict[str, Any]:
    """Verify and load a dsv_ext.train checkpoint (tensors and plain containers only:
    ``weights_only`` unpickling). Raises :class:`CheckpointError` with one line naming the file
    and the problem; ``required`` keys must be present."""
    path = os.fspath(path)
    h = verify_checkpoint(path)
    try:
        with open(path, "rb") as f:
            if h["verified"]:
                src = io.BufferedReader(_Window(f, h["offset"], h["payload_bytes"]), _CHUNK)
            else:
                src = f
            ck = torch.load(src, map_location=map_location, weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # unpickling errors of all kinds: one line, no traceback
        what = "unreadable" if h["verified"] else "not a readable checkpoint"
        raise CheckpointError(f"checkpoint: {path}: {what} ({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(ck, dict):
        raise CheckpointError(f"checkpoint: {path}: holds a {type(ck).__name__}, not a dsv_ext.train checkpoint")
    missing = [k for k in required if k not in ck]
    if missing:
        raise CheckpointError(f"checkpoint: {path}: no {', '.join(map(repr, missing))} entry "
                              "(not a dsv_ext.train checkpoint)")
    if not h["verified"]:
        warnings.warn(f"checkpoint: {path}: written without a checksum (older dsv_ext): not verified",
                      stacklevel=2)
    return ck


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

    p = argparse.ArgumentParser(prog="python -m dsv_ext.checkpoint",
                                description="Verify dsv_ext.train checkpoints and print what they hold.")
    p.add_argument("paths", nargs="+", metavar="CKPT")
    a = p.parse_args(argv)

    def body() -> int:
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
