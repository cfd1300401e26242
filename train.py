"""Train a Transformer with the paper's recipe (§5).

    python train.py experiment=paper_base
    torchrun --nproc_per_node=8 train.py experiment=paper_big
    python train.py -m experiment=table3_A_h1,table3_A_h4,table3_A_h16,table3_A_h32   # a Table 3 sweep

Any setting can be overridden (`trainer.max_steps=1000 model=tiny data=multi30k`); a wrong value is
reported in one line and the exit status is 2 (a key that does not exist is refused by Hydra itself).
A run in an existing run directory continues from its newest checkpoint (trainer.resume=auto). SIGTERM
or Ctrl-C saves a checkpoint, then exits with the status of a process the signal killed (143, 130).
"""

import os
import sys

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from transformer.checkpoint import CheckpointError
from transformer.config import ConfigError, TrainConfig, app_defaults, from_dict
from transformer.data.sources import DataError
from transformer.training import TrainingError, TrainingStopped, train
from transformer.training.finish import finish
from transformer.utils.cli import exit_with_error

ConfigStore.instance().store(name="train_defaults", node=app_defaults("train"))  # every default


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    if HydraConfig.get().mode == RunMode.MULTIRUN:  # each job of a sweep trains in its own directory
        cfg.trainer.run_dir = HydraConfig.get().runtime.output_dir
    try:
        config = from_dict(TrainConfig, OmegaConf.to_container(cfg, resolve=True))
        run_dir = train(config)
        if int(os.environ.get("RANK", "0")) == 0:  # average, evaluate, show translations (finish.*)
            finish(config, run_dir)
    except (ConfigError, DataError, CheckpointError, TrainingError) as error:
        exit_with_error(error)
    except TrainingStopped as stopped:  # saved; the status tells a scheduler the run is not finished
        sys.exit(stopped.exit_status)


if __name__ == "__main__":
    main()
