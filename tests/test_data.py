"""CPU tests of dsv_ext.app.data: procedural videos, the patch encoder and the folder loader."""
import os
import sys

import numpy as np
import pytest
import torch

from dsv_ext.app.data import PatchEncoder, ProceduralVideos, VideoFolder, make_dataset


def _corr(a, b):
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


def test_procedural_deterministic_and_distinct():
    a = ProceduralVideos(50, 6, 12, 12, 4, seed=3)
    b = ProceduralVideos(50, 6, 12, 12, 4, seed=3)
    x = a[7]
    assert x.shape == (4, 6, 12, 12) and x.dtype == torch.float32
    assert torch.equal(x, b[7])                        # same (seed, index): identical
    assert torch.equal(x, a[7 - 50])                   # negative index
    assert not torch.allclose(x, a[8])                 # other index
    assert not torch.allclose(x, ProceduralVideos(50, 6, 12, 12, 4, seed=4)[7])
    assert not torch.allclose(x, ProceduralVideos(50, 6, 12, 12, 4, seed=3, split="val")[7])
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-3
    with pytest.raises(IndexError):
        a[50]
    with pytest.raises(ValueError, match="^mode"):
        ProceduralVideos(5, 4, 8, 8, mode="rgb")
    with pytest.raises(ValueError, match="^frames"):
        ProceduralVideos(5, 0, 8, 8)


@pytest.mark.parametrize("mode", ["latent", "pixels"])
def test_procedural_has_spatiotemporal_structure(mode):
    ds = ProceduralVideos(100, 8, 16, 16, 4, seed=0, mode=mode)
    tcorr, scorr, change = [], [], []
    for i in range(6):
        x = ds[i]
        tcorr.append(_corr(x[:, :-1], x[:, 1:]))           # neighbouring frames
        scorr.append(_corr(x[..., :-1], x[..., 1:]))       # neighbouring columns
        change.append(float((x[:, -1] - x[:, 0]).abs().mean()))
    # Smooth in space and time (real structure), unlike i.i.d. noise (correlation ~ 0) ...
    assert np.mean(tcorr) > 0.6 and np.mean(scorr) > 0.4, (tcorr, scorr)
    noise = torch.randn(4, 8, 16, 16)
    assert abs(_corr(noise[:, :-1], noise[:, 1:])) < 0.1
    # ... yet things move: the last frame is not the first one.
    assert min(change) > 0.05, change
    # Channels are correlated mixtures (like VAE latents), not copies.
    x = ds[0]
    assert _corr(x[0], x[1]) < 0.999


def test_patch_encoder_roundtrip_and_errors():
    enc = PatchEncoder(channels=4, patch=8, seed=0)
    w = enc.weight
    assert torch.allclose(w @ w.T, 64 * torch.eye(4), atol=1e-4)  # orthogonal rows, norm p
    # Frames that are constant inside each 8x8 patch are exactly recovered (the first three
    # rows are the colour averages).
    coarse = torch.rand(5, 3, 4, 6)
    frames = coarse.repeat_interleave(8, 2).repeat_interleave(8, 3)
    z = enc.encode(frames)
    assert z.shape == (4, 5, 4, 6)
    assert torch.allclose(enc.decode(z), frames, atol=1e-5)
    with pytest.raises(ValueError, match="^frames"):
        enc.encode(torch.rand(5, 3, 10, 16))
    with pytest.raises(ValueError, match="^channels"):
        PatchEncoder(channels=0)


def test_video_folder_npy(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "a.npy", rng.integers(0, 256, (12, 40, 56, 3), dtype=np.uint8))
    np.save(tmp_path / "b.npy", rng.random((5, 64, 64), dtype=np.float32))  # grayscale, short
    lat = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    os.makedirs(tmp_path / "sub")
    np.save(tmp_path / "sub" / "c.npy", lat)                                  # latents already
    ds = VideoFolder(str(tmp_path), frames=4, height=8, width=8, channels=4, normalize=False)
    assert len(ds) == 3 and [os.path.basename(f) for f in ds.files] == ["a.npy", "b.npy", "c.npy"]
    for i in range(3):
        z = ds[i]
        assert z.shape == (4, 4, 8, 8) and torch.isfinite(z).all()
    # uint8 frames: the colour-average channels equal the 8x8 means of the resized frames.
    a = np.load(tmp_path / "a.npy")[:4].astype(np.float32) / 255
    fr = torch.nn.functional.interpolate(torch.from_numpy(a).permute(3, 0, 1, 2)[None],
                                         size=(4, 64, 64), mode="trilinear", align_corners=False)[0]
    means = fr.reshape(3, 4, 8, 8, 8, 8).mean((3, 5))
    got = ds[0][:3] / 64.0  # an average row of the encoder has 64 entries equal to 1
    assert torch.allclose(got, means, atol=1e-4)
    # latents keep their values where no resize is needed in space (time is stretched 3 -> 4).
    z = ds[2]
    assert torch.allclose(z[:, 0], torch.from_numpy(lat)[:, 0], atol=0.5)
    # the split helper
    tr = make_dataset({"source": "folder", "path": str(tmp_path), "frames": 4, "height": 8,
                       "width": 8, "channels": 4, "val_fraction": 0.34}, "train")
    va = make_dataset({"source": "folder", "path": str(tmp_path), "frames": 4, "height": 8,
                       "width": 8, "channels": 4, "val_fraction": 0.34}, "val")
    assert len(tr) == 2 and len(va) == 1


