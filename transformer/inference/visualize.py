"""Attention heatmaps, as in the paper's Figures 3-5: for one layer, every head's weights over the
SentencePiece pieces, for each of the three uses of attention (§3.2.3).

Figures are built with matplotlib's object API (no pyplot state, Agg rendering), so they work on
machines without a display and can be handed to TensorBoard's `SummaryWriter.add_figure`.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from transformer.config import ConfigError, VisualizeConfig
from transformer.data.tokenizer import Tokenizer
from transformer.inference.recording import AttentionRecord, recording
from transformer.inference.translation import Translator
from transformer.model import Transformer
from transformer.utils import atomic
from transformer.vocab import BOS_ID

log = logging.getLogger(__name__)

# Pieces per side of a heatmap: past this the labels cannot be read, and the image (its panels grow
# with the pieces) takes gigabytes.
MAX_PIECES = 64

KINDS = {  # kind -> (title, query side, key side)
    "encoder_self": ("encoder self-attention", "source", "source"),
    "decoder_self": ("decoder masked self-attention", "target", "target"),
    "cross": ("encoder-decoder attention", "target", "source"),
}


@torch.inference_mode()
def record(model: Transformer, src_ids: list[int], tgt_in: list[int]) -> list[AttentionRecord]:
    """Every attention's weights for one teacher-forced pass of (source, decoder input)."""
    device = next(model.parameters()).device
    src = torch.tensor([src_ids], device=device)  # (1, S)
    tgt = torch.tensor([tgt_in], device=device)  # (1, T)
    recorder, records = recording(model)
    recorder(src, tgt)
    return records


def attention_weights(
    model: Transformer,
    tokenizer: Tokenizer,
    src_ids: list[int],
    output_ids: list[int],
    layer: int | None = None,
    window: int = MAX_PIECES,
) -> dict[str, Any]:
    """The model's own attention for one translation, as the explorer draws it: per kind (KINDS), per
    layer (all, or `layer`), per head, the weights of each query piece over the key pieces, in
    thousandths (integers 0-1000). Of a longer sentence the first `window` pieces of each side are
    shown, their weights those of the whole sentence (rows then sum to less than 1000), with a note."""
    n_layers = model.cfg.n_layers
    if layer is not None and not -n_layers <= layer < n_layers:
        raise ConfigError(
            f"attention_layer={layer} is out of range: the model has {n_layers} layers per stack"
        )
    tgt_in = [BOS_ID] + output_ids
    pieces = {"source": tokenizer.pieces(src_ids)[:window], "target": tokenizer.pieces(tgt_in)[:window]}
    layers = list(range(n_layers)) if layer is None else [layer % n_layers]
    payload: dict[str, Any] = {**{f"{side}_pieces": p for side, p in pieces.items()}, "layers": layers}
    payload["heads"] = model.cfg.n_heads
    for rec in sorted(record(model, src_ids, tgt_in), key=lambda r: r.layer):
        if rec.layer in layers:
            shown = rec.weights[0, :, :window, :window]  # (H, T_q, T_k)
            payload.setdefault(rec.kind, []).append((shown.float() * 1000).round().int().tolist())
    if len(src_ids) > window or len(tgt_in) > window:
        payload["note"] = (
            f"the sentence has {len(src_ids)} source and {len(tgt_in)} target pieces; the first {window} "
            "of each are shown, their weights those of the whole sentence"
        )
    return payload


