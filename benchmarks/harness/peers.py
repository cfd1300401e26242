"""The contenders besides ours: torch.nn.Transformer and Hugging Face Marian with the paper's embeddings
and loss (train), and CTranslate2 in a process of its own (decode); ours wrapped to the same interface."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from transformer.config import ModelConfig
from transformer.export import huggingface
from transformer.kernels import Kernels
from transformer.layers import sinusoidal_table
from transformer.model import Transformer
from transformer.training.loss import Seq2SeqLoss
from transformer.vocab import PAD_ID


class OursObjective(nn.Module):
    """The project's training objective, Seq2SeqLoss; returns the summed smoothed loss only."""

    def __init__(self, cfg: ModelConfig, label_smoothing: float, kernels: Kernels | None = None) -> None:
        super().__init__()
        kernels = Kernels() if kernels is None else kernels  # as training hands them over
        self.objective = Seq2SeqLoss(kernels.apply(Transformer(cfg)), label_smoothing, kernels.products)

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        return self.objective(src, tgt_in, tgt_out)[0]


def smoothed_loss_sum(logits: Tensor, tgt_out: Tensor, label_smoothing: float) -> Tensor:
    """The peers' loss: torch's label-smoothed cross-entropy, summed over non-pad targets."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),  # (B * T, V)
        tgt_out.reshape(-1),
        ignore_index=PAD_ID,
        label_smoothing=label_smoothing,
        reduction="sum",
    )


class TorchTransformerPeer(nn.Module):
    """torch.nn.Transformer (post-LN, ReLU; it adds a final LayerNorm to each stack) with the paper's
    embeddings: one matrix for source, target and output projection (§3.4), x sqrt(d_model),
    sinusoidal positions (§3.5), and the paper's dropout only (§5.4)."""

    def __init__(self, cfg: ModelConfig, label_smoothing: float) -> None:
        super().__init__()
        self.d_model, self.label_smoothing = cfg.d_model, label_smoothing
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
        self.register_buffer("table", sinusoidal_table(cfg.max_positions, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.core = nn.Transformer(
            cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.n_layers, cfg.d_ff, cfg.dropout, batch_first=True
        )
        # The paper's dropout only (§5.4: sub-layer outputs and embedding sums, as ours and Marian's):
        # nn.Transformer's one rate would also drop attention weights and the feed-forward's ReLU output.
        for layer in [*self.core.encoder.layers, *self.core.decoder.layers]:
            layer.dropout.p = 0.0  # the feed-forward's inner dropout
            for attention in (getattr(layer, "self_attn", None), getattr(layer, "multihead_attn", None)):
                if attention is not None:
                    attention.dropout = 0.0

    def _embed(self, tokens: Tensor) -> Tensor:
        positions = self.table[: tokens.size(1)]
        return self.dropout(self.embed(tokens) * math.sqrt(self.d_model) + positions)  # (B, T, d_model)

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        src_pad = src == PAD_ID  # (B, S), True = padding
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), device=src.device)
        states = self.core(
            self._embed(src),
            self._embed(tgt_in),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return smoothed_loss_sum(states @ self.embed.weight.t(), tgt_out, self.label_smoothing)


def marian_config(cfg: ModelConfig) -> Any:
    """A MarianConfig of the same dims: post-LN, ReLU, sinusoidal positions, x sqrt(d_model), one shared
    embedding. Marian's own ids: eos 0, unk 1, pad (and decoder start) V - 1; it adds biases the paper's
    attention has not."""
    v = cfg.vocab_size
    return huggingface.marian_config(
        cfg,
        decoder_vocab_size=v,
        dropout=cfg.dropout,  # where the paper drops out; not in attention or the FFN
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=v - 1,
        eos_token_id=0,
        decoder_start_token_id=v - 1,
        forced_eos_token_id=None,
    )


def build_marian(cfg: ModelConfig) -> nn.Module:
    from transformers import MarianMTModel

    return MarianMTModel._from_config(marian_config(cfg), attn_implementation="sdpa")


class MarianPeer(nn.Module):
    """Hugging Face MarianMTModel (sdpa attention) with torch's label-smoothed cross-entropy."""

    def __init__(self, cfg: ModelConfig, label_smoothing: float) -> None:
        super().__init__()
        self.marian, self.label_smoothing = build_marian(cfg), label_smoothing

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        out = self.marian(
            input_ids=src, attention_mask=(src != PAD_ID).long(), decoder_input_ids=tgt_in, use_cache=False
        )
        return smoothed_loss_sum(out.logits, tgt_out, self.label_smoothing)


def available_peers(args: argparse.Namespace, notes: list[str]) -> set[str]:
    """The requested peers whose packages import; a note for each one skipped."""
    peers = set(args.peers)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally; never wait on the network
    for peer, module in (("marian", "transformers"), ("ct2", "ctranslate2")):
        if peer not in peers:
            continue
        try:
            __import__(module)
        except ImportError:
            peers.discard(peer)
            notes.append(f"{module} is not installed: {peer} skipped (pip install -e '.[bench]')")
    if "marian" in peers:
        import transformers

        transformers.logging.set_verbosity_error()
    return peers


class MarianVocabulary:
    """What CTranslate2's converter reads from a tokenizer: id -> piece, eos and unk. Piece i is "t<i>",
    except Marian's eos 0, unk 1 and pad V - 1 (dropped by the converter, as Marian's own vocabulary)."""

    eos_token, unk_token = "</s>", "<unk>"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @staticmethod
    def piece(i: int) -> str:
        return {0: "</s>", 1: "<unk>"}.get(i, f"t{i}")

    def get_vocab(self) -> dict[str, int]:
        vocab = {self.piece(i): i for i in range(self.vocab_size - 1)}
        vocab["<pad>"] = self.vocab_size - 1
        return vocab


def ct2_convert(marian: nn.Module, workdir: Path) -> str:
    """Convert the (float32, CPU) Marian model with ctranslate2's TransformersConverter; returns its path."""
    from ctranslate2.converters import TransformersConverter

    class InMemoryConverter(TransformersConverter):
        """The converter, fed this model and vocabulary instead of loading them from the hub."""

        def load_model(self, model_class: Any, path: str, **kwargs: Any) -> nn.Module:
            return marian

        def load_tokenizer(self, tokenizer_class: Any, path: str, **kwargs: Any) -> MarianVocabulary:
            return MarianVocabulary(marian.config.vocab_size)

    marian.config.save_pretrained(workdir / "hf")  # the converter reads the config from disk
    return InMemoryConverter(str(workdir / "hf")).convert(str(workdir / "ct2"), force=True)


# The CTranslate2 decoder's own process: one JSON request per line in, one reply per line out.
CT2_WORKER = """
import json, sys
import ctranslate2
model, device, compute_type, threads = sys.argv[1:5]
translator = ctranslate2.Translator(
    model, device=device, compute_type=compute_type, inter_threads=1, intra_threads=int(threads)
)
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    try:
        results = translator.translate_batch(
            job["tokens"], beam_size=job["beam"], min_decoding_length=job["new_tokens"],
            max_decoding_length=job["new_tokens"], max_batch_size=0,
        )
        print(json.dumps({"tokens": sum(len(r.hypotheses[0]) for r in results)}), flush=True)
    except RuntimeError as error:
        print(json.dumps({"error": str(error)}), flush=True)
"""


class Ct2Process:
    """CTranslate2 in a process of its own. Sharing one made both slower: in a process where CTranslate2
    had translated once, our beam search ran 11% slower for good (1.87 -> 2.08 s per run, base dims,
    2 threads; Hugging Face's generate left it unchanged), and CTranslate2 took 2.4-2.6 s per run there
    against 2.1 s alone."""

    def __init__(self, model: str, device: str, compute_type: str, threads: int) -> None:
        command = [sys.executable, "-c", CT2_WORKER, model, device, compute_type, str(threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":  # its traceback went to stderr
            raise RuntimeError(f"CTranslate2 could not load the model (exit status {self.process.wait()})")

    def close(self) -> None:
        """End the process: its stdin closes, its loop ends."""
        self.process.stdin.close()
        self.process.wait(timeout=60)

    def translate(self, tokens: list[list[str]], beam: int, new_tokens: int) -> int:
        """Translate with min = max decoding length; returns the output tokens."""
        request = {"tokens": tokens, "beam": beam, "new_tokens": new_tokens}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline() or '{"error": "the CTranslate2 process ended"}')
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["tokens"]
