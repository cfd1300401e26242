"""The decode section: ours (beam_search, greedy as its beam of 1; on CUDA also in static shapes and
CUDA graphs), Hugging Face generate and CTranslate2 on the same random sources, exactly --new-tokens
outputs."""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from harness.measure import (
    FIRST_TOKEN,
    KERNELS_OFF,
    KERNELS_ON,
    Setup,
    interleave,
    ratio_spread,
    side_kernels,
)
from harness.peers import Ct2Process, MarianVocabulary, build_marian, ct2_convert
from transformer.config import ConfigError, DecodeConfig, ModelConfig, SearchConfig
from transformer.decoding import Shortlist, beam_search, search_weights, vocab_chunks
from transformer.inference.translation import rows
from transformer.kernels import Kernels
from transformer.kernels.timing import decoding_kernels
from transformer.model import Transformer
from transformer.utils.devices import decoding_dtype
from transformer.vocab import EOS_ID

POLICIES = ("ours, n-best 4", "ours, 4 samples (top-k 50)")
PRODUCTS, PRODUCTS_INT8 = "ours, products only", "ours int8, products only"  # the bounds on ours' speed
SIDE_ROWS = (*POLICIES, KERNELS_OFF, KERNELS_ON, PRODUCTS, PRODUCTS_INT8)  # compared with ours, not peers
SHORTLIST = "ours, {:,} candidates"  # --vocabulary-map K: also compared with ours only


def side_row(name: str) -> bool:
    return name in SIDE_ROWS or name.endswith(" candidates")


def decode_inputs(cfg: ModelConfig, n: int, src_len: int, seed: int) -> dict[str, Any]:
    """The same random source pieces for every decoder, each with its own EOS (ours 3, Marian 0)."""
    generator = torch.Generator().manual_seed(seed)
    pieces = torch.randint(FIRST_TOKEN, cfg.vocab_size - 1, (n, src_len - 1), generator=generator)
    ours = torch.cat([pieces, torch.full((n, 1), EOS_ID)], dim=1)  # (N, S)
    marian = torch.cat([pieces, torch.zeros(n, 1, dtype=torch.long)], dim=1)  # (N, S)
    tokens = [[MarianVocabulary.piece(i) for i in row] for row in marian.tolist()]
    return {"ours": ours, "marian": marian, "ct2": tokens}


def ours_decoder(
    model: Transformer, new_tokens: int, kernels: Kernels, graphs: bool = False, **policy: Any
) -> Callable[[Tensor, int], int]:
    """beam_search (§6.1's; a beam of 1 is greedy search) with exactly new_tokens outputs: L = 0 x |X| +
    new_tokens, and EOS suppressed through step new_tokens (min_len), with the kernels as translate.py
    hands them over. With graphs, in static shapes replaying each step as a CUDA graph, recorded anew for
    every call, as translate.py does for every batch. `policy`: SearchConfig's nbest or sampling
    settings. Returns the output tokens (of the best hypotheses)."""
    model = kernels.apply(model)

    def run(src: Tensor, beam: int) -> int:
        search = SearchConfig(beam_size=beam, max_len_a=0.0, max_len_b=new_tokens, **policy)
        result = beam_search(model, src, search, new_tokens, static=graphs, linear=kernels.products)
        return sum(len(tokens) for tokens in result.tokens)

    run.model, run.products = model, kernels.products  # section_decode packs its weights
    return run


