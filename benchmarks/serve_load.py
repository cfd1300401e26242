"""Load on `scripts/serve.py`: N clients, each on a keep-alive connection, send POST /translate back to
back for a fixed time; requests/s, p50 / p99 latency, errors and the requests per batch, for uniform
settings (every request the server's defaults) and mixed ones (a quarter each of four searches). The
server runs in a process of its own; the clients are threads of this one, on the same machine.

  python benchmarks/serve_load.py --checkpoint runs/demo/checkpoints/checkpoint_average_last5.pt
  python benchmarks/serve_load.py --url http://127.0.0.1:8000 --clients 1 8 32 --seconds 10 --json load.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from transformer.utils import atomic

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = [
    "Today the dog sees the cat.",
    "The woman knows that the old man has seen the small bird.",
    "The children play in the garden.",
    "The teacher reads a book.",
    "Yesterday the man bought a red car.",
    "The girl thinks that the boy likes the dog.",
]
MIXES = {
    "uniform": [{}],
    "mixed": [{}, {"beam_size": 2}, {"beam_size": 1}, {"alpha": 1.0}],
}


def start_server(checkpoint: str, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """serve.py on a free port of the loopback; its process and URL once it listens."""
    command = [sys.executable, str(ROOT / "scripts" / "serve.py"), f"checkpoint={checkpoint}", "port=0"]
    command += [f"threads={threads}", *extra]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    said = ""
    while not (found := re.search(r"on (http://[\d.]+:\d+)", said)):
        line = process.stderr.readline()
        if not line:
            raise SystemExit(f"serve.py did not start:\n{said}")
        said += line
    threading.Thread(target=process.stderr.read, daemon=True).start()  # drain its log
    return process, found.group(1)


def client(url: str, mix: list[dict], until: float, seed: int, results: list) -> None:
    """Requests back to back on one keep-alive connection until `until`: (seconds, status, batch)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    n = seed
    while time.perf_counter() < until:
        body = json.dumps({"text": [SENTENCES[n % len(SENTENCES)]], **mix[n % len(mix)]})
        n += 1
        start = time.perf_counter()
        try:
            connection.request("POST", "/translate", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            answer = response.read()
            status = response.status
        except (OSError, http.client.HTTPException):
            status, answer = 0, b"{}"
            connection.close()
            connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        batch = json.loads(answer).get("batch") if status == 200 else None
        results.append((time.perf_counter() - start, status, batch))
    connection.close()


def load(url: str, clients: int, seconds: float, mix: list[dict]) -> dict:
    results: list = []
    until = time.perf_counter() + seconds
    threads = [threading.Thread(target=client, args=(url, mix, until, i, results)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    ok = sorted(t for t, status, _ in results if status == 200)
    batches = [b for _, status, b in results if status == 200]
    per_batch = len(batches) / max(len(set(batches)), 1)
    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "requests_per_s": len(ok) / elapsed,
        "p50_ms": 1e3 * statistics.median(ok) if ok else None,
        "p99_ms": 1e3 * ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else None,
        "requests_per_batch": per_batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint", help="start serve.py with this checkpoint")
    where.add_argument("--url", help="a server already running")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--server-arg", action="append", default=[], help="another key=value for serve.py")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    process, url = (
        (None, args.url) if args.url else start_server(args.checkpoint, args.threads, args.server_arg)
    )
    try:
        load(url, 1, 1.0, MIXES["uniform"])  # warm up
        rows = []
        for mix in args.mixes:
            for clients in args.clients:
                row = {"mix": mix, **load(url, clients, args.seconds, MIXES[mix])}
                rows.append(row)
                print(
                    f"{mix:8} {clients:3} clients: {row['requests_per_s']:6.1f} requests/s, "
                    f"p50 {row['p50_ms'] or 0:7.0f} ms, p99 {row['p99_ms'] or 0:7.0f} ms, "
                    f"errors {row['errors']}, {row['requests_per_batch']:.1f} requests a batch",
                    flush=True,
                )
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    if args.json:
        atomic.write_bytes(args.json, json.dumps({"url": url, "rows": rows}, indent=1).encode("utf-8"))


if __name__ == "__main__":
    main()
