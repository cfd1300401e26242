"""Typed configuration, validated on construction.

One dataclass per concern; each component receives only its own slice. The package never imports
Hydra: the command-line apps compose YAML with Hydra and hand plain dicts to `from_dict`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A user's configuration mistake, reported before any heavy work starts."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _one_of(values: tuple[str, ...]) -> str:
    """The allowed values as a message reads them: "'a', 'b' or 'c'"."""
    quoted = [repr(value) for value in values]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}"


INIT_SCHEMES = ("t2t", "fairseq", "xavier")


@dataclass
class ModelConfig:
    """The Transformer's shape (§3, Table 3). Defaults are the paper's base model."""

    vocab_size: int = 37000  # shared source/target BPE vocabulary (§5.1)
    d_model: int = 512
    n_heads: int = 8  # h
    d_ff: int = 2048
    n_layers: int = 6  # N, for both the encoder and the decoder stack
    dropout: float = 0.1  # P_drop (§5.4): sub-layer outputs and embedding sums
    d_k: int | None = None  # per-head key/query size; None = d_model / h (Table 3, rows A-B vary it)
    d_v: int | None = None  # per-head value size; None = d_model / h
    # Deviations from the paper, each a named switch:
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads (the paper)
    norm_first: bool = False  # pre-LN; the paper is post-LN: LayerNorm(x + Dropout(Sublayer(x)))
    positional: str = "sinusoidal"  # "learned" = Table 3, row E
    attention_dropout: float = 0.0  # dropout on attention weights; the paper has none
    max_positions: int = 1024  # longest sequence the positional table covers
    # Initialisation (the paper states none): "fairseq" | "t2t" | "xavier" (`Transformer.reset_parameters`);
    # fairseq's trains the paper's post-LN fastest (docs/results.md, "Initialisation")
    init: str = "fairseq"
    # Mixture-of-experts feed-forward networks (transformer/moe.py; GShard, Switch Transformer)
    moe_experts: int = 0  # experts per layer (0 = one dense FFN per layer, the paper)
    moe_top_k: int = 2  # experts per token
    moe_capacity: float = 1.25  # in training, each expert takes at most capacity * tokens * top_k / experts
    moe_aux_loss: float = 0.01  # weight of the load-balancing loss in the training objective

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "max_positions"):
            _check(getattr(self, name) > 0, f"model.{name}={getattr(self, name)} must be positive")
        if self.d_k is None or self.d_v is None:
            _check(
                self.d_model % self.n_heads == 0,
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "change one of them or set model.d_k and model.d_v explicitly",
            )
        if self.d_k is None:
            self.d_k = self.d_model // self.n_heads
        if self.d_v is None:
            self.d_v = self.d_model // self.n_heads
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _check(self.d_k > 0 and self.d_v > 0, f"d_k={self.d_k} and d_v={self.d_v} must be positive")
        _check(
            0 < self.n_kv_heads <= self.n_heads and self.n_heads % self.n_kv_heads == 0,
            f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}",
        )
        _check(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)")
        _check(
            0.0 <= self.attention_dropout < 1.0,
            f"model.attention_dropout={self.attention_dropout} must be in [0, 1)",
        )
        _check(
            self.positional in ("sinusoidal", "learned"),
            f"model.positional={self.positional!r} must be 'sinusoidal' or 'learned'",
        )
        _check(
            self.init in INIT_SCHEMES,
            f"model.init={self.init!r} must be {_one_of(INIT_SCHEMES)}",
        )
        if self.moe_experts:
            experts = self.moe_experts
            _check(experts >= 2, f"model.moe_experts={experts} must be 0 (dense) or at least 2")
            _check(
                1 <= self.moe_top_k <= experts,
                f"model.moe_top_k={self.moe_top_k} must be between 1 and model.moe_experts={experts}",
            )
            _check(self.moe_capacity > 0, f"model.moe_capacity={self.moe_capacity} must be positive")
            _check(self.moe_aux_loss >= 0, f"model.moe_aux_loss={self.moe_aux_loss} must be >= 0")


@dataclass
class ToyConfig:
    """Sizes of the built-in synthetic corpus (data.source=toy)."""

    n_train: int = 50000
    n_valid: int = 1000
    n_test: int = 1000
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("n_train", "n_valid", "n_test"):
            _check(getattr(self, name) > 0, f"data.toy.{name}={getattr(self, name)} must be positive")


@dataclass
class DataConfig:
    """A corpus and how it is prepared (§5.1): source -> clean -> shared BPE -> binary shards."""

    name: str = "wmt14_en_de"
    source: str = "hf"  # "hf" (Hugging Face datasets) | "local" (text files) | "toy" (synthetic)
    path: str | None = None  # directory of local files (source=local) or a saved HF dataset (source=hf)
    hf_dataset: str | None = "wmt/wmt14"  # hub name, for source=hf without data.path
    hf_config: str | None = "de-en"
    src_lang: str = "en"
    tgt_lang: str = "de"
    # role -> the split's name in the source; roles are train (required), valid, test
    splits: dict[str, str] = field(
        default_factory=lambda: {"train": "train", "valid": "validation", "test": "test"}
    )
    # role -> file stem <path>/<stem>.<lang>[.gz] for source=local; None = the same names as `splits`
    local_splits: dict[str, str] | None = None
    dir: str = "data/wmt14_en_de"  # where tokenizer, shards and meta.json are written
    vocab_size: int = 37000  # shared BPE vocabulary (§5.1: about 37,000)
    spm_sample_size: int = 2_000_000  # sentences (both sides together) to learn BPE from
    # Lowercase everything the tokenizer encodes (built into spm.model, so translation input is lowercased
    # too). Off for WMT (the paper is cased); Multi30k's published results train and score lowercased.
    lowercase: bool = False
    max_tokens_per_sentence: int = 250  # training pairs with a longer side are dropped
    max_length_ratio: float = 3.0  # training pairs whose piece counts differ more are dropped
    num_workers: int = 2
    force: bool = False
    toy: ToyConfig = field(default_factory=ToyConfig)

    def __post_init__(self) -> None:
        _check(
            self.source in ("hf", "local", "toy"),
            f"data.source={self.source!r} must be one of 'hf', 'local', 'toy'",
        )
        _check(self.src_lang != self.tgt_lang, f"data.src_lang and data.tgt_lang are both {self.src_lang!r}")
        for key in ("splits", "local_splits"):
            names = getattr(self, key) or {"train": "train"}
            _check("train" in names, f"data.{key} must name a 'train' split")
            unknown = sorted(set(names) - {"train", "valid", "test"})
            _check(not unknown, f"data.{key} has unknown role(s) {unknown}; roles are train, valid, test")
        _check(self.spm_sample_size > 0, "data.spm_sample_size must be positive")
        _check(bool(self.dir), "data.dir must name a directory")
        if self.source == "toy":
            _check(
                {self.src_lang, self.tgt_lang} == {"en", "de"},
                "data.source=toy is English-German: data.src_lang and data.tgt_lang must be 'en' and 'de'",
            )
        _check(self.vocab_size >= 16, f"data.vocab_size={self.vocab_size} is too small")
        _check(self.max_tokens_per_sentence > 0, "data.max_tokens_per_sentence must be positive")
        _check(self.max_length_ratio >= 1.0, "data.max_length_ratio must be at least 1")
        _check(self.num_workers >= 1, "data.num_workers must be at least 1")
        if self.source == "local":
            _check(self.path is not None, "data.source=local needs data.path=<directory of text files>")
        if self.source == "hf":
            _check(
                self.hf_dataset is not None or self.path is not None,
                "data.source=hf needs data.hf_dataset=<hub name> or data.path=<saved dataset>",
            )


@dataclass
class OptimConfig:
    """Adam, the warmup/inverse-square-root schedule (Eq. 3, §5.3) and label smoothing (§5.4)."""

    lr_scale: float = 1.0  # multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    warmup_steps: int = 4000
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1  # eps_ls
    clip_grad_norm: float = 0.0  # 0 = no clipping (the paper clips nothing)

    def __post_init__(self) -> None:
        _check(self.lr_scale > 0, f"optim.lr_scale={self.lr_scale} must be positive")
        _check(self.warmup_steps > 0, f"optim.warmup_steps={self.warmup_steps} must be positive")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
        _check(self.eps > 0, "optim.eps must be positive")
        _check(0.0 <= self.label_smoothing < 1.0, "optim.label_smoothing must be in [0, 1)")
        _check(self.clip_grad_norm >= 0, "optim.clip_grad_norm must be >= 0 (0 disables clipping)")


@dataclass
class DeviceConfig:
    """Where and in what precision a model runs: training's (`trainer.*`) and decoding's settings."""

    device: str = "auto"  # "auto" (CUDA when present) | "cpu" | "cuda" | "cuda:N"
    # "auto": bf16 on CUDA, and in training also on CPUs with AMX or AVX512-BF16 | "fp32" | "bf16"
    precision: str = "auto"  # (| "int8": decoding)
    threads: int | None = None  # CPU threads of PyTorch's kernels; None = its default (one per core)

    def check_device(self, where: str = "", precisions: tuple[str, ...] = ("auto", "fp32", "bf16")) -> None:
        _check(
            self.device in ("auto", "cpu") or self.device.startswith("cuda"),
            f"{where}device={self.device!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'",
        )
        _check(
            self.precision in precisions,
            f"{where}precision={self.precision!r} must be {_one_of(precisions)}",
        )
        _check(self.threads is None or self.threads >= 1, f"{where}threads={self.threads} must be at least 1")


@dataclass
class SearchConfig:
    """How to search (§6.1): beam 4, length penalty alpha 0.6, maximum output = input + 50; decoding's
    and the finish stage's (`finish.*`) settings."""

    beam_size: int = 4  # 1 = greedy search (no length penalty)
    alpha: float = 0.6  # GNMT length penalty exponent
    max_len_a: float = 1.0  # maximum output length = max_len_a * source tokens + max_len_b
    max_len_b: int = 50

    def check_search(self, where: str = "") -> None:
        _check(self.beam_size >= 1, f"{where}beam_size={self.beam_size} must be at least 1")
        _check(self.alpha >= 0, f"{where}alpha={self.alpha} must be >= 0")
        _check(
            self.max_len_a >= 0 and self.max_len_b >= 1,
            f"{where}max_len_a must be >= 0 and {where}max_len_b >= 1",
        )