def plot_heads(weights: torch.Tensor, queries: list[str], keys: list[str], title: str) -> Figure:
    """One panel per head: weights (H, T_q, T_k), rows labelled by query pieces, columns by key pieces."""
    heads = weights.size(0)
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    size = 0.28 * max(len(queries), len(keys)) + 1.5  # inches per panel: room for the piece labels
    figure = Figure(figsize=(cols * size, rows * size + 0.6), layout="constrained")
    axes = figure.subplots(rows, cols, squeeze=False).ravel()
    for head, ax in enumerate(axes):
        if head >= heads:
            ax.set_axis_off()
            continue
        ax.imshow(weights[head].float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_title(f"head {head + 1}", fontsize=9)
        ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
        ax.set_yticks(range(len(queries)), queries, fontsize=7)
    figure.suptitle(title)
    return figure


def attention_figures(
    model: Transformer, tokenizer: Tokenizer, src_ids: list[int], output_ids: list[int], layer: int = -1
) -> dict[str, Figure]:
    """kind -> Figure for `layer` (negative counts from the last), from one pass over
    (source pieces + EOS, [BOS] + output pieces)."""
    n_layers = model.cfg.n_layers
    if not -n_layers <= layer < n_layers:
        raise ConfigError(f"layer={layer} is out of range: the model has {n_layers} layers per stack")
    layer %= n_layers
    tgt_in = [BOS_ID] + output_ids
    labels = {"source": tokenizer.pieces(src_ids), "target": tokenizer.pieces(tgt_in)}
    figures = {}
    for rec in record(model, src_ids, tgt_in):
        if rec.layer == layer:
            title, query_side, key_side = KINDS[rec.kind]
            figures[rec.kind] = plot_heads(
                rec.weights[0], labels[query_side], labels[key_side], f"{title}, layer {layer + 1}"
            )
    return figures


def save_figures(figures: dict[str, Figure], out_dir: str | Path, dpi: int = 120) -> list[Path]:
    """One PNG per figure, `<out_dir>/<kind>.png`, each written atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind, figure in figures.items():
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=dpi)
        paths.append(out_dir / f"{kind}.png")
        atomic.write_bytes(paths[-1], buffer.getvalue())
    return paths


def figures_to_tensorboard(figures: dict[str, Figure], log_dir: str | Path, step: int = 0) -> None:
    """The same figures as TensorBoard images, under tags attention/<kind>."""
    from torch.utils.tensorboard import SummaryWriter  # imported here: slow, and optional

    with SummaryWriter(str(log_dir)) as writer:
        for kind, figure in figures.items():
            writer.add_figure(f"attention/{kind}", figure, global_step=step, close=False)


def draw_attention(
    translator: Translator, text: str, layer: int, out_dir: str | Path
) -> tuple[str, list[Path], dict[str, Figure]]:
    """Translate `text`, then write its heatmaps for `layer` into `out_dir`.
    Returns the translation, the PNG paths and the figures."""
    whole = dataclasses.replace(translator.cfg.search, long_inputs="truncate")  # one source: no parts
    src_ids = translator.encode([" ".join(text.splitlines())], whole)[0][0]
    if len(src_ids) > MAX_PIECES:
        raise ConfigError(
            f"the text is {len(src_ids)} pieces long (EOS included); a heatmap shows at most {MAX_PIECES}: "
            "pass a shorter sentence"
        )
    output_ids = translator.translate_ids([src_ids])[0]
    shown = output_ids[: MAX_PIECES - 1]  # with BOS; causal: the first positions' weights are the same
    if len(shown) < len(output_ids):
        log.warning(
            "the translation is %d pieces long; the heatmaps show its first %d", len(output_ids), len(shown)
        )
    figures = attention_figures(translator.model, translator.tokenizer, src_ids, shown, layer)
    return translator.tokenizer.decode(output_ids), save_figures(figures, out_dir), figures


def visualize_checkpoint(cfg: VisualizeConfig) -> tuple[str, list[Path]]:
    """`draw_attention` for a checkpoint file (and to TensorBoard when asked)."""
    translator = Translator.from_checkpoint(cfg)
    translation, paths, figures = draw_attention(translator, cfg.text, cfg.layer, cfg.out_dir)
    if cfg.tensorboard:
        figures_to_tensorboard(figures, cfg.out_dir, step=translator.info.get("step") or 0)
    return translation, paths
