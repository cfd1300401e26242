"""The real `train(cfg)` and `train.py` on a tiny corpus written here: exact resume, fallback past a
corrupt checkpoint, SIGTERM, two-process DDP against one process, a Hydra sweep. CPU only."""

import itertools
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from transformer import config
from transformer.checkpoint import (
    CheckpointError,
    average_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    set_aside_newer,
    write_checkpoint,
)
from transformer.config import INIT_SCHEMES, ConfigError, ModelConfig, TrainConfig, from_dict
from transformer.data.batching import TokenBudgetBatchSampler
from transformer.data.dataset import ShardDataset
from transformer.data.prepare import prepare
from transformer.training import Parts, TrainingStopped, policy, train
from transformer.training import loss as loss_module
from transformer.training.monitor import Monitor
from transformer.training.schedule import inverse_sqrt_lr
from transformer.training.state import Run
from transformer.training.step import finish_step, grad_norm, queue_step

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
# One intra-op thread here too, as in the subprocesses: the same kernels give the same bits.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = dict(
    zip(
        "the a cat dog sees likes small big red house tree runs".split(),
        "der ein katze hund sieht mag klein gross rot haus baum laeuft".split(),
    )
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """300 training, 20 validation and 20 test pairs: English words -> German words in reverse order."""
    return reversal_corpus(tmp_path_factory.mktemp("raw"), WORDS, seed=0)


def reversal_corpus(raw: Path, words: dict[str, str], seed: int) -> Path:
    """Write into raw 300 training, 20 validation and 20 test pairs of 2-9 random English words of
    `words` and their German words in reverse order."""
    rng = random.Random(seed)
    for split, n in (("train", 300), ("valid", 20), ("test", 20)):
        src = [[rng.choice(list(words)) for _ in range(rng.randint(2, 9))] for _ in range(n)]
        (raw / f"{split}.en").write_text("".join(" ".join(s) + "\n" for s in src))
        (raw / f"{split}.de").write_text("".join(" ".join(words[w] for w in reversed(s)) + "\n" for s in src))
    return raw


def overrides(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "data=multi30k",
        "data.source=local",
        f"data.path={corpus}",
        f"data.dir={corpus.with_name(corpus.name + '_prepared')}",  # one per corpus fixture
        "data.local_splits=null",  # the files are named by role: train, valid, test
        "data.vocab_size=64",
        "data.splits.valid=valid",
        "data.num_workers=1",
        "model=tiny",
        "model.d_model=32",
        "model.n_heads=4",
        "model.d_ff=64",
        "model.n_layers=2",
        "optim.warmup_steps=50",
        "trainer=cpu",
        f"trainer.run_dir={run_dir}",
        "trainer.tokens_per_step=1000",
        "trainer.max_tokens=500",
        "trainer.save_every_minutes=0",
        "trainer.eval_every_steps=5",
        "trainer.progress=false",
        *extra,
    ]


def compose_config(args: list[str]) -> TrainConfig:
    """What train.py builds from the same command-line overrides."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("train", overrides=args)
    return from_dict(TrainConfig, OmegaConf.to_container(cfg, resolve=True))


def watching(observe) -> type[Monitor]:
    """A Monitor that hands each step's number and statistics to observe(n, stats) after logging them."""

    class Watching(Monitor):
        def step(self, n, stats):
            super().step(n, stats)
            observe(n, stats)

    return Watching


def signal_at(*steps: int) -> type[Monitor]:
    """A Monitor that sends this process SIGTERM after each of `steps`, once each."""
    pending = list(steps)

    def observe(n, _stats):
        if pending and n == pending[0]:
            pending.pop(0)
            os.kill(os.getpid(), signal.SIGTERM)

    return watching(observe)


