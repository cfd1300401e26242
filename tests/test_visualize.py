"""Attention heatmaps: one figure per attention type, one panel per head, pieces on the axes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from transformer.config import ConfigError, VisualizeConfig
from transformer.translation import Translator
from transformer.visualize import attention_figures

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_one_panel_per_head_labelled_with_pieces(tiny_checkpoint):
    cfg = VisualizeConfig(checkpoint=str(tiny_checkpoint), text="x", max_len_b=4)
    translator = Translator.from_checkpoint(cfg)
    tokenizer, heads = translator.tokenizer, translator.model.cfg.n_heads
    src = translator.encode(["The cat sees the house."])[0]
    out = translator.translate_ids([src])[0]
    figures = attention_figures(translator.model, tokenizer, src, out, layer=0)
    assert sorted(figures) == ["cross", "decoder_self", "encoder_self"]
    source, target = tokenizer.pieces(src), tokenizer.pieces([2] + out)  # [BOS] + output
    expected = {"encoder_self": (source, source), "decoder_self": (target, target), "cross": (target, source)}
    for kind, figure in figures.items():
        panels = [ax for ax in figure.axes if ax.images]
        assert len(panels) == heads
        rows, cols = expected[kind]
        for ax in panels:
            assert [t.get_text() for t in ax.get_yticklabels()] == rows
            assert [t.get_text() for t in ax.get_xticklabels()] == cols
            assert ax.images[0].get_array().shape == (len(rows), len(cols))
    decoder = figures["decoder_self"].axes[0].images[0].get_array()
    assert float(decoder[0, 1:].max()) == 0.0  # masked: the first position sees only itself
    with pytest.raises(ConfigError, match="layer=2 is out of range"):
        attention_figures(translator.model, tokenizer, src, out, layer=2)


def test_script_writes_three_pngs_and_tensorboard_events(tiny_checkpoint, tmp_path):
    script = str(ROOT / "scripts" / "visualize_attention.py")
    command = [
        sys.executable,
        script,
        f"checkpoint={tiny_checkpoint}",
        "text=A dog likes a red ball.",
        f"out_dir={tmp_path}",
        "tensorboard=true",
        "max_len_b=3",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[:3] == ["cross.png", "decoder_self.png", "encoder_self.png"]
    assert len(names) == 4 and names[3].startswith("events.out.tfevents")
    assert all((tmp_path / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names[:3])
