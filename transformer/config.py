"""Typed configuration, validated on construction: the one home of every default.

One dataclass per concern; each component receives only its own slice. The defaults live here, so the
Python API (`Translator.from_checkpoint`, tests, scripts) has them without Hydra; the YAML files under
configs/ hold only what differs from them (a model size, a corpus, a recipe), and the command-line apps
register `defaults(...)` with Hydra as the base of their configs (one line each). The package never
imports Hydra: the apps compose YAML with it and hand plain dicts to `from_dict`.

Every setting is typed and checked on construction, from the command line, a YAML file or Python
alike (`Settings.__post_init__`, then each class's `check`), and a mistake names the setting as the
command line spells it (`trainer.max_steps=0 must be positive`); a list of allowed values always reads
"must be one of 'a', 'b' or 'c'".
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A user's configuration mistake, reported before any heavy work starts."""


def one_of(values: tuple[str | None, ...]) -> str:
    """The allowed values as a message reads them: "one of 'a', 'b' or 'c'"."""
    quoted = ["null" if value is None else repr(value) for value in values]
    return f"one of {', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else f"{quoted[0]}"


class Settings:
    """The base of every config dataclass: `PREFIX` is how the command line reaches its keys
    ("trainer.", "" for a decoding app's own keys). Each value is first typed as its field is (a typo
    such as trainer.max_steps=abc, or beam_size="4" from Python, fails here); then subclasses check
    their fields in `check` and call super()'s."""

    PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            if not dataclasses.is_dataclass(hints[f.name]):  # a nested config comes typed
                setattr(self, f.name, _typed(hints[f.name], getattr(self, f.name), self.PREFIX + f.name))
        self.check()

    def check(self) -> None:
        pass

    def require(self, condition: bool, key: str, requirement: str) -> None:
        """A ConfigError "<prefix><key>=<value> <requirement>" unless the condition holds."""
        if not condition:
            raise ConfigError(f"{self.PREFIX}{key}={getattr(self, key)!r} {requirement}")

    def require_choice(self, key: str, choices: tuple[str | None, ...]) -> None:
        self.require(getattr(self, key) in choices, key, f"must be {one_of(choices)}")

    def require_files(self, *keys: str) -> None:
        for key in keys:
            if (name := getattr(self, key)) is not None and not Path(name).is_file():
                raise ConfigError(f"{self.PREFIX}{key}={name} is not a file")

    def require_positive(self, *keys: str) -> None:
        for key in keys:
            self.require(getattr(self, key) > 0, key, "must be positive")


INIT_SCHEMES = ("t2t", "fairseq", "xavier")
DEVICES = "'auto', 'cpu', 'cuda' or 'cuda:N'"
# trainer.length_buckets when unset, by device type; else 0: off (docs/performance.md, "Few batch shapes")
LENGTH_BUCKETS = {"cuda": 12}
# torch's scaled_dot_product_attention backends; flash takes no padding mask (training has them)
ATTENTION_BACKENDS = ("flash", "efficient", "cudnn", "math")
# what a resume compares with its checkpoint, as it changes what the run means (the data position's
# batches, the token ids); trainer.resume_changes accepts a difference knowingly
RESUME_CHANGES = ("tokenizer", "trainer.tokens_per_step", "trainer.max_tokens", "trainer.pad_to_multiple")
TRAIN_PRECISIONS = ("auto", "fp32", "bf16")
DECODE_PRECISIONS = ("auto", "fp32", "bf16", "int8")  # int8: the CPU's 8-bit products (kernels/onednn.py)
EXPORT_FORMATS = ("ctranslate2", "huggingface")
MAX_BEAM = 1024  # hypotheses (or samples) per sentence at most: beam_size, nbest
MAX_ALPHA = 10.0  # the length penalty's exponent at most: lp(1024 tokens) stays a float32 number
TEMPERATURES = (0.01, 100.0)  # sampling's temperature: logits / temperature stay float32 numbers
REPETITION_PENALTIES = (0.01, 100.0)  # repetition_penalty: scaled logits stay float32 numbers
LONG_INPUTS = ("split", "truncate")  # a line longer than a model takes (inference/translation.py)
OUTPUT_FORMATS = ("text", "fairseq", "jsonl")  # translate.py (transformer/formats.py)
ROLES = ("train", "valid", "test")


