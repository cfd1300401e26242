"""Every YAML file under configs/ composes with Hydra into a valid config; the defaults hold the paper's
values; mistakes are rejected by name, before any work."""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from transformer.config import (
    ConfigError,
    DataConfig,
    EvaluateConfig,
    ExportConfig,
    FinishConfig,
    ModelConfig,
    SearchConfig,
    TrainConfig,
    TrainerConfig,
    TranslateConfig,
    app_defaults,
    from_dict,
)
from transformer.training import train
from transformer.training.finish import check_finish, print_next_steps
from transformer.utils import devices
from transformer.utils.devices import CpuFeatures

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))

# Table 3 of the paper: what each row changes relative to the base model.
TABLE3 = {
    "A_h1": {"model.n_heads": 1, "model.d_k": 512, "model.d_v": 512},
    "A_h4": {"model.n_heads": 4, "model.d_k": 128, "model.d_v": 128},
    "A_h16": {"model.n_heads": 16, "model.d_k": 32, "model.d_v": 32},
    "A_h32": {"model.n_heads": 32, "model.d_k": 16, "model.d_v": 16},
    "B_dk16": {"model.d_k": 16, "model.d_v": 64},  # d_v as in the base model
    "B_dk32": {"model.d_k": 32, "model.d_v": 64},
    "C_N2": {"model.n_layers": 2},
    "C_N4": {"model.n_layers": 4},
    "C_N8": {"model.n_layers": 8},
    "C_dmodel256": {"model.d_model": 256, "model.d_k": 32, "model.d_v": 32},
    "C_dmodel1024": {"model.d_model": 1024, "model.d_k": 128, "model.d_v": 128},
    "C_dff1024": {"model.d_ff": 1024},
    "C_dff4096": {"model.d_ff": 4096},
    "D_dropout0": {"model.dropout": 0.0},
    "D_dropout0p2": {"model.dropout": 0.2},
    "D_ls0": {"optim.label_smoothing": 0.0},
    "D_ls0p2": {"optim.label_smoothing": 0.2},
    "E_learned_pos": {"model.positional": "learned"},
}


