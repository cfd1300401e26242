"""The data pipeline end to end: sources -> cleaning -> shared BPE -> shards -> ShardDataset.

Expected shards are recomputed here from the raw text with the trained tokenizer and the cleaning rules
written out in a plain loop, so the pipeline's chunked, vectorised, multi-process code is checked
against an independent reference.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from transformer.config import ConfigError, DataConfig, ToyConfig
from transformer.data import binarize
from transformer.data import prepare as prepare_module
from transformer.data.batching import collate
from transformer.data.dataset import ShardDataset, load_meta
from transformer.data.prepare import prepare
from transformer.data.sources import DataError
from transformer.data.tokenizer import Tokenizer
from transformer.utils import atomic

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

LEXICON = {
    "the": "die", "big": "große", "small": "kleine", "cat": "Katze", "dog": "Hund", "house": "Haus",
    "tree": "Baum", "sees": "sieht", "likes": "mag", "over": "über", "green": "grüne", "street": "Straße",
    "runs": "läuft", "quickly": "schnell", "today": "heute", "and": "und", "with": "mit", "man": "Mann",
    "woman": "Frau", "red": "rote", "ball": "Ball", "plays": "spielt", "in": "in", "garden": "Garten",
}  # fmt: skip


def make_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = [rng.choice(list(LEXICON)) for _ in range(rng.randint(3, 10))]
        pairs.append(
            (" ".join(words).capitalize() + ".", " ".join(LEXICON[w] for w in words).capitalize() + ".")
        )
    return pairs


def write_side(path: Path, lines: list[str], *, crlf: bool = False, bom: bool = False) -> None:
    newline = "\r\n" if crlf else "\n"
    data = (("\ufeff" if bom else "") + newline.join(lines) + newline).encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


# Training lines the cleaning must drop, one reason or more each; `max_tokens_per_sentence=40` below.
SPECIAL_TRAIN = [
    ("", "Leer."),  # empty
    ("   ", "\t"),  # empty after stripping
    (" ".join(["the big green tree"] * 15), " ".join(["der große grüne Baum"] * 15)),  # too long
    ("Dog.", "Der große Hund und die kleine Katze spielen."),  # length ratio
]


def write_corpus(root: Path) -> dict[str, list[tuple[str, str]]]:
    """train (en gzipped, de with CRLF and a BOM), dev and test in plain text; dev has an empty pair."""
    train = make_pairs(300, seed=1)
    for offset, pair in enumerate(SPECIAL_TRAIN):
        train.insert(10 + 20 * offset, pair)
    splits = {"train": train, "dev": make_pairs(30, seed=2), "test": make_pairs(20, seed=3)}
    splits["dev"][4] = ("", "")
    root.mkdir(parents=True, exist_ok=True)
    write_side(root / "train.en.gz", [en for en, _ in train])
    write_side(root / "train.de", [de for _, de in train], crlf=True, bom=True)
    for name in ("dev", "test"):
        write_side(root / f"{name}.en", [en for en, _ in splits[name]])
        write_side(root / f"{name}.de", [de for _, de in splits[name]])
    return splits


def local_config(tmp_path: Path, **overrides) -> DataConfig:
    values = dict(
        name="tiny",
        source="local",
        path=str(tmp_path / "corpus"),
        splits={"train": "train", "valid": "dev", "test": "test"},
        dir=str(tmp_path / "out"),
        vocab_size=120,
        max_tokens_per_sentence=40,
        num_workers=1,
    )
    return DataConfig(**(values | overrides))


def reference_pairs(pairs, tokenizer: Tokenizer, cfg: DataConfig | None):
    """The shards' expected content: clean with the rules spelled out (cfg=None: no filtering)."""
    kept, dropped = [], Counter({"empty": 0, "too_long": 0, "length_ratio": 0})
    for src, tgt in pairs:
        src_ids, tgt_ids = tokenizer.encode(src.strip()), tokenizer.encode(tgt.strip())
        if cfg is None:
            kept.append((src_ids, tgt_ids))
        elif not src.strip() or not tgt.strip() or not src_ids or not tgt_ids:
            dropped["empty"] += 1
        elif max(len(src_ids), len(tgt_ids)) > cfg.max_tokens_per_sentence:
            dropped["too_long"] += 1
        elif max(len(src_ids), len(tgt_ids)) > cfg.max_length_ratio * min(len(src_ids), len(tgt_ids)):
            dropped["length_ratio"] += 1
        else:
            kept.append((src_ids, tgt_ids))
    return kept, dict(dropped)