def products_decoder(ours: Callable[[Tensor, int], int], new_tokens: int) -> Callable[[Tensor, int], int]:
    """The bound on the speed of the decoder `ours` (an `ours_decoder`): its search's linear maps alone,
    on the rows it multiplies and with its kernels and packed weights (the encoder's and the
    encoder-decoder keys and values once, then at every step the decoder's and the output projection's
    chunks), on random states; no attention, normalization, softmax, ranking or cache. Returns the
    output tokens ours would give."""
    model, products = ours.model, ours.products

    def run(src: Tensor, beam: int) -> int:
        (n, s), d = src.shape, model.cfg.d_model
        x, y = torch.randn(n, s, d), torch.randn(n * beam, 1, d)  # the encoder's rows, a step's rows
        vocab = model.embed.weight
        chunks = [vocab[start:end] for start, end in vocab_chunks(vocab.size(0), vocab.device)]
        for layer in model.encoder:
            layer.self_attn.w_qkv(x), layer.self_attn.w_o(x), layer.ffn(x)
        for layer in model.decoder:
            layer.cross_attn.w_kv(x)
        for _ in range(new_tokens):
            for layer in model.decoder:
                attn, cross = layer.self_attn, layer.cross_attn
                attn.w_qkv(y), attn.w_o(y), cross.w_q(y), cross.w_o(y), layer.ffn(y)
            for chunk in chunks:
                products(y[:, 0], chunk)
        return n * new_tokens

    return run


def shortlist_decoder(
    ours: Callable[[Tensor, int], int], new_tokens: int, k: int
) -> Callable[[Tensor, int], int]:
    """The decoder `ours` (an `ours_decoder`) with the shortlist of a vocabulary map that gives each batch
    k candidates: the special symbols and k - 4 other pieces, drawn once (what `vocabulary_map=FILE`
    saves at that many candidates; section_decode packs their weights)."""
    model, products = ours.model, ours.products
    vocab = model.cfg.vocab_size
    others = torch.randperm(vocab - EOS_ID - 1, generator=torch.Generator().manual_seed(0))[: k - EOS_ID - 1]
    ids = torch.cat([torch.arange(EOS_ID + 1), others.sort().values + EOS_ID + 1])
    shortlist = Shortlist.of(model, ids.to(model.embed.weight.device))

    def run(src: Tensor, beam: int) -> int:
        search = SearchConfig(beam_size=beam, max_len_a=0.0, max_len_b=new_tokens)
        result = beam_search(model, src, search, new_tokens, linear=products, shortlist=shortlist)
        return sum(len(tokens) for tokens in result.tokens)

    run.model, run.products = model, products
    run.weights = shortlist.chunks()
    return run