def raw(*overrides: str) -> dict:
    """The composed YAML as plain values, before the dataclasses fill in derived fields."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return OmegaConf.to_container(compose("train", overrides=list(overrides)), resolve=True)


def composed(*overrides: str) -> TrainConfig:
    return from_dict(TrainConfig, raw(*overrides))


def flat(cfg: dict) -> dict:
    out = {}
    for section, values in cfg.items():
        if isinstance(values, dict):
            out.update({f"{section}.{key}": value for key, value in values.items()})
        else:
            out[section] = values
    return out


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    cfg = composed(f"experiment={experiment}")
    assert cfg.name == experiment
    assert cfg.trainer.run_dir == f"runs/{experiment}"


@pytest.mark.parametrize("group", ["model", "data", "optim", "trainer"])
def test_every_group_option_composes_and_validates(group):
    for option in sorted(p.stem for p in (ROOT / "configs" / group).glob("*.yaml")):
        composed(f"{group}={option}")


@pytest.mark.parametrize("name", ["translate", "prepare_data", "evaluate", "visualize", "export"])
def test_app_configs_compose(name):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(name)
    assert OmegaConf.to_container(cfg, resolve=True)


def test_defaults_are_the_paper_recipe():
    cfg = composed()
    o, m, t = cfg.optim, cfg.model, cfg.trainer
    assert (o.beta1, o.beta2, o.eps, o.warmup_steps, o.label_smoothing, o.lr_scale) == (
        0.9,
        0.98,
        1e-9,
        4000,
        0.1,
        1.0,
    )
    assert (m.n_layers, m.d_model, m.d_ff, m.n_heads, m.d_k, m.d_v, m.dropout) == (
        6,
        512,
        2048,
        8,
        64,
        64,
        0.1,
    )
    assert (t.tokens_per_step, t.max_steps) == (28672, 100000)
    assert cfg.data.name == "wmt14_en_de"


@pytest.mark.parametrize("max_tokens", [500, 3125, 4096, 12500, 25000, 40000])
@pytest.mark.parametrize("tokens_per_step", [1000, 4096, 25000])
def test_a_step_holds_tokens_per_step_however_it_is_split(tokens_per_step, max_tokens):
    """§5.1 ~25k tokens per step on any number of GPUs: the step's batches share tokens_per_step evenly
    (up to rounding), none over max_tokens, and no fewer batches could hold it."""
    t = TrainerConfig(tokens_per_step=tokens_per_step, max_tokens=max_tokens)
    for ranks in (1, 2, 3, 8, 64):
        batches = t.grad_accum(ranks) * ranks  # per step, over all ranks
        assert t.batch_tokens(ranks) <= max_tokens
        assert tokens_per_step <= batches * t.batch_tokens(ranks) < tokens_per_step + batches
        assert t.grad_accum(ranks) == 1 or (t.grad_accum(ranks) - 1) * ranks * max_tokens < tokens_per_step


def test_paper_big():
    cfg = composed("experiment=paper_big")
    m = cfg.model
    assert (m.n_layers, m.d_model, m.d_ff, m.n_heads, m.d_k, m.dropout) == (6, 1024, 4096, 16, 64, 0.3)
    assert cfg.trainer.max_steps == 300000 and cfg.finish.average_last == 20
    assert composed("experiment=paper_base").finish.average_last == 5


def test_table3_experiments_change_only_their_row():
    assert sorted(f"table3_{row}" for row in TABLE3) == [e for e in EXPERIMENTS if e.startswith("table3_")]
    base = flat(raw("experiment=paper_base"))
    for row, change in TABLE3.items():
        cfg = flat(raw(f"experiment=table3_{row}"))
        composed(f"experiment=table3_{row}")  # and it is a valid model
        differing = {k for k in cfg if cfg[k] != base[k]} - {"name", "trainer.run_dir"}
        differing -= {k for k in differing if k.startswith("finish.")}
        assert differing == set(change), row
        assert all(cfg[k] == v for k, v in change.items()), row
        assert cfg["trainer.max_steps"] == 100000 and cfg["finish.evaluate_split"] == "valid"


def test_unknown_key_is_refused_by_hydra_and_by_name():
    with pytest.raises(ConfigCompositionException, match="nonsense"):
        composed("trainer.nonsense=1")
    with pytest.raises(ConfigError, match="unknown key.*model.colour"):
        from_dict(TrainConfig, {"model": {"colour": "red"}})


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, ROOT / "train.py", *args], capture_output=True, text=True, env=env)


def test_cli_reports_mistakes_in_one_line(tmp_path):
    struct = run_cli("trainer.nonsense=1", f"hydra.run.dir={tmp_path}")
    assert struct.returncode != 0 and "nonsense" in struct.stderr
    added = run_cli("+trainer.nonsense=1", f"trainer.run_dir={tmp_path}")
    assert added.returncode == 2, added.stderr
    assert added.stderr.strip().splitlines()[-1].startswith("error: unknown key(s) trainer.nonsense")
    assert "Traceback" not in added.stderr


def test_resume_never_refuses_a_run_directory_with_checkpoints(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "checkpoint_100.pt").write_bytes(b"")
    cfg = composed(f"trainer.run_dir={tmp_path}", "trainer.resume=never")
    with pytest.raises(ConfigError, match="trainer.resume=never"):
        train(cfg)
    with pytest.raises(ConfigError, match="no such file"):
        train(composed(f"trainer.run_dir={tmp_path}", f"trainer.resume={tmp_path / 'missing.pt'}"))


def test_bad_values_fail_before_any_work():
    with pytest.raises(ConfigError, match="^model.d_model=500 is not divisible by model.n_heads=8"):
        composed("model.d_model=500")
    with pytest.raises(ConfigError, match="data.source='ftp'"):
        composed("data.source=ftp")
    with pytest.raises(ConfigError, match="model.vocab_size=0"):
        composed("model.vocab_size=0")
    with pytest.raises(ConfigError, match="trainer.max_tokens=0"):
        composed("trainer.max_tokens=0")
    with pytest.raises(ConfigError, match="trainer.save_every_steps=-1"):
        composed("trainer.save_every_steps=-1")
    with pytest.raises(ConfigError, match=r"data.lowercase='maybe' must be true or false"):
        composed("data.lowercase=maybe")  # a non-empty string would pass as true
    with pytest.raises(ConfigError, match=r"model.norm_first=1 must be true or false"):
        composed("model.norm_first=1")
    # a value of the wrong type is named, not a TypeError deep in the run
    with pytest.raises(ConfigError, match=r"trainer.max_steps='abc' must be a whole number"):
        composed("trainer.max_steps=abc")
    with pytest.raises(ConfigError, match=r"trainer.seed=1.5 must be a whole number"):
        composed("trainer.seed=1.5")
    with pytest.raises(ConfigError, match=r"trainer.save_every_minutes='ten' must be a number"):
        composed("trainer.save_every_minutes=ten")
    with pytest.raises(ConfigError, match=r"finish.examples='hello' must be a list"):
        composed("finish.examples=hello")
    with pytest.raises(ConfigError, match=r"trainer.attention_backends=\['fast'\] has \['fast'\]: each must"):
        composed("trainer.attention_backends=[fast]")
    with pytest.raises(ConfigError, match=r"needs one besides flash, which takes no padding mask on CUDA"):
        composed("trainer.attention_backends=[flash]")
    assert composed("trainer.attention_backends=[flash,efficient]").trainer.attention_backends == [
        "flash",
        "efficient",
    ]
    assert composed("optim.lr_scale=2").optim.lr_scale == 2  # a whole number is a number
    assert composed("name=2024").name == "2024"  # Hydra reads it as a number
    with pytest.raises(
        ConfigError, match=r"^finish.evaluate_split='dev' must be one of 'valid', 'test' or null$"
    ):
        composed("finish.evaluate_split=dev")
    # the device and search settings are checked in one place for training, its finish stage and decoding
    with pytest.raises(
        ConfigError, match=r"^trainer.precision='fp16' must be one of 'auto', 'fp32' or 'bf16'$"
    ):
        composed("trainer.precision=fp16")
    with pytest.raises(ConfigError, match=r"^finish.max_len_b=0 must be at least 1$"):
        composed("finish.max_len_b=0")
    with pytest.raises(
        ConfigError, match=r"^finish.precision='fp16' must be one of 'auto', 'fp32', 'bf16' or 'int8'$"
    ):
        composed("finish.precision=fp16")
    with pytest.raises(
        ConfigError, match=r"^precision='fp16' must be one of 'auto', 'fp32', 'bf16' or 'int8'$"
    ):
        TranslateConfig(checkpoint="x.pt", precision="fp16")
    with pytest.raises(ConfigError, match=r"^beam_size=0 must be in 1..1024"):
        TranslateConfig(checkpoint="x.pt", beam_size=0)


def test_a_finish_stage_that_would_fail_fails_before_training(tmp_path):
    """An evaluation split the corpus lacks is reported before training starts, not after 100k steps."""
    done = run_cli(
        "experiment=demo", "finish.evaluate_split=test", "~data.splits.test", f"trainer.run_dir={tmp_path}"
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: finish.evaluate_split=test: data toy has no 'test' split (it has: train, valid); "
        "choose another or finish.evaluate_split=null"
    )
    assert not (tmp_path / "checkpoints").exists()


def test_averaging_more_checkpoints_than_a_run_keeps_or_writes_fails_before_training():
    for experiment in ("demo", "multi30k", "paper_base", "paper_big"):  # the recipes average what they keep
        check_finish(composed(f"experiment={experiment}"))
    with pytest.raises(
        ConfigError, match=r"^finish.average_last=20 averages more checkpoints than trainer.keep_last=5 keeps"
    ):
        check_finish(composed("experiment=demo", "finish.average_last=20"))
    with pytest.raises(
        ConfigError, match=r"^finish.average_last=5: with trainer.save_every_steps and trainer"
    ):
        check_finish(composed("experiment=demo", "trainer.save_every_steps=0"))


def test_validations_on_data_without_a_valid_split_fail_before_training(tmp_path):
    """BLEU, the best by BLEU and early stopping need the valid split: said before the data is prepared,
    not skipped without a word."""
    done = run_cli(
        "experiment=demo",
        "~data.splits.valid",
        "trainer.patience=2",
        "finish.evaluate_split=null",
        f"trainer.run_dir={tmp_path}",
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: trainer.translate_every_steps=100, trainer.patience=2, trainer.best_metric=bleu: validations "
        "on the 'valid' split, which data toy does not have; add one (data.splits.valid) or turn these off"
    )
    assert not (tmp_path / "checkpoints").exists()


def test_best_metric_chrf_without_a_valid_split_or_its_validations_is_refused():
    no_valid = ("experiment=demo", "~data.splits.valid", "finish.evaluate_split=null")
    for metric in ("chrf", "chrf++"):
        said = f"trainer.translate_every_steps=100, trainer.best_metric={metric}: validations on the 'valid'"
        with pytest.raises(ConfigError, match=f"^{re.escape(said)} split, which data toy does not have"):
            composed(*no_valid, f"trainer.best_metric={metric}")
        said = f"trainer.best_metric='{metric}' needs its validations: trainer.translate_every_steps is 0"
        with pytest.raises(ConfigError, match=f"^{re.escape(said)}$"):
            composed(f"trainer.best_metric={metric}", "trainer.translate_every_steps=0")


def test_the_old_name_bleu_every_steps_still_works_but_not_beside_the_new_one(tmp_path):
    """The old name sets the new one; beside it (a recipe's translate_every_steps) it is refused in one
    line, an old trainer.bleu_every_steps=0 included, rather than ignored."""
    trainer = composed("trainer.bleu_every_steps=500", "trainer.best_metric=chrf++").trainer
    assert (trainer.translate_every_steps, trainer.bleu_every_steps) == (500, None)
    said = "trainer.bleu_every_steps=0 is the old name of trainer.translate_every_steps=100: give one"
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}$"):
        composed("experiment=demo", "trainer.bleu_every_steps=0")
    both = run_cli("experiment=multi30k", "trainer.bleu_every_steps=250", f"trainer.run_dir={tmp_path}")
    assert both.returncode == 2, both.stderr
    assert both.stderr.strip().splitlines()[-1] == (
        "error: trainer.bleu_every_steps=250 is the old name of trainer.translate_every_steps=500: give one"
    )
    assert not (tmp_path / "checkpoints").exists()


def test_a_finish_stage_in_int8_where_8_bit_products_cannot_run_fails_before_training(monkeypatch):
    monkeypatch.setattr(
        devices, "cpu_features", lambda: CpuFeatures("DEFAULT", False, False, False, "Apple M2")
    )
    with pytest.raises(
        ConfigError,
        match=r"^finish.precision=int8 multiplies .* this CPU is not an x86 one: use finish.precision=fp32$",
    ):
        check_finish(composed("experiment=demo", "finish.precision=int8"))
    nothing_decoded = ("finish.evaluate_split=null", "finish.examples=[]", "finish.attention_text=null")
    check_finish(composed("experiment=demo", "finish.precision=int8", *nothing_decoded))


@pytest.mark.parametrize("experiment, suggested", [("demo", True), ("paper_base", False)])
def test_the_next_steps_suggest_the_papers_run_only_to_runs_on_other_data(experiment, suggested, capsys):
    cfg = composed(f"experiment={experiment}")
    print_next_steps(cfg, Path("runs/x"), Path("runs/x/checkpoints/checkpoint_last.pt"), [])
    shown = capsys.readouterr().out
    assert "translate.py checkpoint=runs/x/checkpoints/checkpoint_last.pt" in shown
    assert ("python train.py experiment=paper_base" in shown) == suggested


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cuda_requested_without_a_gpu(tmp_path):
    with pytest.raises(ConfigError, match="no CUDA device"):
        train(composed(f"trainer.run_dir={tmp_path}", "trainer.device=cuda"))


def test_one_named_gpu_for_every_torchrun_process_is_refused(tmp_path):
    """Under torchrun each process takes the GPU of its LOCAL_RANK; cuda:N would put them all on one."""
    ranks = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    done = run_cli("trainer.device=cuda:1", f"trainer.run_dir={tmp_path}", env=ranks)
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("error: trainer.device=cuda:1 would put all 2 processes on one GPU")
    )


# ------------------------------------------------------------------ one home for every default


def composed_app(app: str, *overrides: str) -> dict:
    """configs/<app>.yaml composed as the app composes it, interpolations left as written."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(app, overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=False)


CONFIGURATION = ROOT / "docs" / "configuration.md"  # every setting's table
TABLES = {  # the bold heading above a table in docs/configuration.md -> (app, section of its config)
    "**`model/`**": ("train", "model"),
    "**`data/`**": ("train", "data"),
    "**`optim/`**": ("train", "optim"),
    "**`trainer/`**": ("train", "trainer"),
    "**`finish`**": ("train", "finish"),
    "**The search**": ("translate", None),
    "**Decoding apps**": ("translate", None),
}


def table_rows(heading: str) -> list[tuple[str, str]]:
    """(key, value as written) for every key of the table below `heading` in docs/configuration.md."""
    text = CONFIGURATION.read_text(encoding="utf-8")
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:  # past the header and its rule
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        keys = re.findall(r"`([^`]+)`", cells[0])
        values = cells[1].split(", ") if len(keys) > 1 else [cells[1]]
        assert len(values) == len(keys), line
        rows += zip(keys, values)
    return rows


def as_value(written: str) -> object:
    value = yaml.safe_load(written)
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads 1e-9 as a string
        except ValueError:
            return value
    return value


@pytest.mark.parametrize("heading", list(TABLES))
def test_the_key_tables_state_the_defaults(heading):
    app, section = TABLES[heading]
    cfg = composed_app(app)
    cfg = cfg if section is None else cfg[section]
    rows = table_rows(heading)
    assert len(rows) >= 5
    for key, written in rows:
        value = cfg
        for part in key.split("."):
            value = value[part]
        assert as_value(written) == value, f"{heading} says {key}={written}, the config {value!r}"


def test_the_tables_name_every_setting_of_the_model_optim_trainer_finish_and_the_decoding_apps():
    """Adding a setting means documenting it: the search's table names every field of SearchConfig,
    and with it the finish table names finish.*, the decoding apps' table translate.py's keys."""
    cfg = composed_app("train")
    for heading in ("**`model/`**", "**`optim/`**", "**`trainer/`**"):
        assert {key for key, _ in table_rows(heading)} == set(cfg[TABLES[heading][1]]), heading
    search = {key for key, _ in table_rows("**The search**")}
    assert search == {f.name for f in dataclasses.fields(SearchConfig)}
    assert {key for key, _ in table_rows("**`finish`**")} | search == set(cfg["finish"])
    decoding = {key for key, _ in table_rows("**Decoding apps**")}
    assert decoding | search == set(composed_app("translate")) and not decoding & search


@pytest.mark.parametrize("group", ["model", "data", "optim", "trainer"])
def test_group_files_hold_only_deltas_over_the_dataclass_defaults(group):
    """configs/<group>/*.yaml never restate a default of transformer/config.py: the dataclasses are the
    one home of every default (an experiment, a recipe, may pin values of its own)."""
    defaults = app_defaults("train")[group]
    for path in sorted((ROOT / "configs" / group).glob("*.yaml")):
        values = yaml.safe_load(path.read_text()) or {}
        values.pop("defaults", None)
        for key, value in values.items():
            assert value != defaults[key], f"{path.name} restates {group}.{key}={value!r}, the default"


@pytest.mark.parametrize("app", ["translate", "evaluate", "visualize", "export", "serve", "prepare_data"])
def test_app_files_hold_no_settings_of_their_own(app):
    values = yaml.safe_load((ROOT / "configs" / f"{app}.yaml").read_text())
    assert set(values) == {"defaults", "hydra"}


CHOICES = [  # (settings, key, what the command line calls it)
    (lambda v: ModelConfig(positional=v), "positional", "model.positional"),
    (lambda v: ModelConfig(init=v), "init", "model.init"),
    (lambda v: DataConfig(source=v), "source", "data.source"),
    (lambda v: TrainerConfig(precision=v), "precision", "trainer.precision"),
    (lambda v: FinishConfig(precision=v), "precision", "finish.precision"),
    (lambda v: FinishConfig(evaluate_split=v), "evaluate_split", "finish.evaluate_split"),
    (lambda v: TranslateConfig(checkpoint="x.pt", precision=v), "precision", "precision"),
    (lambda v: EvaluateConfig(checkpoint="x.pt", split=v), "split", "split"),
    (lambda v: ExportConfig(checkpoint="x.pt", out="d", format=v), "format", "format"),
]


@pytest.mark.parametrize("build, key, name", CHOICES)
def test_every_choice_is_refused_in_one_format(build, key, name):
    with pytest.raises(ConfigError) as refused:
        build("bogus")
    assert re.fullmatch(
        rf"{re.escape(name)}='bogus' must be one of ('[\w-]+'|null)(, ('[\w-]+'|null))* or ('[\w-]+'|null)",
        str(refused.value),
    ), str(refused.value)