@dataclass
class ModelConfig(Settings):
    """The Transformer's shape (§3, Table 3). Defaults are the paper's base model."""

    PREFIX: ClassVar[str] = "model."

    vocab_size: int = 37000  # shared source/target BPE vocabulary (§5.1); training takes the corpus'
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

    def check(self) -> None:
        self.require_positive("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "max_positions")
        if self.d_k is None or self.d_v is None:
            self.require(
                self.d_model % self.n_heads == 0,
                "d_model",
                f"is not divisible by model.n_heads={self.n_heads}; change one of them or set model.d_k "
                "and model.d_v explicitly",
            )
        self.d_k = self.d_model // self.n_heads if self.d_k is None else self.d_k
        self.d_v = self.d_model // self.n_heads if self.d_v is None else self.d_v
        self.n_kv_heads = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        self.require_positive("d_k", "d_v")
        self.require(
            0 < self.n_kv_heads <= self.n_heads and self.n_heads % self.n_kv_heads == 0,
            "n_kv_heads",
            f"must divide model.n_heads={self.n_heads}",
        )
        self.require(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        self.require(0.0 <= self.attention_dropout < 1.0, "attention_dropout", "must be in [0, 1)")
        self.require_choice("positional", ("sinusoidal", "learned"))
        self.require_choice("init", INIT_SCHEMES)
        if self.moe_experts:
            experts = self.moe_experts
            self.require(experts >= 2, "moe_experts", "must be 0 (dense) or at least 2")
            self.require(
                1 <= self.moe_top_k <= experts,
                "moe_top_k",
                f"must be between 1 and model.moe_experts={experts}",
            )
            self.require_positive("moe_capacity")
            self.require(self.moe_aux_loss >= 0, "moe_aux_loss", "must be >= 0")
        super().check()


@dataclass
class ToyConfig(Settings):
    """Sizes of the built-in synthetic corpus (data.source=toy)."""

    PREFIX: ClassVar[str] = "data.toy."

    n_train: int = 50000
    n_valid: int = 1000
    n_test: int = 1000
    seed: int = 1234

    def check(self) -> None:
        self.require_positive("n_train", "n_valid", "n_test")
        super().check()


@dataclass
class DataConfig(Settings):
    """A corpus and how it is prepared (§5.1): source -> clean -> shared BPE -> binary shards."""

    PREFIX: ClassVar[str] = "data."

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

    def check(self) -> None:
        self.require_choice("source", ("hf", "local", "toy"))
        self.require(self.src_lang != self.tgt_lang, "src_lang", "is data.tgt_lang too")
        for key in ("splits", "local_splits"):
            names = getattr(self, key) or {"train": "train"}
            self.require("train" in names, key, "must name a 'train' split")
            unknown = sorted(set(names) - set(ROLES))
            self.require(not unknown, key, f"has unknown role(s) {unknown}; roles are train, valid, test")
        self.require_positive("spm_sample_size", "max_tokens_per_sentence", "num_workers")
        self.require(bool(self.dir), "dir", "must name a directory")
        if self.source == "toy":
            self.require(
                {self.src_lang, self.tgt_lang} == {"en", "de"},
                "source",
                "is English-German: data.src_lang and data.tgt_lang must be 'en' and 'de'",
            )
        self.require(self.vocab_size >= 16, "vocab_size", "is too small (at least 16)")
        self.require(self.max_length_ratio >= 1.0, "max_length_ratio", "must be at least 1")
        if self.source == "local":
            self.require(
                self.path is not None, "path", "is needed with data.source=local: a directory of text files"
            )
        if self.source == "hf":
            self.require(
                self.hf_dataset is not None or self.path is not None,
                "hf_dataset",
                "is needed with data.source=hf, or data.path=<saved dataset>",
            )
        super().check()

    @property
    def split_names(self) -> dict[str, str]:
        """role -> the split's name in the source, in the order train, valid, test."""
        names = self.local_splits if self.source == "local" and self.local_splits is not None else self.splits
        return {role: names[role] for role in ROLES if role in names}


@dataclass
class OptimConfig(Settings):
    """Adam, the warmup/inverse-square-root schedule (Eq. 3, §5.3) and label smoothing (§5.4)."""

    PREFIX: ClassVar[str] = "optim."

    lr_scale: float = 1.0  # multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    warmup_steps: int = 4000
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-9
    weight_decay: float = 0.0  # the paper has none
    label_smoothing: float = 0.1  # eps_ls
    clip_grad_norm: float = 0.0  # 0 = no clipping (the paper clips nothing)

    def check(self) -> None:
        self.require_positive("lr_scale", "warmup_steps", "eps")
        for key in ("beta1", "beta2", "label_smoothing"):
            self.require(0.0 <= getattr(self, key) < 1.0, key, "must be in [0, 1)")
        self.require(self.clip_grad_norm >= 0, "clip_grad_norm", "must be >= 0 (0 disables clipping)")
        super().check()


@dataclass
class DeviceConfig(Settings):
    """Where a model runs (transformer/devices.py resolves these, and `precision`)."""

    device: str = "auto"  # "auto" (CUDA when present) | "cpu" | "cuda" | "cuda:N"
    threads: int | None = None  # CPU threads of PyTorch's kernels; None = its default (one per core)
    # the CPU kernels (transformer/kernels): "auto" (by the CPU's instruction set; a resumed run: as it
    # was trained) | "on" | "off" (plain PyTorch)
    cpu_kernels: str = "auto"

    def check(self) -> None:
        self.require(
            self.device in ("auto", "cpu") or self.device.startswith("cuda"), "device", f"must be {DEVICES}"
        )
        self.require_choice("cpu_kernels", ("auto", "on", "off"))
        self.require(self.threads is None or self.threads >= 1, "threads", "must be at least 1")
        super().check()


@dataclass
class SearchConfig(Settings):
    """How to search (§6.1): beam 4, length penalty alpha 0.6, at most input length + 50 tokens; or the
    n best of the beam, or samples. The one object that carries decoding settings from every entry point
    (translate.py, evaluate.py, a request to serve.py, `Translator`, training's valid BLEU and the finish
    stage) to the search (`decoding.beam_search`); a request may change every one of them."""

    beam_size: int = 4  # 1 = greedy search (no length penalty)
    alpha: float = 0.6  # GNMT length penalty exponent
    max_len_a: float = 1.0  # maximum output length = max_len_a * source tokens + max_len_b
    max_len_b: int = 50
    nbest: int = 1  # hypotheses per input (at most beam_size), or samples with sampling=true
    sampling: bool = False  # draw nbest samples per input instead of searching (e.g. back-translation)
    topk: int = 0  # sampling: from the k most probable tokens only; 0 = all
    topp: float = 1.0  # sampling: from the most probable tokens whose probability reaches p; 1.0 = all
    temperature: float = 1.0  # sampling: softmax(logits / temperature)
    seed: int = 0  # sampling: the same seed draws the same samples, whatever the batches (no vocabulary map)
    no_repeat_ngram_size: int = 0  # no output holds an n-gram of this many pieces twice; 0 = off
    repetition_penalty: float = 1.0  # logits of pieces already output: / p where > 0, * p where < 0
    # a line longer than the model takes: "split" at sentence ends (an overlong sentence into parts),
    # translated in parts and joined | "truncate": its first pieces only
    long_inputs: str = "split"
    # each hypothesis's hard alignment to its source, pieces and words, from the last decoder layer's
    # encoder-decoder attention (inference/alignment.py); a translation's text stays the same
    alignment: bool = False

    def check(self) -> None:
        self.require(1 <= self.beam_size <= MAX_BEAM, "beam_size", f"must be in 1..{MAX_BEAM}")
        # lp(Y) = ((5 + |Y|) / 6)^alpha stays a float32 number up to 1,024 positions
        self.require(0 <= self.alpha <= MAX_ALPHA, "alpha", f"must be in [0, {MAX_ALPHA}]")
        self.require(self.max_len_a >= 0, "max_len_a", "must be >= 0")
        self.require(self.max_len_b >= 1, "max_len_b", "must be at least 1")
        self.require(1 <= self.nbest <= MAX_BEAM, "nbest", f"must be in 1..{MAX_BEAM}")
        if not self.sampling:
            self.require(self.nbest <= self.beam_size, "nbest", f"must be at most beam_size={self.beam_size}")
        self.require(0 <= self.seed < 2**32, "seed", "must be in 0..2^32 - 1")
        self.require(self.topk >= 0, "topk", "must be >= 0 (0 = every token)")
        self.require(0 < self.topp <= 1, "topp", "must be in (0, 1]")
        low, high = TEMPERATURES
        self.require(low <= self.temperature <= high, "temperature", f"must be in [{low}, {high}]")
        self.require(self.no_repeat_ngram_size >= 0, "no_repeat_ngram_size", "must be >= 0 (0 = off)")
        low, high = REPETITION_PENALTIES
        penalty_ok = low <= self.repetition_penalty <= high
        self.require(penalty_ok, "repetition_penalty", f"must be in [{low}, {high}]")
        self.require_choice("long_inputs", LONG_INPUTS)
        if not self.sampling and (self.topk or self.topp < 1 or self.temperature != 1):
            raise ConfigError(f"{self.PREFIX}topk, topp and temperature shape sampling: add sampling=true")
        super().check()

    @property
    def search(self) -> SearchConfig:
        """These settings alone (of a config that holds more)."""
        return SearchConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SearchConfig)})

    @property
    def width(self) -> int:
        """Rows decoded per sentence: the beam, or one per sample."""
        return self.nbest if self.sampling else self.beam_size

    @property
    def ranking_alpha(self) -> float:
        """The length penalty's exponent the search ranks by: alpha for a beam; none for greedy search
        and for samples (log P(Y|X))."""
        return self.alpha if self.beam_size > 1 and not self.sampling else 0.0

    def describe(self) -> str:
        """`beam4.alpha0.6`, `greedy` or `sample.seed<s>` (`sample<n>` for n samples, then `.topk<k>`,
        `.topp<p>`, `.temp<t>` where set), then `.norepeat<n>`, `.reppen<p>` for repetition control,
        `.len<a>x+<b>` for an output limit other than §6.1's and `.truncate` for long inputs truncated: a
        name that tells one search from another (evaluate.py's result files)."""
        name = f"beam{self.beam_size}.alpha{self.alpha:g}" if self.beam_size > 1 else "greedy"
        if self.sampling:
            name = f"sample{self.nbest if self.nbest > 1 else ''}.seed{self.seed}"
            shape = {"topk": (self.topk, SearchConfig.topk), "topp": (self.topp, SearchConfig.topp)}
            shape["temp"] = (self.temperature, SearchConfig.temperature)
            name += "".join(f".{k}{v:g}" for k, (v, default) in shape.items() if v != default)
        if self.no_repeat_ngram_size:
            name += f".norepeat{self.no_repeat_ngram_size}"
        if self.repetition_penalty != SearchConfig.repetition_penalty:
            name += f".reppen{self.repetition_penalty:g}"
        if (self.max_len_a, self.max_len_b) != (SearchConfig.max_len_a, SearchConfig.max_len_b):
            name += f".len{self.max_len_a:g}x+{self.max_len_b}"  # another output limit
        if self.long_inputs != SearchConfig.long_inputs:
            name += f".{self.long_inputs}"
        return name


