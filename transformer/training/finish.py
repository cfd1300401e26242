"""What `train.py` does once training has reached trainer.max_steps (`finish.*`, rank 0 only):
average the last checkpoints (§6.1), score BLEU beside the published figures, translate a few
example sentences and draw the attention of one of them, then say where everything is."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import torch

from transformer.checkpoint import (
    BEST,
    average_checkpoints,
    averaged_path,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    write_checkpoint,
)
from transformer.config import ConfigError, DecodeConfig, EvaluateConfig, TrainConfig, to_dict
from transformer.inference.evaluation import evaluate_checkpoint
from transformer.inference.translation import Translator
from transformer.inference.visualize import draw_attention
from transformer.utils.devices import decoding_dtype

log = logging.getLogger(__name__)


def check_finish(cfg: TrainConfig) -> None:
    """What the finish stage will need of this machine, checked before training instead of after it (the
    settings' own needs are TrainConfig's checks): 8-bit products where they can run."""
    finish = cfg.finish
    decodes = finish.evaluate_split is not None or finish.examples or finish.attention_text
    if decodes and finish.precision == "int8":
        decoding_dtype("int8", torch.device("cpu"), "finish.precision")


def finish(cfg: TrainConfig, run_dir: Path) -> Path | None:
    """Run the finish stage when the run is complete; returns the checkpoint it used (None if skipped)."""
    found = latest_checkpoint(run_dir)
    if found is None or (found[1]["step"] < cfg.trainer.max_steps and not found[1].get("early_stopped")):
        return None  # an unfinished run: nothing final to report yet
    settings = cfg.finish
    checkpoint = found[0]
    if settings.average_last > 0:
        checkpoint = _average(run_dir, settings.average_last)
    int8 = settings.precision == "int8"  # 8-bit products run on the CPU, whatever device trained
    trainer = cfg.trainer
    device = {
        "device": "cpu" if int8 else trainer.device,
        "threads": trainer.threads,
        "cpu_kernels": trainer.cpu_kernels,
    }
    decode = dict(checkpoint=str(checkpoint), precision=settings.precision, **device)
    decode |= to_dict(settings.search)
    written = [checkpoint]
    best, record = checkpoint_dir(run_dir) / BEST, found[1].get("best") or {}
    if best.is_file() and record.get("value") is not None:  # the best validation (trainer.best_metric)
        print(
            f"best checkpoint: {best} (step {record['step']}, valid {record['metric']} {record['value']:.4g})"
        )
        written.append(best)
    if settings.evaluate_split is None and not settings.examples and not settings.attention_text:
        print_next_steps(cfg, run_dir, checkpoint, written)
        return checkpoint
    translator = Translator.from_checkpoint(DecodeConfig(**decode))  # loaded once for all that follows
    if settings.evaluate_split is not None:
        evaluation = EvaluateConfig(**decode, data=cfg.data, split=settings.evaluate_split)
        result = evaluate_checkpoint(evaluation, translator)
        print(result["table"])
        written.append(Path(result["path"]))
    if settings.examples:
        print("\ntranslations:")
    for source, output in zip(settings.examples, translator.translate(list(settings.examples))):
        print(f"  {source}\n    -> {output}")
    if settings.attention_text:
        try:
            written += draw_attention(translator, settings.attention_text, -1, run_dir / "attention")[1]
        except ConfigError as error:  # found out only now (pieces need the tokenizer): not worth a failed run
            print(f"\nno attention heatmaps: {error}")
    print_next_steps(cfg, run_dir, checkpoint, written)
    return checkpoint


def _average(run_dir: Path, last: int) -> Path:
    paths = list_checkpoints(run_dir)[-last:]
    if len(paths) < last:
        log.warning(
            "finish.average_last=%d: the run has %d numbered checkpoints; averaging those", last, len(paths)
        )
    output = averaged_path(run_dir, len(paths))
    write_checkpoint(average_checkpoints(paths), output)
    print(f"averaged the last {len(paths)} checkpoints ({paths[0].name} .. {paths[-1].name}) into {output}")
    return output


def print_next_steps(cfg: TrainConfig, run_dir: Path, checkpoint: Path, written: list[Path]) -> None:
    """Where everything is, and the commands to translate with the checkpoint, draw its attention and
    watch the curves."""
    ckpt = shlex.quote(str(checkpoint))
    example = shlex.quote(cfg.finish.examples[0] if cfg.finish.examples else "Hello.")
    print("\nwritten:")
    for path in written:
        print(f"  {path}")
    print(f"  {run_dir / 'tensorboard'} (training curves)")
    print("\nnext:")
    print(f"  echo {example} | python translate.py checkpoint={ckpt}")
    print(f"  python scripts/visualize_attention.py checkpoint={ckpt} text='\"...\"'")
    print(f"  tensorboard --logdir {shlex.quote(str(run_dir))}")
    if cfg.data.name != "wmt14_en_de":  # the paper's run, for those who have not started it
        print("  python scripts/prepare_data.py data=wmt14_en_de && python train.py experiment=paper_base")
