"""Which CPU kernels run where (`Kernels.choose`): decided by the instruction set, faked here for each
one (AVX-512, AVX2, an x86 CPU without either, ARM), forced with cpu_kernels=on|off; the outputs equal
across choices (eval mode); a training run records its choice and a resumed run takes it again,
whatever the machine would choose now; int8 is refused on a CPU without fbgemm (not x86, or no AVX2)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from conftest import sources, tiny_model
from test_training_run import assert_same_state, compose_config, corpus, overrides  # noqa: F401 (fixture)
from torch.utils._python_dispatch import TorchDispatchMode

import transformer.kernels as kernels_module
from transformer.checkpoint import checkpoint_dir, load_checkpoint
from transformer.config import ConfigError, SearchConfig
from transformer.decoding import beam_search, search_weights
from transformer.inference.translation import Translator
from transformer.kernels import Kernels
from transformer.training import train
from transformer.utils import devices
from transformer.utils.devices import CpuFeatures

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")
ISAS = {
    "AVX-512": CpuFeatures("AVX512", True, True, False, "x86 with AVX-512"),
    "AVX2": CpuFeatures("AVX2", True, False, False, "x86 with AVX2"),
    "x86 without AVX2": CpuFeatures("DEFAULT", True, False, False, "an old x86"),
    "ARM": CpuFeatures("DEFAULT", False, False, False, "Apple M2"),
    "ARM with SVE": CpuFeatures("SVE256", False, True, False, "Graviton 3"),
}
EXPECTED = {  # onednn, noise_dropout, short_attention
    "AVX-512": (True, True, True),
    "AVX2": (False, True, True),
    "x86 without AVX2": (False, True, True),
    "ARM": (False, False, False),
    "ARM with SVE": (False, False, False),
}


@pytest.mark.parametrize("isa", list(ISAS))
def test_each_instruction_set_gets_the_kernels_that_win_there_and_on_off_force_them(isa):
    chosen = Kernels.choose(CPU, "auto", ISAS[isa])
    assert tuple(chosen.record().values()) == EXPECTED[isa]
    assert all(Kernels.choose(CPU, "on", ISAS[isa]).record().values())
    assert not any(Kernels.choose(CPU, "off", ISAS[isa]).record().values())
    assert not any(Kernels.choose(torch.device("meta"), "on", ISAS[isa]).record().values())  # not a CPU


@pytest.mark.parametrize("isa", list(ISAS))
def test_every_choice_computes_the_same_model(isa):
    """Logits and beam search of the same float32 weights with the kernels each CPU would choose, all
    of them and none: the same to float32 rounding."""
    model = tiny_model(seed=5, dtype=torch.float32)
    src, tgt = sources([9, 2, 5, 1], 24, seed=6), sources([4, 6, 3, 2], 24, seed=7)
    plain_logits, plain = model(src, tgt), beam_search(model, src, SearchConfig(beam_size=3, max_len_b=6))
    for kernels in (Kernels.choose(CPU, "auto", ISAS[isa]), Kernels.choose(CPU, "on"), Kernels()):
        fast = kernels.apply(model)
        torch.testing.assert_close(fast(src, tgt), plain_logits, rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # at inference short attention is written out whatever the heads' width
            torch.testing.assert_close(fast(src, tgt), plain_logits, rtol=1e-5, atol=1e-5)
        with kernels.products.prepacked(search_weights(fast)):
            found = beam_search(fast, src, SearchConfig(beam_size=3, max_len_b=6), linear=kernels.products)
        assert found.tokens == plain.tokens
        torch.testing.assert_close(found.scores, plain.scores, rtol=1e-5, atol=1e-5)


def test_a_resumed_run_takes_the_kernels_it_was_trained_with(corpus, tmp_path, monkeypatch, caplog):  # noqa: F811
    """Trained on an AVX-512 CPU (every kernel), resumed on an AVX2 one: bitwise the uninterrupted
    AVX-512 run (the noise dropout's random stream included); cpu_kernels=off on resume is obeyed and
    said to change the run."""
    monkeypatch.setattr(kernels_module, "cpu_features", lambda: ISAS["AVX-512"])
    uninterrupted = tmp_path / "uninterrupted"
    train(compose_config(overrides(corpus, uninterrupted, "trainer.max_steps=6")))
    train(compose_config(overrides(corpus, tmp_path / "parts", "trainer.max_steps=3")))
    first = load_checkpoint(checkpoint_dir(tmp_path / "parts") / "checkpoint_3.pt")
    assert first["kernels"] == {"onednn": True, "noise_dropout": True, "short_attention": True}
    monkeypatch.setattr(kernels_module, "cpu_features", lambda: ISAS["AVX2"])  # another machine
    train(compose_config(overrides(corpus, tmp_path / "parts", "trainer.max_steps=6")))
    resumed = load_checkpoint(checkpoint_dir(tmp_path / "parts") / "checkpoint_6.pt")
    assert_same_state(resumed, load_checkpoint(checkpoint_dir(uninterrupted) / "checkpoint_6.pt"))
    assert resumed["kernels"] == first["kernels"]
    with caplog.at_level(logging.WARNING):
        train(
            compose_config(
                overrides(corpus, tmp_path / "parts", "trainer.max_steps=8", "trainer.cpu_kernels=off")
            )
        )
    assert (
        "the run was trained with onednn, noise_dropout, short_attention; it goes on with none" in caplog.text
    )
    assert load_checkpoint(checkpoint_dir(tmp_path / "parts") / "checkpoint_8.pt")["kernels"] == {
        "onednn": False,
        "noise_dropout": False,
        "short_attention": False,
    }


def test_a_run_trained_on_a_gpu_takes_the_kernels_of_the_cpu_it_resumes_on(corpus, tmp_path, monkeypatch):  # noqa: F811
    """A GPU run records no CPU kernels (None): resumed on a CPU it takes those that CPU chooses."""
    monkeypatch.setattr(kernels_module, "cpu_features", lambda: ISAS["AVX2"])
    train(compose_config(overrides(corpus, tmp_path, "trainer.max_steps=2")))
    path = checkpoint_dir(tmp_path) / "checkpoint_2.pt"
    written = load_checkpoint(path)
    torch.save({**written, "kernels": None}, path)  # as a run on CUDA writes it
    train(compose_config(overrides(corpus, tmp_path, "trainer.max_steps=3")))
    resumed = load_checkpoint(checkpoint_dir(tmp_path) / "checkpoint_3.pt")["kernels"]
    assert resumed == dict(zip(("onednn", "noise_dropout", "short_attention"), EXPECTED["AVX2"]))


FLOAT_PRODUCTS = {"linear", "addmm", "mm", "_linear_pointwise"}  # F.linear's ops, oneDNN's


class OpsCalled(TorchDispatchMode):
    """The names of the ATen (and quantized) ops run within the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not devices.cpu_features().x86, reason="precision=int8 multiplies with fbgemm (x86)")
