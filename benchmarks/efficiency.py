"""The three efficiency routes of attention models, measured side by side in this code:

attention  fused attention (`attention`: PyTorch's scaled_dot_product_attention) against Eq. 1 written
           out (`reference_attention`, which holds the n x n weights): self-attention of one sentence,
           8 heads of 64, forward only; median time, peak memory above the inputs, the fitted growth
           exponent of each against the length, and the largest difference of the outputs;
kv         grouped-query and multi-query attention (`model.n_kv_heads` = h, h/2, h/4, 1) at the base
           dimensions: bytes of the decoder's key/value cache per sentence, read from the cache itself,
           and beam-4 output tokens/s at two output lengths (random weights, EOS suppressed);
moe        a mixture-of-experts feed-forward network (`model.moe_experts`) against the dense one at equal
           active feed-forward parameters per token: parameters in total and active, training tokens/s.

    python benchmarks/efficiency.py --device cpu --threads 2 --json efficiency.json --plot docs/efficiency.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness.decode import decode_inputs, ours_decoder
from harness.measure import interleave, make_setup, peak_memory, timed
from harness.report import print_table

from transformer.attention import attention, reference_attention
from transformer.config import ModelConfig
from transformer.decoding import search_weights
from transformer.decoding.cache import DecoderCache
from transformer.kernels import Kernels
from transformer.model import Transformer
from transformer.moe import MixtureOfExperts
from transformer.training.loss import Seq2SeqLoss
from transformer.utils import atomic

HEADS, HEAD_DIM = 8, 64
SIZES = {"base": {}, "tiny": dict(d_model=64, d_ff=128, n_layers=2)}  # tiny: for the tests; 8 heads in both


def growth(lengths: list[int], values: list[float]) -> float:
    """The exponent p of value ~ length^p, fitted over the longer half of the lengths."""
    half = len(lengths) // 2
    return float(np.polyfit(np.log(lengths[half:]), np.log(values[half:]), 1)[0])


def section_attention(device: torch.device, max_len: int, repeats: int) -> dict[str, Any]:
    rows, lengths = [], []
    length = 64
    while length <= max_len:
        q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, device=device) for _ in range(3))
        row: dict[str, Any] = {"length": length}
        with torch.no_grad():
            fused_out = attention(q, k, v, None, False, 0.0)
            written_out, _ = reference_attention(q, k, v, None, False, 0.0)
            row["max_diff"] = (fused_out - written_out).abs().max().item()
            del fused_out, written_out
            for name, fn in (("fused", attention), ("written", reference_attention)):
                with peak_memory(device) as memory:
                    seconds = [
                        timed(lambda fn=fn, qkv=(q, k, v): fn(*qkv, None, False, 0.0), device)[0]
                        for _ in range(repeats)
                    ]
                row[f"{name}_ms"] = 1e3 * statistics.median(seconds)
                row[f"{name}_mib"] = memory["mib"]
        rows.append(row)
        lengths.append(length)
        length *= 2
    fits = {
        f"{name}_{what}_exponent": growth(lengths, [max(r[f"{name}_{what}"] or 1e-3, 1e-3) for r in rows])
        for name in ("fused", "written")
        for what in ("ms", "mib")
    }
    print_table(
        f"attention, self, 1 sentence x {HEADS} heads x {HEAD_DIM}, forward; fitted exponents {fits}",
        [
            ("length", "length", "d"),
            ("fused ms", "fused_ms", ".2f"),
            ("written-out ms", "written_ms", ".2f"),
            ("fused MiB", "fused_mib", ".1f"),
            ("written-out MiB", "written_mib", ".1f"),
            ("max |diff|", "max_diff", ".1e"),
        ],
        rows,
    )
    return {"rows": rows, **fits}


def cache_bytes(model: Transformer, src_len: int, out_len: int) -> tuple[int, int]:
    """Bytes of one sentence's decoder cache: (self-attention keys and values for out_len positions,
    encoder-decoder keys and values for src_len source tokens), read from a DecoderCache."""
    memory = torch.zeros(1, src_len, model.cfg.d_model)
    cache = DecoderCache(model, memory, torch.ones(1, src_len, dtype=torch.bool), 1, out_len, static=False)
    size = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    cross = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.cross)
    return size, cross


def section_kv(setup: Any, args: argparse.Namespace) -> dict[str, Any]:
    rows, runs, packed = [], {}, ExitStack()
    for kv in (HEADS, HEADS // 2, HEADS // 4, 1):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=args.vocab, n_kv_heads=kv, dropout=0.0, **SIZES[args.size])
        model = Transformer(cfg).eval().to(setup.device)
        kernels = Kernels.choose(setup.device)  # as translate.py hands them over
        self_bytes, cross_bytes = cache_bytes(model, args.src_len, max(args.new_tokens))
        rows.append(
            {
                "n_kv_heads": kv,
                "self_per_token": self_bytes / max(args.new_tokens),
                "cross_per_token": cross_bytes / args.src_len,
            }
        )
        src = decode_inputs(cfg, args.sentences, args.src_len, seed=1)["ours"].to(setup.device)
        for new_tokens in args.new_tokens:
            run = ours_decoder(model, new_tokens, kernels)
            runs[f"{kv}/{new_tokens}"] = lambda i, run=run, src=src: run(src, 4)
        packed.enter_context(kernels.products.prepacked(search_weights(run.model)))
    with torch.inference_mode(), packed:
        results = interleave(runs, args.rounds, setup.device, "beam 4")
    for row in rows:
        for n in args.new_tokens:
            timings = results[f"{row['n_kv_heads']}/{n}"]
            row[f"tokens_per_s_{n}"] = timings[0][1] / statistics.median(t for t, _ in timings)
            # 4 beams per sentence, each with its own self-attention cache; one cross-attention cache
            per_sentence = 4 * row["self_per_token"] * n + row["cross_per_token"] * args.src_len
            row[f"cache_mib_{n}"] = args.sentences * per_sentence / 2**20
    columns = [
        ("n_kv_heads", "n_kv_heads", "d"),
        ("self KV bytes / output token", "self_per_token", ",.0f"),
        ("cross KV bytes / source token", "cross_per_token", ",.0f"),
    ]
    for n in args.new_tokens:
        columns += [
            (f"cache MiB ({n} out)", f"cache_mib_{n}", ".1f"),
            (f"tok/s ({n} out)", f"tokens_per_s_{n}", ",.0f"),
        ]
    title = f"decoding, {args.size} dims, beam 4, {args.sentences} sentences x {args.src_len} source tokens"
    print_table(title, columns, rows)
    return {"sentences": args.sentences, "src_len": args.src_len, "rows": rows}


def section_moe(setup: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The dense FFN against 4 experts of half its width with top-2 and 8 experts of its width with
    top-1 (Switch): the same feed-forward parameters active per token."""
    d_ff = ModelConfig(**SIZES[args.size]).d_ff
    variants = {
        "dense (the paper)": {},
        f"4 experts x d_ff {d_ff // 2}, top-2": dict(moe_experts=4, moe_top_k=2, d_ff=d_ff // 2),
        f"8 experts x d_ff {d_ff}, top-1": dict(moe_experts=8, moe_top_k=1),
    }
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(4, args.vocab, (args.batch, args.length), generator=generator).to(setup.device)
    tgt = torch.randint(4, args.vocab, (args.batch, args.length + 1), generator=generator).to(setup.device)
    runs, rows = {}, []
    for name, change in variants.items():
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=args.vocab, **{**SIZES[args.size], **change})
        kernels = Kernels.choose(setup.device)  # as training hands them over
        model = kernels.apply(Transformer(cfg).to(setup.device))
        objective = Seq2SeqLoss(model, 0.1, kernels.products).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)

        def step(_: int, objective=objective, optimizer=optimizer, model=model) -> float:
            with setup.autocast():
                loss, _, figures = objective(src, tgt[:, :-1], tgt[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(figures["moe_dropped"]) if figures else 0.0

        step(0)  # warm-up: Adam's state, the kernels' first calls
        runs[name] = step
        total = active = model.num_parameters()
        for mixture in (m for m in model.modules() if isinstance(m, MixtureOfExperts)):  # k experts of E
            experts = sum(p.numel() for p in mixture.experts.parameters())
            active -= experts - experts // len(mixture.experts) * mixture.top_k
        rows.append({"model": name, "params_m": total / 1e6, "active_m": active / 1e6})
    results = interleave(runs, args.rounds, setup.device, "training steps")
    tokens = args.batch * args.length
    for row in rows:
        timings = results[row["model"]]
        row["tokens_per_s"] = tokens / statistics.median(t for t, _ in timings)
        row["dropped"] = statistics.mean(d for _, d in timings)
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    print_table(
        f"training step, {args.size} dims, {args.batch} x {args.length} tokens, fp32 (capacity factor 1.25)",
        [
            ("model", "model", ""),
            ("parameters M", "params_m", ".1f"),
            ("active per token M", "active_m", ".1f"),
            ("target tokens/s", "tokens_per_s", ",.0f"),
            ("/ dense", "ratio", ".2f"),
            ("assignments dropped", "dropped", ".1%"),
        ],
        rows,
    )
    return {"batch": args.batch, "length": args.length, "rows": rows}


def plot(result: dict[str, Any], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["attention"]["rows"]
    lengths = [r["length"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, what, title in zip(axes, ("ms", "mib"), ("time (ms)", "peak memory above the inputs (MiB)")):
        for name, label in (("fused", "fused (SDPA)"), ("written", "written out (Eq. 1)")):
            ax.plot(lengths, [r[f"{name}_{what}"] for r in rows], "o-", label=label)
        ax.set(xscale="log", yscale="log", xlabel="sequence length", title=f"self-attention: {title}")
    axes[0].legend()
    fig.tight_layout()
    with atomic.writing(output) as file:
        fig.savefig(file, format="png", dpi=100)
    print(f"wrote {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=list(SIZES), default="base", help="model dimensions (kv, moe)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--sections", default="attention,kv,moe")
    parser.add_argument(
        "--max-len", type=int, default=8192, help="longest attention length (doubling from 64)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="attention timings per length")
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--src-len", type=int, default=30)
    parser.add_argument("--sentences", type=int, default=8, help="decoded at once, 4 beams each")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[40, 200])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each model")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="attention time and memory against length (PNG)")
    args = parser.parse_args()
    setup = make_setup(args.device, args.threads)
    sections = args.sections.split(",")
    result: dict[str, Any] = {"device": args.device, "threads": args.threads, "torch": torch.__version__}
    if "attention" in sections:
        result["attention"] = section_attention(setup.device, args.max_len, args.repeats)
    if "kv" in sections:
        result["kv"] = section_kv(setup, args)
    if "moe" in sections:
        result["moe"] = section_moe(setup, args)
    if args.json:
        atomic.write_bytes(args.json, json.dumps(result, indent=1).encode("utf-8"))
        print(f"wrote {args.json}")
    if args.plot and "attention" in result:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
