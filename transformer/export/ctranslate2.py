"""A checkpoint as a CTranslate2 model directory, built with ctranslate2's own specification and
converter API: `ctranslate2.Translator(DIR)` then translates the SentencePiece pieces of `DIR/spm.model`.

Post-LN (the paper) and pre-LN, shared embeddings, sinusoidal or learned positions (their table),
grouped-query attention. The layouts match: CTranslate2 also keeps W^Q, W^K, W^V of self-attention as one
matrix and W^K, W^V of encoder-decoder attention as another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformer.config import ConfigError, ModelConfig
from transformer.data.tokenizer import Tokenizer
from transformer.model import Transformer

QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "float16", "bfloat16")


def export_ctranslate2(model: Transformer, spm_model: bytes, out: Path, quantization: str | None) -> Path:
    """Write the CTranslate2 model of `model` and its tokenizer to `out`; returns `out`."""
    from ctranslate2.converters.converter import Converter

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization={quantization} must be one of {', '.join(QUANTIZATIONS)} or null")
    if model.cfg.d_k != model.cfg.d_v:
        raise ConfigError(f"CTranslate2 has one head size: model.d_k={model.cfg.d_k} != d_v={model.cfg.d_v}")
    if model.cfg.moe_experts:
        experts = model.cfg.moe_experts
        raise ConfigError(f"CTranslate2's Transformer has no mixture of experts: model.moe_experts={experts}")

    class CheckpointConverter(Converter):
        def _load(self) -> Any:
            return model_spec(model, Tokenizer.from_bytes(spm_model))

    CheckpointConverter().convert(str(out), quantization=quantization, force=True)
    (out / "spm.model").write_bytes(spm_model)
    return out


def model_spec(model: Transformer, tokenizer: Tokenizer) -> Any:
    """ctranslate2's TransformerSpec holding the model's weights and its vocabulary."""
    from ctranslate2.specs import transformer_spec

    cfg = model.cfg
    shape = dict(
        pre_norm=cfg.norm_first,
        num_heads_kv=cfg.n_kv_heads if cfg.n_kv_heads != cfg.n_heads else None,
        head_dim=cfg.d_k if cfg.d_k != cfg.d_model // cfg.n_heads else None,
    )
    encoder = transformer_spec.TransformerEncoderSpec(cfg.n_layers, cfg.n_heads, **shape)
    decoder = transformer_spec.TransformerDecoderSpec(cfg.n_layers, cfg.n_heads, **shape)
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    spec.config.layer_norm_epsilon = model.encoder[0].res_self.norm.eps
    spec.config.add_source_eos = True  # a source is its pieces + EOS
    spec.config.decoder_start_token = "<s>"  # BOS
    _set_stack(encoder, model, cfg, "encoder")
    _set_stack(decoder, model, cfg, "decoder")
    decoder.projection.weight = _array(model.embed.weight)  # §3.4: the embedding matrix, shared
    pieces = tokenizer.pieces(range(tokenizer.vocab_size))
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    return spec


def _set_stack(spec: Any, model: Transformer, cfg: ModelConfig, stack: str) -> None:
    embeddings = spec.embeddings[0] if stack == "encoder" else spec.embeddings  # the encoder has a list
    embeddings.weight = _array(model.embed.weight)  # multiplied by sqrt(d_model): scale_embeddings
    table = model.embed.learned.weight if model.embed.learned is not None else model.embed.table
    spec.position_encodings.encodings = _array(table)
    if cfg.norm_first:  # pre-LN's final LayerNorm
        _set_norm(spec.layer_norm, model.encoder_norm if stack == "encoder" else model.decoder_norm)
    for layer_spec, layer in zip(spec.layer, model.encoder if stack == "encoder" else model.decoder):
        _set_attention(layer_spec.self_attention, [layer.self_attn.w_qkv, layer.self_attn.w_o])
        _set_norm(layer_spec.self_attention.layer_norm, layer.res_self.norm)
        if stack == "decoder":
            cross = layer.cross_attn
            _set_attention(layer_spec.attention, [cross.w_q, cross.w_kv, cross.w_o])
            _set_norm(layer_spec.attention.layer_norm, layer.res_cross.norm)
        for linear_spec, linear in (
            (layer_spec.ffn.linear_0, layer.ffn.w_1),
            (layer_spec.ffn.linear_1, layer.ffn.w_2),
        ):
            linear_spec.weight, linear_spec.bias = _array(linear.weight), _array(linear.bias)
        _set_norm(layer_spec.ffn.layer_norm, layer.res_ffn.norm)


def _set_attention(spec: Any, linears: list[torch.nn.Linear]) -> None:
    for linear_spec, linear in zip(spec.linear, linears):
        linear_spec.weight = _array(linear.weight)  # no biases (§3.2.2)


def _set_norm(spec: Any, norm: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _array(norm.weight), _array(norm.bias)


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy().copy()
