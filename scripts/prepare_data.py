"""Prepare a corpus for training: shared SentencePiece BPE + binary token shards (§5.1).

  python scripts/prepare_data.py data=wmt14_en_de
  python scripts/prepare_data.py data=multi30k data.source=local data.path=../shared/data/multi30k
  python scripts/prepare_data.py data=toy

Everything is written into data.dir (default data/<name>); a re-run skips finished steps.
"""

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also runs from a checkout not pip-installed

from transformer.config import ConfigError, DataConfig, from_dict  # noqa: E402
from transformer.data.prepare import prepare  # noqa: E402
from transformer.data.sources import DataError  # noqa: E402


@hydra.main(config_path="../configs", config_name="prepare_data", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        prepare(from_dict(DataConfig, OmegaConf.to_container(cfg.data, resolve=True), "data."))
    except (ConfigError, DataError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