def assert_same_state(a: dict, b: dict) -> None:
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for index, moments in a["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, b["optimizer"]["state"][index][key]), (index, key)
    assert a["data_state"] == b["data_state"] and a["step"] == b["step"]


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory) -> Path:
    """A 12-step run with a checkpoint at every step (dropout on: the RNG state matters)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    args = overrides(
        corpus, run_dir, "trainer.max_steps=12", "trainer.save_every_steps=1", "trainer.keep_last=12"
    )
    train(compose_config(args))
    return run_dir


def test_saving_the_best_checkpoint_does_not_postpone_the_timed_checkpoints(corpus, tmp_path):
    """trainer.save_every_minutes (§6.1: every 10 minutes) counts from the last numbered checkpoint: a
    validation that writes only checkpoint_best.pt, a step apart, is no resume point. A clock that moves
    a second each time it is read: numbered checkpoints every few steps, not only after the last."""
    seconds = itertools.count()
    args = ["trainer.max_steps=12", "trainer.save_every_minutes=0.1", "trainer.save_every_steps=0"]
    args += ["trainer.eval_every_steps=1", "trainer.keep_last=12"]
    train(compose_config(overrides(corpus, tmp_path, *args)), Parts(clock=lambda: float(next(seconds))))
    assert (tmp_path / "checkpoints" / "checkpoint_best.pt").is_file()
    assert len(list_checkpoints(tmp_path)) >= 2


def test_interrupted_and_resumed_run_is_bitwise_the_uninterrupted_one(corpus, uninterrupted, tmp_path):
    args = overrides(corpus, tmp_path, "trainer.save_every_steps=100")
    train(compose_config([*args, "trainer.max_steps=5"]))  # stops mid-epoch, checkpoint at the last step
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_5.pt"]
    train(compose_config([*args, "trainer.max_steps=12"]))  # resume=auto
    final = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_12.pt")
    assert final["data_state"]["epoch"] >= 1  # the runs crossed epoch boundaries
    assert_same_state(final, load_checkpoint(uninterrupted / "checkpoints" / "checkpoint_12.pt"))


def test_resume_from_an_explicit_checkpoint_into_a_new_run_directory(corpus, uninterrupted, tmp_path):
    start = uninterrupted / "checkpoints" / "checkpoint_7.pt"
    train(compose_config(overrides(corpus, tmp_path, "trainer.max_steps=12", f"trainer.resume={start}")))
    final = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_12.pt")
    assert_same_state(final, load_checkpoint(uninterrupted / "checkpoints" / "checkpoint_12.pt"))


def test_a_run_resumes_whatever_its_model_init_and_keeps_recording_the_checkpoints(
    corpus, uninterrupted, tmp_path
):
    start = uninterrupted / "checkpoints" / "checkpoint_7.pt"
    other = next(init for init in INIT_SCHEMES if init != ModelConfig().init)
    args = overrides(
        corpus, tmp_path, "trainer.max_steps=12", f"trainer.resume={start}", f"model.init={other}"
    )
    train(compose_config(args))
    final = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_12.pt")
    assert_same_state(final, load_checkpoint(uninterrupted / "checkpoints" / "checkpoint_12.pt"))
    assert final["model_config"]["init"] == final["config"]["model"]["init"] == ModelConfig().init


def test_resuming_at_or_past_max_steps_says_there_is_nothing_to_train(
    corpus, uninterrupted, tmp_path, caplog
):
    start = uninterrupted / "checkpoints" / "checkpoint_7.pt"
    with caplog.at_level(logging.WARNING):
        train(compose_config(overrides(corpus, tmp_path, "trainer.max_steps=5", f"trainer.resume={start}")))
    assert f"{start} is at step 7, trainer.max_steps=5: nothing left to train" in caplog.text
    assert list_checkpoints(tmp_path) == []


def test_a_resumed_run_takes_its_own_optim_settings_from_the_first_update(corpus, uninterrupted, tmp_path):
    """After a divergence the README says: lower optim.lr_scale (or raise warmup_steps) and resume. The
    resumed run's settings, not those saved with Adam's state, make the very next update."""
    rates = {}
    start = uninterrupted / "checkpoints" / "checkpoint_7.pt"
    changed = ["optim.lr_scale=0.5", "optim.warmup_steps=20", "optim.beta2=0.9", "optim.weight_decay=0.01"]
    args = overrides(corpus, tmp_path, "trainer.max_steps=9", f"trainer.resume={start}", *changed)
    train(compose_config(args), Parts(monitor=watching(lambda n, stats: rates.update({n: stats["lr"]}))))
    d_model = 32
    assert rates == {s: pytest.approx(inverse_sqrt_lr(s, d_model, 20, 0.5)) for s in (8, 9)}
    final = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_9.pt")
    [group] = final["optimizer"]["param_groups"]
    assert (group["betas"], group["weight_decay"]) == ((0.9, 0.9), 0.01)
    assert final["config"]["optim"]["lr_scale"] == 0.5


def test_a_bucketed_run_records_its_buckets_and_resumes_onto_the_same_batches(corpus, tmp_path, caplog):
    """trainer.length_buckets=3: batches in at most 3 padded lengths, recorded in every checkpoint; a run
    resumed with the setting left unset goes on with them, bitwise the uninterrupted run; one resumed
    with another number says that its batches change."""
    args = overrides(corpus, tmp_path / "whole", "trainer.max_steps=8", "trainer.length_buckets=3")
    train(compose_config(args))
    whole = load_checkpoint(tmp_path / "whole" / "checkpoints" / "checkpoint_8.pt")
    buckets = whole["batching"]["buckets"]
    multiple = whole["config"]["trainer"]["pad_to_multiple"]
    assert 1 <= len(buckets) <= 3 and buckets == sorted(buckets) and all(b % multiple == 0 for b in buckets)
    parts = tmp_path / "parts"
    train(compose_config(overrides(corpus, parts, "trainer.max_steps=4", "trainer.length_buckets=3")))
    train(compose_config(overrides(corpus, parts, "trainer.max_steps=8")))  # length_buckets unset
    assert_same_state(load_checkpoint(parts / "checkpoints" / "checkpoint_8.pt"), whole)
    with caplog.at_level(logging.WARNING):
        train(compose_config(overrides(corpus, parts, "trainer.max_steps=9", "trainer.length_buckets=0")))
    assert f"the run was batched with buckets {buckets}, it goes on with None" in caplog.text
    assert load_checkpoint(parts / "checkpoints" / "checkpoint_9.pt")["batching"] == {"buckets": None}


def test_recorded_buckets_that_the_corpus_outgrew_are_refused_with_what_to_do(
    corpus, uninterrupted, tmp_path
):
    """A checkpoint whose buckets no longer hold the corpus's longest pair (the data changed) stops the
    resumed run before any step, naming the setting that batches it anew."""
    ckpt = load_checkpoint(uninterrupted / "checkpoints" / "checkpoint_7.pt")
    ckpt["batching"] = {"buckets": [2]}
    write_checkpoint(ckpt, tmp_path / "old.pt")
    args = overrides(corpus, tmp_path / "run", "trainer.max_steps=8", f"trainer.resume={tmp_path / 'old.pt'}")
    with pytest.raises(ConfigError, match=r"length buckets \[2\] do not hold the corpus's longest pair "
                       r".* set trainer.length_buckets to batch it anew"):  # fmt: skip
        train(compose_config(args))


def test_a_checkpoint_from_before_buckets_resumes_onto_the_batches_it_had(
    corpus, uninterrupted, tmp_path, monkeypatch
):
    """Where buckets are the default (as on CUDA), a checkpoint that records no batching, written before
    they existed (after the CPU kernels were recorded), goes on unbucketed: bitwise the uninterrupted
    run."""
    old = load_checkpoint(uninterrupted / "checkpoints" / "checkpoint_7.pt")
    del old["batching"]
    write_checkpoint(old, tmp_path / "old.pt")
    monkeypatch.setitem(config.LENGTH_BUCKETS, "cpu", 3)
    train(
        compose_config(
            overrides(
                corpus, tmp_path / "run", "trainer.max_steps=12", f"trainer.resume={tmp_path / 'old.pt'}"
            )
        )
    )
    final = load_checkpoint(tmp_path / "run" / "checkpoints" / "checkpoint_12.pt")
    assert final["batching"] == {"buckets": None}
    assert_same_state(final, load_checkpoint(uninterrupted / "checkpoints" / "checkpoint_12.pt"))
    train(compose_config(overrides(corpus, tmp_path / "fresh", "trainer.max_steps=1")))  # a new run: buckets
    assert (
        len(load_checkpoint(tmp_path / "fresh" / "checkpoints" / "checkpoint_1.pt")["batching"]["buckets"])
        <= 3
    )


def test_the_checkpoint_records_the_initialisation_scheme(corpus, uninterrupted, tmp_path):
    default = load_checkpoint(uninterrupted / "checkpoints" / "checkpoint_1.pt")
    assert default["model_config"]["init"] == ModelConfig().init
    train(compose_config(overrides(corpus, tmp_path, "trainer.max_steps=1", "model.init=t2t")))
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_1.pt")
    assert ckpt["model_config"]["init"] == ckpt["config"]["model"]["init"] == "t2t" != ModelConfig().init


def test_a_mixture_of_experts_run_resumes_exactly_averages_and_translates(corpus, tmp_path):
    moe = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity=1.0", "trainer.save_every_steps=3"]
    moe.append("trainer.log_every_steps=1")
    whole = overrides(corpus, tmp_path / "whole", *moe, "trainer.max_steps=6")
    train(compose_config(whole))
    parts = overrides(corpus, tmp_path / "parts", *moe)
    train(compose_config([*parts, "trainer.max_steps=3"]))
    train(compose_config([*parts, "trainer.max_steps=6"]))
    final = load_checkpoint(tmp_path / "parts" / "checkpoints" / "checkpoint_6.pt")
    assert_same_state(final, load_checkpoint(tmp_path / "whole" / "checkpoints" / "checkpoint_6.pt"))
    assert "encoder.1.ffn.experts.3.w_2.weight" in final["model"]
    assert final["model_config"]["moe_experts"] == 4
    dropped = tensorboard_scalars(tmp_path / "whole", "train/moe_dropped")  # capacity 1.0 drops some
    assert dropped and all(0 <= d < 1 for d in dropped) and max(dropped) > 0
    averaged = tmp_path / "average.pt"
    write_checkpoint(average_checkpoints(list_checkpoints(tmp_path / "parts")), averaged)
    done = subprocess.run(
        [sys.executable, str(ROOT / "translate.py"), f"checkpoint={averaged}", "device=cpu"],
        input="the cat sees a dog\n\nthe red house\n",
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 3  # one line out per line in


def test_pairs_longer_than_the_positional_table_fail_before_the_first_step(corpus, tmp_path):
    args = overrides(corpus, tmp_path, "trainer.max_steps=2", "trainer.pad_to_multiple=8")
    prepare(compose_config(args).data)
    train_set = ShardDataset(corpus.with_name(corpus.name + "_prepared"), "train")
    longest = int(max(train_set.src_lengths.max(), train_set.tgt_lengths.max())) + 1  # + EOS
    needed = -(-longest // 8) * 8  # padded as the batches are
    with pytest.raises(ConfigError, match=f"the train split's longest pair needs {needed} positions"):
        train(compose_config([*args, f"model.max_positions={needed - 1}"]))
    assert not (tmp_path / "checkpoints").exists()
    train(compose_config([*args, f"model.max_positions={needed}"]))  # just enough
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_2.pt"]


def test_an_averaged_checkpoint_is_refused_for_resuming_before_the_data_is_prepared(
    corpus, uninterrupted, tmp_path
):
    averaged = tmp_path / "average.pt"
    write_checkpoint(average_checkpoints(list_checkpoints(uninterrupted)[-2:]), averaged)
    args = overrides(corpus, tmp_path / "run", "trainer.max_steps=12", f"trainer.resume={averaged}")
    args.append(f"data.dir={tmp_path / 'unprepared'}")
    with pytest.raises(CheckpointError, match="cannot resume training: it has no optimizer"):
        train(compose_config(args))
    assert not (tmp_path / "unprepared").exists()


def test_the_optimizer_train_builds_is_the_papers_adam(uninterrupted):
    """§5.3: Adam with beta1 = 0.9, beta2 = 0.98, eps = 1e-9, no weight decay, the rate of Eq. (3)."""
    ckpt = load_checkpoint(uninterrupted / "checkpoints" / "checkpoint_12.pt")
    [group] = ckpt["optimizer"]["param_groups"]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.98), 1e-9, 0.0)
    d_model, warmup = 32, 50  # the overrides above
    assert group["lr"] == pytest.approx(d_model**-0.5 * min(13**-0.5, 13 * warmup**-1.5))  # the 13th update's


def test_gradient_clipping_scales_the_gradients_to_the_limit_and_reports_the_norm_before():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))  # the global L2 norm, written out
    assert norm > 0.5
    assert float(grad_norm(model, 0.0)) == pytest.approx(norm)  # 0 = no clipping (the paper)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert float(grad_norm(model, 0.5)) == pytest.approx(norm)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g * 0.5 / norm, rtol=1e-4, atol=1e-7)


def test_corrupt_newest_checkpoint_is_reported_and_the_previous_one_resumed(
    corpus, uninterrupted, tmp_path, caplog
):
    args = overrides(corpus, tmp_path, "trainer.save_every_steps=4")
    train(compose_config([*args, "trainer.max_steps=8"]))
    newest = tmp_path / "checkpoints" / "checkpoint_8.pt"
    corrupt = newest.read_bytes()[:5000]
    newest.write_bytes(corrupt)
    with caplog.at_level(logging.WARNING):
        train(compose_config([*args, "trainer.max_steps=10"]))
    assert "checkpoint_8.pt" in caplog.text
    final = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_10.pt")
    assert_same_state(final, load_checkpoint(uninterrupted / "checkpoints" / "checkpoint_10.pt"))
    # the unusable file was set aside: rotation keeps this run's checkpoints, never it
    aside = tmp_path / "checkpoints" / "checkpoint_8.pt.not_resumed"
    assert aside.read_bytes() == corrupt and load_checkpoint(tmp_path / "checkpoints" / "checkpoint_8.pt")


def test_resuming_another_model_is_refused_before_the_data_is_prepared(corpus, tmp_path):
    train(compose_config(overrides(corpus, tmp_path / "run", "trainer.max_steps=2")))
    fresh = tmp_path / "fresh_data"  # a data.dir not prepared yet: preparing it would take the time
    changed = overrides(
        corpus, tmp_path / "run", "trainer.max_steps=4", "model.n_layers=3", f"data.dir={fresh}"
    )
    with pytest.raises(ConfigError, match=r"checkpoint_2.pt holds a model with other settings \(n_layers\)"):
        train(compose_config(changed))
    assert not fresh.exists()


def test_resuming_onto_a_corpus_of_another_vocabulary_is_refused_before_any_step(corpus, tmp_path):
    """The vocabulary's size is the prepared corpus's: compared with the checkpoint's once it is read."""
    train(compose_config(overrides(corpus, tmp_path / "run", "trainer.max_steps=2")))
    other = overrides(corpus, tmp_path / "run", "trainer.max_steps=4", "data.vocab_size=60")
    other.append(f"data.dir={tmp_path / 'data60'}")
    with pytest.raises(
        ConfigError, match=r"checkpoint_2.pt holds a model with other settings \(vocab_size\)"
    ):
        train(compose_config(other))
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint_2.pt"]


