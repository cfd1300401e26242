"""Attention heatmaps of one sentence and its translation (the paper's Figures 3-5).

python scripts/visualize_attention.py checkpoint=PATH text='"The cat sat on the mat."' layer=-1
... tensorboard=true   # also as TensorBoard images: tensorboard --logdir attention
"""

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from transformer.checkpoint import CheckpointError
from transformer.config import ConfigError, VisualizeConfig, app_defaults, from_dict
from transformer.inference.visualize import visualize_checkpoint
from transformer.utils.cli import exit_with_error, log_to_stderr

ConfigStore.instance().store(
    name="visualize_defaults", node=app_defaults("visualize")
)  # configs/visualize.yaml


@hydra.main(config_path="../configs", config_name="visualize", version_base=None)
def main(cfg: DictConfig) -> None:
    log_to_stderr()
    try:
        settings = from_dict(VisualizeConfig, OmegaConf.to_container(cfg, resolve=True))
        translation, paths = visualize_checkpoint(settings)
        print(translation)
        for path in paths:
            print(f"wrote {path}")
    except (ConfigError, CheckpointError, OSError) as error:
        exit_with_error(error)


if __name__ == "__main__":
    main()
