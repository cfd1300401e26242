"""BLEU, chrF and chrF++ on the valid split while training (`trainer.translate_every_steps`, rank 0): the
live model decodes the raw source text with the finish stage's search (§6.1), scored with the corpus's
published metric (the paper's tokenized BLEU for WMT, Wu et al.'s lowercased one for Multi30k),
sacreBLEU, chrF and chrF++ beside it, all from the same hypotheses.
It draws from no random generator, so the trained weights are bitwise those of a run without it. The
hypotheses of each validation go beside the checkpoints: `valid_step<N>.hyp.<lang>`."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from transformer.checkpoint import checkpoint_dir
from transformer.config import DecodeConfig, to_dict
from transformer.data.sources import Split
from transformer.data.tokenizer import Tokenizer
from transformer.inference.evaluation import published, score_all, wants_lowercase
from transformer.inference.translation import Translator, rows
from transformer.kernels.timing import decoding_kernels
from transformer.training.state import Run
from transformer.utils import atomic

# what each validation logs, in this order on every rank; "bleu" is the corpus's published metric
SCORES = ("bleu", "sacrebleu", "chrf", "chrf++")


def valid_scores(run: Run, text: Split) -> dict[str, float]:
    """{"bleu": the corpus's metric, "sacrebleu", "chrf", "chrf++"} of the live model at this step, on
    `text`: the first `trainer.bleu_sentences` sentences of the valid split (`corpus.read_corpus`)."""
    checkpoint, device, search = str(run.run_dir), str(run.runtime.device), to_dict(run.cfg.finish.search)
    # the weights stay as they train (fp32), the search in dynamic shapes
    cfg = DecodeConfig(checkpoint=checkpoint, device=device, precision="fp32", cuda_graphs=False, **search)
    setting = run.cfg.trainer.cpu_kernels
    kernels = decoding_kernels(run.model.cfg, run.runtime.device, setting, False, *rows(cfg))
    model = kernels.apply(run.model).eval()  # decoding's kernels, the training weights themselves
    info = {"data_meta": run.meta}  # the source language, whose rules split a line too long
    translator = Translator(model, Tokenizer.from_bytes(run.spm_model), cfg, info, kernels)
    # bf16 autocast on CUDA; a CPU decodes fastest in fp32 with its kernels
    with run.runtime.autocast() if run.runtime.device.type == "cuda" else nullcontext():
        hypotheses = translator.translate(text.src)
    data = run.cfg.data
    figures = published(data.name, "test") or published(data.name, "valid")
    metric = figures[0].metric if figures else "tokenized"  # the corpus's published one
    lowercase = wants_lowercase(data.name, "test") or metric == "tokenized_lowercase"
    scores = score_all(hypotheses, text.tgt, data.tgt_lang, lowercase)
    path = checkpoint_dir(run.run_dir) / f"valid_step{run.step}.hyp.{data.tgt_lang}"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(path, "".join(h + "\n" for h in hypotheses).encode("utf-8"))
    return {name: scores[metric if name == "bleu" else name].score for name in SCORES}