def test_the_plan_is_logged_once_before_the_data_and_once_with_it(corpus, tmp_path, caplog):
    """What the settings and the checkpoint decide (device, kernels, resume point, batch budget), then
    what the data decides (vocabulary, buckets, CUDA graphs): one line each, the first before the data
    is prepared."""
    args = overrides(corpus, tmp_path, "trainer.max_steps=2", f"data.dir={tmp_path / 'prepared'}")
    with caplog.at_level(logging.INFO, logger="transformer"):
        train(compose_config(args))
    plan = [r.getMessage() for r in caplog.records if r.name == "transformer.training.plan"]
    assert len(plan) == 2 and plan[0].startswith("plan: ") and plan[1].startswith("data: ")
    assert "on cpu x1 (float32; CPU kernels: " in plan[0] and "from step 0" in plan[0]
    assert "vocabulary 64; length buckets: none; CUDA graphs: off" in plan[1]
    prepared = [i for i, r in enumerate(caplog.records) if r.name.startswith("transformer.data")]
    starts = [i for i, r in enumerate(caplog.records) if r.getMessage().startswith("plan: ")]
    assert prepared and starts[0] < prepared[0]  # decided before any data work


def test_going_back_to_an_earlier_checkpoint_sets_the_later_last_and_best_aside(corpus, tmp_path):
    """trainer.resume=<an earlier file>: the checkpoints of the abandoned steps, checkpoint_last.pt and a
    later checkpoint_best.pt among them, are set aside, so a kill before the next save resumes the
    branch taken, and the finish stage never reports the other one's best."""
    args = ["trainer.save_every_steps=4", "trainer.eval_every_steps=1", "trainer.max_steps=8"]
    train(compose_config(overrides(corpus, tmp_path, *args)))
    checkpoints = tmp_path / "checkpoints"
    best_step = load_checkpoint(checkpoints / "checkpoint_best.pt")["step"]
    set_aside_newer(tmp_path, 4)
    assert latest_checkpoint(tmp_path)[1]["step"] == 4
    assert (checkpoints / "checkpoint_last.pt.not_resumed").is_file()
    assert (checkpoints / "checkpoint_best.pt").is_file() == (best_step <= 4)