def ours_for(rows: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The row of ours a peer is compared with: ours int8 for int8 peers (None where it did not run),
    else the fastest of ours (the search's 1-best; the n-best and sampling rows are compared with it
    too)."""
    if "int8" in name:
        return next((r for r in rows if r["decoder"] == "ours int8"), None)
    plain = (r for r in rows if r["decoder"].startswith("ours") and "int8" not in r["decoder"])
    return max((r for r in plain if not side_row(r["decoder"])), key=lambda r: r["tokens_per_s"])


def hf_decoder(model: nn.Module, new_tokens: int) -> Callable[[Tensor, int], int]:
    """Hugging Face generate with min_new_tokens = max_new_tokens; returns the generated tokens."""

    @torch.inference_mode()
    def run(src: Tensor, beam: int) -> int:
        out = model.generate(
            input_ids=src,
            attention_mask=torch.ones_like(src),
            num_beams=beam,
            do_sample=False,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
        )
        return int((out[:, 1:] != model.config.pad_token_id).sum())  # the decoder start token excluded

    return run


def ct2_decoder(worker: Ct2Process, new_tokens: int) -> Callable[[list[list[str]], int], int]:
    """CTranslate2 translate_batch with min = max decoding length (EOS is not counted in it: outputs
    have exactly that many tokens; checked in the run)."""
    return lambda tokens, beam: worker.translate(tokens, beam, new_tokens)


def build_decoders(
    ours: Transformer,
    kernels: Kernels,
    cfg: ModelConfig,
    setup: Setup,
    peers: set[str],
    args: argparse.Namespace,
    workdir: Path,
    notes: list[str],
    cleanup: ExitStack,
) -> dict[str, tuple[str, Callable[[Any, int], int]]]:
    """name -> (which inputs it reads, run(inputs, beam) -> output tokens). Random weights, eval mode;
    bf16 models on CUDA, as translate.py runs them."""
    cuda = setup.device.type == "cuda"
    decoders = {"ours": ("ours", ours_decoder(ours, args.new_tokens, kernels))}
    if not cuda:
        decoders[PRODUCTS] = ("ours", products_decoder(decoders["ours"][1], args.new_tokens))
    # the search's other policies, beam 4 only (translate.py nbest=4; sampling=true nbest=4 topk=50)
    decoders[POLICIES[0]] = ("ours", ours_decoder(ours, args.new_tokens, kernels, nbest=4))
    sampling = {"sampling": True, "nbest": 4, "topk": 50}
    decoders[POLICIES[1]] = ("ours", ours_decoder(ours, args.new_tokens, kernels, **sampling))
    if args.vocabulary_map:
        shortlist = shortlist_decoder(decoders["ours"][1], args.new_tokens, args.vocabulary_map)
        decoders[SHORTLIST.format(args.vocabulary_map)] = ("ours", shortlist)
    for name, side in side_kernels(setup.device, kernels).items():  # the same search, cpu_kernels=off (=on)
        decoders[name] = ("ours", ours_decoder(ours, args.new_tokens, side))
    if not cuda:  # translate.py precision=int8, where it runs: a copy of the weights in 8 bits
        try:
            decoding_dtype("int8", setup.device)  # translate.py's own refusal (fbgemm: x86, AVX2)
            shapes = rows(DecodeConfig(checkpoint="-", device="cpu", precision="int8"))
            chosen = decoding_kernels(cfg, setup.device, "auto", True, *shapes)  # as translate.py's
            int8 = ours_decoder(copy.deepcopy(ours), args.new_tokens, chosen)
            decoders["ours int8"] = ("ours", int8)  # (section_decode packs them)
            decoders[PRODUCTS_INT8] = ("ours", products_decoder(int8, args.new_tokens))
        except ConfigError as error:
            notes.append(f"ours int8 left out: {error}")
    # on CUDA also ours as translate.py cuda_graphs=true runs it; last, so that the others have warmed
    # up first (a capture that raises drops this row with a note; one that broke the CUDA context would
    # fail the section, and the benchmark reports the sections it has)
    graphed = {"ours, CUDA graphs": ("ours", ours_decoder(ours, args.new_tokens, kernels, graphs=True))}
    graphed = graphed if cuda else {}
    if "marian" not in peers:
        if "ct2" in peers:
            notes.append("CTranslate2 converts the Marian model, which needs transformers: skipped")
        return decoders | graphed
    torch.manual_seed(args.seed)
    marian = build_marian(cfg).eval()
    hf = ("marian", hf_decoder(marian, args.new_tokens))
    if "ct2" in peers:
        converted = ct2_convert(marian, workdir)
        for compute in [args.ct2_compute] if cuda else ["float32", "int8", "int8_float32"]:
            try:
                worker = Ct2Process(converted, setup.device.type, compute, args.threads)
                cleanup.callback(worker.close)
                decoders[f"CTranslate2 {compute}"] = ("ct2", ct2_decoder(worker, args.new_tokens))
            except Exception as error:  # a peer's failure leaves it out, not the section
                notes.append(
                    f"CTranslate2 {compute} could not load the model on {setup.device.type}: {error!r}"
                )
    marian.to(setup.device, torch.bfloat16 if cuda else torch.float32)
    decoders["HF generate"] = hf
    return decoders | graphed


def bench_decode_mode(
    decoders: dict[str, tuple[str, Callable[[Any, int], int]]],
    beam: int,
    n: int,
    cfg: ModelConfig,
    setup: Setup,
    args: argparse.Namespace,
    notes: list[str],
) -> dict[str, Any]:
    """Every decoder on the same n sentences, interleaved run by run; medians. ours/this takes the
    fastest of ours (on CUDA: with or without CUDA graphs)."""
    inputs = decode_inputs(cfg, n, args.src_len, args.seed)
    inputs = {k: v.to(setup.device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
    few = n if setup.device.type == "cuda" else min(n, 4)  # a CPU needs no full-size warm-up
    for name, (key, run) in list(decoders.items()):
        try:
            run(inputs[key][:few], beam)
        except Exception as error:  # e.g. CTranslate2 missing the CUDA libraries it loads at run time
            if name == "ours":
                raise
            notes.append(f"{name} failed on {setup.device.type} and is left out: {error!r}")
            del decoders[name]
    runs = {name: (lambda _, k=key, run=run: run(inputs[k], beam)) for name, (key, run) in decoders.items()}
    times = interleave(runs, args.decode_rounds, setup.device, f"decode beam {beam}", args.time_box)
    rows = []
    for name, results in times.items():
        seconds = statistics.median(s for s, _ in results)
        tokens = results[0][1]
        if tokens != n * args.new_tokens:
            notes.append(f"{name} (beam {beam}) produced {tokens} tokens, not {n} x {args.new_tokens}")
        rows.append(
            {
                "decoder": name,
                "tokens_per_s": tokens / seconds,
                "sentences_per_s": n / seconds,
                "seconds": seconds,
                "output_tokens": tokens,
                "run_times_s": [s for s, _ in results],
            }
        )
    for r in rows:  # int8 rows against ours int8, the others against the fastest of ours (as the goals)
        ours = ours_for(rows, r["decoder"])  # the median of the rounds' ratios, and their range
        spread = (None, None, None) if ours is None else ratio_spread(ours["run_times_s"], r["run_times_s"])
        r["ours_over_this"], r["ours_over_this_range"] = spread[0], list(spread[1:])
    return {"beam": beam, "sentences": n, "src_len": args.src_len, "new_tokens": args.new_tokens} | {
        "rows": rows
    }


def section_decode(
    args: argparse.Namespace, cfg: ModelConfig, setup: Setup, peers: set[str], notes: list[str]
) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if setup.device.type == "cuda" else torch.float32  # as translate.py
    ours = Transformer(cfg).eval().to(setup.device, dtype)
    # as translate.py hands them over: on a CPU timed on this machine (at translate.py's default shapes)
    kernels = decoding_kernels(cfg, setup.device, "auto", False, *rows(DecodeConfig(checkpoint="-")))
    if setup.device.type == "cpu":
        notes.append(
            f"ours decodes with CPU kernels {kernels.describe()} (timed on this machine, as translate.py)"
        )
    with tempfile.TemporaryDirectory() as workdir, ExitStack() as cleanup:
        decoders = build_decoders(ours, kernels, cfg, setup, peers, args, Path(workdir), notes, cleanup)
        # ours as translate.py runs it: the decoder's weights packed for oneDNN once for all batches (on
        # a CPU; CTranslate2 packs its own when it loads the model), the int8 copy's in 8 bits
        packed = ExitStack()
        for name, int8 in (("ours", False), (KERNELS_ON, False), ("ours int8", True)):
            if name in decoders:
                run = decoders[name][1]
                packed.enter_context(run.products.prepacked(search_weights(run.model, int8), int8))
        if args.vocabulary_map:
            run = decoders[SHORTLIST.format(args.vocabulary_map)][1]
            packed.enter_context(run.products.prepacked(run.weights))
        greedy = {name: decoder for name, decoder in decoders.items() if name not in POLICIES}
        with torch.inference_mode(), packed:
            return {
                "beam4": bench_decode_mode(decoders, 4, args.beam_sentences, cfg, setup, args, notes),
                "greedy": bench_decode_mode(greedy, 1, args.greedy_sentences, cfg, setup, args, notes),
            }