def test_video_folder_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="^root"):
        VideoFolder(str(tmp_path / "missing"), 4, 8, 8)
    with pytest.raises(FileNotFoundError, match="^root"):
        VideoFolder(str(tmp_path), 4, 8, 8)
    np.save(tmp_path / "bad.npy", np.zeros((4, 5), dtype=np.float32))
    ds = VideoFolder(str(tmp_path), 4, 8, 8)
    with pytest.raises(ValueError, match="bad.npy"):
        ds[0]
    os.remove(tmp_path / "bad.npy")
    (tmp_path / "clip.mp4").write_bytes(b"\x00" * 16)
    # Neither PyAV nor torchvision importable: a clear ImportError naming what to install.
    monkeypatch.setitem(sys.modules, "av", None)
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    ds = VideoFolder(str(tmp_path), 4, 8, 8)
    with pytest.raises(ImportError, match="PyAV"):
        ds[0]
    with pytest.raises(ValueError, match="^data.source"):
        make_dataset({"source": "web", "frames": 4, "height": 8, "width": 8})


def test_video_folder_mp4_with_pyav(tmp_path):
    av = pytest.importorskip("av")
    frames = (np.random.default_rng(0).random((6, 32, 48, 3)) * 255).astype(np.uint8)
    path = str(tmp_path / "clip.mp4")
    with av.open(path, mode="w") as out:
        st = out.add_stream("mpeg4", rate=8)
        st.width, st.height, st.pix_fmt = 48, 32, "yuv420p"
        for f in frames:
            for pkt in st.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(pkt)
        for pkt in st.encode():
            out.mux(pkt)
    z = VideoFolder(str(tmp_path), frames=4, height=4, width=6)[0]
    assert z.shape == (4, 4, 4, 6) and torch.isfinite(z).all()


def test_video_folder_integer_and_float255_frames(tmp_path):
    # int64 frames (np.random.default_rng().integers' default dtype) hold 0..255 like uint8: they
    # must encode like uint8, not be read as 0..1 floats and clamp to white.
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (4, 64, 64, 3))
    assert a.dtype == np.int64
    os.makedirs(tmp_path / "u8")
    os.makedirs(tmp_path / "i64")
    np.save(tmp_path / "u8" / "a.npy", a.astype(np.uint8))
    np.save(tmp_path / "i64" / "a.npy", a)
    ref = VideoFolder(str(tmp_path / "u8"), 4, 8, 8, normalize=False)[0]
    got = VideoFolder(str(tmp_path / "i64"), 4, 8, 8, normalize=False)[0]
    assert torch.allclose(got, ref, atol=1e-5)
    # out-of-range integers and float frames in 0..255 are errors, not white clips
    os.makedirs(tmp_path / "u16")
    np.save(tmp_path / "u16" / "a.npy", (a * 200).astype(np.uint16))
    with pytest.raises(ValueError, match="a.npy: integer frames"):
        VideoFolder(str(tmp_path / "u16"), 4, 8, 8)[0]
    os.makedirs(tmp_path / "f255")
    np.save(tmp_path / "f255" / "a.npy", a.astype(np.float32))
    with pytest.raises(ValueError, match="a.npy: float frames"):
        VideoFolder(str(tmp_path / "f255"), 4, 8, 8)[0]


def test_video_folder_rejects_a_single_image(tmp_path):
    # one RGB image [H, W, 3] is not H grayscale frames 3 pixels wide
    np.save(tmp_path / "img.npy", np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="img.npy: .*one image"):
        VideoFolder(str(tmp_path), 4, 8, 8)[0]
