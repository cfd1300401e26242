"""translate.py end to end: the real command in a subprocess, on a tiny untrained checkpoint.

Each subprocess costs seconds of imports, so each call checks several things at once.
"""

from __future__ import annotations

import io
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from transformer.config import ConfigError, TranslateConfig
from transformer.inference.translation import Translator, split_input

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def translate(*overrides: str, stdin: bytes = b"", env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "translate.py"), *overrides],
        input=stdin,
        capture_output=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def test_every_input_line_gets_one_output_line(tiny_checkpoint):
    too_long = " ".join(["the old tree"] * 100)  # far more pieces than the 128 positions allow
    lines = [
        b"The cat sees the house.",
        b"",
        b"   \t ",
        b"My friend \xff\xfe finds das Haus.",  # invalid UTF-8
        too_long.encode(),
        "emoji \U0001f600, control \x07\x0b\x0c chars, \u2028 separator, CJK \u4e2d\u6587".encode(),
        b"A dog likes a red ball.\r",  # CRLF line ending
        b"Ein Hund",  # no final newline
    ]
    done = translate(f"checkpoint={tiny_checkpoint}", "beam_size=2", stdin=b"\n".join(lines))
    assert done.returncode == 0, done.stderr.decode()
    output = done.stdout.decode("utf-8").split("\n")
    assert output[-1] == ""  # every line ends with a newline
    output = output[:-1]
    assert len(output) == len(lines)
    assert output[1] == "" and output[2] == ""
    assert all(output[i] for i in (0, 3, 4, 5, 6, 7))  # an untrained model still says something
    errors = done.stderr.decode()
    assert "line 4: invalid UTF-8" in errors
    assert "line 5:" in errors and "parts; translating its sentences alone" in errors  # split, not cut
    assert "Traceback" not in errors


def test_input_and_output_files_and_one_text(tiny_checkpoint, tmp_path):
    source = tmp_path / "in.en"
    source.write_text("The cat sees the house.\n\nA dog likes a red ball.\n", encoding="utf-8")
    target = tmp_path / "out.de"
    done = translate(f"checkpoint={tiny_checkpoint}", f"input={source}", f"output={target}", "max_tokens=16")
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == b""
    written = target.read_text(encoding="utf-8").split("\n")
    assert len(written) == 4 and written[1] == "" and written[3] == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.en", "out.de"]  # no temp file left
    one = translate(f"checkpoint={tiny_checkpoint}", "text=The cat sees the house.")
    assert one.returncode == 0, one.stderr.decode()
    assert one.stdout.decode() == written[0] + "\n"  # the same sentence alone, the same translation


def test_a_text_of_undecodable_bytes_and_a_missing_input_file(tiny_checkpoint, tmp_path):
    """text= is translated whatever bytes the shell passed (U+FFFD for what is not UTF-8); a missing
    input= or score= file is named before any checkpoint loads (here a missing one too)."""
    done = translate(f"checkpoint={tiny_checkpoint}", b"text='The caf\xe9 sees the house.'")
    assert done.returncode == 0 and len(done.stdout.decode().splitlines()) == 1, done.stderr.decode()
    missing = tmp_path / "missing"
    for key in ("input", "score"):
        done = translate(f"checkpoint={missing}.pt", f"{key}={missing}", "output_format=jsonl")
        assert done.returncode == 2 and done.stderr.decode().strip().endswith(
            f"{key}={missing} is not a file"
        )


def test_many_bad_lines_give_the_first_few_warnings_and_a_count(tiny_checkpoint):
    lines = [b"bad \xff line"] * 30 + [" ".join(["the old tree"] * 100).encode()] * 7 + [b"A dog."]
    done = translate(
        f"checkpoint={tiny_checkpoint}", "beam_size=1", "max_len_a=0", "max_len_b=2", stdin=b"\n".join(lines)
    )
    assert done.returncode == 0 and len(done.stdout.decode().splitlines()) == 38
    errors = [line for line in done.stderr.decode().splitlines() if line.startswith("WARNING: ")]
    assert [line.split(":")[1] for line in errors if "invalid UTF-8" in line] == [
        f" line {n}" for n in range(1, 6)
    ]
    assert "30 lines in all like these (lines 1, 2, 3, 4, 5, ...): undecodable bytes replaced" in errors[5]
    too_long = [line for line in errors if "pieces exceed" in line]
    assert len(too_long) == 5 and too_long[0].startswith("WARNING: line 31: ")
    assert "7 lines in all like these (lines 31, 32, 33, 34, 35, ...): translating its" in errors[-1]
    assert len(errors) == 12


