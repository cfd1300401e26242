"""Every YAML file under configs/ composes with Hydra and validates as the typed config it feeds."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from transformer.config import ConfigError, DataConfig, ModelConfig, TrainConfig, from_dict

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def compose_train(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("train", overrides=list(overrides))
    return from_dict(TrainConfig, OmegaConf.to_container(cfg, resolve=True))


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes_and_validates(experiment):
    cfg = compose_train(f"experiment={experiment}")
    assert cfg.name == experiment
    assert cfg.trainer.run_dir.endswith(cfg.name)


@pytest.mark.parametrize("group", ["model", "data", "optim", "trainer"])
def test_every_group_option_composes_and_validates(group):
    for option in options(group):
        compose_train(f"{group}={option}")


def test_paper_defaults():
    cfg = compose_train()
    m, o = cfg.model, cfg.optim
    shape = (m.n_layers, m.d_model, m.d_ff, m.n_heads, m.d_k, m.d_v, m.dropout)
    assert shape == (6, 512, 2048, 8, 64, 64, 0.1)
    assert (m.norm_first, m.positional, m.n_kv_heads) == (False, "sinusoidal", 8)
    assert (o.beta1, o.beta2, o.eps, o.warmup_steps, o.label_smoothing) == (0.9, 0.98, 1e-9, 4000, 0.1)
    assert cfg.data.vocab_size == 37000 and cfg.trainer.max_steps == 100000
    big = compose_train("experiment=paper_big")
    assert (big.model.d_model, big.model.d_ff, big.model.n_heads, big.model.dropout) == (1024, 4096, 16, 0.3)
    assert big.trainer.max_steps == 300000 and big.finish.average_last == 20


def test_table3_rows_change_what_the_paper_says():
    assert compose_train("experiment=table3_B_dk16").model.d_k == 16
    assert compose_train("experiment=table3_C_N2").model.n_layers == 2
    assert compose_train("experiment=table3_D_ls0").optim.label_smoothing == 0.0
    assert compose_train("experiment=table3_E_learned_pos").model.positional == "learned"


def test_unknown_key_is_rejected_by_name():
    with pytest.raises(Exception, match="nonsense"):
        compose_train("trainer.nonsense=1")
    with pytest.raises(ConfigError, match="unknown key.*model.colour"):
        from_dict(TrainConfig, {"model": {"colour": "red"}})


def test_bad_values_fail_on_construction():
    with pytest.raises(ConfigError, match="d_model=500 is not divisible by n_heads=8"):
        compose_train("model.d_model=500")
    with pytest.raises(ConfigError, match="data.source='ftp'"):
        from_dict(DataConfig, {"source": "ftp"})
    with pytest.raises(ConfigError, match="model.vocab_size=0"):
        from_dict(ModelConfig, {"vocab_size": 0})


@pytest.mark.parametrize("name", ["translate", "prepare_data", "evaluate", "visualize"])
def test_app_configs_compose(name):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose(name)
    assert OmegaConf.to_container(cfg, resolve=True)