@dataclass
class TrainerConfig(DeviceConfig):
    """How long, how big a step, where to write, and on what device."""

    run_dir: str = "runs/default"
    max_steps: int = 100000  # optimizer steps (base: 100k, big: 300k)
    tokens_per_step: int = 28672  # padded tokens per optimizer step: ~25k real target tokens (§5.1)
    max_tokens: int = 14336  # padded tokens per batch per rank, at most (memory); see batch_tokens
    pad_to_multiple: int = 8  # pad batch lengths to a multiple of this (aligned matmuls)
    compile: bool = False
    save_every_steps: int = 1000  # 0 = off
    save_every_minutes: float = 10.0  # the paper wrote a checkpoint every 10 minutes; 0 = off
    keep_last: int = 20
    eval_every_steps: int = 1000  # validation loss on the `valid` split; 0 = off
    log_every_steps: int = 100
    resume: str = "auto"  # "auto" (newest valid checkpoint in run_dir) | "never" | a checkpoint path
    max_nonfinite_steps: int = 10  # consecutive skipped non-finite updates before the run stops
    seed: int = 1
    progress: bool = True
    dist_timeout_minutes: float = 15.0  # a collective waiting longer (a peer died) fails instead of hanging

    def __post_init__(self) -> None:
        for name in (
            "max_steps",
            "tokens_per_step",
            "max_tokens",
            "keep_last",
            "log_every_steps",
            "max_nonfinite_steps",
            "dist_timeout_minutes",
        ):
            _check(getattr(self, name) > 0, f"trainer.{name}={getattr(self, name)} must be positive")
        for name in ("save_every_steps", "save_every_minutes", "eval_every_steps"):
            _check(getattr(self, name) >= 0, f"trainer.{name}={getattr(self, name)} must be >= 0 (0 = off)")
        _check(self.pad_to_multiple >= 1, "trainer.pad_to_multiple must be at least 1")
        self.check_device("trainer.")

    def grad_accum(self, world_size: int) -> int:
        """Batches per rank per optimizer step, so that max_tokens x accum x ranks >= tokens_per_step."""
        return max(1, math.ceil(self.tokens_per_step / (self.max_tokens * world_size)))

    def batch_tokens(self, world_size: int) -> int:
        """The padded-token budget of each batch: tokens_per_step shared evenly among the step's batches
        on all ranks (at most max_tokens), so a step holds tokens_per_step whatever the split."""
        return math.ceil(self.tokens_per_step / (self.grad_accum(world_size) * world_size))