def test_warnings_name_lines_in_the_whole_input_when_it_comes_in_chunks(tiny_checkpoint):
    """buffer_size=2 translates two lines at a time; a warning still gives the line's number in the whole
    input, not in its chunk."""
    lines = [
        b"The cat sees the house.",
        b"A dog.",
        b"bad \xff line",  # line 3: invalid UTF-8
        b"A dog.",
        " ".join(["the old tree"] * 100).encode(),  # line 5: too long, split
        b"The cat.\t" + b"Katze " * 150,  # line 6: a phrase longer than an output can be
    ]
    done = translate(
        f"checkpoint={tiny_checkpoint}",
        "buffer_size=2",
        "constraints_inline=true",
        "beam_size=1",
        stdin=b"\n".join(lines) + b"\n",
    )
    assert done.returncode == 0 and len(done.stdout.decode().splitlines()) == 6, done.stderr.decode()
    errors = [line for line in done.stderr.decode().splitlines() if line.startswith("WARNING: ")]
    by_line = {line.split(":")[1].strip(): line for line in errors}
    assert sorted(by_line) == ["line 3", "line 5", "line 6"] and len(errors) == 3
    assert "invalid UTF-8" in by_line["line 3"]
    assert "parts; translating its sentences alone" in by_line["line 5"]
    assert "its target prefix and constraints take" in by_line["line 6"]


@pytest.mark.parametrize(
    "make_path, message",
    [
        (lambda tmp: tmp / "missing.pt", "checkpoint not found"),
        (lambda tmp: tmp, "is a directory"),
        (lambda tmp: _write(tmp / "notes.pt", b"not a checkpoint at all"), "is not a checkpoint (not a file"),
        (lambda tmp: _write(tmp / "empty.pt", b""), "is empty (0 bytes): not a checkpoint"),
    ],
    ids=["missing", "directory", "not-a-checkpoint", "empty"],
)
def test_a_bad_checkpoint_path_is_one_line_and_exit_code_2(tmp_path, make_path, message):
    done = translate(f"checkpoint={make_path(tmp_path)}", stdin=b"Hello.\n")
    errors = done.stderr.decode().strip()
    assert done.returncode == 2
    assert len(errors.splitlines()) == 1 and errors.startswith("error: ") and message in errors
    assert done.stdout == b""


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _flip_four_bytes_of_the_largest_tensor(data: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        entry = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_length, extra_length = struct.unpack(
        "<HH", data[entry.header_offset + 26 : entry.header_offset + 30]
    )
    start = entry.header_offset + 30 + name_length + extra_length + entry.file_size // 2  # inside its bytes
    damaged = bytearray(data)
    for i in range(start, start + 4):
        damaged[i] ^= 0xFF
    return bytes(damaged)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data[: len(data) // 2], r"is truncated \([\d,]+ bytes; its end is missing\)"),
        (_flip_four_bytes_of_the_largest_tensor, r"is corrupt: \S+/data/\d+ does not match the checksum"),
        (
            lambda data: _saved({"format": "transformer-checkpoint", "model": _RunsCode()}),
            r"refers to (posix|nt)\.system, which no checkpoint holds; refused",
        ),
    ],
    ids=["truncated", "flipped-bytes", "code"],
)
def test_a_damaged_or_dangerous_checkpoint_is_refused_with_what_is_wrong(
    tiny_checkpoint, tmp_path, damage, message
):
    path = _write(tmp_path / "damaged.pt", damage(tiny_checkpoint.read_bytes()))
    done = translate(f"checkpoint={path}", stdin=b"Hello.\n")
    errors = done.stderr.decode().strip()
    assert done.returncode == 2 and done.stdout == b"" and "pwned" not in done.stdout.decode()
    assert len(errors.splitlines()) == 1 and re.search(message, errors), errors


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_missing_checkpoint_setting_and_unknown_key(tiny_checkpoint):
    done = translate(stdin=b"Hello.\n")
    assert done.returncode == 2 and done.stderr.decode().strip() == (
        "error: checkpoint=PATH is required (a .pt file written by train.py)"
    )
    unknown = translate(f"checkpoint={tiny_checkpoint}", "beam=4")
    assert unknown.returncode != 0 and "Could not override 'beam'" in unknown.stderr.decode()


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_int8_translates_every_line_on_the_cpu_and_is_refused_elsewhere(tiny_checkpoint, tmp_path):
    lines = b"The cat sees the house.\n\nA dog likes a red ball.\n"
    done = translate(f"checkpoint={tiny_checkpoint}", "precision=int8", "beam_size=2", stdin=lines)
    assert done.returncode == 0, done.stderr.decode()
    output = done.stdout.decode().split("\n")
    assert len(output) == 4 and output[0] and output[1] == "" and output[2] and output[3] == ""
    fp32 = translate(f"checkpoint={tiny_checkpoint}", "beam_size=2", stdin=lines)
    assert fp32.stdout.decode().split("\n")[0]  # both translate (this untrained model's outputs may differ)
    for setting in ({"cuda_graphs": True}, {"device": "cuda"}):
        with pytest.raises(ConfigError, match="precision=int8 runs on the CPU"):
            TranslateConfig(checkpoint=str(tiny_checkpoint), precision="int8", **setting)


