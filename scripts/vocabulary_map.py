"""Write a vocabulary map (CTranslate2's vmap format) from a prepared corpus's training pairs, for
`vocabulary_map=FILE` (docs/translating.md#vocabulary-map): the most frequent target pieces, always
allowed, and per source piece the target pieces most often found in the same pair.

    python scripts/vocabulary_map.py data/toy --output data/toy/vmap.txt
    python scripts/vocabulary_map.py data/wmt14 --output vmap.txt --per-source 50 --max-pairs 1000000

The corpus is a run's `data.path` (prepare_data.py's output): the map is in its tokenizer's pieces.
The counts take ~16 bytes per distinct (source piece, target piece) pair seen together, a number that
grows with the pairs read: --max-pairs bounds it on a large corpus.
"""

import argparse
import itertools
from pathlib import Path

from transformer.config import ConfigError
from transformer.data.dataset import ShardDataset
from transformer.data.tokenizer import Tokenizer
from transformer.inference import vocabulary_map
from transformer.utils.cli import exit_with_error, log_to_stderr


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, help="a prepared corpus (prepare_data.py's output directory)")
    parser.add_argument("--output", type=Path, required=True, help="the map file to write")
    parser.add_argument("--always", type=int, default=100, help="target pieces always allowed (100)")
    parser.add_argument("--per-source", type=int, default=100, help="target pieces per source piece (100)")
    parser.add_argument("--max-pairs", type=int, default=None, help="read the first N training pairs only")
    args = parser.parse_args(argv)
    for key in ("always", "per_source", "max_pairs"):
        value = getattr(args, key)
        if value is not None and value < (0 if key == "always" else 1):
            parser.error(f"--{key.replace('_', '-')} must be {'>= 0' if key == 'always' else 'positive'}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log_to_stderr()
    try:
        if not (args.data / "spm.model").is_file():
            raise ConfigError(f"{args.data} is not a prepared corpus (no spm.model): run prepare_data.py")
        if args.output.is_dir() or not args.output.resolve().parent.is_dir():
            raise ConfigError(f"--output {args.output} must be a file in an existing directory")
        tokenizer = Tokenizer.from_file(args.data / "spm.model")
        pairs = ShardDataset(args.data, "train")
        if len(pairs) == 0:
            raise ConfigError(f"{args.data} holds no training pairs to count")
        read = itertools.islice((pairs[i] for i in range(len(pairs))), args.max_pairs)
        frequent, rules = vocabulary_map.build(read, tokenizer.vocab_size, args.always, args.per_source)
        vocabulary_map.write(args.output, tokenizer, frequent, rules)
        n = min(len(pairs), args.max_pairs or len(pairs))
        print(f"{args.output}: {len(frequent)} pieces always, {len(rules)} source pieces, from {n:,} pairs")
    except (ConfigError, OSError) as error:
        exit_with_error(error)


if __name__ == "__main__":
    main()