@dataclass
class FinishConfig(SearchConfig):
    """What `train.py` does once training ends (rank 0): average, evaluate, show translations, decoding
    with the search settings of §6.1 unless told otherwise."""

    average_last: int = 0  # average the last K checkpoints (§6.1: 5 for base, 20 for big); 0 = skip
    evaluate_split: str | None = None  # role ("valid", "test") to score with BLEU; None = skip
    examples: list[str] = field(default_factory=list)  # sentences to translate and print
    attention_text: str | None = None  # write attention heatmaps for this sentence
    precision: str = "auto"  # of its decoding: "auto" (bf16 on CUDA) | "fp32" | "bf16" | "int8" (CPU)

    def __post_init__(self) -> None:
        _check(self.average_last >= 0, "finish.average_last must be >= 0")
        _check(
            self.precision in DECODE_PRECISIONS,
            f"finish.precision={self.precision!r} must be {', '.join(map(repr, DECODE_PRECISIONS))}",
        )
        _check(
            self.evaluate_split in (None, "valid", "test"),
            f"finish.evaluate_split={self.evaluate_split!r} must be valid, test or null",
        )
        self.check_search("finish.")


@dataclass
class TrainConfig:
    """Everything `train.py` needs."""

    name: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    finish: FinishConfig = field(default_factory=FinishConfig)