def test_threads_sets_the_cpu_threads_of_decoding(tiny_checkpoint):
    before = torch.get_num_threads()
    try:
        Translator.from_checkpoint(TranslateConfig(checkpoint=str(tiny_checkpoint), threads=before + 1))
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="threads=0 must be at least 1"):
        TranslateConfig(checkpoint=str(tiny_checkpoint), threads=0)


def test_sorted_batches_come_back_in_input_order(tiny_checkpoint):
    """Length-sorted, token-budget batches give each line the translation it gets alone."""
    translator = Translator.from_checkpoint(TranslateConfig(checkpoint=str(tiny_checkpoint), max_tokens=20))
    lines = ["A dog.", "The cat sees the house and the old tree.", "", "Mein Freund mag das Haus.", "Ein"]
    together = translator.translate(lines)
    alone = [translator.translate([line])[0] for line in lines]
    assert together == alone
    assert len({len(line) for line in together if line}) > 1  # the outputs really differ


def test_a_batch_holds_at_most_max_sentences(tiny_checkpoint, monkeypatch):
    """Short lines fit the source-token budget by the hundred; max_sentences bounds a batch (and with it
    the decoder's cache) without changing any translation."""
    lines = [f"Ein Hund {i}." for i in range(11)] + ["The cat sees the house."]
    unbounded = Translator.from_checkpoint(TranslateConfig(checkpoint=str(tiny_checkpoint)))
    bounded = Translator.from_checkpoint(TranslateConfig(checkpoint=str(tiny_checkpoint), max_sentences=4))
    sizes, search = [], Translator.search

    def recording(self, src, *rest):
        sizes.append(src.size(0))
        return search(self, src, *rest)

    monkeypatch.setattr(Translator, "search", recording)
    expected = unbounded.translate(lines)
    assert sizes == [12]  # one batch within the token budget
    sizes.clear()
    assert bounded.translate(lines) == expected
    assert sizes == [4, 4, 4]


def test_bf16_on_the_cpu_translates_like_fp32_within_its_precision(tiny_checkpoint):
    """precision=bf16 runs the model in bfloat16 (scores still add up in float32): one line out per line
    in, and on this model mostly the fp32 translations."""
    lines = ["A dog.", "The cat sees the house.", "", "Mein Freund mag das Haus."]
    fp32 = Translator.from_checkpoint(TranslateConfig(checkpoint=str(tiny_checkpoint), device="cpu"))
    bf16 = Translator.from_checkpoint(
        TranslateConfig(checkpoint=str(tiny_checkpoint), device="cpu", precision="bf16")
    )
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    half, full = bf16.translate(lines), fp32.translate(lines)
    assert len(half) == len(lines) and half[2] == "" and all(half[i] for i in (0, 1, 3))
    assert sum(half[i] == full[i] for i in (0, 1, 3)) >= 2


