"""Config files: YAML numbers as people write them, and the train / DSV sections."""
import dsv_ext
from dsv_ext.config import yaml_load
from dsv_ext.app.train import load_config


def test_exponent_without_dot_is_a_float():
    got = yaml_load("lr: 1e-4\nb: 1.0e-4\nn: 3\nbig: 1e5\nname: abc\n")
    assert got == {"lr": 1e-4, "b": 1e-4, "n": 3, "big": 1e5, "name": "abc"}
    assert isinstance(got["lr"], float) and isinstance(got["n"], int)


def test_config_files_read_exponents(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("dsv:\n  predictor_lr: 1e-4\n  finetune_lr: 2e-5\n")
    cfg = dsv_ext.DSVConfig.from_yaml(str(p))
    assert cfg.predictor_lr == 1e-4 and cfg.finetune_lr == 2e-5
    full = tmp_path / "t.yaml"
    full.write_text("train:\n  lr: 3e-4\n")
    assert load_config(str(full), ["train.weight_decay=1e-2"])["train"] == {"lr": 3e-4, "weight_decay": 1e-2}


def _shipped_configs():
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "configs"
    return sorted(root.glob("*.yaml"))


def test_every_shipped_config_is_valid():
    """Each file in configs/ passes the checks a run makes before it builds anything: a DSV-only
    file as a DSVConfig, a run config section by section (model shape against its latents, patch
    and heads; data, train, dsv), so that a typo in a shipped config fails here and not on a GPU
    minutes into a job."""
    from dsv_ext.app.common import TrainConfig, dsv_config
    from dsv_ext.app.models.dit import DiTConfig

    paths = _shipped_configs()
    assert len(paths) >= 8, paths
    for p in paths:
        cfg = yaml_load(p.read_text())
        if "model" not in cfg:  # a DSV settings file (dsv_default, dsv_smoke)
            dsv_ext.DSVConfig.from_yaml(str(p))
            continue
        cfg = load_config(str(p))
        assert cfg["name"] == p.stem, p
        d = cfg["data"]
        mc = dict(cfg["model"], in_channels=d.get("channels", 4),
                  latent_size=(d["frames"], d["height"], d["width"]))
        dit = DiTConfig.from_dict(mc)
        TrainConfig.from_dict(cfg["train"])
        dsv_config(cfg)
        assert dit.num_tokens >= 1 and dit.head_dim >= 1, p