@dataclass
class DecodingPrecision(Settings):
    """Decoding's precision (transformer/utils/devices.py): the dtype the weights are cast to, scores in
    float32. The model's, not the search's: a request to the server cannot change it."""

    # "auto": bf16 on CUDA, fp32 on a CPU | "fp32" | "bf16" | "int8" (8-bit products on the CPU)
    precision: str = "auto"

    def check(self) -> None:
        self.require_choice("precision", DECODE_PRECISIONS)
        super().check()


@dataclass
class TrainerConfig(DeviceConfig):
    """How long, how big a step, where to write, and on what device."""

    PREFIX: ClassVar[str] = "trainer."

    # Training's precision (transformer/devices.py): the dtype of autocast, weights and Adam in float32;
    # "auto": bf16 on CUDA and on CPUs with AMX or AVX512-BF16, else fp32 | "fp32" | "bf16"
    precision: str = "auto"
    run_dir: str = "runs/default"
    max_steps: int = 100000  # optimizer steps (base: 100k, big: 300k)
    tokens_per_step: int = 28672  # padded tokens per optimizer step: ~25k real target tokens (§5.1)
    max_tokens: int = 14336  # padded tokens per batch per rank, at most (memory); see batch_tokens
    pad_to_multiple: int = 8  # pad batch lengths to a multiple of this (aligned matmuls)
    # batch shapes from a fixed set (transformer/data/batching.py): both sides padded to one of this many
    # lengths, and the rows that length fits in a batch; None: LENGTH_BUCKETS by device (CUDA 12, a CPU 0:
    # off, the tightest batches), and a resumed run keeps its checkpoint's
    length_buckets: int | None = None
    compile: bool = False  # torch.compile by regions (each layer, the loss), with dynamic shapes
    # the backends torch's fused attention may choose among, e.g. [flash, efficient]; None: torch's choice
    attention_backends: list[str] | None = None
    # each step run as CUDA graph replays, a graph per batch shape (transformer/training/graphs.py); None:
    # on CUDA where it can be (length buckets, one process, no mixture of experts)
    cuda_graphs: bool | None = None
    save_every_steps: int = 1000  # 0 = off
    save_every_minutes: float = 10.0  # the paper wrote a checkpoint every 10 minutes; 0 = off
    keep_last: int = 20  # numbered checkpoints kept (averaging takes up to 20, §6.1)
    eval_every_steps: int = 1000  # validation loss on the `valid` split; 0 = off
    # translate the `valid` split with the finish stage's search and score it: BLEU, chrF, chrF++; 0 = off
    translate_every_steps: int = 0
    bleu_every_steps: int | None = None  # deprecated: the old name of translate_every_steps
    bleu_sentences: int = 0  # the first N sentences of the valid split to translate; 0 = all
    # "loss" (lower is better) | "bleu" | "chrf" | "chrf++" (higher): checkpoint_best.pt is the best
    # validation's checkpoint
    best_metric: str = "loss"
    patience: int = 0  # stop after this many validations of best_metric without improvement; 0 = off
    log_every_steps: int = 100
    # [first, last]: these optimizer steps under torch.profiler, each operator's time, a Chrome trace and
    # the device's busy share in <run_dir>/profile (transformer/training/profile.py); None = off
    profile_steps: list[int] | None = None
    resume: str = "auto"  # "auto" (newest valid checkpoint in run_dir) | "never" | a checkpoint path
    # differences from the resumed checkpoint accepted knowingly, of RESUME_CHANGES, e.g. [trainer.max_tokens]
    resume_changes: list[str] = field(default_factory=list)
    # a checkpoint whose weights (and tokenizer: the corpus is encoded with it) start a new run: Adam, the
    # schedule, the step and the best validation start afresh; once the run has saved, resume=auto goes on
    finetune_from: str | None = None
    # an exponential moving average of the weights (transformer/training/ema.py), what checkpoints,
    # validation, averaging and translation use; e.g. 0.9999 (fairseq's, Marian's); 0 = off (the paper)
    ema_decay: float = 0.0
    max_nonfinite_steps: int = 10  # consecutive skipped non-finite updates before the run stops
    seed: int = 1
    progress: bool = True
    dist_timeout_minutes: float = 15.0  # a collective waiting longer (a peer died) fails instead of hanging

    def check(self) -> None:
        if self.bleu_every_steps is not None:  # the old name: its value under the new one
            self.require(
                not self.translate_every_steps,
                "bleu_every_steps",
                f"is the old name of trainer.translate_every_steps={self.translate_every_steps}: give one",
            )
            self.translate_every_steps, self.bleu_every_steps = self.bleu_every_steps, None
        self.require_choice("precision", TRAIN_PRECISIONS)
        self.require_positive(
            "max_steps",
            "tokens_per_step",
            "max_tokens",
            "keep_last",
            "log_every_steps",
            "max_nonfinite_steps",
            "dist_timeout_minutes",
            "pad_to_multiple",
        )
        for key in (
            "save_every_steps",
            "save_every_minutes",
            "eval_every_steps",
            "translate_every_steps",
            "patience",
        ):
            self.require(getattr(self, key) >= 0, key, "must be >= 0 (0 = off)")
        self.require(self.bleu_sentences >= 0, "bleu_sentences", "must be >= 0 (0 = all)")
        self.require(
            self.length_buckets is None or self.length_buckets >= 0, "length_buckets", "must be >= 0"
        )
        self.require_choice("best_metric", ("loss", "bleu", "chrf", "chrf++"))
        self.require(0 <= self.ema_decay < 1, "ema_decay", "must be in [0, 1) (0 = off)")
        unknown = sorted(set(self.resume_changes) - set(RESUME_CHANGES))
        self.require(not unknown, "resume_changes", f"has {unknown}: each must be {one_of(RESUME_CHANGES)}")
        if self.profile_steps is not None:
            steps = self.profile_steps
            self.require(
                len(steps) == 2 and 1 <= steps[0] <= steps[1] <= self.max_steps,
                "profile_steps",
                f"must be [first, last]: optimizer steps, 1 <= first <= last <= max_steps ({self.max_steps})",
            )
        if self.attention_backends is not None:
            unknown = sorted(set(self.attention_backends) - set(ATTENTION_BACKENDS))
            self.require(
                not unknown, "attention_backends", f"has {unknown}: each must be {one_of(ATTENTION_BACKENDS)}"
            )
            masked = set(self.attention_backends) - {"flash"}
            self.require(
                bool(masked),
                "attention_backends",
                "needs one besides flash, which takes no padding mask on CUDA",
            )
        translated = self.best_metric != "loss"  # a score of the valid split's translations
        validations = self.translate_every_steps if translated else self.eval_every_steps
        every = "trainer.translate_every_steps" if translated else "trainer.eval_every_steps"
        if translated or self.patience:  # loss without validations: no best checkpoint
            self.require(validations > 0, "best_metric", f"needs its validations: {every} is 0")
        super().check()

    def grad_accum(self, world_size: int) -> int:
        """Batches per rank per optimizer step, so that max_tokens x accum x ranks >= tokens_per_step."""
        return max(1, math.ceil(self.tokens_per_step / (self.max_tokens * world_size)))

    def batch_tokens(self, world_size: int) -> int:
        """The padded-token budget of each batch: tokens_per_step shared evenly among the step's batches
        on all ranks (at most max_tokens), so a step holds tokens_per_step whatever the split."""
        return math.ceil(self.tokens_per_step / (self.grad_accum(world_size) * world_size))


