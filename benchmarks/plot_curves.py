"""Training curves of one or more runs, from their TensorBoard event files, as one PNG.

python benchmarks/plot_curves.py runs/multi30k --output docs/results/multi30k_curves.png
python benchmarks/plot_curves.py runs/a runs/b --output curves.png       # runs side by side
python benchmarks/plot_curves.py runs/a runs/b --perplexity --output ppl.png   # train and valid perplexity
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from transformer.utils import atomic  # noqa: E402

PANELS = (("train/loss", "valid/loss", "label-smoothed loss"), ("train/lr", None, "learning rate"))
PERPLEXITY = (("train/ppl", None, "training perplexity"), (None, "valid/ppl", "validation perplexity"))


def scalars(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar tag of the run as (steps, values)."""
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    if not tags:
        raise SystemExit(f"error: {run_dir / 'tensorboard'} holds no scalars")
    series = {tag: events.Scalars(tag) for tag in tags}
    return {tag: ([e.step for e in points], [e.value for e in points]) for tag, points in series.items()}


def plot(run_dirs: list[Path], output: Path, perplexity: bool = False) -> None:
    panels = PERPLEXITY if perplexity else PANELS
    fig, axes = plt.subplots(1, len(panels), figsize=(10, 3.8))
    for run_dir in run_dirs:
        curves = scalars(run_dir)
        for ax, (train_tag, valid_tag, title) in zip(axes, panels):
            color = None
            if train_tag is not None:
                (line,) = ax.plot(*curves[train_tag], lw=1, label=f"{run_dir.name} train")
                color = line.get_color()
            if valid_tag in curves:  # dashed, with markers: the valid points are sparse
                ax.plot(*curves[valid_tag], "o--", ms=3, color=color, label=f"{run_dir.name} valid")
            ax.set(title=title, xlabel="optimizer step", yscale="log" if perplexity else "linear")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    with atomic.writing(output) as file:  # a crash leaves no half image under the name
        fig.savefig(file, format="png", dpi=90)
    print(f"wrote {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", help="run directories (with tensorboard/)")
    parser.add_argument("--output", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--perplexity", action="store_true", help="training and validation perplexity")
    args = parser.parse_args()
    for run_dir in args.run_dirs:
        if not (run_dir / "tensorboard").is_dir():
            raise SystemExit(f"error: {run_dir} has no tensorboard/ directory (is it a run directory?)")
    plot(args.run_dirs, args.output, args.perplexity)


if __name__ == "__main__":
    main()
