"""Translate with a trained checkpoint (beam search as in §6.1).

  echo "The cat sat on the mat." | python translate.py checkpoint=runs/demo/checkpoints/checkpoint_last.pt
  python translate.py checkpoint=... input=newstest2014.en output=hyp.de beam_size=4 alpha=0.6
  python translate.py checkpoint=... text='"One sentence, quoted for Hydra."'

One output line per input line, always: bad lines get a warning on stderr, never a stop.
"""

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from transformer import atomic
from transformer.checkpoint import CheckpointError
from transformer.cli import exit_with_error
from transformer.config import ConfigError, TranslateConfig, app_defaults, from_dict
from transformer.translation import Translator, split_input

ConfigStore.instance().store(
    name="translate_defaults", node=app_defaults("translate")
)  # configs/translate.yaml


def read_lines(cfg: TranslateConfig) -> list[str]:
    if cfg.text is not None:
        return [" ".join(cfg.text.splitlines())]
    if cfg.input is None:
        return split_input(sys.stdin.buffer.read())
    path = Path(cfg.input)
    if not path.is_file():
        raise ConfigError(f"input={cfg.input} is not a file")
    return split_input(path.read_bytes())


def run(cfg: TranslateConfig) -> None:
    output = Path(cfg.output) if cfg.output is not None else None
    if output is not None and (output.is_dir() or not output.resolve().parent.is_dir()):
        raise ConfigError(f"output={cfg.output} must be a file in an existing directory")
    translator = Translator.from_checkpoint(cfg)
    lines = read_lines(cfg)
    translations = translator.translate(lines, progress=cfg.input is not None)
    text = "".join(line + "\n" for line in translations)
    if output is None:
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.flush()
    else:
        atomic.write_bytes(output, text.encode("utf-8"))


@hydra.main(config_path="configs", config_name="translate", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s", stream=sys.stderr)
    try:
        run(from_dict(TranslateConfig, OmegaConf.to_container(cfg, resolve=True)))
    except (ConfigError, CheckpointError, OSError) as error:
        exit_with_error(error)


if __name__ == "__main__":
    main()