@dataclass
class FinishConfig(SearchConfig, DecodingPrecision):
    """What `train.py` does once training ends (rank 0): average, evaluate, show translations, decoding
    with the search settings of §6.1 unless told otherwise (on the training's device; int8 on the CPU)."""

    PREFIX: ClassVar[str] = "finish."

    average_last: int = 0  # average the last K checkpoints (§6.1: 5 for base, 20 for big); 0 = skip
    evaluate_split: str | None = None  # role ("valid", "test") to score with BLEU; None = skip
    examples: list[str] = field(default_factory=list)  # sentences to translate and print
    attention_text: str | None = None  # write attention heatmaps for this sentence

    def check(self) -> None:
        self.require(self.average_last >= 0, "average_last", "must be >= 0 (0 = skip)")
        self.require_choice("evaluate_split", ("valid", "test", None))
        if self.alignment:
            raise ConfigError(f"{self.PREFIX}alignment=true: the finish stage writes no alignments")
        super().check()


@dataclass
class TrainConfig(Settings):
    """Everything `train.py` needs."""

    name: str = "default"  # names the run directory, runs/<name>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    finish: FinishConfig = field(default_factory=FinishConfig)

    def check(self) -> None:
        """What one section asks of another: validations of a valid split the corpus has, a finish
        stage that evaluates a split it has and averages checkpoints the run keeps."""
        trainer, finish, roles = self.trainer, self.finish, self.data.split_names
        if "valid" not in roles:
            needs = [f"trainer.{k}={getattr(trainer, k)}" for k in ("translate_every_steps", "patience")]
            needs = [need for need, on in zip(needs, (trainer.translate_every_steps, trainer.patience)) if on]
            needs += [f"trainer.best_metric={trainer.best_metric}"] if trainer.best_metric != "loss" else []
            if needs:
                raise ConfigError(
                    f"{', '.join(needs)}: validations on the 'valid' split, which data {self.data.name} "
                    "does not have; add one (data.splits.valid) or turn these off"
                )
        if finish.evaluate_split is not None and finish.evaluate_split not in roles:
            raise ConfigError(
                f"finish.evaluate_split={finish.evaluate_split}: data {self.data.name} has no "
                f"'{finish.evaluate_split}' split (it has: {', '.join(roles)}); choose another or "
                "finish.evaluate_split=null"
            )
        if finish.average_last > trainer.keep_last:
            raise ConfigError(
                f"finish.average_last={finish.average_last} averages more checkpoints than "
                f"trainer.keep_last={trainer.keep_last} keeps: raise keep_last or lower average_last"
            )
        if finish.average_last > 1 and not (trainer.save_every_steps or trainer.save_every_minutes):
            raise ConfigError(
                f"finish.average_last={finish.average_last}: with trainer.save_every_steps and "
                "trainer.save_every_minutes both 0 only the last step is saved; set one of them, or "
                "finish.average_last=0"
            )
        super().check()


