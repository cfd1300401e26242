"""BLEU: the paper-comparable tokenized score checked by hand and against sacreBLEU; chrF and chrF++
beside it; evaluate.py end to end on a few Multi30k-style lines."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sacrebleu.metrics import BLEU, CHRF

from transformer.checkpoint import load_checkpoint, write_checkpoint
from transformer.config import ConfigError, DataConfig
from transformer.inference.evaluation import (
    chrf,
    lowercase_bleu,
    moses_tokenize,
    paper_table,
    read_split,
    sacre_bleu,
    score_all,
    split_compounds,
    tokenized_bleu,
)
from transformer.inference.translation import Translator

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
HYPOTHESES = ["Die Grenz-Kontrolle war streng.", "Es ist ein gutes Buch."]
REFERENCES = ["Die Grenz-Kontrolle war sehr streng.", "Es ist ein gutes Buch."]


def test_tokenization_is_moses_then_compound_splitting():
    tokenized = moses_tokenize(HYPOTHESES, "de")
    assert tokenized == ["Die Grenz-Kontrolle war streng .", "Es ist ein gutes Buch ."]
    assert split_compounds(tokenized[0]) == "Die Grenz ##AT##-##AT## Kontrolle war streng ."
    # like perl's s{(\S)-(\S)}{...}g: matches do not overlap, a lone or trailing hyphen stays
    assert split_compounds("a-b-c x - y e-") == "a ##AT##-##AT## b-c x - y e-"
    # perl matches bytes: the second byte of "à" (C3 A0) is a \S of its own, so both hyphens split
    assert split_compounds("vis-à-vis") == "vis ##AT##-##AT## à ##AT##-##AT## vis"
    assert moses_tokenize(['Er sagte "ja" & ging.'], "de") == ["Er sagte &quot; ja &quot; &amp; ging ."]


def test_tokenized_bleu_by_hand():
    """Tokens: hyp 7 + 6 = 13, ref 8 + 6 = 14. Matches, sentence 1 + sentence 2:
    1-grams 7/7 + 6/6; 2-grams 5/6 + 5/5 ("war streng" is not in the reference);
    3-grams 3/5 + 4/4; 4-grams 2/4 + 3/3. BLEU = BP * geometric mean, BP = exp(1 - 14/13)."""
    precisions = [13 / 13, 10 / 11, 7 / 9, 5 / 7]
    expected = 100 * math.exp(1 - 14 / 13) * math.exp(sum(math.log(p) for p in precisions) / 4)
    result = tokenized_bleu(HYPOTHESES, REFERENCES, "de")
    assert result.score == pytest.approx(expected, abs=1e-9)
    assert result.precisions == pytest.approx([100 * p for p in precisions])
    assert (result.hyp_len, result.ref_len) == (13, 14)
    hyp, ref = ([split_compounds(x) for x in moses_tokenize(side, "de")] for side in (HYPOTHESES, REFERENCES))
    pre_tokenized = BLEU(tokenize="none").corpus_score(hyp, [ref])  # sacreBLEU -tok none
    assert result.score == pytest.approx(pre_tokenized.score, abs=1e-12)
    assert "tok:none" in result.signature and "case:mixed" in result.signature
    # multi-bleu.perl: no 4-gram match anywhere in the corpus is BLEU 0 (sacreBLEU would smooth it)
    assert tokenized_bleu(["Das Haus ist alt."], ["Das Haus war alt."], "de").score == 0.0


def test_lowercased_and_sacrebleu_variants():
    hyp, ref = ["das haus ist sehr alt und klein ."], ["Das Haus ist sehr alt und klein ."]
    assert lowercase_bleu(hyp, ref, "de").score == pytest.approx(100.0)
    cased = 100 * (6 / 8 * 5 / 7 * 4 / 6 * 3 / 5) ** 0.25  # "das haus" misses 1-, 2-, 3- and 4-grams
    assert tokenized_bleu(hyp, ref, "de").score == pytest.approx(cased)
    sacre = sacre_bleu(HYPOTHESES, REFERENCES)
    assert sacre.score == pytest.approx(BLEU().corpus_score(HYPOTHESES, [REFERENCES]).score)
    assert "tok:13a" in sacre.signature and "case:mixed" in sacre.signature
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        sacre_bleu(HYPOTHESES, REFERENCES[:1])


def test_lowercase_bleu_by_hand_keeps_compounds_whole():
    """Multi30k's convention: "t-shirt" is one token. Tokens: hyp 8, ref 9 ("eine" is missing);
    matches: 1-grams 8/8, 2-grams 6/7, 3-grams 4/6, 4-grams 3/5."""
    hyp = ["Ein Mann im blauen T-Shirt spielt Gitarre."]
    ref = ["ein mann im blauen t-shirt spielt eine gitarre ."]
    precisions = [8 / 8, 6 / 7, 4 / 6, 3 / 5]
    expected = 100 * math.exp(1 - 9 / 8) * math.exp(sum(math.log(p) for p in precisions) / 4)
    result = lowercase_bleu(hyp, ref, "de")
    assert result.score == pytest.approx(expected, abs=1e-9)
    assert (result.hyp_len, result.ref_len) == (8, 9) and "case:lc" in result.signature


@pytest.mark.skipif(not MULTI30K.is_dir(), reason="no ../shared/data/multi30k")
def test_lowercase_bleu_tokenizes_the_multi30k_test_reference_as_wu_et_al():
    """Their BLEU log's reference length on test_2016_flickr, 12,103 tokens; 12,240 cased and with the
    compound splitting of the WMT script."""
    with gzip.open(MULTI30K / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        references = f.read().splitlines()
    assert lowercase_bleu(references, references, "de").ref_len == 12103
    assert tokenized_bleu(references, references, "de").ref_len == 12240


def test_paper_table_puts_published_figures_beside_ours():
    scores = score_all(HYPOTHESES, REFERENCES, "de", lowercase=False)
    table = paper_table(scores, "wmt14_en_de", "test")
    assert "27.30" in table and "28.40" in table and "newstest2014" not in table.splitlines()[0]
    delta = scores["tokenized"].score - 27.3
    assert f"{delta:+.2f} for this checkpoint" in table
    assert "25.80" in paper_table(scores, "wmt14_en_de", "valid")
    assert "41.02" in paper_table(scores, "multi30k", "test") and "not scored here" in paper_table(
        scores, "multi30k", "test"
    )
    toy = paper_table(scores, "toy", "test")  # the synthetic corpus: WMT figures for context only
    assert "27.30" in toy and "another corpus: for context only" in toy and "for this checkpoint" not in toy


def test_chrf_and_chrf_plus_plus_are_sacrebleus_and_stay_out_of_the_bleu_comparisons():
    scores = score_all(HYPOTHESES, REFERENCES, "de", lowercase=False)
    for name, word_order in (("chrf", 0), ("chrf++", 2)):
        expected = CHRF(word_order=word_order).corpus_score(HYPOTHESES, [REFERENCES]).score
        assert scores[name].score == pytest.approx(expected, abs=1e-12)
        assert f"nw:{word_order}" in scores[name].signature and "case:mixed" in scores[name].signature
    assert scores["chrf"].score != scores["chrf++"].score
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        chrf(HYPOTHESES, REFERENCES[:1])
    lines = paper_table(scores, "wmt14_en_de", "test").splitlines()
    heading = next(i for i, line in enumerate(lines) if line.split()[:2] == ["chrF", "metric"])
    assert all("chrf" not in line for line in lines[:heading])  # ours by BLEU, then the published BLEU
    assert any(line.startswith("Transformer (big), newstest2014") for line in lines[:heading])
    assert [line.split()[2:] for line in lines[heading + 1 :]] == [
        [name, f"{scores[name].score:.2f}", scores[name].signature] for name in ("chrf", "chrf++")
    ]


def write_corpus(directory: Path, src: list[str], tgt: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "test_2016_flickr.en").write_text("".join(s + "\n" for s in src), encoding="utf-8")
    (directory / "test_2016_flickr.de").write_text("".join(t + "\n" for t in tgt), encoding="utf-8")
    return directory


def test_read_split_reads_only_that_split(tmp_path):
    corpus = write_corpus(tmp_path / "m30k", ["A dog.", "A cat."], ["Ein Hund.", "Eine Katze."])
    cfg = DataConfig(
        name="multi30k",
        source="local",
        path=str(corpus),
        local_splits={"train": "train", "valid": "val", "test": "test_2016_flickr"},
    )
    split = read_split(cfg, "test")  # there are no train or val files: they are not read
    assert split.name == "test_2016_flickr"
    assert (split.src, split.tgt) == (["A dog.", "A cat."], ["Ein Hund.", "Eine Katze."])
    with pytest.raises(ConfigError, match="no 'valid' split"):
        read_split(DataConfig(name="x", source="local", path=str(corpus), splits={"train": "t"}), "valid")


def test_evaluate_script_end_to_end(tiny_checkpoint, tmp_path):
    checkpoint = Path(shutil.copy(tiny_checkpoint, tmp_path / "checkpoint_last.pt"))
    src = ["The cat sees the house.", "A dog likes a red ball.", "My friend finds the old tree."]
    references = ["Die Katze sieht das Haus.", "Ein Hund mag den Ball.", "Ja."]
    corpus = write_corpus(tmp_path / "m30k", src, references)
    script = str(ROOT / "scripts" / "evaluate.py")
    command = [
        sys.executable,
        script,
        f"checkpoint={checkpoint}",
        "data=multi30k",
        "data.source=local",
        "split=test",
        "beam_size=2",
        "max_len_b=10",
        f"data.path={corpus}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "41.02" in done.stdout and "tokenized_lowercase" in done.stdout and "chrf++" in done.stdout
    report = tmp_path / "checkpoint_last.pt.multi30k.test.beam2.alpha0.6.len1x+10"  # not §6.1's limit: named
    result = json.loads(Path(f"{report}.bleu.json").read_text())
    hypotheses = Path(f"{report}.hyp.de").read_text().splitlines()
    assert len(hypotheses) == result["sentences"] == 3 and result["split_name"] == "test_2016_flickr"
    expected = lowercase_bleu(hypotheses, references, "de").score
    assert result["scores"]["tokenized_lowercase"]["score"] == pytest.approx(expected)
    for name, word_order in (("chrf", 0), ("chrf++", 2)):
        metric = CHRF(word_order=word_order)
        assert result["scores"][name]["score"] == pytest.approx(
            metric.corpus_score(hypotheses, [references]).score
        )
        assert result["scores"][name]["signature"] == str(metric.get_signature())
    greedy = [arg if arg != "beam_size=2" else "beam_size=1" for arg in command]
    assert subprocess.run(greedy, capture_output=True, cwd=ROOT, timeout=300, env=env).returncode == 0
    greedy_path = tmp_path / "checkpoint_last.pt.multi30k.test.greedy.len1x+10.bleu.json"
    greedy_report = json.loads(greedy_path.read_text())
    assert greedy_report["settings"]["beam_size"] == 1
    int8 = subprocess.run([*greedy, "precision=int8"], capture_output=True, cwd=ROOT, timeout=300, env=env)
    assert int8.returncode == 0, int8.stderr
    int8_report = tmp_path / "checkpoint_last.pt.multi30k.test.greedy.len1x+10.int8.bleu.json"
    assert json.loads(int8_report.read_text())["settings"]["precision"] == "int8"
    assert json.loads(greedy_path.read_text()) == greedy_report  # not overwritten by int8's
    vmap = tmp_path / "short.txt"  # a vocabulary map that allows the special symbols only
    vmap.write_text("\t\n", encoding="utf-8")
    mapped = subprocess.run(
        [*greedy, f"vocabulary_map={vmap}"], capture_output=True, cwd=ROOT, timeout=300, env=env
    )
    assert mapped.returncode == 0, mapped.stderr
    digest = hashlib.sha1(vmap.read_bytes()).hexdigest()[:8]  # another map of that name: another file
    mapped_path = tmp_path / f"checkpoint_last.pt.multi30k.test.greedy.len1x+10.vmap-short-{digest}.hyp.de"
    assert set(mapped_path.read_text().split()) <= {"⁇"}  # nothing but EOS and UNK to output
    unmapped = greedy_path.with_name(greedy_path.name.replace(".bleu.json", ".hyp.de"))
    assert set(unmapped.read_text().split()) - {"⁇"}  # without the map: other words
    assert json.loads(greedy_path.read_text()) == greedy_report  # not overwritten either
    assert json.loads(Path(f"{report}.bleu.json").read_text()) == result  # not overwritten
    for topk in (5, 10):  # samples narrowed otherwise: each its own result
        sampled = [*greedy, "sampling=true", f"topk={topk}"]
        assert subprocess.run(sampled, capture_output=True, cwd=ROOT, timeout=300, env=env).returncode == 0
    for topk in (5, 10):
        name = f"checkpoint_last.pt.multi30k.test.sample.seed0.topk{topk}.len1x+10.bleu.json"
        assert json.loads((tmp_path / name).read_text())["settings"]["topk"] == topk
    command[-1] = f"data.path={tmp_path / 'nowhere'}"
    missing = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    said = [line for line in missing.stderr.splitlines() if not line.startswith("INFO: CPU kernels")]
    assert missing.returncode == 2 and len(said) == 1
    assert said[0].startswith("error: ") and "nowhere" in said[0]


def test_evaluate_takes_prefixes_and_constraints_and_writes_alignments(tiny_checkpoint, tmp_path):
    """evaluate.py target_prefix=FILE constraints=FILE alignment=true: the hypotheses are those the API
    gives with the same prefixes and phrases, the .align file holds its word alignments, the result is
    named by both files; files of another line count, or missing, are one-line errors."""
    checkpoint = Path(shutil.copy(tiny_checkpoint, tmp_path / "checkpoint_last.pt"))
    src = ["The cat sees the house.", "A dog likes a red ball.", "My friend finds the old tree."]
    corpus = write_corpus(tmp_path / "m30k", src, ["Die Katze sieht das Haus.", "Ein Hund.", "Ja."])
    prefixes, phrases = ["Die Katze", "", "Mein"], [["Haus"], [], ["das Haus", "mag"]]
    (tmp_path / "prefix.de").write_text("".join(p + "\n" for p in prefixes), encoding="utf-8")
    (tmp_path / "terms.de").write_text("".join("\t".join(p) + "\n" for p in phrases), encoding="utf-8")
    settings = ["data=multi30k", "data.source=local", f"data.path={corpus}", "beam_size=2", "max_len_b=10"]
    guided = [
        f"target_prefix={tmp_path / 'prefix.de'}",
        f"constraints={tmp_path / 'terms.de'}",
        "alignment=true",
    ]
    script = [sys.executable, str(ROOT / "scripts" / "evaluate.py"), f"checkpoint={checkpoint}", *settings]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*script, *guided], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    digests = [hashlib.sha1((tmp_path / f).read_bytes()).hexdigest()[:8] for f in ("prefix.de", "terms.de")]
    stem = f"checkpoint_last.pt.multi30k.test.beam2.alpha0.6.len1x+10.prefix-prefix-{digests[0]}"
    stem = tmp_path / f"{stem}.constraints-terms-{digests[1]}"
    api = Translator.from_checkpoint(str(checkpoint), device="cpu", beam_size=2, max_len_b=10, alignment=True)
    expected = [h[0] for h in api.translate_nbest(src, target_prefix=prefixes, constraints=phrases)]
    hypotheses = Path(f"{stem}.hyp.de").read_text(encoding="utf-8").splitlines()
    assert hypotheses == [h.text for h in expected]
    assert hypotheses[0].startswith("Die Katze") and "Haus" in hypotheses[0] and "mag" in hypotheses[2]
    assert Path(f"{stem}.align").read_text().splitlines() == [
        " ".join(f"{i}-{j}" for i, j in h.alignment.words) for h in expected
    ]
    assert json.loads(Path(f"{stem}.bleu.json").read_text())["alignments"] == f"{stem}.align"
    (tmp_path / "prefix.de").write_text("Die\n", encoding="utf-8")
    short = subprocess.run([*script, *guided], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert short.returncode == 2 and short.stderr.strip().splitlines()[-1] == (
        f"error: target_prefix={tmp_path / 'prefix.de'} has 1 lines for 3 of the split"
    )
    missing = subprocess.run([*script, "constraints=missing.tsv"], capture_output=True, text=True, env=env)
    assert (
        missing.returncode == 2 and missing.stderr.strip() == "error: constraints=missing.tsv is not a file"
    )


def test_evaluate_without_data_scores_the_corpus_the_checkpoint_was_trained_on(tiny_checkpoint, tmp_path):
    """Its data.KEY=VALUE settings apply over that corpus; data=NAME chooses another."""
    src = ["The cat sees the house.", "A dog likes a red ball."]
    corpus = write_corpus(tmp_path / "m30k", src, ["Die Katze sieht das Haus.", "Ein Hund mag den Ball."])
    ckpt = load_checkpoint(tiny_checkpoint)
    trained_on = {"name": "multi30k", "source": "local", "path": str(tmp_path / "moved"), "lowercase": True}
    ckpt["config"] = {"data": {**trained_on, "local_splits": {"test": "test_2016_flickr", "train": "train"}}}
    checkpoint = tmp_path / "checkpoint_last.pt"
    write_checkpoint(ckpt, checkpoint)
    command = [
        sys.executable,
        str(ROOT / "scripts" / "evaluate.py"),
        f"checkpoint={checkpoint}",
        "max_len_b=10",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    moved = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert moved.returncode == 2 and f"{tmp_path / 'moved'}" in moved.stderr  # the recorded path, not the hub
    done = subprocess.run(
        [*command, f"data.path={corpus}"], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "corpus: multi30k, the checkpoint's" in done.stderr
    result = json.loads(
        (tmp_path / "checkpoint_last.pt.multi30k.test.beam4.alpha0.6.len1x+10.bleu.json").read_text()
    )
    assert result["split_name"] == "test_2016_flickr" and result["sentences"] == 2
    other = [*command, "data=wmt14_en_de", "data.source=local", f"data.path={corpus}"]
    chosen = subprocess.run(other, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert chosen.returncode == 2 and "the 'test' split is missing: expected" in chosen.stderr
