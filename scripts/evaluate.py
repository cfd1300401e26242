"""BLEU of a checkpoint on one split of a corpus, beside the paper's figures (§6.1, Tables 2-3), and
sacreBLEU's chrF and chrF++.

  python scripts/evaluate.py data=wmt14_en_de split=test \
      checkpoint=runs/paper_base/checkpoints/checkpoint_average_last5.pt
  python scripts/evaluate.py checkpoint=... data=multi30k data.source=local data.path=../shared/data/multi30k
  python scripts/evaluate.py checkpoint=runs/demo/checkpoints/checkpoint_average_last5.pt
  python scripts/evaluate.py checkpoint=[a.pt,b.pt] weights=[0.5,0.5]     # an ensemble
  python scripts/evaluate.py checkpoint=... constraints=terms.tsv alignment=true

Without `data=`, the corpus is the one the checkpoint was trained on (data.KEY=VALUE settings apply
over it).

Writes <checkpoint>.<data>.<split>.<search>.bleu.json and .hyp.<lang> beside the checkpoint (search:
beam4.alpha0.6 by default, greedy for beam_size=1, then .len<a>x+<b> for other max_len_a/max_len_b and
.bf16 or .int8 for those precisions, and the files of target prefixes, constraints or a vocabulary map
named), so scores of other decoding settings sit side by side; with alignment=true, .align too (each
translation's word alignment, "source-target" pairs from 0).
"""

import sys
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from transformer.checkpoint import CheckpointError
from transformer.config import ConfigError, DataConfig, EvaluateConfig, app_defaults, from_dict, known
from transformer.data.sources import DataError
from transformer.inference.evaluation import evaluate_checkpoint
from transformer.inference.translation import Translator
from transformer.utils.cli import exit_with_error, log_to_stderr

ConfigStore.instance().store(name="evaluate_defaults", node=app_defaults("evaluate"))  # every default


def corpus(cfg: DictConfig, recorded: dict[str, Any] | None) -> dict[str, Any]:
    """The `data=` group when one is given; else the corpus the checkpoint was trained on, with the
    command line's data.KEY=VALUE settings over it."""
    given = [o.lstrip("+~").split("=", 1)[0] for o in HydraConfig.get().overrides.task]
    if "data" in given or recorded is None:
        return OmegaConf.to_container(cfg.data, resolve=True)
    data = OmegaConf.create(known(DataConfig, recorded))
    for key in (k.removeprefix("data.") for k in given if k.startswith("data.")):
        OmegaConf.update(data, key, OmegaConf.select(cfg.data, key), merge=False)
    print(f"corpus: {data.name}, the checkpoint's (data=NAME chooses another)", file=sys.stderr)
    return OmegaConf.to_container(data)


@hydra.main(config_path="../configs", config_name="evaluate", version_base=None)
def main(cfg: DictConfig) -> None:
    log_to_stderr()
    try:
        settings = OmegaConf.to_container(cfg, resolve=True)
        translator = Translator.from_checkpoint(from_dict(EvaluateConfig, settings))
        settings["data"] = corpus(cfg, (translator.info.get("config") or {}).get("data"))
        result = evaluate_checkpoint(from_dict(EvaluateConfig, settings), translator)
        print(result["table"])
    except (ConfigError, CheckpointError, DataError, OSError) as error:
        exit_with_error(error)


if __name__ == "__main__":
    main()