@dataclass
class DecodeConfig(SearchConfig, DecodingPrecision, DeviceConfig):
    """A checkpoint (or several: an ensemble) and how to decode with it: the search (§6.1) or sampling,
    the precision, the device, the batches."""

    checkpoint: str | list[str] | None = None  # a checkpoint file (it carries its tokenizer), or a list
    weights: list[float] | None = None  # an ensemble's weight per checkpoint (Marian's --weights); None: 1
    max_tokens: int = 4096  # padded source tokens per batch
    max_sentences: int = 256  # sentences per batch: bounds the decoder's cache on batches of short lines
    cuda_graphs: bool | None = None  # each search step one CUDA graph replay; None: on CUDA
    # a vocabulary map (CTranslate2's vmap format): each batch's outputs drawn from its candidates only
    vocabulary_map: str | None = None

    def check(self) -> None:
        if self.checkpoint is None:
            raise ConfigError("checkpoint=PATH is required (a .pt file written by train.py)")
        self.require_files("vocabulary_map")
        self.require_positive("max_tokens", "max_sentences")
        super().check()
        if self.precision == "int8" and (self.device.startswith("cuda") or self.cuda_graphs):
            raise ConfigError("precision=int8 runs on the CPU: not with device=cuda or cuda_graphs=true")
        paths = self.checkpoint if isinstance(self.checkpoint, list) else [self.checkpoint]
        self.require(len(paths) > 0, "checkpoint", "must name at least one file")
        if self.weights is not None:
            self.require(
                len(self.weights) == len(paths),
                "weights",
                f"must have one weight per checkpoint ({len(paths)})",
            )
            self.require(
                all(w >= 0 for w in self.weights) and sum(self.weights) > 0,
                "weights",
                "must be >= 0, not all 0",
            )


