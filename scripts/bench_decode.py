"""Beam-search decoding speed against Hugging Face's MarianMTModel.generate, side by side in one run.

  python scripts/bench_decode.py [--threads 2] [--batch 32] [--new-tokens 40] [--precision fp32|bf16]

Both models are the paper's base size (N=6, d_model=512, d_ff=2048, h=8, vocab 37000) with random
weights, on the CPU, both in float32 (or both in bfloat16 with --precision bf16). Both decode the
same batch with beam 4 and exactly `new_tokens` output tokens (EOS suppressed until then), so they
run the same number of decoder steps. Reported: output tokens per second (batch x new tokens /
seconds, the best of `repeats` alternating runs) and the ratio. Needs `transformers`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also runs from a checkout not pip-installed

from transformer.config import ModelConfig  # noqa: E402
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID  # noqa: E402
from transformer.decoding import beam_search  # noqa: E402
from transformer.model import Transformer  # noqa: E402


def marian_like(cfg: ModelConfig):
    """A MarianMTModel of the same shape: post-LN, ReLU, sinusoidal positions, scaled shared embeddings."""
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, activation_function="relu",
        encoder_layers=cfg.n_layers, decoder_layers=cfg.n_layers,
        encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, max_position_embeddings=cfg.max_positions,
        scale_embedding=True, pad_token_id=PAD_ID, eos_token_id=EOS_ID, decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )
    return MarianMTModel(config).eval()


def run(threads: int = 2, batch: int = 32, src_len: int = 30, new_tokens: int = 40, beam_size: int = 4,
        repeats: int = 2, vocab_size: int = 37000, precision: str = "fp32") -> dict:
    """Time both decoders on one batch; returns tokens/s of each and their ratio (ours / Hugging Face).
    precision "fp32" or "bf16": the weights of both models (our scores still add up in float32)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    cfg = ModelConfig(vocab_size=vocab_size, dropout=0.0)
    ours = Transformer(cfg).eval().to(dtype)
    theirs = marian_like(cfg).to(dtype)
    src = torch.randint(4, vocab_size, (batch, src_len))
    src[:, -1] = EOS_ID  # src_len tokens: pieces + EOS

    def decode_ours() -> None:
        beam_search(ours, src, beam_size, alpha=0.6, max_len_a=0.0, max_len_b=new_tokens, min_len=new_tokens)

    @torch.inference_mode()
    def decode_theirs() -> None:
        theirs.generate(
            input_ids=src, attention_mask=torch.ones_like(src), num_beams=beam_size, do_sample=False,
            min_new_tokens=new_tokens, max_new_tokens=new_tokens, length_penalty=0.6,
        )

    decoders = {"ours": decode_ours, "hf_marian": decode_theirs}
    seconds: dict[str, list[float]] = {name: [] for name in decoders}
    for fn in decoders.values():
        fn()  # warm-up: allocator, kernels, lazy imports
    for _ in range(repeats):  # alternate, so that a busy moment on the machine hits both alike
        for name, fn in decoders.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    out = {}
    for name, times in seconds.items():
        out[f"{name}_seconds"] = min(times)
        out[f"{name}_tokens_per_s"] = batch * new_tokens / min(times)
    out["ratio"] = out["ours_tokens_per_s"] / out["hf_marian_tokens_per_s"]
    out.update(threads=threads, batch=batch, src_len=src_len, new_tokens=new_tokens, beam_size=beam_size,
               precision=precision, torch=torch.__version__,
               transformers=__import__("transformers").__version__)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src-len", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    result = run(args.threads, args.batch, args.src_len, args.new_tokens, repeats=args.repeats,
                 precision=args.precision)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
