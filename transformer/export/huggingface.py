"""A checkpoint as a Hugging Face `transformers` directory: a MarianMTModel (the post-LN encoder-decoder
of the paper, sinusoidal positions, one shared embedding matrix) and a MarianTokenizer on the
checkpoint's SentencePiece model, so that `transformers.pipeline("translation", model=DIR)` translates.

Marian lays its sinusoids out as sin-half | cos-half, this model interleaved as §3.5 writes them. The
export permutes the d_model dimensions of the residual stream to Marian's order throughout (every
weight that reads or writes it, the layer norms, the shared embedding): the same function, to float
rounding. Marian's attention projections have biases; they are zero (§3.2.2 has none).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from transformer.config import ConfigError, ModelConfig
from transformer.data.tokenizer import Tokenizer
from transformer.model import Transformer
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID


def marian_config(cfg: ModelConfig, **overrides: Any) -> Any:
    """A MarianConfig of the model's dims: post-LN, ReLU, sinusoidal positions, x sqrt(d_model) (§3.4),
    one shared embedding matrix; this project's token ids unless `overrides` says otherwise."""
    from transformers import MarianConfig

    settings = dict(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        encoder_layers=cfg.n_layers,
        decoder_layers=cfg.n_layers,
        encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function="relu",
        max_position_embeddings=cfg.max_positions,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=EOS_ID,
    )
    return MarianConfig(**{**settings, **overrides})


def export_huggingface(model: Transformer, spm_model: bytes, out: Path) -> Path:
    """Write the MarianMTModel of `model` and its tokenizer to `out`; returns `out`."""
    from transformers import GenerationConfig, MarianMTModel, MarianTokenizer

    cfg = model.cfg
    _check_representable(model)
    marian = MarianMTModel(marian_config(cfg)).eval()
    missing, unexpected = marian.load_state_dict(marian_state_dict(model), strict=False)
    left = [k for k in missing if not k.endswith("embed_positions.weight")]  # Marian makes its own sinusoids
    if left or unexpected:
        raise RuntimeError(f"weights not mapped: missing {left}, unexpected {unexpected}")
    marian.generation_config = GenerationConfig(
        num_beams=4,  # §6.1 (Hugging Face's length penalty divides by |Y|^alpha, not GNMT's lp)
        max_length=cfg.max_positions,
        decoder_start_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        bad_words_ids=[[PAD_ID], [BOS_ID]],  # never generated, as in this project's search
    )
    marian.save_pretrained(out)
    with tempfile.TemporaryDirectory() as tmp:
        spm, vocab = Path(tmp) / "spm.model", Path(tmp) / "vocab.json"
        spm.write_bytes(spm_model)
        tokenizer = Tokenizer.from_bytes(spm_model)
        pieces = tokenizer.pieces(range(tokenizer.vocab_size))
        vocab.write_text(json.dumps({piece: i for i, piece in enumerate(pieces)}, ensure_ascii=False))
        special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
        MarianTokenizer(str(spm), str(spm), str(vocab), **special).save_pretrained(out)
    return out


def _check_representable(model: Transformer) -> None:
    cfg = model.cfg
    if cfg.moe_experts:
        raise ConfigError(f"MarianMTModel has no mixture of experts: model.moe_experts={cfg.moe_experts}")
    refusals = {
        "model.norm_first=true: MarianMTModel is post-LN": cfg.norm_first,
        "model.positional=learned: MarianMTModel's positions are sinusoidal": cfg.positional == "learned",
        f"model.n_kv_heads={cfg.n_kv_heads}: MarianMTModel has a key/value head per query head": (
            cfg.n_kv_heads != cfg.n_heads
        ),
        f"model.d_k={cfg.d_k}, d_v={cfg.d_v}: MarianMTModel's heads are d_model / n_heads wide": (
            cfg.d_k != cfg.d_model // cfg.n_heads or cfg.d_v != cfg.d_k
        ),
    }
    for reason, refused in refusals.items():
        if refused:
            raise ConfigError(
                f"this model cannot be a MarianMTModel: {reason}; format=ctranslate2 can take it"
            )


def marian_state_dict(model: Transformer) -> dict[str, Tensor]:
    """The model's weights under MarianMTModel's names, the residual dimensions in Marian's order."""
    d = model.cfg.d_model
    p = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # Marian dim j = this model's dim p[j]
    state: dict[str, Tensor] = {}
    embedding = model.embed.weight[:, p]
    for name in ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens", "lm_head"):
        state[f"{name}.weight"] = embedding
    state["final_logits_bias"] = torch.zeros(1, model.cfg.vocab_size)

    def reads(prefix: str, linear: torch.nn.Module, rows: slice = slice(None)) -> None:  # in: the residual
        state[f"{prefix}.weight"] = linear.weight[rows][:, p]
        bias = linear.bias if linear.bias is not None else torch.zeros(linear.weight.size(0))
        state[f"{prefix}.bias"] = bias[rows]

    def writes(prefix: str, linear: torch.nn.Module) -> None:  # out: the residual
        state[f"{prefix}.weight"] = linear.weight[p]
        state[f"{prefix}.bias"] = linear.bias[p] if linear.bias is not None else torch.zeros(d)

    def norm(prefix: str, layer_norm: torch.nn.LayerNorm) -> None:
        state[f"{prefix}.weight"], state[f"{prefix}.bias"] = layer_norm.weight[p], layer_norm.bias[p]

    def attention(prefix: str, attn: torch.nn.Module) -> None:
        q, k, v = (slice(a, b) for a, b in _blocks(attn.splits))
        if attn.cross:
            reads(f"{prefix}.q_proj", attn.w_q)
            reads(f"{prefix}.k_proj", attn.w_kv, slice(0, attn.splits[1]))
            reads(f"{prefix}.v_proj", attn.w_kv, slice(attn.splits[1], None))
        else:
            for name, rows in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                reads(f"{prefix}.{name}", attn.w_qkv, rows)
        writes(f"{prefix}.out_proj", attn.w_o)

    def ffn(prefix: str, layer: torch.nn.Module) -> None:
        reads(f"{prefix}.fc1", layer.ffn.w_1)
        writes(f"{prefix}.fc2", layer.ffn.w_2)
        norm(f"{prefix}.final_layer_norm", layer.res_ffn.norm)

    for i, layer in enumerate(model.encoder):
        attention(f"model.encoder.layers.{i}.self_attn", layer.self_attn)
        norm(f"model.encoder.layers.{i}.self_attn_layer_norm", layer.res_self.norm)
        ffn(f"model.encoder.layers.{i}", layer)
    for i, layer in enumerate(model.decoder):
        attention(f"model.decoder.layers.{i}.self_attn", layer.self_attn)
        norm(f"model.decoder.layers.{i}.self_attn_layer_norm", layer.res_self.norm)
        attention(f"model.decoder.layers.{i}.encoder_attn", layer.cross_attn)
        norm(f"model.decoder.layers.{i}.encoder_attn_layer_norm", layer.res_cross.norm)
        ffn(f"model.decoder.layers.{i}", layer)
    return {name: tensor.detach().float().contiguous() for name, tensor in state.items()}


def _blocks(splits: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each of the widths `splits`, one after the other."""
    ends = torch.tensor(splits).cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends))
