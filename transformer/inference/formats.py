"""How translate.py writes its results (`output_format`), one input line's worth at a time:

- `text`: the best translation, one line per input line;
- `fairseq`: the lines fairseq-generate prints, per input line i: `S-i` (the source as given), then per
  hypothesis `H-i` (score, pieces), `D-i` (score, detokenized text) and `P-i` (each piece's and EOS's
  log-probability), and with `alignment=true` `A-i` (the hard alignment of pieces, "source-target"
  indices from 0, EOS excluded). As fairseq prints them, scores are in base 2 (natural log / ln 2),
  P- values with four decimals; the H-/D- score is this project's ranking score (log P / lp(Y), GNMT),
  not fairseq's (log P / |Y|^lenpen);
- `jsonl`: one JSON object per input line: {"line", "source", "hypotheses": [{"text", "score",
  "log_prob", "pieces", "token_log_probs"}]}, natural logs, `score` = log_prob / lp(Y) with the
  decoding's alpha (0 for a beam of 1 and for sampling's ranking); with `alignment=true` each hypothesis
  also has "alignment" (of words) and "piece_alignment" (of pieces): [source, target] index pairs.
"""

from __future__ import annotations

import json
import math
from typing import Any

from transformer.inference.alignment import links_text
from transformer.inference.translation import Translation


def translation_dict(t: Translation) -> dict[str, Any]:
    """A hypothesis as JSON takes it."""
    entry = {
        "text": t.text,
        "score": t.score,
        "log_prob": t.log_prob,
        "pieces": t.pieces,
        "token_log_probs": t.token_log_probs,
    }
    if t.alignment is not None:
        entry["alignment"] = [list(link) for link in t.alignment.words]
        entry["piece_alignment"] = [list(link) for link in t.alignment.pieces]
    return entry


def format_line(kind: str, number: int, source: str, hypotheses: list[Translation]) -> str:
    """The output of input line `number` (0-based) in format `kind`, newline-terminated."""
    if kind == "text":
        return (hypotheses[0].text if hypotheses else "") + "\n"
    if kind == "jsonl":
        entry = {"line": number, "source": source, "hypotheses": [translation_dict(h) for h in hypotheses]}
        return json.dumps(entry, ensure_ascii=False) + "\n"
    lines = [f"S-{number}\t{' '.join(source.splitlines())}"]  # one line, whatever breaks it held
    for h in hypotheses:
        score = h.score / math.log(2)
        pieces = [p for p in h.pieces if p != "</s>"]  # EOS (each part's) shows in P- only, as A- counts
        lines.append(f"H-{number}\t{score}\t{' '.join(pieces)}")
        lines.append(f"D-{number}\t{score}\t{h.text}")
        lines.append(f"P-{number}\t{' '.join(f'{p / math.log(2):.4f}' for p in h.token_log_probs)}")
        if h.alignment is not None:
            lines.append(f"A-{number}\t{links_text(h.alignment.pieces)}")
    return "".join(line + "\n" for line in lines)
