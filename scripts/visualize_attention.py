"""Attention heatmaps of one sentence and its translation (the paper's Figures 3-5).

python scripts/visualize_attention.py checkpoint=PATH text='"The cat sat on the mat."' layer=-1
... tensorboard=true   # also as TensorBoard images: tensorboard --logdir attention
"""

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also runs from a checkout not pip-installed

from transformer.checkpoint import CheckpointError  # noqa: E402
from transformer.config import ConfigError, VisualizeConfig, from_dict  # noqa: E402
from transformer.translation import exit_with_error  # noqa: E402
from transformer.visualize import visualize_checkpoint  # noqa: E402


@hydra.main(config_path="../configs", config_name="visualize", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s", stream=sys.stderr)
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
