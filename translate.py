"""Translate with a trained checkpoint (beam search as in §6.1), or several (an ensemble).

  echo "The cat sat on the mat." | python translate.py checkpoint=runs/demo/checkpoints/checkpoint_last.pt
  python translate.py checkpoint=... input=newstest2014.en output=hyp.de beam_size=4 alpha=0.6
  python translate.py checkpoint=... text='"One sentence, quoted for Hydra."'
  python translate.py checkpoint=... nbest=4 output_format=jsonl          # n-best lists with scores
  python translate.py checkpoint=... sampling=true nbest=2 topp=0.9 seed=1 output_format=jsonl  # samples
  python translate.py checkpoint=... input=src.de score=hyp.en output_format=jsonl  # score translations
  python translate.py checkpoint=... alignment=true output_format=fairseq      # with word alignments
  python translate.py checkpoint=... input=src.en target_prefix=start.de      # outputs start as given
  python translate.py checkpoint=... input=src.en constraints=terms.de         # and contain these phrases
  python translate.py checkpoint=[a.pt,b.pt] weights=[0.5,0.5]             # an ensemble

One output line (text) or entry per input line, always: bad lines get a warning on stderr, never a
stop. From a terminal, or with buffer_size=N, each line (each N lines) is translated and written as it
arrives; a piped file is read whole and batched for speed.
"""

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from transformer.checkpoint import CheckpointError
from transformer.config import ConfigError, TranslateConfig, app_defaults, from_dict
from transformer.inference.formats import format_line
from transformer.inference.translation import Translator, read_guides, split_input
from transformer.utils import atomic
from transformer.utils.cli import exit_with_error, log_to_stderr

ConfigStore.instance().store(name="translate_defaults", node=app_defaults("translate"))  # every default


def read_lines(cfg: TranslateConfig) -> list[str]:
    if cfg.text is not None:  # as the shell gave it: bytes that are not UTF-8 become U+FFFD
        return [" ".join(cfg.text.encode("utf-8", "surrogateescape").decode("utf-8", "replace").splitlines())]
    if cfg.input is None:
        return split_input(sys.stdin.buffer.read())
    return split_input(Path(cfg.input).read_bytes())


def chunks(stream: BinaryIO, size: int) -> Iterator[list[str]]:
    """The lines of `stream` `size` at a time, each chunk as soon as its lines have arrived."""
    pending: list[bytes] = []
    done = 0  # lines yielded before: a warning numbers its line in the whole input
    for raw in iter(stream.readline, b""):
        pending.append(raw.removesuffix(b"\n"))
        if len(pending) == size:
            yield split_input(b"\n".join(pending) + b"\n", done)
            done, pending = done + size, []
    if pending:
        yield split_input(b"\n".join(pending) + b"\n", done)


def results(
    translator: Translator,
    cfg: TranslateConfig,
    lines: list[str],
    first: int,
    guides: dict[str, list],
) -> str:
    """The output of input lines numbered from `first`, in cfg.output_format; guides: their target
    prefixes and constraints (`read_guides`); constraints_inline: each line's phrases after tabs."""
    if cfg.constraints_inline:
        fields = [line.split("\t") for line in lines]
        lines, guides = [f[0] for f in fields], {**guides, "constraints": [f[1:] for f in fields]}
    if cfg.score is not None:
        references = split_input(Path(cfg.score).read_bytes())
        found = [[t] if t is not None else [] for t in translator.score(lines, references)]
    else:
        progress = cfg.input is not None
        # a line whose prefix and phrases do not fit is warned about, not a stop: one output line per line
        found = translator.translate_nbest(lines, progress, first, strict=False, **guides)
    return "".join(
        format_line(cfg.output_format, first + i, line, h) for i, (line, h) in enumerate(zip(lines, found))
    )


def run(cfg: TranslateConfig) -> None:
    output = Path(cfg.output) if cfg.output is not None else None
    if output is not None and (output.is_dir() or not output.resolve().parent.is_dir()):
        raise ConfigError(f"output={cfg.output} must be a file in an existing directory")
    interactive = cfg.text is None and cfg.input is None and (cfg.buffer_size or sys.stdin.isatty())
    lines = None if interactive and cfg.score is None else read_lines(cfg)  # before the checkpoints load
    count = None if lines is None else len(lines)
    what = "interactive input" if lines is None else f"{count} input lines"
    guides = read_guides(cfg, count, f"{what}: one per input line, of input=FILE, text= or a piped file")
    translator = Translator.from_checkpoint(cfg)
    with translator.packed():  # once for the session, not for every chunk of lines
        if lines is None:
            written, first = [], 0
            for lines in chunks(sys.stdin.buffer, cfg.buffer_size or 1):
                text = results(translator, cfg, lines, first, guides)
                first += len(lines)
                if output is None:
                    sys.stdout.buffer.write(text.encode("utf-8"))
                    sys.stdout.flush()
                written.append(text)
            text = "".join(written)
        else:
            text = results(translator, cfg, lines, 0, guides)
            if output is None:
                sys.stdout.buffer.write(text.encode("utf-8"))
                sys.stdout.flush()
    if output is not None:
        atomic.write_bytes(output, text.encode("utf-8"))


@hydra.main(config_path="configs", config_name="translate", version_base=None)
def main(cfg: DictConfig) -> None:
    log_to_stderr()
    try:
        run(from_dict(TranslateConfig, OmegaConf.to_container(cfg, resolve=True)))
    except (ConfigError, CheckpointError, OSError) as error:
        exit_with_error(error)


if __name__ == "__main__":
    main()
