"""Prepare a corpus for training: shared SentencePiece BPE + binary token shards (§5.1).

  python scripts/prepare_data.py data=wmt14_en_de
  python scripts/prepare_data.py data=multi30k data.source=local data.path=../shared/data/multi30k
  python scripts/prepare_data.py data=toy

Everything is written into data.dir (default data/<name>); a re-run skips finished steps.
"""

import logging
import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from transformer.config import ConfigError, DataConfig, app_defaults, from_dict
from transformer.data.prepare import prepare
from transformer.data.sources import DataError
from transformer.utils.cli import exit_with_error

ConfigStore.instance().store(
    name="prepare_data_defaults", node=app_defaults("prepare_data")
)  # configs/prepare_data.yaml


@hydra.main(config_path="../configs", config_name="prepare_data", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        prepare(from_dict(DataConfig, OmegaConf.to_container(cfg.data, resolve=True), "data."))
    except (ConfigError, DataError) as error:
        exit_with_error(error)


if __name__ == "__main__":
    main()