def test_sigterm_saves_a_checkpoint_and_exits_with_the_status_of_the_signal(corpus, uninterrupted, tmp_path):
    args = overrides(corpus, tmp_path, "trainer.max_steps=100000", "trainer.save_every_steps=3")
    process = subprocess.Popen(
        [sys.executable, ROOT / "train.py", *args], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    first = tmp_path / "checkpoints" / "checkpoint_3.pt"
    deadline = time.monotonic() + 120
    while not first.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0].decode()
    assert process.returncode == 128 + signal.SIGTERM, output  # as if killed by it: the run is not done
    assert "stopped at step" in output and "Traceback" not in output
    stopped = load_checkpoint(list_checkpoints(tmp_path)[-1])
    assert stopped["step"] >= 3
    if stopped["step"] <= 12:  # the same state as the in-process run at that step
        reference = load_checkpoint(uninterrupted / "checkpoints" / f"checkpoint_{stopped['step']}.pt")
        assert_same_state(stopped, reference)


def test_sigterm_during_a_compile_stops_at_once_and_keeps_the_last_checkpoint(corpus, tmp_path):
    """A signal while torch.compile works (minutes on a GPU) ends the process at once, without a step
    or a checkpoint: the last one stays as it was and the run resumes from it."""
    args = overrides(corpus, tmp_path, "trainer.save_every_steps=2", "trainer.eval_every_steps=0")
    train(compose_config([*args, "trainer.max_steps=2"]))
    last = tmp_path / "checkpoints" / "checkpoint_2.pt"
    written = last.read_bytes()
    process = subprocess.Popen(
        [sys.executable, ROOT / "train.py", *args, "trainer.max_steps=6", "trainer.compile=true"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = ""
    for line in process.stdout:  # the start line: the first step, and its compile, come next
        output += line
        if "training steps" in line:
            break
    process.send_signal(signal.SIGTERM)
    output += process.communicate(timeout=60)[0]
    assert process.returncode == 128 + signal.SIGTERM, output
    assert "SIGTERM received while compiling: stopped at once" in output and "Traceback" not in output
    assert "step 3:" not in output and [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_2.pt"]
    assert last.read_bytes() == written


@pytest.mark.parametrize("unsaved_steps", [0, 1])
def test_a_signal_before_a_compile_stops_at_once_only_when_nothing_is_unsaved(unsaved_steps):
    """SIGTERM, then a compile in the same step: with no step since the last checkpoint the compile is
    cut short (TrainingStopped at once); with one, the compile and the step finish, to be saved."""
    from transformer.config import TrainerConfig
    from transformer.kernels import Kernels
    from transformer.training.distributed import Runtime

    runtime = Runtime(0, 1, torch.device("cpu"), torch.float32, Kernels())
    rule = policy.Policy(TrainerConfig(), runtime, step=7)
    compiled = torch.compile(lambda x: x.sin() + 1, backend="eager")
    torch._dynamo.reset()
    with pytest.raises(TrainingStopped, match="stopped at step 7") if not unsaved_steps else nullcontext():
        with rule:
            if unsaved_steps:
                rule.after_step(8, {"finite": True}, False, False)
            os.kill(os.getpid(), signal.SIGTERM)
            assert compiled(torch.ones(3)).tolist() == pytest.approx([1 + math.sin(1)] * 3)  # compiled, run
    assert rule.received == "SIGTERM" and rule.requests()[0] == 1.0  # the stop after this step stands


def test_a_signal_saves_then_holds_every_rank_until_rank_0_wrote_then_raises(corpus, tmp_path, monkeypatch):
    """train() raises TrainingStopped after the checkpoint; a rank that exited while rank 0 still wrote
    would make torchrun stop (and kill) rank 0, so every rank first waits for it."""
    events = []

    def saving(run, *args):
        Run.save(run, *args)
        events.append(("saved", run.step))

    monkeypatch.setattr(policy, "wait_for_main", lambda runtime: events.append(("waited", None)))
    args = overrides(corpus, tmp_path, "trainer.max_steps=1000", "trainer.eval_every_steps=0")
    with pytest.raises(TrainingStopped, match=r"stopped at step \d+ by SIGTERM") as stopped:
        train(compose_config(args), Parts(monitor=signal_at(2), save=saving))
    assert stopped.value.exit_status == 128 + signal.SIGTERM and stopped.value.step >= 2
    assert events[-2:] == [("saved", stopped.value.step), ("waited", None)]
    assert load_checkpoint(list_checkpoints(tmp_path)[-1])["step"] == stopped.value.step


def test_a_signal_during_the_last_step_stops_after_its_checkpoint(corpus, tmp_path):
    """The stop is honoured (status 143 from train.py) and the finish stage is left to the next start,
    which has nothing left to train."""
    args = overrides(corpus, tmp_path, "trainer.max_steps=3")
    with pytest.raises(TrainingStopped, match=r"stopped at step 3 by SIGTERM"):
        # after the last step's update, before its checkpoint
        train(compose_config(args), Parts(monitor=signal_at(3)))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_3.pt"]
    assert train(compose_config(args)) == tmp_path  # nothing left: on to the finish stage


def test_a_stopped_and_resumed_run_keeps_and_averages_the_checkpoints_of_an_uninterrupted_one(
    corpus, uninterrupted, tmp_path
):
    """Signals stop the runs after steps 6 (an interim checkpoint), 8 (a due one) and 10 (interim); a
    resumed run's next checkpoint replaces the interim one it resumed from, so that none takes a
    keep_last place or enters the average."""
    parts = Parts(monitor=signal_at(5, 7, 9))  # a signal during step n stops the run after step n + 1
    args = overrides(
        corpus, tmp_path, "trainer.max_steps=12", "trainer.save_every_steps=4", "trainer.keep_last=2"
    )
    names = []
    for _ in range(3):
        with pytest.raises(TrainingStopped):
            train(compose_config(args), parts)
        names.append([p.name for p in list_checkpoints(tmp_path)])
    train(compose_config(args), parts)
    assert names == [[f"checkpoint_{n}.pt" for n in pair] for pair in ((4, 6), (4, 8), (8, 10))]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_8.pt", "checkpoint_12.pt"]
    reference = average_checkpoints([uninterrupted / "checkpoints" / f"checkpoint_{n}.pt" for n in (8, 12)])
    for name, tensor in average_checkpoints(list_checkpoints(tmp_path))["model"].items():
        assert torch.equal(tensor, reference["model"][name]), name


def test_a_full_disk_stops_the_run_with_one_message_and_leaves_the_last_checkpoint_current(
    corpus, uninterrupted, tmp_path, monkeypatch
):
    args = overrides(corpus, tmp_path, "trainer.save_every_steps=2", "trainer.eval_every_steps=0")  # no best
    train(compose_config([*args, "trainer.max_steps=4"]))
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=100_000))
    with pytest.raises(CheckpointError, match=r"not enough disk space in .*checkpoints for checkpoint_6\.pt"):
        train(compose_config([*args, "trainer.max_steps=8"]))
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == [
        "checkpoint_2.pt",
        "checkpoint_4.pt",
        "checkpoint_last.pt",
    ]
    assert (directory / "checkpoint_last.pt").samefile(directory / "checkpoint_4.pt")
    monkeypatch.setattr(shutil, "disk_usage", real_usage)  # space freed: the run goes on from step 4
    train(compose_config([*args, "trainer.max_steps=8"]))
    final = load_checkpoint(directory / "checkpoint_8.pt")
    assert_same_state(final, load_checkpoint(uninterrupted / "checkpoints" / "checkpoint_8.pt"))


def test_the_temp_file_of_a_killed_save_is_removed_on_the_next_start(corpus, tmp_path):
    args = overrides(corpus, tmp_path, "trainer.max_steps=2")
    train(compose_config(args))
    directory = tmp_path / "checkpoints"
    leftover = directory / ".checkpoint_last.pt.0123abcd.tmp"  # what kill -9 between write and rename leaves
    leftover.write_bytes((directory / "checkpoint_2.pt").read_bytes())
    train(compose_config(overrides(corpus, tmp_path, "trainer.max_steps=3")))
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["checkpoint_2.pt", "checkpoint_3.pt", "checkpoint_best.pt", "checkpoint_last.pt"]


def test_a_run_resumes_from_its_last_checkpoint_when_the_numbered_ones_are_unreadable_and_never_restarts(
    corpus, uninterrupted, tmp_path
):
    args = overrides(corpus, tmp_path, "trainer.save_every_steps=2")
    train(compose_config([*args, "trainer.max_steps=4"]))
    directory = tmp_path / "checkpoints"
    for path in list_checkpoints(tmp_path):  # each damaged alone (checkpoint_last.pt is a hard link)
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data[:3000])
    train(compose_config([*args, "trainer.max_steps=6"]))
    final = load_checkpoint(directory / "checkpoint_6.pt")
    assert_same_state(final, load_checkpoint(uninterrupted / "checkpoints" / "checkpoint_6.pt"))
    for path in directory.iterdir():
        path.unlink()
        path.write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(CheckpointError, match=r"none of the \d checkpoints in .* can resume training"):
        train(compose_config([*args, "trainer.max_steps=8"]))
    assert all(p.read_bytes() == b"PK\x03\x04 cut short" for p in directory.iterdir())  # none overwritten


