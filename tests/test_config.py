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
