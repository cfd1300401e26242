"""The alignment error rate (AER, Och & Ney 2003) of a checkpoint's `alignment=true` word links on the
toy corpus's test split, against the gold links its generator knows (transformer/data/toy.py). Each
reference translation is force-decoded (`Translator.score`, as translate.py's score=FILE), so the
alignment scored is that of the gold sentence pair.

    python scripts/alignment_error.py runs/demo/checkpoints/checkpoint_average_last5.pt
    python scripts/alignment_error.py CHECKPOINT --gold-dir data/toy/gold   # also write the gold files

--gold-dir writes test.<src>, test.<tgt> and test.align, a line per pair: "i-j" a sure link and "ipj" a
possible one, source word i and target word j counted from 0 (docs/translating.md).
"""

import argparse
import re
from pathlib import Path

from transformer.checkpoint import CheckpointError
from transformer.config import ConfigError
from transformer.data.toy import generate_alignments, generate_pairs
from transformer.inference.alignment import alignment_error_rate, parse_gold
from transformer.inference.translation import Translator
from transformer.utils import atomic
from transformer.utils.cli import exit_with_error, log_to_stderr

Link = tuple[int, int]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint trained on the toy corpus (data=toy)")
    parser.add_argument("--gold-dir", type=Path, help="also write the test split and its gold links here")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    return parser.parse_args(argv)


def gold_split(data: dict) -> tuple[list[str], list[str], list[str]]:
    """The toy test split of a run's data settings: its sources, targets and gold lines (source-target)."""
    if data.get("source") != "toy":
        raise ConfigError(
            f"the checkpoint was trained on {data.get('name')!r}: gold links are the toy corpus's"
        )
    toy = data["toy"]
    english, german = zip(*generate_pairs(toy["n_test"], toy["seed"]))
    gold = generate_alignments(toy["n_test"], toy["seed"])  # English-German
    if data["src_lang"] == "en":
        return list(english), list(german), gold
    return list(german), list(english), [transposed(line) for line in gold]


def transposed(line: str) -> str:
    """A gold line with its two sides swapped: "i-j" -> "j-i", "ipj" -> "jpi"."""
    return re.sub(r"(\d+)([-p])(\d+)", r"\3\2\1", line)


def scores(predicted: list[set[Link]], gold: list[str]) -> dict[str, float]:
    """AER, precision against P and recall of S, over the corpus."""
    sure, possible = map(list, zip(*map(parse_gold, gold)))
    found = sum(map(len, predicted))
    precision = sum(len(a & p) for a, p in zip(predicted, possible)) / found
    recall = sum(len(a & s) for a, s in zip(predicted, sure)) / sum(map(len, sure))
    return {"aer": alignment_error_rate(predicted, sure, possible), "precision": precision, "recall": recall}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log_to_stderr()
    try:
        translator = Translator.from_checkpoint(args.checkpoint, device=args.device, alignment=True)
        data = translator.info["config"]["data"]
        sources, targets, gold = gold_split(data)
        if args.gold_dir is not None:
            args.gold_dir.mkdir(parents=True, exist_ok=True)
            names = {
                f"test.{data['src_lang']}": sources,
                f"test.{data['tgt_lang']}": targets,
                "test.align": gold,
            }
            for name, lines in names.items():
                atomic.write_bytes(
                    args.gold_dir / name, "".join(f"{line}\n" for line in lines).encode("utf-8")
                )
        scored = translator.score(sources, targets)
        predicted = [set(t.alignment.words) if t is not None and t.alignment else set() for t in scored]
        result = scores(predicted, gold)
        print(
            f"AER {100 * result['aer']:.1f}% (precision {100 * result['precision']:.1f}%, recall "
            f"{100 * result['recall']:.1f}%) on {len(gold)} sentence pairs of the toy test split"
        )
    except (ConfigError, CheckpointError, OSError) as error:
        exit_with_error(error)


if __name__ == "__main__":
    main()