@pytest.mark.parametrize("setting", ["auto", "off"])
@pytest.mark.parametrize("isa", ["AVX-512", "AVX2"])
def test_int8_translation_multiplies_every_linear_map_in_8_bits_whatever_the_kernels(
    tiny_checkpoint, monkeypatch, isa, setting
):
    """precision=int8: every product of a linear map (encoder, decoder, output projection) is fbgemm's
    8-bit one, with the oneDNN products chosen or not, in the search and in scoring given translations;
    no float32 product of one is left."""
    monkeypatch.setattr(kernels_module, "cpu_features", lambda: ISAS[isa])
    translator = Translator.from_checkpoint(
        tiny_checkpoint, precision="int8", device="cpu", cpu_kernels=setting
    )
    with OpsCalled() as ops:
        assert translator.translate(["The cat sees the house.", "A dog"])[1] is not None
    quantized = ops.names.count("linear_dynamic") + ops.names.count("linear_relu_dynamic")
    assert quantized > 0 and not FLOAT_PRODUCTS & set(ops.names)
    with OpsCalled() as ops:  # scoring given translations: teacher forcing, the same products
        assert translator.score(["A dog"], ["Ein Hund"])[0] is not None
    assert "linear_dynamic" in ops.names and not FLOAT_PRODUCTS & set(ops.names)
    translator = Translator.from_checkpoint(tiny_checkpoint, device="cpu", cpu_kernels=setting)  # float32
    with OpsCalled() as ops:
        translator.translate(["The cat sees the house.", "A dog"])
    assert "linear_dynamic" not in ops.names and FLOAT_PRODUCTS & set(ops.names)
    int8 = dataclasses.replace(translator.cfg, precision="int8")  # without 8-bit kernels: refused
    with pytest.raises(ValueError, match="precision=int8 needs the models' kernels chosen with int8=True"):
        Translator(translator.models, translator.tokenizer, int8, kernels=translator.kernels)


def test_int8_is_refused_on_an_x86_cpu_without_avx2_where_pytorch_has_no_fbgemm(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(devices, "cpu_features", lambda: ISAS["x86 without AVX2"])
    monkeypatch.setattr(type(torch.backends.quantized), "supported_engines", ["qnnpack", "none"])
    with pytest.raises(ConfigError, match="AVX2 or newer; this CPU has no AVX2: use precision=fp32"):
        Translator.from_checkpoint(tiny_checkpoint, precision="int8", device="cpu")


def test_int8_is_refused_on_a_cpu_without_fbgemms_engine_and_bf16_is_not_auto_there(
    tiny_checkpoint, monkeypatch
):
    monkeypatch.setattr(devices, "cpu_features", lambda: ISAS["ARM"])
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: False)
    with pytest.raises(ConfigError, match="precision=int8 multiplies with fbgemm, PyTorch's x86 engine"):
        Translator.from_checkpoint(tiny_checkpoint, precision="int8", device="cpu")
    assert devices.training_dtype("auto", CPU) == torch.float32
    monkeypatch.setattr(kernels_module, "cpu_features", lambda: ISAS["ARM"])
    translator = Translator.from_checkpoint(tiny_checkpoint, device="cpu")  # plain PyTorch on ARM
    assert not any(translator.kernels.record().values())
    assert translator.translate(["The cat sees the house."])[0] is not None
