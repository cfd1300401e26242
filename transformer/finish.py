"""What `train.py` does once training has reached trainer.max_steps (`finish.*`, rank 0 only):
average the last checkpoints (§6.1), score BLEU beside the published figures, translate a few
example sentences and draw the attention of one of them, then say where everything is."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

from transformer.config import DecodeConfig, EvaluateConfig, TrainConfig, VisualizeConfig
from transformer.evaluation import evaluate_checkpoint
from transformer.training.checkpoint import (
    atomic_save,
    average_checkpoints,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
)
from transformer.translation import Translator
from transformer.visualize import attention_figures, save_figures

log = logging.getLogger(__name__)


def finish(cfg: TrainConfig, run_dir: Path) -> Path | None:
    """Run the finish stage when the run is complete; returns the checkpoint it used (None if skipped)."""
    found = latest_checkpoint(run_dir)
    if found is None or found[1]["step"] < cfg.trainer.max_steps:
        return None  # stopped early (a signal): nothing final to report yet
    f = cfg.finish
    checkpoint = found[0]
    if f.average_last > 0:
        checkpoint = _average(run_dir, f.average_last)
    decode = dict(checkpoint=str(checkpoint), beam_size=f.beam_size, alpha=f.alpha, device=cfg.trainer.device)
    written = [checkpoint]
    if f.evaluate_split is not None:
        print(evaluate_checkpoint(EvaluateConfig(**decode, data=cfg.data, split=f.evaluate_split))["table"])
        written.append(Path(f"{checkpoint}.{cfg.data.name}.{f.evaluate_split}.bleu.json"))
    if f.examples or f.attention_text:
        translator = Translator.from_checkpoint(DecodeConfig(**decode))
        if f.examples:
            print("\ntranslations:")
        for source, output in zip(f.examples, translator.translate(list(f.examples))):
            print(f"  {source}\n    -> {output}")
        if f.attention_text:
            written += _attention(translator, VisualizeConfig(**decode, text=f.attention_text), run_dir)
    _next_steps(cfg, run_dir, checkpoint, written)
    return checkpoint


def _average(run_dir: Path, last: int) -> Path:
    paths = list_checkpoints(run_dir)[-last:]
    output = checkpoint_dir(run_dir) / f"checkpoint_average_last{len(paths)}.pt"
    atomic_save(average_checkpoints(paths), output)
    print(f"averaged the last {len(paths)} checkpoints ({paths[0].name} .. {paths[-1].name}) into {output}")
    return output


def _attention(translator: Translator, cfg: VisualizeConfig, run_dir: Path) -> list[Path]:
    src_ids = translator.encode([cfg.text])[0]
    output_ids = translator.translate_ids([src_ids])[0]
    figures = attention_figures(translator.model, translator.tokenizer, src_ids, output_ids, cfg.layer)
    return save_figures(figures, run_dir / "attention")


def _next_steps(cfg: TrainConfig, run_dir: Path, checkpoint: Path, written: list[Path]) -> None:
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
    print("  python scripts/prepare_data.py data=wmt14_en_de && python train.py experiment=paper_base")