DECODE_PRECISIONS = ("auto", "fp32", "bf16", "int8")  # int8: the CPU's 8-bit products (kernels/onednn.py)


@dataclass
class DecodeConfig(SearchConfig, DeviceConfig):
    """A checkpoint and how to decode with it: the search (§6.1), the device, the batches."""

    checkpoint: str | None = None  # a checkpoint file (it carries its tokenizer)
    max_tokens: int = 4096  # padded source tokens per batch
    max_sentences: int = 256  # sentences per batch: bounds the decoder's cache on batches of short lines
    cuda_graphs: bool | None = None  # each search step one CUDA graph replay; None: on CUDA

    def __post_init__(self) -> None:
        _check(self.checkpoint is not None, "checkpoint=PATH is required (a .pt file written by train.py)")
        # Each value typed as `from_dict` types it: these settings are also built in code (finish.py).
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            if not dataclasses.is_dataclass(hints[f.name]):  # EvaluateConfig.data comes typed
                setattr(self, f.name, _typed(hints[f.name], getattr(self, f.name), f.name))
        self.check_search()
        self.check_device(precisions=DECODE_PRECISIONS)
        _check(
            self.precision != "int8" or (not self.device.startswith("cuda") and not self.cuda_graphs),
            "precision=int8 runs on the CPU: not with device=cuda or cuda_graphs=true",
        )
        _check(self.max_tokens > 0, f"max_tokens={self.max_tokens} must be positive")
        _check(self.max_sentences > 0, f"max_sentences={self.max_sentences} must be positive")


