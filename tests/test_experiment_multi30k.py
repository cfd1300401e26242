"""`experiment=multi30k`: the published "Transformer-tiny" (Wu et al., ACL 2021) composes, has the
published shape, and trains a few steps through the real `train(cfg)` on a tiny corpus written here."""

import math
import random
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from transformer.checkpoint import list_checkpoints, load_checkpoint
from transformer.config import TrainConfig, from_dict
from transformer.model import Transformer
from transformer.training import train
from transformer.training.schedule import inverse_sqrt_lr

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def compose_experiment(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("train", overrides=["experiment=multi30k", *overrides])
    return from_dict(TrainConfig, OmegaConf.to_container(cfg, resolve=True))


def test_the_published_tiny_model_and_evaluation_protocol():
    cfg = compose_experiment()
    m = cfg.model
    assert (m.n_layers, m.d_model, m.d_ff, m.n_heads) == (4, 128, 256, 4)
    assert (cfg.data.name, cfg.data.src_lang, cfg.data.tgt_lang) == ("multi30k", "en", "de")
    assert cfg.data.lowercase  # the published figures train on and score lowercased text
    assert (cfg.finish.average_last, cfg.finish.evaluate_split, cfg.finish.beam_size) == (10, "test", 5)
    assert cfg.trainer.keep_last >= cfg.finish.average_last  # the checkpoints to average are kept
    assert cfg.trainer.device == "cpu" and cfg.optim.label_smoothing == 0.1


def test_about_the_published_parameter_count_with_a_10k_vocabulary():
    """Wu et al. report about 2.6M parameters; their joint BPE vocabulary is about 10k."""
    cfg = compose_experiment("model.vocab_size=10000")
    d, f, v, n = 128, 256, 10000, 4
    attention = 4 * d * d  # W^Q, W^K, W^V, W^O, without bias (§3.2.2)
    feed_forward, norm = 2 * d * f + f + d, 2 * d
    encoder_layer = attention + feed_forward + 2 * norm
    decoder_layer = 2 * attention + feed_forward + 3 * norm  # self- and cross-attention
    final_norms = 2 * norm if cfg.model.norm_first else 0  # pre-LN normalizes each stack's output
    by_hand = v * d + n * (encoder_layer + decoder_layer) + final_norms  # one shared embedding matrix
    assert Transformer(cfg.model).num_parameters() == by_hand
    assert abs(by_hand - 2.6e6) / 2.6e6 < 0.05


def test_peak_learning_rate_is_the_published_5e_3():
    o = compose_experiment().optim
    peak = o.lr_scale * 128**-0.5 * o.warmup_steps**-0.5  # Eq. (3) at step_num = warmup_steps
    assert math.isclose(inverse_sqrt_lr(o.warmup_steps, 128, o.warmup_steps, o.lr_scale), peak)
    assert peak == pytest.approx(5e-3, rel=0.01)  # Wu et al.'s peak, reached after their 2,000 warmup steps


def test_an_update_holds_two_4096_token_batches_for_8000_updates():
    """Wu et al.'s command: two GPUs with --max-tokens 4096 each, so two batches per update, and
    --max-update 8000; on one CPU process the two batches are accumulated."""
    t = compose_experiment().trainer
    assert (t.grad_accum(1), t.batch_tokens(1)) == (2, 4096)
    assert (t.grad_accum(2), t.batch_tokens(2)) == (1, 4096)  # as their two workers
    assert t.max_steps == 8000


@pytest.mark.skipif(not MULTI30K.is_dir(), reason="no ../shared/data/multi30k")
def test_the_raw_multi30k_release_has_every_split_the_config_names():
    cfg = compose_experiment("data.source=local", f"data.path={MULTI30K}")
    for name in cfg.data.split_names.values():
        for lang in (cfg.data.src_lang, cfg.data.tgt_lang):
            assert (MULTI30K / f"{name}.{lang}.gz").is_file(), name


def write_corpus(directory: Path) -> None:
    """Short caption-like pairs, files named as in the raw Multi30k release (train, val, test_2016_flickr)."""
    nouns = {"man": "mann", "dog": "hund", "child": "kind", "woman": "frau", "ball": "ball"}
    verbs = {"sees": "sieht", "holds": "hält", "throws": "wirft"}
    rng = random.Random(0)
    for name, n in (("train", 200), ("val", 10), ("test_2016_flickr", 10)):
        en, de = [], []
        for _ in range(n):
            a, b, verb = rng.choice(list(nouns)), rng.choice(list(nouns)), rng.choice(list(verbs))
            en.append(f"a {a} {verb} a {b} .\n")
            de.append(f"ein {nouns[a]} {verbs[verb]} ein {nouns[b]} .\n")
        (directory / f"{name}.en").write_text("".join(en), encoding="utf-8")
        (directory / f"{name}.de").write_text("".join(de), encoding="utf-8")


def test_the_experiment_trains_a_few_steps_through_train(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    write_corpus(raw)
    cfg = compose_experiment(
        "data.source=local",
        f"data.path={raw}",
        f"data.dir={tmp_path / 'prepared'}",
        "data.vocab_size=64",
        "data.num_workers=1",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.max_steps=3",
        "trainer.tokens_per_step=400",
        "trainer.max_tokens=200",
        "trainer.save_every_steps=1",
        "trainer.eval_every_steps=3",
        "trainer.progress=false",
    )
    run_dir = train(cfg)
    assert [p.name for p in list_checkpoints(run_dir)] == [f"checkpoint_{k}.pt" for k in (1, 2, 3)]
    last = load_checkpoint(run_dir / "checkpoints" / "checkpoint_3.pt")
    assert last["step"] == 3
    shape = {k: last["model_config"][k] for k in ("n_layers", "d_model", "d_ff", "n_heads", "dropout")}
    assert shape == {"n_layers": 4, "d_model": 128, "d_ff": 256, "n_heads": 4, "dropout": cfg.model.dropout}
    assert last["model_config"]["vocab_size"] == 64  # set by the prepared corpus
    first = load_checkpoint(run_dir / "checkpoints" / "checkpoint_1.pt")
    changed = [k for k, v in last["model"].items() if not v.equal(first["model"][k])]
    assert changed  # the updates moved the weights