@dataclass
class GuideFiles(Settings):
    """Files that guide each line's search, a line per input line (or line of the split): what its
    output starts with, and the phrases its output contains (decoding/constraints.py)."""

    target_prefix: str | None = None  # a file of what each output starts with
    constraints: str | None = None  # a file of the phrases each output contains, separated by tabs


@dataclass
class TranslateConfig(DecodeConfig, GuideFiles):
    """`translate.py`: lines from `input` (default stdin) or one `text`, to `output` (default stdout)."""

    input: str | None = None  # a text file, one sentence per line; None = standard input
    output: str | None = None  # None = standard output; a file is written atomically (at the end)
    text: str | None = None  # one sentence to translate instead of the input
    output_format: str = (
        "text"  # "text" (the best, a line each) | "fairseq" | "jsonl" (transformer/formats.py)
    )
    score: str | None = (
        None  # a file of given translations, a line per input line, to score instead of search
    )
    constraints_inline: bool = False  # the phrases follow the source on its input line, after tabs (fairseq)
    buffer_size: int | None = None  # translate and write each N lines as they arrive; None: 1 from a terminal

    def check(self) -> None:
        super().check()
        if self.text is not None and self.input is not None:
            raise ConfigError("give either text=... or input=FILE, not both")
        self.require_choice("output_format", OUTPUT_FORMATS)
        if self.output_format == "text" and self.nbest > 1:
            raise ConfigError(
                f"output_format=text writes one translation per line: with nbest={self.nbest} choose "
                "output_format=jsonl or output_format=fairseq"
            )
        if self.score is not None and self.output_format == "text":
            raise ConfigError(
                "score=FILE writes each translation's log-probabilities: choose output_format=jsonl or "
                "output_format=fairseq"
            )
        if self.score is not None and self.sampling:
            raise ConfigError("score=FILE scores the translations given: not with sampling=true")
        if self.score is not None and self.target_prefix is not None:
            raise ConfigError("score=FILE scores the translations given: not with target_prefix=FILE")
        constrained = self.constraints is not None or self.constraints_inline
        if self.constraints is not None and self.constraints_inline:
            raise ConfigError(
                "constraints=FILE or constraints_inline=true: the phrases come from one of them"
            )
        if constrained and (self.sampling or self.score is not None):
            raise ConfigError("constraints shape a search: not with sampling=true or score=FILE")
        if self.alignment and self.output_format == "text":
            raise ConfigError(
                "alignment=true writes each translation's alignment: choose output_format=jsonl or "
                "output_format=fairseq"
            )
        self.require(self.buffer_size is None or self.buffer_size >= 1, "buffer_size", "must be at least 1")
        self.require_files("input", "score", "target_prefix", "constraints")  # before any checkpoint loads


