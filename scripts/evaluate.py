"""BLEU of a checkpoint on one split of a corpus, beside the paper's figures (§6.1, Tables 2-3).

  python scripts/evaluate.py data=wmt14_en_de split=test \
      checkpoint=runs/paper_base/checkpoints/checkpoint_average_last5.pt
  python scripts/evaluate.py checkpoint=... data=multi30k data.source=local data.path=../shared/data/multi30k

Writes <checkpoint>.<data>.<split>.<search>.bleu.json and .hyp.<lang> beside the checkpoint (search:
beam4.alpha0.6 by default, greedy for beam_size=1, then .len<a>x+<b> for other max_len_a/max_len_b), so
scores of other decoding settings sit side by side.
"""

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also runs from a checkout not pip-installed

from transformer.config import ConfigError, EvaluateConfig, from_dict  # noqa: E402
from transformer.data.sources import DataError  # noqa: E402
from transformer.evaluation import evaluate_checkpoint  # noqa: E402
from transformer.training.checkpoint import CheckpointError  # noqa: E402
from transformer.translation import exit_with_error  # noqa: E402


@hydra.main(config_path="../configs", config_name="evaluate", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s", stream=sys.stderr)
    try:
        result = evaluate_checkpoint(from_dict(EvaluateConfig, OmegaConf.to_container(cfg, resolve=True)))
        print(result["table"])
    except (ConfigError, CheckpointError, DataError, OSError) as error:
        exit_with_error(error)


if __name__ == "__main__":
    main()
