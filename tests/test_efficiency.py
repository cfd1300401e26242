"""benchmarks/efficiency.py end to end at tiny sizes on the CPU: what it reports must hold whatever the
machine (speed is never asserted): fused attention equals Eq. 1 written out, the cache bytes are the
formula's, the mixtures have the parameters their shapes give."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_three_routes_are_measured_and_their_accounting_is_exact(tmp_path):
    out = tmp_path / "efficiency.json"
    args = "--size tiny --threads 1 --max-len 256 --vocab 100 --sentences 2 --new-tokens 3 6"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "efficiency.py"), *args.split(), "--batch", "2",
         "--length", "8", "--rounds", "2", "--json", str(out), "--plot", str(tmp_path / "attention.png")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())

    attention = result["attention"]["rows"]
    assert [r["length"] for r in attention] == [64, 128, 256]
    assert all(r["max_diff"] < 1e-5 and r["fused_ms"] > 0 and r["written_ms"] > 0 for r in attention)

    layers, d_k, fp32 = 2, 64 // 8, 4  # keys and values, per layer, per key/value head
    kv = {r["n_kv_heads"]: r for r in result["kv"]["rows"]}
    assert sorted(kv) == [1, 2, 4, 8]
    for heads, row in kv.items():
        assert row["self_per_token"] == row["cross_per_token"] == 2 * layers * heads * d_k * fp32
        assert row["tokens_per_s_3"] > 0 and row["tokens_per_s_6"] > 0
        assert row["cache_mib_6"] * 2**20 == 2 * (4 * row["self_per_token"] * 6 + row["cross_per_token"] * 30)

    dense, top2, top1 = result["moe"]["rows"]

    def ffn(d_ff: int) -> int:  # W_1, b_1, W_2, b_2 of one expert or of the dense network
        return 2 * 64 * d_ff + d_ff + 64

    added = {"top-2": 4 * ffn(64) + 4 * 64 - ffn(128), "top-1": 8 * ffn(128) + 8 * 64 - ffn(128)}  # + routers
    for row, key in ((top2, "top-2"), (top1, "top-1")):  # 2 encoder + 2 decoder layers
        assert round(row["params_m"] * 1e6) == round(dense["params_m"] * 1e6) + 2 * layers * added[key]
    active = {"top-2": 4 * 64 + 2 * ffn(64) - ffn(128), "top-1": 8 * 64}  # the router, k experts, not the FFN
    for row, key in ((top2, "top-2"), (top1, "top-1")):
        assert round(row["active_m"] * 1e6) == round(dense["active_m"] * 1e6) + 2 * layers * active[key]
    assert dense["active_m"] == dense["params_m"] and 0 <= top2["dropped"] < 1 and top1["tokens_per_s"] > 0
    assert (tmp_path / "attention.png").stat().st_size > 0
