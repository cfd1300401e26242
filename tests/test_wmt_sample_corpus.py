"""benchmarks/wmt_sample_corpus.py on a folder of the shared data's layout: BPE markers removed, Moses
tokenization undone, newstest2013 as validation."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ("opennmt_wmt_sample10k.tok", "stanford_wmt14_train_head10k.tok", "europarl_head10k.tok.bpe")


def test_the_samples_become_one_detokenized_corpus(tmp_path):
    shared = tmp_path / "shared"
    (shared / "wmt_sample").mkdir(parents=True)
    (shared / "wmt14").mkdir()
    for lang, line in (("en", "It &apos;s a hou@@ se , isn &apos;t it ?"), ("de", "Das Ha@@ us ( alt ) .")):
        for sample in (*SAMPLES, "news_commentary_v8_head20k.tok.lc"):
            (shared / "wmt_sample" / f"{sample}.{lang}").write_text(f"{line}\n{line}\n", encoding="utf-8")
        (shared / "wmt14" / f"newstest2013.{lang}").write_text("One.\nTwo.\n", encoding="utf-8")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "wmt_sample_corpus.py"),
            str(shared),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    english = (tmp_path / "out" / "train.en").read_text(encoding="utf-8").splitlines()
    german = (tmp_path / "out" / "train.de").read_text(encoding="utf-8").splitlines()
    assert english == ["It's a house, isn't it?"] * 8 and german == ["Das Haus (alt)."] * 8
    assert (tmp_path / "out" / "valid.de").read_text(encoding="utf-8") == "One.\nTwo.\n"