@dataclass
class TranslateConfig(DecodeConfig):
    """`translate.py`: lines from `input` (default stdin) or one `text`, to `output` (default stdout)."""

    input: str | None = None
    output: str | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.text is None or self.input is None, "give either text=... or input=FILE, not both")


@dataclass
class EvaluateConfig(DecodeConfig):
    """`scripts/evaluate.py`: BLEU of a checkpoint on one split (role) of a corpus."""

    data: DataConfig = field(default_factory=DataConfig)
    split: str = "test"  # role: valid | test | train
    lowercase: bool | None = None  # also score lowercased; None = where the published figures are

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.split in ("train", "valid", "test"), f"split={self.split!r} must be valid, test or train")


@dataclass
class VisualizeConfig(DecodeConfig):
    """`scripts/visualize_attention.py`: attention heatmaps of one sentence and its translation."""

    text: str | None = None
    layer: int = -1  # which layer of each stack; negative counts from the last
    out_dir: str = "attention"
    tensorboard: bool = False  # also write the figures to TensorBoard (in out_dir)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(bool(self.text and self.text.strip()), 'text="..." is required: the sentence to translate')


EXPORT_FORMATS = ("ctranslate2", "huggingface")


@dataclass
class ExportConfig:
    """`scripts/export.py`: a checkpoint written out for CTranslate2 or Hugging Face `transformers`."""

    checkpoint: str | None = None  # a checkpoint file written by train.py
    format: str = "ctranslate2"  # "ctranslate2" | "huggingface"
    out: str | None = None  # the directory to write (new, or empty)
    quantization: str | None = None  # ctranslate2 only: "int8", "int8_float32", ... (None = float32)

    def __post_init__(self) -> None:
        _check(self.checkpoint is not None, "checkpoint=PATH is required (a .pt file written by train.py)")
        _check(self.out is not None, "out=DIR is required: the directory to write")
        _check(
            self.format in EXPORT_FORMATS,
            f"format={self.format!r} must be one of {', '.join(EXPORT_FORMATS)}",
        )
        _check(
            self.quantization is None or self.format == "ctranslate2",
            f"quantization={self.quantization} applies to format=ctranslate2 only",
        )


def from_dict(cls: type, values: dict[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from nested plain dicts, rejecting unknown keys by name."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where or cls.__name__} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(where + k for k in unknown)}; known: {', '.join(sorted(names))}"
        )
    kwargs = {}
    for key, value in values.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = from_dict(hint, value, f"{where}{key}.")
        else:
            value = _typed(hint, value, f"{where}{key}")
        kwargs[key] = value
    return cls(**kwargs)


def _typed(hint: Any, value: Any, name: str) -> Any:
    """value as a field of type `hint` takes it, or a ConfigError that names the setting: a typo such as
    trainer.max_steps=abc fails here, not as a TypeError deep in the run."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        if value is None:
            return None
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    kind = typing.get_origin(hint) or hint
    if kind is bool and not isinstance(value, bool):  # "maybe" or 1 would pass as truthy
        raise ConfigError(f"{name}={value!r} must be true or false")
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"{name}={value!r} must be a whole number")
    if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise ConfigError(f"{name}={value!r} must be a number")
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # Hydra reads name=2024 as a number
    names = {str: "a string", list: "a list", dict: "a mapping"}
    if kind in names and not isinstance(value, kind):
        raise ConfigError(f"{name}={value!r} must be {names[kind]}")
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """The inverse of `from_dict`: plain, JSON- and checkpoint-friendly values."""
    return dataclasses.asdict(obj)
