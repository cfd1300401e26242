"""Fine-tuning (`trainer.finetune_from`): a new run from a checkpoint's weights and tokenizer, on
another corpus; Adam, the schedule, the step count and the best validation start afresh; the model must
match; once the new run has saved, resuming goes on with it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from test_training_config import run_cli
from test_training_run import WORDS, compose_config, corpus, overrides, reversal_corpus  # noqa: F401 (corpus: a fixture)

from transformer.checkpoint import checkpoint_dir, load_checkpoint
from transformer.config import ConfigError
from transformer.training import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def shifted(tmp_path_factory) -> Path:
    """Another corpus: other sentences, and words the first corpus never had (its own BPE differs)."""
    words = {**WORDS, "bird": "vogel", "garden": "garten", "green": "gruen", "flies": "fliegt"}
    return reversal_corpus(tmp_path_factory.mktemp("shifted"), words, seed=7)


@pytest.fixture(scope="module")
def source(corpus, tmp_path_factory) -> Path:  # noqa: F811
    """The checkpoint fine-tuned: 12 steps on the first corpus."""
    run_dir = tmp_path_factory.mktemp("source")
    train(compose_config(overrides(corpus, run_dir, "trainer.max_steps=12", "trainer.best_metric=loss")))
    return checkpoint_dir(run_dir) / "checkpoint_last.pt"


def distance(a: dict, b: dict) -> float:
    return sum(float((a[k].double() - b[k].double()).norm()) for k in a)


def test_a_fine_tuned_run_starts_from_the_weights_and_tokenizer_alone_and_resumes_itself(
    source, shifted, tmp_path, caplog
):
    run_dir = tmp_path / "tuned"
    args = overrides(shifted, run_dir, "trainer.max_steps=3", "trainer.save_every_steps=3")
    tuned_dir = train(compose_config([*args, f"trainer.finetune_from={source}"]))
    fresh_args = overrides(shifted, tmp_path / "fresh", "trainer.max_steps=3", f"data.dir={tmp_path / 'own'}")
    fresh_dir = train(compose_config(fresh_args))
    start, tuned = load_checkpoint(source), load_checkpoint(checkpoint_dir(tuned_dir) / "checkpoint_3.pt")
    fresh = load_checkpoint(checkpoint_dir(fresh_dir) / "checkpoint_3.pt")
    # the checkpoint's tokenizer encodes the new corpus: no BPE learned on it
    assert tuned["spm_model"] == start["spm_model"] != fresh["spm_model"]
    prepared = Path(compose_config(args).data.dir)
    assert (prepared / "spm.model").read_bytes() == start["spm_model"]
    # from the checkpoint's weights: 3 steps away from them, where a fresh run is far
    assert distance(tuned["model"], start["model"]) < 0.2 * distance(fresh["model"], start["model"])
    # a new optimizer, schedule, step count and best validation
    assert tuned["step"] == 3 and tuned["scheduler"]["last_epoch"] == 3
    assert all(int(s["step"]) == 3 for s in tuned["optimizer"]["state"].values())
    assert tuned["best"]["step"] <= 3 and start["step"] == 12
    # the same command again, with more steps: it goes on with its own checkpoint, not the old one
    more = compose_config(
        [*overrides(shifted, run_dir, "trainer.max_steps=5"), f"trainer.finetune_from={source}"]
    )
    with caplog.at_level(logging.INFO):
        train(more)
    assert load_checkpoint(checkpoint_dir(run_dir) / "checkpoint_last.pt")["step"] == 5
    assert "started this run; it goes on from" in caplog.text and "checkpoint_3.pt" in caplog.text
    # its data prepared again (removed, here), with the checkpoint's tokenizer, not one learned anew
    shutil.rmtree(prepared)
    train(
        compose_config(
            [*overrides(shifted, run_dir, "trainer.max_steps=6"), f"trainer.finetune_from={source}"]
        )
    )
    assert (prepared / "spm.model").read_bytes() == start["spm_model"]
    assert load_checkpoint(checkpoint_dir(run_dir) / "checkpoint_last.pt")["step"] == 6


def test_another_model_is_refused_in_one_line_before_the_data_is_prepared(source, shifted, tmp_path):
    data = tmp_path / "not_prepared"
    args = overrides(shifted, tmp_path / "run", "model.d_ff=128", "model.dropout=0.3", f"data.dir={data}")
    with pytest.raises(ConfigError, match=r"holds another model: model.d_ff=128 \(the checkpoint's: 64\);"):
        train(compose_config([*args, f"trainer.finetune_from={source}"]))
    assert not data.exists()  # dropout is the fine-tuning's own: not named
    done = run_cli(*args, "trainer.finetune_from=missing.pt")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "error: trainer.finetune_from=missing.pt: no such file"
    )
    both = run_cli(*args[:-1], f"trainer.finetune_from={source}", f"trainer.resume={source}")
    assert both.returncode == 2 and "trainer.finetune_from starts a new run" in both.stderr


def test_data_encoded_with_another_tokenizer_is_refused_then_rebuilt_with_the_checkpoints(
    source, shifted, tmp_path
):
    data = f"data.dir={tmp_path / 'own_bpe'}"
    train(compose_config([*overrides(shifted, tmp_path / "own", "trainer.max_steps=1"), data]))
    tuned = [
        *overrides(shifted, tmp_path / "tuned", "trainer.max_steps=1"),
        data,
        f"trainer.finetune_from={source}",
    ]
    with pytest.raises(ConfigError, match="encoded with another tokenizer than trainer.finetune_from's"):
        train(compose_config(tuned))
    train(compose_config([*tuned, "data.force=true"]))
    again = overrides(shifted, tmp_path / "new", "trainer.max_steps=1")  # from scratch, on the same data
    with pytest.raises(ConfigError, match="holds data encoded with a checkpoint's tokenizer"):
        train(compose_config([*again, data]))
    # a run directory of a run from scratch is not where a fine-tuning run goes on
    scratch = [
        *overrides(shifted, tmp_path / "own", "trainer.max_steps=2"),
        data,
        f"trainer.finetune_from={source}",
    ]
    with pytest.raises(
        ConfigError, match=r"holds a run started from scratch \(.*checkpoint_1.pt\); choose another"
    ):
        train(compose_config(scratch))
    tokenizer = load_checkpoint(source)["spm_model"]
    assert (tmp_path / "own_bpe" / "spm.model").read_bytes() == tokenizer
    assert (
        load_checkpoint(checkpoint_dir(tmp_path / "tuned") / "checkpoint_last.pt")["spm_model"] == tokenizer
    )
