"""Average the parameters of a run's last checkpoints into one standalone checkpoint (§6.1: the last 5
for the base models, the last 20 for the big ones), which translation loads like any other.

    python scripts/average_checkpoints.py --run-dir runs/paper_base --last 5
    python scripts/average_checkpoints.py --inputs a.pt b.pt c.pt --output averaged.pt
    python scripts/average_checkpoints.py --run-dir runs/ema --last 1 --trained --output trained.pt

Default output: <run_dir>/checkpoints/checkpoint_average_last<K>.pt (not a name `trainer.resume=auto`
picks up; with --trained, checkpoint_average_last<K>_trained.pt). The result has no optimizer or data
state: it is for translation, not for resuming.
"""

import argparse
from pathlib import Path

from transformer.checkpoint import (
    CheckpointError,
    average_checkpoints,
    averaged_path,
    list_checkpoints,
    write_checkpoint,
)
from transformer.utils.cli import exit_with_error


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir", type=Path, help="a training run; its newest --last checkpoints")
    source.add_argument("--inputs", type=Path, nargs="+", help="explicit checkpoint files")
    parser.add_argument(
        "--last", type=int, default=5, help="how many of the run's newest checkpoints (default 5)"
    )
    parser.add_argument("--output", type=Path, help="where to write the average")
    parser.add_argument(
        "--trained",
        action="store_true",
        help="average the trained weights of a run with trainer.ema_decay, not their moving average "
        "(the weights of the same run without it)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.inputs:
        paths = args.inputs
        output = args.output or paths[-1].with_name(f"checkpoint_average_of{len(paths)}.pt")
    else:
        if args.last < 1:
            raise CheckpointError(f"--last={args.last} must be at least 1")
        if not args.run_dir.is_dir():
            raise CheckpointError(f"--run-dir={args.run_dir} is not a directory")
        if args.run_dir.name == "checkpoints" and list_checkpoints(args.run_dir.parent):
            raise CheckpointError(
                f"--run-dir takes the run directory ({args.run_dir.parent}), not its checkpoints/"
            )
        found = list_checkpoints(args.run_dir)
        if len(found) < args.last:
            raise CheckpointError(
                f"{args.run_dir} has {len(found)} checkpoint(s), fewer than --last={args.last} "
                f"(raise trainer.keep_last to keep more)"
            )
        paths = found[-args.last :]
        output = args.output or averaged_path(args.run_dir, args.last)
    if args.trained and not args.output:  # beside the average of the averages, not over it
        output = output.with_name(f"{output.stem}_trained.pt")
    averaged = average_checkpoints(paths, args.trained)
    write_checkpoint(averaged, output)
    print(f"averaged {len(paths)} checkpoints ({paths[0].name} .. {paths[-1].name}) into {output}")
    return output


if __name__ == "__main__":
    try:
        main()
    except CheckpointError as error:
        exit_with_error(error)
