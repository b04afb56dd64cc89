"""Rebuild a sweep JSON (the summary keys `nori-jax plan sweep --measured` reads) from the text
report that `bench serve` printed, for sweeps whose --result-json did not survive (a device call
returns only small files; a 1,000-request sweep's JSON with its per-request arrays is ~30 MB).

    python benchmarks/plan/report_to_sweep.py serve.log > sweep.json

Only the summary lines vLLM's report prints are read, and the "Server" block's (the engine's
steps from its /metrics; None where the report has none); per-request data cannot be recovered.
"""

from __future__ import annotations

import json
import re
import sys

# report label -> vLLM's result key
LABELS = {
    "Successful requests": "completed",
    "Failed requests": "failed",
    "Benchmark duration (s)": "duration",
    "Total input tokens": "total_input_tokens",
    "Total generated tokens": "total_output_tokens",
    "Request throughput (req/s)": "request_throughput",
    "Output token throughput (tok/s)": "output_throughput",
    "Total token throughput (tok/s)": "total_token_throughput",
}
# the "Server" block (nori_jax/bench/report.py SERVER_ROWS)
SERVER_LABELS = {
    "Engine steps": "server_steps",
    "Mean step time (ms)": "server_mean_step_ms",
    "Mean scheduler time (ms)": "server_mean_scheduler_ms",
    "Tokens per step": "server_tokens_per_step",
    "Mean core I/O per step (ms)": "server_mean_core_io_ms",
    "Mean TTFT at the engine (ms)": "server_mean_ttft_ms",
}
LABELS |= SERVER_LABELS
_INTS = ("completed", "failed", "server_steps")
for _metric, _name in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2EL", "e2el")):
    for _stat, _key in (("Mean", "mean"), ("Median", "median"), ("P99", "p99")):
        LABELS[f"{_stat} {_metric} (ms)"] = f"{_key}_{_name}_ms"

_LINE = re.compile(r"^(?P<label>[^:]+):\s+(?P<value>[-+0-9.eE]+|inf)\s*$")


def parse(text: str) -> dict:
    runs: list[dict] = []
    for line in text.splitlines():
        if line.startswith("Traffic request rate:"):
            rate = float(line.split(":", 1)[1])
            runs.append({"request_rate": rate} | dict.fromkeys(SERVER_LABELS.values()))
            continue
        m = _LINE.match(line.strip())
        if runs and m and m["label"].strip() in LABELS:
            key = LABELS[m["label"].strip()]
            value = float(m["value"])
            runs[-1][key] = int(value) if key in _INTS else value
    missing = [r["request_rate"] for r in runs if "p99_tpot_ms" not in r]
    if not runs or missing:
        raise SystemExit(f"no complete report in the input (incomplete rates: {missing})")
    return {"source": "rebuilt from the printed bench serve report", "runs": runs}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(parse(f.read()), indent=1))