@dataclass
class ServeConfig(DecodeConfig):
    """`scripts/serve.py`: a local HTTP endpoint (transformer/serving/server.py) and its limits."""

    host: str = "127.0.0.1"  # this machine only; 0.0.0.0 listens on every interface
    port: int = 8000
    # the Host header values served ("*": any); None: the loopback's names, and host's
    allowed_hosts: list[str] | None = None
    max_body_bytes: int = 1_000_000  # a larger request is refused (413)
    max_lines: int = 64  # lines per request (and per batch of requests)
    max_chars: int = 10_000  # characters per line
    batch_wait_ms: float = 10.0  # how long a batch waits for more requests after its first
    # source pieces x beam (or samples) x output limit (x nbest with attention), summed over the lines
    max_request_cost: int = 1_000_000
    max_queue: int = 256  # requests waiting for the model; more are answered 503 with Retry-After
    request_timeout_s: float = 60.0  # a request not answered by then gets 504 (and is dropped if not run)
    read_timeout_s: float = 10.0  # a request's head, and its body, arrive within this, or it is cut off
    keep_alive_s: float = 5.0  # an idle connection is closed after this
    max_connections: int = 256  # open connections; more are answered 503
    shutdown_timeout_s: float = 5.0  # SIGTERM: the work in flight finishes within this

    def check(self) -> None:
        super().check()
        self.require(0 <= self.port < 65536, "port", "must be in 0..65535 (0: any free port)")
        self.require_positive("max_body_bytes", "max_lines", "max_chars", "max_request_cost", "max_queue")
        self.require_positive("request_timeout_s", "read_timeout_s", "keep_alive_s", "max_connections")
        self.require(self.batch_wait_ms >= 0, "batch_wait_ms", "must be >= 0")
        self.require(self.shutdown_timeout_s >= 0, "shutdown_timeout_s", "must be >= 0")
        if self.allowed_hosts is None and not _loopback(self.host):
            raise ConfigError(
                f"host={self.host} serves other machines: name the hosts clients reach it by, "
                "allowed_hosts=[translate.example.org] (or allowed_hosts=['*'] behind a proxy that checks "
                "them)"
            )


