"""Attention heatmaps: one figure per attention type, one panel per head, pieces on the axes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_tiny_checkpoint
from test_training_config import composed

from transformer.checkpoint import RESUME_KEYS, load_checkpoint, write_checkpoint
from transformer.config import ConfigError, VisualizeConfig
from transformer.inference import visualize
from transformer.inference.translation import Translator
from transformer.inference.visualize import attention_figures
from transformer.training.finish import finish

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_one_panel_per_head_labelled_with_pieces(tiny_checkpoint):
    cfg = VisualizeConfig(checkpoint=str(tiny_checkpoint), text="x", max_len_b=4)
    translator = Translator.from_checkpoint(cfg)
    tokenizer, heads = translator.tokenizer, translator.model.cfg.n_heads
    (src,) = translator.encode(["The cat sees the house."])[0]  # one line, one source
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


def test_heatmaps_refuse_a_long_text_and_show_the_start_of_a_long_translation(
    tiny_checkpoint, tmp_path, monkeypatch, caplog
):
    """Panels grow with the pieces: a 600-piece translation would take gigabytes to draw."""
    monkeypatch.setattr(visualize, "MAX_PIECES", 8)
    translator = Translator.from_checkpoint(VisualizeConfig(checkpoint=str(tiny_checkpoint), text="x"))
    monkeypatch.setattr(translator, "translate_ids", lambda ids: pytest.fail("translated a refused text"))
    with pytest.raises(ConfigError, match="pieces long .EOS included.; a heatmap shows at most 8"):
        visualize.draw_attention(translator, "The cat sees the house. A dog likes a red ball.", -1, tmp_path)
    long_output = translator.encode(["The cat sees the house. A dog likes a red ball."])[0][0][:-1]
    monkeypatch.setattr(translator, "translate_ids", lambda ids: [long_output])
    translation, _, figures = visualize.draw_attention(translator, "A", -1, tmp_path)
    assert translation == translator.tokenizer.decode(long_output)  # the whole translation is returned
    rows = figures["decoder_self"].axes[0].get_yticklabels()
    assert [t.get_text() for t in rows] == translator.tokenizer.pieces([2] + long_output[:7])
    assert f"the translation is {len(long_output)} pieces long; the heatmaps show its first 7" in caplog.text


def test_the_finish_stage_notes_a_text_too_long_to_draw_and_goes_on(tmp_path, capsys):
    """It is found out after training (counting pieces needs the tokenizer): not worth failing the run."""
    path = make_tiny_checkpoint(tmp_path / "checkpoints" / "checkpoint_0.pt")
    ckpt = load_checkpoint(path)
    write_checkpoint(ckpt | {k: {} for k in RESUME_KEYS}, path)  # what finish takes for a run's checkpoint
    cfg = composed(
        "experiment=demo", "trainer.max_steps=1", "finish.average_last=0", "finish.evaluate_split=null",
        "finish.examples=[A dog.]", f"finish.attention_text={' '.join(['The cat sees the house.'] * 20)}",
    )  # fmt: skip
    cfg.trainer.max_steps = 0  # the checkpoint's step: the run is complete
    assert finish(cfg, tmp_path) == tmp_path / "checkpoints" / "checkpoint_0.pt"
    out = capsys.readouterr().out
    assert "no attention heatmaps: the text is" in out and "a heatmap shows at most 64" in out
    assert "A dog.\n    -> " in out and "next:" in out and not (tmp_path / "attention").exists()