def shard_content(out: Path, role: str) -> list[tuple[list[int], list[int]]]:
    dataset = ShardDataset(out, role)
    return [(src.tolist(), tgt.tolist()) for src, tgt in (dataset[i] for i in range(len(dataset)))]


def expected_files(roles=("train", "valid", "test"), langs=("en", "de")) -> set[str]:
    shards = {f"{role}.{lang}.{ext}" for role in roles for lang in langs for ext in ("bin", "idx")}
    return shards | {"spm.model", "meta.json"}


def test_local_corpus_end_to_end(tmp_path):
    raw = write_corpus(tmp_path / "corpus")
    cfg = local_config(tmp_path)
    out = prepare(cfg)
    assert out == Path(cfg.dir)
    assert {p.name for p in out.iterdir()} == expected_files()  # nothing else, no temp files
    meta = load_meta(out)
    tokenizer = Tokenizer.from_file(out / "spm.model")
    assert meta["name"] == "tiny" and (meta["src_lang"], meta["tgt_lang"]) == ("en", "de")
    assert meta["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert meta["vocab_size"] == tokenizer.vocab_size == 120 and meta["dtype"] == "uint16"
    assert meta["tokenizer"]["sha256"] == hashlib.sha256((out / "spm.model").read_bytes()).hexdigest()
    assert meta["split_names"] == {"train": "train", "valid": "dev", "test": "test"}
    assert meta["config"]["vocab_size"] == 120 and meta["config"]["path"] == cfg.path

    kept, dropped = reference_pairs(raw["train"], tokenizer, cfg)
    assert all(count >= 1 for count in dropped.values()), "the corpus must exercise every drop reason"
    assert meta["splits"]["train"]["dropped"] == dropped
    assert meta["splits"]["train"]["read"] == len(raw["train"])
    assert shard_content(out, "train") == kept  # the BOM, CRLF and gzip left no trace in the ids
    for role, name in (("valid", "dev"), ("test", "test")):
        assert shard_content(out, role) == reference_pairs(raw[name], tokenizer, None)[0]
    assert ShardDataset(out, "valid")[4][0].size == 0  # an empty valid line stays, as an empty sequence
    assert tokenizer.decode(ShardDataset(out, "train")[0][1]) == raw["train"][0][1]

    # Batches read from the shards at once: the pairs above, padded one by one by collate.
    valid = reference_pairs(raw["dev"], tokenizer, None)[0]
    rng = np.random.default_rng(0)
    for indices in ([4], [4, 0, 4], rng.integers(0, len(valid), 50)):  # with the empty source, repeats
        for multiple in (1, 8):
            batch = ShardDataset(out, "valid").batch(indices, multiple)
            expected = collate([(np.array(valid[i][0]), np.array(valid[i][1])) for i in indices], multiple)
            assert all(torch.equal(a, b) for a, b in zip(batch[:3], expected[:3]))
            assert batch[3:] == expected[3:]


def test_parallel_encoding_matches_serial(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus")
    monkeypatch.setattr(binarize, "CHUNK_PAIRS", 37)  # many chunks, so the pool and its ordering matter
    serial = prepare(local_config(tmp_path, dir=str(tmp_path / "serial"), num_workers=1))
    parallel = prepare(local_config(tmp_path, dir=str(tmp_path / "parallel"), num_workers=2))
    for name in sorted(expected_files() - {"meta.json", "spm.model"}):
        assert (serial / name).read_bytes() == (parallel / name).read_bytes(), name
    # spm.model records the thread count it was trained with; the vocabulary itself is the same
    serial_pieces = Tokenizer.from_file(serial / "spm.model").pieces(range(120))
    assert Tokenizer.from_file(parallel / "spm.model").pieces(range(120)) == serial_pieces


def test_any_direction_and_language_pair(tmp_path):
    pairs = make_pairs(200, seed=4)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_side(corpus / "train.xx", [en for en, _ in pairs])
    write_side(corpus / "train.yy", [de for _, de in pairs])
    cfg = local_config(tmp_path, src_lang="yy", tgt_lang="xx", splits={"train": "train"}, vocab_size=100)
    out = prepare(cfg)
    assert {p.name for p in out.iterdir()} == expected_files(("train",), ("xx", "yy"))
    tokenizer = Tokenizer.from_file(out / "spm.model")
    flipped = [(de, en) for en, de in pairs]
    assert shard_content(out, "train") == reference_pairs(flipped, tokenizer, cfg)[0]


def wmt14_schema(splits: dict[str, list[tuple[str, str]]]):
    from datasets import Dataset, DatasetDict

    return DatasetDict(
        {
            name: Dataset.from_dict({"translation": [{"de": de, "en": en} for en, de in pairs]})
            for name, pairs in splits.items()
        }
    )


def test_hf_saved_dataset_with_the_wmt14_schema(tmp_path):
    raw = {
        "train": make_pairs(200, seed=5),
        "validation": make_pairs(20, seed=6),
        "test": make_pairs(15, seed=7),
    }
    raw["test"][0] = ("  ", "")
    wmt14_schema(raw).save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(
        name="hf", source="hf", path=str(tmp_path / "saved"), dir=str(tmp_path / "out"), vocab_size=100
    )
    out = prepare(cfg)
    tokenizer = Tokenizer.from_file(out / "spm.model")
    assert load_meta(out)["split_names"] == {"train": "train", "valid": "validation", "test": "test"}
    assert shard_content(out, "train") == reference_pairs(raw["train"], tokenizer, cfg)[0]
    assert shard_content(out, "valid") == reference_pairs(raw["validation"], tokenizer, None)[0]
    assert shard_content(out, "test") == reference_pairs(raw["test"], tokenizer, None)[0]


def test_hf_load_dataset_path_with_the_flat_schema(tmp_path, monkeypatch):
    """The hub code path, `load_dataset(name, config)`, on a local folder of parquet files laid out like
    bentrevett/multi30k (flat columns "en" and "de")."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    raw = {"train": make_pairs(150, seed=8), "validation": make_pairs(10, seed=9)}
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for name, pairs in raw.items():
        flat = datasets.Dataset.from_dict({"en": [en for en, _ in pairs], "de": [de for _, de in pairs]})
        flat.to_parquet(str(tmp_path / "hub" / "data" / f"{name}-00000-of-00001.parquet"))
    cfg = DataConfig(
        name="flat",
        source="hf",
        hf_dataset=str(tmp_path / "hub"),
        hf_config=None,
        splits={"train": "train", "valid": "validation"},
        dir=str(tmp_path / "out"),
        vocab_size=100,
    )
    out = prepare(cfg)
    tokenizer = Tokenizer.from_file(out / "spm.model")
    assert shard_content(out, "train") == reference_pairs(raw["train"], tokenizer, cfg)[0]
    assert shard_content(out, "valid") == reference_pairs(raw["validation"], tokenizer, None)[0]


def test_hf_errors_name_the_dataset_and_split(tmp_path):
    wmt14_schema({"train": make_pairs(20, seed=10)}).save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(source="hf", path=str(tmp_path / "saved"), dir=str(tmp_path / "out"), vocab_size=50)
    with pytest.raises(DataError, match=r"has no split 'validation' \(data.splits.valid\); it has: train"):
        prepare(cfg)
    cfg = DataConfig(source="hf", path=str(tmp_path / "saved"), src_lang="fr", dir=str(tmp_path / "out"))
    with pytest.raises(DataError, match="has no fr text; it has: de, en"):
        prepare(cfg)
    with pytest.raises(DataError, match="cannot load the Hugging Face dataset") as error:
        prepare(DataConfig(source="hf", path=str(tmp_path / "nothing"), dir=str(tmp_path / "out")))
    assert "offline" not in str(error.value)


@pytest.mark.parametrize(
    "error, hint",
    [
        # what datasets raises with no network
        (ConnectionError("Couldn't reach 'wmt14' on the Hub (LocalEntryNotFoundError)"), True),
        (ValueError("BuilderConfig 'de-xx' not found"), False),  # a wrong data.hf_config: not offline
    ],
)
def test_an_unreachable_hub_names_the_offline_route(tmp_path, monkeypatch, error, hint):
    datasets = pytest.importorskip("datasets")

    def load_dataset(*_args, **_kwargs):
        raise error

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DataError, match="cannot load the Hugging Face dataset") as raised:
        prepare(DataConfig(source="hf", dir=str(tmp_path / "out")))
    assert str(error) in str(raised.value)
    assert str(raised.value).endswith("; offline, data.source=local data.path=DIR reads text files") == hint


@pytest.mark.skipif(not (SHARED_DATA / "multi30k").is_dir(), reason="../shared/data/multi30k is absent")
def test_real_multi30k_files(tmp_path):
    cfg = DataConfig(
        name="multi30k",
        source="local",
        path=str(SHARED_DATA / "multi30k"),
        local_splits={"train": "train", "valid": "val", "test": "test_2016_flickr"},
        dir=str(tmp_path / "multi30k"),
        vocab_size=8000,
        num_workers=2,
    )
    out = prepare(cfg)
    meta = load_meta(out)
    assert meta["splits"]["train"]["read"] == 29000
    assert meta["splits"]["train"]["pairs"] + sum(meta["splits"]["train"]["dropped"].values()) == 29000
    assert meta["splits"]["valid"]["pairs"] == 1014 and meta["splits"]["test"]["pairs"] == 1000
    tokenizer = Tokenizer.from_file(out / "spm.model")
    for role, name in (("valid", "val"), ("test", "test_2016_flickr")):
        lines = {
            lang: gzip.decompress((SHARED_DATA / "multi30k" / f"{name}.{lang}.gz").read_bytes())
            .decode("utf-8")
            .rstrip("\n")
            .split("\n")
            for lang in ("en", "de")
        }
        expected = reference_pairs(list(zip(lines["en"], lines["de"])), tokenizer, None)[0]
        assert shard_content(out, role) == expected


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda c: write_side(c / "test.de", ["Eins.", "Zwei."]),
            r"test\.en has 20 lines but .*test\.de has 2",
        ),
        (
            lambda c: (c / "dev.de").write_bytes(b"gut\nauch gut\nschlecht \xff\xfe\n"),
            r"dev\.de, line 3: invalid UTF-8",
        ),
        (lambda c: (c / "test.en").write_bytes(b""), r"test\.en is empty"),
        (
            lambda c: (c / "dev.en").unlink(),
            r"the 'valid' split is missing: expected .*dev\.en or .*dev\.en\.gz",
        ),
        (lambda c: write_side(c / "train.en", ["x"]), r"both .*train\.en and .*train\.en\.gz exist"),
        (  # five whole lines, then a second gzip member cut off after its header
            lambda c: (c / "train.en.gz").write_bytes(
                gzip.compress(b"a\nb\nc\nd\ne\n") + gzip.compress(b"f\n")[:12]
            ),
            r"train\.en\.gz, line 6: truncated or not gzip",
        ),
        (
            lambda c: (c / "train.en.gz").write_bytes(b"plain text\n"),
            r"train\.en\.gz, line 1: truncated or not gzip",
        ),
    ],
    ids=["line-counts", "utf8", "empty-file", "missing-split", "ambiguous", "truncated-gzip", "not-gzip"],
)
def test_bad_input_is_reported_before_any_work(tmp_path, damage, message):
    write_corpus(tmp_path / "corpus")
    damage(tmp_path / "corpus")
    with pytest.raises(DataError, match=message):
        prepare(local_config(tmp_path))
    assert not (tmp_path / "out").exists()  # nothing was written


def test_vocabulary_too_large_for_the_corpus(tmp_path):
    write_corpus(tmp_path / "corpus")
    with pytest.raises(DataError, match=r"data.vocab_size=5000 is too large for this corpus"):
        prepare(local_config(tmp_path, vocab_size=5000))


def identity(path: Path) -> tuple[int, int]:
    """Which file is under the name: its inode, and when it was written (a deleted file's inode number
    may be given to the file that replaces it)."""
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns


def test_rerun_skips_force_redoes_and_a_lost_file_is_rebuilt(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus")
    cfg = local_config(tmp_path)
    out = prepare(cfg)
    content = {p.name: p.read_bytes() for p in out.iterdir()}
    identities = {p.name: identity(p) for p in out.iterdir()}
    (out / ".train.en.bin.1234abcd.tmp").write_bytes(b"left by a killed run")

    def must_not_read(cfg):
        raise AssertionError("a finished corpus must not be read again")

    with monkeypatch.context() as patch:
        patch.setattr(prepare_module, "load_splits", must_not_read)
        prepare(cfg)
    assert {p.name: identity(p) for p in out.iterdir()} == identities  # untouched, temp file removed

    (out / "test.de.bin").unlink()
    prepare(cfg)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == content
    rebuilt = {name for name, before in identities.items() if identity(out / name) != before}
    assert rebuilt == {"test.en.bin", "test.en.idx", "test.de.bin", "test.de.idx", "meta.json"}

    prepare(local_config(tmp_path, force=True))
    assert all(identity(out / name) != before for name, before in identities.items())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == content  # same input, same output


def test_changed_configuration_is_refused_without_force(tmp_path):
    write_corpus(tmp_path / "corpus")
    prepare(local_config(tmp_path))
    with pytest.raises(
        ConfigError, match=r"different configuration \(changed: vocab_size\).*data.force=true"
    ):
        prepare(local_config(tmp_path, vocab_size=100))
    prepare(local_config(tmp_path, num_workers=2))  # how it is built is not what is built: accepted
    assert load_meta(tmp_path / "out")["vocab_size"] == 120
    assert prepare(local_config(tmp_path, vocab_size=100, force=True))
    assert load_meta(tmp_path / "out")["vocab_size"] == 100


def test_lowercase_corpus(tmp_path):
    """data.lowercase: the shards hold the lowercased text, and a cased dir is not silently reused."""
    raw = write_corpus(tmp_path / "corpus")
    out = prepare(local_config(tmp_path, lowercase=True))
    tokenizer = Tokenizer.from_file(out / "spm.model")
    decoded = [tokenizer.decode(tgt) for _, tgt in shard_content(out, "test")]
    assert decoded == [de.lower() for _, de in raw["test"]]
    assert any(de != de.lower() for _, de in raw["test"]) and any("ß" in de for de in decoded)
    with pytest.raises(ConfigError, match=r"changed: lowercase"):
        prepare(local_config(tmp_path))


def test_a_directory_prepared_before_a_config_key_existed_is_reused(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus")
    out = prepare(local_config(tmp_path))
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    del meta["config"]["lowercase"]  # as written before data.lowercase was added
    (out / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    monkeypatch.setattr(prepare_module, "load_splits", lambda cfg: pytest.fail("the corpus was rebuilt"))
    assert prepare(local_config(tmp_path)) == out
    with pytest.raises(ConfigError, match=r"changed: lowercase"):
        prepare(local_config(tmp_path, lowercase=True))


def test_crash_leaves_no_partial_file_and_the_rerun_resumes(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus")
    cfg = local_config(tmp_path)
    real_encode = binarize.encode_split

    def crash_on_valid(src, tgt, out, *args, **kwargs):
        if "valid" in out["src_bin"].name:
            with atomic.writing(out["src_bin"]) as file:
                file.write(b"half a shard")
                raise KeyboardInterrupt
        return real_encode(src, tgt, out, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(prepare_module, "encode_split", crash_on_valid)
        with pytest.raises(KeyboardInterrupt):
            prepare(cfg)
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == expected_files(("train",))  # no temp file, no half shard
    with pytest.raises(ConfigError, match="did not finish; run the same prepare_data.py command again"):
        ShardDataset(out, "train")
    spm_inode = (out / "spm.model").stat().st_ino
    prepare(cfg)
    assert (out / "spm.model").stat().st_ino == spm_inode  # the tokenizer step was not redone
    assert {p.name for p in out.iterdir()} == expected_files()


def test_shard_dataset_errors_and_pickling(tmp_path):
    with pytest.raises(
        ConfigError, match=r"no prepared corpus .*python scripts/prepare_data.py data=<corpus>"
    ):
        ShardDataset(tmp_path / "never", "train")
    write_corpus(tmp_path / "corpus")
    out = prepare(local_config(tmp_path, splits={"train": "train", "valid": "dev"}))
    with pytest.raises(ConfigError, match="has no 'test' split; it has: train, valid"):
        ShardDataset(out, "test")
    dataset = ShardDataset(out, "train")
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    with pytest.raises(IndexError, match="out of range"):
        dataset.batch([0, len(dataset)])
    clone = pickle.loads(pickle.dumps(dataset))  # as DataLoader workers receive it
    assert all(np.array_equal(a, b) for i in range(len(dataset)) for a, b in zip(dataset[i], clone[i]))
    assert np.array_equal(dataset.src_lengths, [len(dataset[i][0]) for i in range(len(dataset))])
    meta = json.loads((out / "meta.json").read_text())
    meta["splits"]["train"]["pairs"] += 1
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="does not match its index or meta.json"):
        ShardDataset(out, "train")


def test_toy_source(tmp_path):
    toy = pytest.importorskip("transformer.data.toy")
    sizes = ToyConfig(n_train=300, n_valid=20, n_test=20, seed=3)
    cfg = DataConfig(
        name="toy",
        source="toy",
        src_lang="de",
        tgt_lang="en",
        splits={"train": "train", "valid": "valid", "test": "test"},
        dir=str(tmp_path / "toy"),
        vocab_size=300,
        toy=sizes,
    )
    out = prepare(cfg)
    corpus = toy.generate_splits(sizes.n_train, sizes.n_valid, sizes.n_test, sizes.seed)
    tokenizer = Tokenizer.from_file(out / "spm.model")
    german_first = [(de, en) for en, de in corpus["valid"]]
    assert shard_content(out, "valid") == reference_pairs(german_first, tokenizer, None)[0]
    assert load_meta(out)["splits"]["train"]["read"] == 300


def run_script(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "scripts" / "prepare_data.py"), *overrides]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_script_writes_only_data_and_reports_errors_in_one_line(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, seed in (("train", 11), ("val", 12), ("test_2016_flickr", 13)):
        pairs = make_pairs(120 if name == "train" else 10, seed)
        write_side(corpus / f"{name}.en", [en for en, _ in pairs])
        write_side(corpus / f"{name}.de", [de for _, de in pairs])
    run = tmp_path / "run"
    run.mkdir()
    done = run_script(run, "data=multi30k", "data.source=local", f"data.path={corpus}", "data.vocab_size=90")
    assert done.returncode == 0, done.stderr
    assert [p.name for p in run.iterdir()] == ["data"]  # no outputs/, .hydra/ or log file
    assert {p.name for p in (run / "data" / "multi30k").iterdir()} == expected_files()

    (corpus / "val.de.gz").write_bytes(gzip.compress((corpus / "val.de").read_bytes())[:-20])
    (corpus / "val.de").unlink()
    truncated = ["data.source=local", f"data.path={corpus}", "data.dir=data/truncated"]
    for overrides in (
        ["data.source=local", f"data.path={tmp_path / 'missing'}"],
        ["data.vocab_size=5"],
        truncated,
    ):
        failed = run_script(run, "data=multi30k", *overrides)
        assert failed.returncode == 2
        errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and failed.stderr.endswith(errors[0] + "\n"), (
            failed.stderr
        )  # reading bars before
        assert "Traceback" not in failed.stderr
    assert "val.de.gz, line 10: truncated or not gzip" in errors[0]
    assert not (run / "data" / "truncated").exists()