def _loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class EvaluateConfig(DecodeConfig, GuideFiles):
    """`scripts/evaluate.py`: BLEU of a checkpoint on one split (role) of a corpus."""

    data: DataConfig = field(default_factory=DataConfig)
    split: str = "test"  # role: valid | test | train
    lowercase: bool | None = None  # also score lowercased; None = where the published figures are

    def check(self) -> None:
        super().check()
        self.require_choice("split", ROLES)
        self.require_files("target_prefix", "constraints")
        if self.constraints is not None and self.sampling:
            raise ConfigError("constraints shape a search: not with sampling=true")


@dataclass
class VisualizeConfig(DecodeConfig):
    """`scripts/visualize_attention.py`: attention heatmaps of one sentence and its translation."""

    precision: str = "fp32"  # the weights are plotted: fp32 keeps them exact
    text: str | None = None  # the sentence
    layer: int = -1  # which layer of each stack; negative counts from the last
    out_dir: str = "attention"  # PNGs: encoder_self.png, decoder_self.png, cross.png
    tensorboard: bool = False  # also write the figures to TensorBoard (in out_dir)

    def check(self) -> None:
        super().check()
        if not (self.text and self.text.strip()):
            raise ConfigError('text="..." is required: the sentence to translate')


@dataclass
class ExportConfig(Settings):
    """`scripts/export.py`: a checkpoint written out for CTranslate2 or Hugging Face `transformers`."""

    checkpoint: str | None = None  # a checkpoint file written by train.py
    format: str = "ctranslate2"  # "ctranslate2" | "huggingface"
    out: str | None = None  # the directory to write (new, or empty)
    quantization: str | None = None  # ctranslate2 only: "int8", "int8_float32", ... (None = float32)

    def check(self) -> None:
        if self.checkpoint is None:
            raise ConfigError("checkpoint=PATH is required (a .pt file written by train.py)")
        if self.out is None:
            raise ConfigError("out=DIR is required: the directory to write")
        self.require_choice("format", EXPORT_FORMATS)
        self.require(
            self.quantization is None or self.format == "ctranslate2",
            "quantization",
            "applies to format=ctranslate2 only",
        )
        super().check()


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
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None, X | Y | None
        if value is None:
            return None
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        for option in options[:-1]:  # the first the value fits, the last one's message otherwise
            try:
                return _typed(option, value, name)
            except ConfigError:
                pass
        hint = options[-1]
    kind = typing.get_origin(hint) or hint
    if kind is bool and not isinstance(value, bool):  # "maybe" or 1 would pass as truthy
        raise ConfigError(f"{name}={value!r} must be true or false")
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"{name}={value!r} must be a whole number")
    if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise ConfigError(f"{name}={value!r} must be a number")
    if kind is float:
        if not math.isfinite(value):  # inf and nan would pass every range check
            raise ConfigError(f"{name}={value!r} must be a finite number")
        return float(value)
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # Hydra reads name=2024 as a number
    names = {str: "a string", list: "a list", dict: "a mapping"}
    if kind in names and not isinstance(value, kind):
        raise ConfigError(f"{name}={value!r} must be {names[kind]}")
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """The inverse of `from_dict`: plain, JSON- and checkpoint-friendly values."""
    return dataclasses.asdict(obj)


def defaults(cls: type) -> dict[str, Any]:
    """Every setting of dataclass `cls` with its default, as plain nested values (the base the apps
    register with Hydra), without constructing `cls` (a DecodeConfig needs a checkpoint)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = defaults(hints[f.name])
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
        else:
            values[f.name] = f.default
    return values


def app_defaults(app: str) -> dict[str, Any]:
    """The defaults of a command-line app's settings, which it registers with Hydra as
    `<app>_defaults`, the first entry of configs/<app>.yaml's defaults list."""
    apps = {
        "train": TrainConfig,
        "translate": TranslateConfig,
        "evaluate": EvaluateConfig,
        "visualize": VisualizeConfig,
        "export": ExportConfig,
        "serve": ServeConfig,
    }
    if app == "prepare_data":
        return {"data": defaults(DataConfig)}
    return defaults(apps[app])


def known(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of `values` that name a setting of dataclass `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {key: value for key, value in values.items() if key in names}
