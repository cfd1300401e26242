"""A checkpoint written before the encoder's `res_attn` became `res_self` (tests/data/checkpoint_2b99159.pt,
by the code of commit 2b99159; its .json holds what that code gave with it) loads, translates, resumes,
averages and exports as it did then."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from transformer.checkpoint import (
    average_checkpoints,
    load_checkpoint,
    model_from_checkpoint,
    write_checkpoint,
)
from transformer.config import DecodeConfig, SearchConfig, TrainConfig, from_dict
from transformer.data.tokenizer import Tokenizer
from transformer.decoding import beam_search
from transformer.inference.translation import Translator
from transformer.training import train
from transformer.vocab import EOS_ID

ROOT = Path(__file__).resolve().parents[1]
GREEDY_60 = SearchConfig(beam_size=1, max_len_a=0.0, max_len_b=60)
OLD = ROOT / "tests" / "data" / "checkpoint_2b99159.pt"
EXPECTED = json.loads((ROOT / "tests" / "data" / "checkpoint_2b99159.json").read_text(encoding="utf-8"))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_its_parameters_load_under_todays_names_and_give_the_same_logits():
    raw = torch.load(OLD, weights_only=True)["model"]
    assert any(".res_attn." in key for key in raw)  # it is an old one indeed
    model = model_from_checkpoint(load_checkpoint(OLD)).double()
    assert all(".res_attn." not in key for key in model.state_dict())
    with torch.no_grad():
        logits = model(torch.tensor(EXPECTED["logits"]["src"]), torch.tensor(EXPECTED["logits"]["tgt"]))[0]
    torch.testing.assert_close(
        logits, torch.tensor(EXPECTED["logits"]["values"], dtype=torch.float64), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize(
    "search, settings",
    # int8 quantizes the activations at every product, so attention's rounding can move its outputs: it
    # decodes with the attention that code used on every x86 CPU, written out (cpu_kernels=on)
    [("beam4", {}), ("greedy", {"beam_size": 1}), ("int8", {"precision": "int8", "cpu_kernels": "on"})],
)
def test_it_translates_line_for_line_as_before(search, settings):
    translator = Translator.from_checkpoint(DecodeConfig(checkpoint=str(OLD), device="cpu", **settings))
    assert translator.translate(EXPECTED["sources"]) == EXPECTED[search]
    assert len(set(EXPECTED[search])) > 8  # outputs that differ from sentence to sentence


def test_an_average_with_it_is_its_own_weights():
    averaged = average_checkpoints([OLD, OLD])
    model = model_from_checkpoint(load_checkpoint(OLD))
    assert averaged["model"].keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(averaged["model"][name], tensor, rtol=0, atol=1e-7)


def test_it_resumes_training_as_it_did(tmp_path):
    """The 10 steps after it, from its optimizer, schedule, batch position and random state, end where the
    old code ended them (to float rounding: the kernels differ by machine)."""
    old = load_checkpoint(OLD)
    overrides = [
        f"trainer.run_dir={tmp_path / 'run'}",
        f"trainer.resume={shutil.copy(OLD, tmp_path / 'checkpoint_600.pt')}",
        f"data.dir={tmp_path / 'data'}",
        "trainer.max_steps=610",
        "trainer.eval_every_steps=0",
        "trainer.progress=false",
        "finish.average_last=0",
    ] + [f"{key}={value}" for key, value in _recorded_overrides(old["config"]).items()]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("train", overrides=["experiment=demo", *overrides])
    cfg = from_dict(TrainConfig, OmegaConf.to_container(cfg, resolve=True))
    run_dir = train(cfg)
    assert (tmp_path / "data" / "spm.model").read_bytes() == old["spm_model"]  # the same corpus and pieces
    resumed = load_checkpoint(run_dir / "checkpoints" / "checkpoint_610.pt")
    assert resumed["step"] == 610 and resumed["data_state"] != old["data_state"]
    for name, (total, size, *first) in EXPECTED["resumed_610"].items():
        tensor = resumed["model"][name.replace(".res_attn.", ".res_self.")].double()
        assert tensor.sum().item() == pytest.approx(total, rel=1e-4, abs=1e-4), name
        assert tensor.abs().sum().item() == pytest.approx(size, rel=1e-4), name
        assert tensor.flatten()[:4].tolist() == pytest.approx(first, rel=1e-4, abs=1e-5), name


def _recorded_overrides(config: dict) -> dict:
    """The settings the old run was made with, beyond the demo's (tests/data/checkpoint_2b99159.json)."""
    data, model, trainer = config["data"], config["model"], config["trainer"]
    return {
        "data.toy.n_train": data["toy"]["n_train"],
        "data.toy.n_valid": data["toy"]["n_valid"],
        "data.toy.n_test": data["toy"]["n_test"],
        "data.vocab_size": data["vocab_size"],
        "model.d_model": model["d_model"],
        "model.n_heads": model["n_heads"],
        "model.d_ff": model["d_ff"],
        "model.n_layers": model["n_layers"],
        "trainer.tokens_per_step": trainer["tokens_per_step"],
        "trainer.max_tokens": trainer["max_tokens"],
        "optim.warmup_steps": config["optim"]["warmup_steps"],
    }


def test_it_exports_to_ctranslate2_and_decodes_as_this_model(tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    done = subprocess.run(
        [sys.executable, "scripts/export.py", f"checkpoint={OLD}", "format=ctranslate2", f"out={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    ckpt = load_checkpoint(OLD)
    tokenizer = Tokenizer.from_bytes(ckpt["spm_model"])
    ids = [tokenizer.encode(line) for line in EXPECTED["sources"]]
    results = ctranslate2.Translator(str(out), device="cpu").translate_batch(
        [tokenizer.pieces(i) for i in ids],
        beam_size=1,
        max_decoding_length=60,
        suppress_sequences=[["<pad>"], ["<s>"]],
    )
    theirs = [[tokenizer.piece_id(p) for p in r.hypotheses[0]] for r in results]
    model = model_from_checkpoint(ckpt)
    ours = [beam_search(model, torch.tensor([i + [EOS_ID]]), GREEDY_60).tokens[0] for i in ids]
    assert theirs == ours


def test_a_checkpoint_saved_again_is_written_under_todays_names(tmp_path):
    write_checkpoint(load_checkpoint(OLD), tmp_path / "again.pt")
    raw = torch.load(tmp_path / "again.pt", weights_only=True)["model"]
    assert any(".res_self." in key for key in raw) and not any(".res_attn." in key for key in raw)