def test_split_input_splits_on_newline_only():
    data = "a\u2028b\x0cc\r\n\nd\xff".encode() + b"\xff\n"
    assert split_input(data) == ["a\u2028b\x0cc", "", "d\xff\ufffd"]
    assert split_input(b"") == [] and split_input(b"\n") == [""]


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"beam_size": "abc"}, "beam_size='abc' must be a whole number"),
        ({"beam_size": 0}, "beam_size=0 must be in 1..1024"),
        ({"max_sentences": 0}, "max_sentences=0 must be positive"),
        ({"alpha": "high"}, "alpha='high' must be a number"),
        ({"device": "tpu"}, "device='tpu' must be"),
        ({"text": "a", "input": "b.txt"}, "either text=... or input=FILE"),
        ({"cuda_graphs": "yes"}, "cuda_graphs='yes' must be true or false"),
    ],
)
def test_bad_settings_are_named(tiny_checkpoint, settings, message):
    with pytest.raises(ConfigError, match=message):
        TranslateConfig(checkpoint=str(tiny_checkpoint), **settings)


def test_settings_that_leave_no_room_and_a_text_hydra_read_as_a_number(tiny_checkpoint):
    for max_len_a in (1.0, 0.0):  # the tiny model has 128 positions
        with pytest.raises(ConfigError, match="max_len_b=200 leave no room"):
            Translator.from_checkpoint(
                TranslateConfig(checkpoint=str(tiny_checkpoint), max_len_a=max_len_a, max_len_b=200)
            )
    with pytest.raises(ConfigError, match=r"max_len_a=1000.0 and max_len_b=1 leave no room"):
        Translator.from_checkpoint(
            TranslateConfig(checkpoint=str(tiny_checkpoint), max_len_a=1000.0, max_len_b=1)
        )
    assert TranslateConfig(checkpoint=str(tiny_checkpoint), text=123).text == "123"
    for max_len_b in (10, 200):  # a tiny max_len_a: room beyond any float, or none below 0
        tiny = TranslateConfig(checkpoint=str(tiny_checkpoint), max_len_a=2.2e-309, max_len_b=max_len_b)
        if max_len_b < 128:
            assert Translator.from_checkpoint(tiny).max_source_tokens(tiny.search) == 128
        else:
            with pytest.raises(ConfigError, match="max_len_b=200 leave no room"):
                Translator.from_checkpoint(tiny)


def test_cuda_graphs_without_a_cuda_device_are_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="cuda_graphs=true needs a CUDA device; device=cpu gives the CPU"):
        Translator.from_checkpoint(
            TranslateConfig(checkpoint=str(tiny_checkpoint), cuda_graphs=True, device="cpu")
        )


def test_cuda_graphs_are_off_by_default_on_the_cpu(tiny_checkpoint):
    for precision in ("fp32", "int8"):
        cfg = TranslateConfig(checkpoint=str(tiny_checkpoint), device="cpu", precision=precision)
        assert cfg.cuda_graphs is None and Translator.from_checkpoint(cfg).cfg.cuda_graphs is False


@pytest.mark.gpu
def test_cuda_graphs_translate_as_the_dynamic_search(tiny_checkpoint):
    """The real command on CUDA, with and without cuda_graphs: the same lines (fp32, so that the two
    searches' arithmetic cannot round apart); on CUDA they are on by default."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lines = b"The cat sees the house.\n\nA dog likes a red ball.\nMein Freund findet das Haus.\n"
    runs = [
        translate(
            f"checkpoint={tiny_checkpoint}", "device=cuda", "precision=fp32", f"cuda_graphs={g}", stdin=lines
        )
        for g in ("false", "true")
    ]
    for done in runs:
        assert done.returncode == 0, done.stderr.decode()
    assert runs[1].stdout == runs[0].stdout and len(runs[1].stdout.splitlines()) == 4
    default = Translator.from_checkpoint(TranslateConfig(checkpoint=str(tiny_checkpoint), device="cuda"))
    assert default.cfg.cuda_graphs is True
