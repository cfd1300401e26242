"""A small WMT en-de corpus from the training samples in shared/data/wmt_sample, for short runs at the
base model's size (docs/results.md, "Initialisation"): the four samples' 50,000 pairs, BPE markers
removed and Moses tokenization undone (one sample is lowercased, as shipped), as train.{en,de}, and
newstest2013 as valid.{en,de}.

python benchmarks/wmt_sample_corpus.py ../shared/data data/wmt_sample_raw
python train.py experiment=paper_base data.source=local data.path=data/wmt_sample_raw \
    "data.local_splits={train:train,valid:valid}" "data.splits={train:train,valid:valid}" \
    data.name=wmt_sample data.dir=data/wmt_sample data.vocab_size=8000 ...
"""

import argparse
from pathlib import Path

from sacremoses import MosesDetokenizer

from transformer.utils import atomic

SAMPLES = (
    "opennmt_wmt_sample10k.tok",
    "stanford_wmt14_train_head10k.tok",
    "europarl_head10k.tok.bpe",
    "news_commentary_v8_head20k.tok.lc",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shared_data", type=Path, help="the folder holding wmt_sample/ and wmt14/")
    parser.add_argument("out", type=Path, help="where train.{en,de} and valid.{en,de} are written")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for lang in ("en", "de"):
        detokenize = MosesDetokenizer(lang).detokenize  # also turns &apos; &quot; &amp; back
        lines = []
        for sample in SAMPLES:
            text = (args.shared_data / "wmt_sample" / f"{sample}.{lang}").read_text(encoding="utf-8")
            lines += [detokenize(line.replace("@@ ", "").split()) for line in text.splitlines()]
        atomic.write_bytes(args.out / f"train.{lang}", ("\n".join(lines) + "\n").encode("utf-8"))
        valid = (args.shared_data / "wmt14" / f"newstest2013.{lang}").read_text(encoding="utf-8")
        atomic.write_bytes(args.out / f"valid.{lang}", valid.encode("utf-8"))
        print(f"{args.out}: train.{lang} {len(lines)} lines, valid.{lang} {len(valid.splitlines())} lines")


if __name__ == "__main__":
    main()
