"""A run directory nothing can clobber or change silently: one writer at a time (a lock a killed process
never leaves behind), a resume that refuses another tokenizer or batch budget unless told, TensorBoard
without the steps a resume redid, checkpoints to average that meet the last step. CPU only."""

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from test_training_run import (  # noqa: F401 (the corpus fixture)
    ENV,
    ROOT,
    compose_config,
    corpus,
    overrides,
)

from transformer.checkpoint import list_checkpoints, load_checkpoint, write_checkpoint
from transformer.config import ConfigError
from transformer.data.prepare import SPM_FILE
from transformer.training import Plan, train
from transformer.training import lock as run_lock

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def holder(run_dir) -> subprocess.Popen:
    """Another process that takes the run directory's lock and waits; its PID is the holder's."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from transformer.training.lock import lock
        lock({str(run_dir)!r})
        print("locked", flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "locked"
    return process


def test_a_second_launch_on_a_held_run_directory_stops_before_writing_anything(corpus, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    first = holder(run_dir)
    try:
        args = overrides(corpus, run_dir, "trainer.max_steps=2")
        done = subprocess.run(
            [sys.executable, ROOT / "train.py", *args], env=ENV, capture_output=True, text=True
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"error: {run_dir} is in use by another training run (PID {first.pid}); wait for it to end, stop "
            "it, or choose another trainer.run_dir"
        ]
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # no .hydra/, no log, no checkpoint
    finally:
        first.kill()
        first.wait()


def test_the_lock_of_a_killed_run_never_blocks_the_next(corpus, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    first = holder(run_dir)
    with pytest.raises(run_lock.RunDirectoryInUse, match=f"PID {first.pid}"):
        run_lock.lock(run_dir)
    first.send_signal(signal.SIGKILL)
    first.wait()
    args = overrides(corpus, run_dir, "trainer.max_steps=2", "trainer.eval_every_steps=0")
    done = subprocess.run([sys.executable, ROOT / "train.py", *args], env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in list_checkpoints(run_dir)] == ["checkpoint_2.pt"]


def test_a_child_the_holder_forked_does_not_keep_the_lock_after_the_holder_dies(tmp_path):
    """Data preparation forks workers while the lock is held: killed with its holder's death, the lock
    must not live on in a worker."""
    code = textwrap.dedent(
        f"""
        import multiprocessing, time
        from transformer.training.lock import lock
        lock({str(tmp_path)!r})
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
        child.start()
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # the forked child lives on
        run_lock.lock(tmp_path)
        run_lock.unlock(tmp_path)
    finally:
        os.kill(child, signal.SIGKILL)


def test_one_process_may_take_its_own_lock_again_and_holds_it_until_the_last_release(tmp_path):
    code = f"from transformer.training.lock import lock; lock({str(tmp_path)!r})"
    run_lock.lock(tmp_path)
    run_lock.lock(tmp_path)  # the Hydra callback, then the training plan
    run_lock.unlock(tmp_path)
    refused = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True)
    assert refused.returncode == 1 and f"PID {os.getpid()}" in refused.stderr
    run_lock.unlock(tmp_path)
    assert subprocess.run([sys.executable, "-c", code], env=ENV).returncode == 0


def test_a_filesystem_without_locks_is_warned_about_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    def no_locks(fd, operation):
        raise OSError(37, "No locks available")  # ENOLCK, as some network filesystems answer

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING):
        run_lock.lock(tmp_path)
    run_lock.unlock(tmp_path)
    assert f"{tmp_path}: cannot lock the run directory (No locks available)" in caplog.text


def test_the_training_plan_holds_the_run_directory_while_it_runs(corpus, tmp_path):  # noqa: F811
    code = f"from transformer.training.lock import lock; lock({str(tmp_path)!r})"
    plan = Plan.make(compose_config(overrides(corpus, tmp_path, "trainer.max_steps=2")))
    held = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True)
    plan.close()
    assert held.returncode == 1 and "is in use by another training run" in held.stderr
    assert subprocess.run([sys.executable, "-c", code], env=ENV).returncode == 0


@pytest.fixture(scope="module")
def two_steps(corpus, tmp_path_factory):  # noqa: F811
    """A run of two steps to resume from."""
    run_dir = tmp_path_factory.mktemp("two_steps")
    train(compose_config(overrides(corpus, run_dir, "trainer.max_steps=2", "trainer.eval_every_steps=0")))
    return run_dir / "checkpoints" / "checkpoint_2.pt"