def test_trainer_threads_sets_the_cpu_threads_of_the_run(corpus, tmp_path):
    seen = []
    parts = Parts(monitor=watching(lambda n, stats: seen.append(torch.get_num_threads())))
    before = torch.get_num_threads()
    try:
        train(
            compose_config(
                overrides(corpus, tmp_path, "trainer.max_steps=2", f"trainer.threads={before + 1}")
            ),
            parts,
        )
    finally:
        torch.set_num_threads(before)
    assert seen == [before + 1] * 2


def tensorboard_scalars(run_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def test_two_process_ddp_matches_one_process_with_the_same_global_batch(corpus, tmp_path):
    common = [
        "model.dropout=0.0",
        "trainer.max_steps=6",
        "trainer.log_every_steps=1",
        "trainer.eval_every_steps=0",
    ]
    single_cfg = compose_config(overrides(corpus, tmp_path / "single", *common))
    assert single_cfg.trainer.grad_accum(1) == 2 and single_cfg.trainer.grad_accum(2) == 1
    train(single_cfg)
    # One process takes batches (2k, 2k+1) for step k; rank r of two takes batch 2k+r: the same pairs
    # as long as an epoch has an even number of batches (otherwise the sampler splits one for the ranks).
    data = ShardDataset(single_cfg.data.dir, "train")
    sampler = TokenBudgetBatchSampler(data.src_lengths, data.tgt_lengths, 500, pad_to_multiple=1)
    assert len(sampler.epoch_batches(0)) % 2 == 0, (
        "choose max_tokens so that an epoch has an even batch count"
    )

    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = overrides(corpus, tmp_path / "ddp", *common)
    done = subprocess.run(
        [*launcher, ROOT / "train.py", *args], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr

    assert tensorboard_scalars(tmp_path / "ddp", "train/loss") == pytest.approx(
        tensorboard_scalars(tmp_path / "single", "train/loss"), rel=1e-6
    )
    single = load_checkpoint(tmp_path / "single" / "checkpoints" / "checkpoint_6.pt")
    ddp = load_checkpoint(tmp_path / "ddp" / "checkpoints" / "checkpoint_6.pt")
    for name, tensor in single["model"].items():
        torch.testing.assert_close(ddp["model"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert len(ddp["rng"]) == 2  # both ranks' RNG states, for an exact resume


def test_sweep_gives_each_job_its_own_run_directory(corpus, tmp_path):
    sweep = tmp_path / "sweep"
    args = overrides(corpus, tmp_path / "unused", "trainer.max_steps=2", "trainer.eval_every_steps=0")
    done = subprocess.run(
        [
            sys.executable,
            ROOT / "train.py",
            "-m",
            *args,
            "optim.lr_scale=0.5,1.0",
            f"hydra.sweep.dir={sweep}",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for job in ("0_default", "1_default"):
        ckpt = load_checkpoint(sweep / job / "checkpoints" / "checkpoint_2.pt")
        assert ckpt["config"]["trainer"]["run_dir"] == str(sweep / job)
    lr_scales = {load_checkpoint(sweep / j / "checkpoints" / "checkpoint_2.pt")["config"]["optim"]["lr_scale"]
                 for j in ("0_default", "1_default")}  # fmt: skip
    assert lr_scales == {0.5, 1.0}
    assert not (tmp_path / "unused").exists()


class Faulty(torch.nn.Module):
    """The training objective, whose loss is NaN (or which raises `error`) at the calls numbered in `bad`
    (from 1; one call per batch), for Parts(objective=...)."""

    def __init__(self, objective: torch.nn.Module, bad, error: Exception | None = None) -> None:
        super().__init__()
        self.objective, self.bad, self.error, self.calls = objective, bad, error, 0

    def forward(self, *batch):
        self.calls += 1
        if self.calls in self.bad and self.error is not None:
            raise self.error
        loss, nll, figures = self.objective(*batch)
        return (loss * float("nan") if self.calls in self.bad else loss), nll, figures


def nan_on_calls(bad) -> Parts:
    return Parts(objective=lambda objective: Faulty(objective, bad))


def test_nonfinite_loss_skips_the_update_and_stops_the_run_when_it_persists(corpus, tmp_path, caplog):
    from transformer.training import TrainingError

    args = overrides(corpus, tmp_path / "once", "trainer.max_steps=3", "trainer.eval_every_steps=0")
    with caplog.at_level(logging.WARNING):
        train(compose_config(args), nan_on_calls({3}))  # step 2, first batch
    assert "non-finite" in caplog.text and "update skipped (1 in a row)" in caplog.text
    assert load_checkpoint(tmp_path / "once" / "checkpoints" / "checkpoint_3.pt")["step"] == 3

    args = overrides(corpus, tmp_path / "always", "trainer.max_steps=5", "trainer.max_nonfinite_steps=2")
    with pytest.raises(TrainingError, match="2 non-finite updates in a row"):
        train(compose_config(args), nan_on_calls(range(1000)))


class _AttentionKernels(TorchDispatchMode):
    """Records the fused attention kernels that run (on a CPU, flash's; math decomposes into matmuls)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            self.seen.add(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "backends, expected", [(None, {"_scaled_dot_product_flash_attention_for_cpu"}), ("[math]", set())]
)
def test_training_steps_attend_with_the_backends_of_trainer_attention_backends(
    corpus, tmp_path, backends, expected
):
    """torch's choice by default (on a CPU its flash kernel); trainer.attention_backends=[math] keeps
    every training step to the written-out math; a backend the CPU lacks is refused before any work."""
    args = ["trainer.max_steps=2", "trainer.eval_every_steps=0", "trainer.cpu_kernels=off"]
    chosen = [] if backends is None else [f"trainer.attention_backends={backends}"]
    kernels = _AttentionKernels()
    with kernels:
        train(compose_config(overrides(corpus, tmp_path, *args, *chosen)))
    assert {name.removesuffix("_backward") for name in kernels.seen} == expected
    with pytest.raises(ConfigError, match=r"on a CPU torch's attention has flash and math only"):
        train(compose_config(overrides(corpus, tmp_path / "x", *args, "trainer.attention_backends=[cudnn]")))


class _NoDeviceReads(TorchDispatchMode):
    """Fails on any read of a tensor's value by the host (`.item()`, `float()`, `bool()`: on a GPU, a
    wait for the device)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func is not torch.ops.aten._local_scalar_dense.default, "a host read of a device value"
        return func(*args, **(kwargs or {}))


def test_a_step_is_queued_without_reading_the_device_and_a_skipped_one_changes_nothing(corpus, tmp_path):
    """Forward, backward, gradient norm and update are queued with no host read (the one read, after
    the next batches are prepared, is `finish_step`'s); a non-finite step leaves the weights and Adam's
    state bitwise as they were, and the schedule where it was."""
    before, skipped = {}, []

    def queue(run, *args):
        before["model"] = {k: v.clone() for k, v in run.model.state_dict().items()}
        before["adam"] = {i: {k: v.clone() for k, v in s.items()} for i, s in run.optimizer.state.items()}
        before["lr"], before["step"] = run.optimizer.param_groups[0]["lr"], run.step
        tolist = torch.Tensor.tolist  # bypasses the dispatcher: replaced for the call
        torch.Tensor.tolist = lambda _t: pytest.fail("a host read of a device value")
        try:
            with _NoDeviceReads():
                return queue_step(run, *args)
        finally:
            torch.Tensor.tolist = tolist

    def finish(run, *args):
        stats = finish_step(run, *args)
        if not stats[0]["finite"]:
            skipped.append(run.step)
            for name, tensor in run.model.state_dict().items():
                assert torch.equal(tensor, before["model"][name]), name
            for i, state in run.optimizer.state.items():
                for key, value in state.items():
                    assert torch.equal(value, before["adam"][i][key]), (i, key)
            assert (run.optimizer.param_groups[0]["lr"], run.step) == (before["lr"], before["step"])
        return stats

    parts = Parts(queue_step=queue, finish_step=finish, objective=nan_on_calls({3}).objective)
    train(
        compose_config(overrides(corpus, tmp_path, "trainer.max_steps=3", "trainer.eval_every_steps=0")),
        parts,
    )
    assert skipped == [1]  # the second step (first batch of two) was skipped, after one finite step


@pytest.mark.gpu
def test_on_a_gpu_a_step_is_queued_without_waiting_for_the_device(corpus, tmp_path):
    """CUDA's own check around every `queue_step` (bf16 autocast, as a GPU run trains; without CUDA
    graphs, whose recordings wait: test_training_graphs has theirs): no call in it waits for the device,
    so the host reads the next batches while the step runs."""

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    queued = []

    def strict(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return queue_step(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            queued.append(True)

    args = [
        "trainer.max_steps=3",
        "trainer.eval_every_steps=0",
        "trainer.device=cuda",
        "trainer.cuda_graphs=false",
    ]
    train(
        compose_config(overrides(corpus, tmp_path, *args, "trainer.precision=bf16")), Parts(queue_step=strict)
    )
    assert len(queued) == 3


def test_out_of_memory_names_the_batch_and_the_setting(corpus, tmp_path):
    from transformer.training import TrainingError

    out_of_memory = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    parts = Parts(objective=lambda objective: Faulty(objective, {1}, out_of_memory))
    with pytest.raises(
        TrainingError, match=r"batch of src \(\d+, \d+\).*lower trainer.max_tokens \(now 500\)"
    ):
        train(compose_config(overrides(corpus, tmp_path, "trainer.max_steps=2")), parts)


def test_compiled_training_compiles_each_region_once_for_all_batch_shapes_and_matches_eager(
    corpus, tmp_path, monkeypatch, caplog
):
    """trainer.compile=true: batches of many (B, S, T) shapes and loss chunkings run through one compiled
    graph per region (an encoder layer, a decoder layer, the loss), with none for validation and valid
    BLEU, and the run ends where the eager run does (dropout off: the same math)."""
    from torch._dynamo.utils import counters

    shapes = set()

    class Recording(torch.nn.Module):  # the training batches' shapes (validations run without gradients)
        def __init__(self, objective):
            super().__init__()
            self.objective = objective

        def forward(self, src, tgt_in, tgt_out):
            if torch.is_grad_enabled():
                shapes.add((tuple(src.shape), tuple(tgt_in.shape)))
            return self.objective(src, tgt_in, tgt_out)

    monkeypatch.setattr(loss_module, "CHUNK_ROWS", 128)  # the batches' rows: 3 or 4 times that
    args = ["trainer.max_steps=8", "trainer.eval_every_steps=4", "trainer.translate_every_steps=4"]
    args.append("model.dropout=0")
    valid, weights = {}, {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            cfg = compose_config(
                overrides(corpus, tmp_path / str(compiled), *args, f"trainer.compile={compiled}")
            )
            train(cfg, Parts(objective=Recording))
        valid[compiled] = [
            float(m.split("valid loss ")[1].split(",")[0]) for m in caplog.messages if "valid loss" in m
        ]
        weights[compiled] = load_checkpoint(tmp_path / str(compiled) / "checkpoints" / "checkpoint_8.pt")[
            "model"
        ]
    chunked = {-(-src[0] * tgt[1] // 128) for src, tgt in shapes}  # chunks of 128 rows a batch fills
    assert len(shapes) >= 8 and len(chunked) >= 2
    assert counters["stats"]["unique_graphs"] == 3  # no recompile after the first step
    assert len(valid[True]) == 2 and valid[True] == pytest.approx(valid[False], rel=1e-3)
    for name, value in weights[False].items():
        torch.testing.assert_close(weights[True][name], value, rtol=0, atol=1e-2, msg=name)