@pytest.mark.parametrize(
    ("change", "old", "new"),
    [
        ("trainer.max_tokens", 500, 400),
        ("trainer.tokens_per_step", 1000, 1500),
        ("trainer.pad_to_multiple", 1, 4),
    ],
)
def test_a_resume_with_another_batch_budget_is_refused_unless_accepted(
    corpus,  # noqa: F811
    two_steps,
    tmp_path,
    caplog,
    change,
    old,
    new,
):
    args = overrides(
        corpus, tmp_path, "trainer.max_steps=4", f"trainer.resume={two_steps}", f"{change}={new}"
    )
    with pytest.raises(ConfigError) as refused:
        train(compose_config(args))
    assert str(refused.value) == (
        f"{two_steps} was trained with other {change} ({old} -> {new}): the run would go on with other "
        f"batches; undo the change, or set trainer.resume_changes=[{change}] to go on knowingly"
    )
    assert not (tmp_path / "checkpoints").exists()
    with caplog.at_level(logging.WARNING):
        train(compose_config([*args, f"trainer.resume_changes=[{change}]"]))
    assert f"resumed with {change} {old} -> {new} (trainer.resume_changes)" in caplog.text
    assert load_checkpoint(tmp_path / "checkpoints" / "checkpoint_4.pt")["step"] == 4


def test_a_resume_onto_another_tokenizer_of_the_same_size_is_refused_unless_accepted(
    corpus,  # noqa: F811
    two_steps,
    tmp_path,
    caplog,
):
    """The same corpus and vocabulary size, the tokenizer learned from another sample: other pieces."""
    other = tmp_path / "other_data"
    args = [*overrides(corpus, tmp_path / "run", "trainer.max_steps=4", f"trainer.resume={two_steps}")]
    args += [f"data.dir={other}", "data.spm_sample_size=150"]
    with pytest.raises(
        ConfigError, match=r"trained with other tokenizer \(not .*spm.model\): the run would go on"
    ):
        train(compose_config(args))  # refused once the data is prepared, before any step
    assert (other / SPM_FILE).read_bytes() != load_checkpoint(two_steps)["spm_model"]
    with pytest.raises(ConfigError, match=r"trainer.resume_changes=\[tokenizer\]"):
        train(compose_config(args))  # the data is prepared now: refused before it is read
    with caplog.at_level(logging.WARNING):
        train(compose_config([*args, "trainer.resume_changes=[tokenizer]"]))
    assert "resumed with tokenizer not" in caplog.text


def test_a_checkpoint_that_recorded_none_of_the_compared_settings_still_resumes(corpus, two_steps, tmp_path):  # noqa: F811
    old = load_checkpoint(two_steps)
    for key in ("max_tokens", "tokens_per_step", "pad_to_multiple"):
        del old["config"]["trainer"][key]
    del old["spm_model"]
    write_checkpoint(old, tmp_path / "old.pt")
    args = overrides(corpus, tmp_path / "run", "trainer.max_steps=3", f"trainer.resume={tmp_path / 'old.pt'}")
    train(compose_config([*args, "trainer.max_tokens=400"]))
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "checkpoint_3.pt")["step"] == 3


@pytest.mark.parametrize("lost", [["checkpoint_4.pt", "checkpoint_last.pt"], ["*"]], ids=["step 2", "step 0"])
def test_tensorboard_after_a_resume_shows_each_step_once(corpus, tmp_path, lost):  # noqa: F811
    """Steps 1-4 logged, a resume from step 2 (the later checkpoints lost), or a start from step 0 (all
    lost): the steps logged again, each once in what TensorBoard reads."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = overrides(corpus, tmp_path, "trainer.save_every_steps=2", "trainer.log_every_steps=1")
    train(compose_config([*args, "trainer.max_steps=4"]))
    for pattern in lost:
        for path in (tmp_path / "checkpoints").glob(pattern):
            path.unlink()
    train(compose_config([*args, "trainer.max_steps=4"]))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]


def test_averaging_checkpoints_that_miss_the_last_step_is_warned_at_the_start(corpus, tmp_path, caplog):  # noqa: F811
    args = ["trainer.max_steps=10", "trainer.save_every_steps=3", "finish.average_last=2"]
    with caplog.at_level(logging.WARNING):
        Plan.make(compose_config(overrides(corpus, tmp_path, *args))).close()
    assert "trainer.save_every_steps=3 does not divide trainer.max_steps=10" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Plan.make(compose_config(overrides(corpus, tmp_path, *args, "trainer.save_every_steps=5"))).close()
    assert "does not divide" not in caplog.text


def test_paper_base_saves_at_an_interval_that_meets_its_last_step():
    for experiment in ("paper_base", "paper_big"):
        cfg = compose_config([f"experiment={experiment}"])
        assert cfg.trainer.max_steps % cfg.trainer.save_every_steps == 0, experiment
