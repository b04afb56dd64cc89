"""Summarize a folder of text documents with `nori-jax run-batch` (docs/batch.md).

    python examples/batch_summarize.py write docs/ summaries.in.jsonl    # one request per file
    nori-jax run-batch -i summaries.in.jsonl -o summaries.out.jsonl      # the embedded model
    python examples/batch_summarize.py read summaries.out.jsonl          # file: summary

Each document becomes a /v1/chat/completions request whose custom_id is the file's path, so the
answers, which come back in the order they finish, join back to their files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

INSTRUCTION = "Summarize the following document in two or three sentences."


def write(folder: Path, out: Path, max_chars: int, max_tokens: int, pattern: str) -> int:
    n = 0
    with out.open("w") as f:
        for path in sorted(folder.rglob(pattern)):
            text = path.read_text(errors="replace")[:max_chars]  # within the model's context
            body = {
                "messages": [
                    {"role": "system", "content": INSTRUCTION},
                    {"role": "user", "content": text},
                ],
                "max_tokens": max_tokens,
                "temperature": 0.0,
            }
            line = {"custom_id": str(path), "method": "POST", "url": "/v1/chat/completions"}
            f.write(json.dumps(line | {"body": body}) + "\n")
            n += 1
    print(f"{n} requests in {out}", file=sys.stderr)
    return 0


def read(out: Path) -> int:
    for row in map(json.loads, out.read_text().splitlines()):
        response = row["response"]
        if response is None:  # a line that was not a request
            print(f"{row['custom_id']}: ERROR {row['error']['message']}")
        elif response["status_code"] != 200:
            print(f"{row['custom_id']}: ERROR {response['body']['error']['message']}")
        else:
            summary = response["body"]["choices"][0]["message"]["content"].strip()
            print(f"{row['custom_id']}: {' '.join(summary.split())}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="a batch file of one summary request per document")
    w.add_argument("folder", type=Path)
    w.add_argument("output", type=Path)
    w.add_argument("--pattern", default="*.txt", help="which files (default: *.txt)")
    w.add_argument("--max-chars", type=int, default=4000, help="of each document (default: 4000)")
    w.add_argument("--max-tokens", type=int, default=96, help="per summary (default: 96)")
    r = sub.add_parser("read", help="print each file's summary from run-batch's output")
    r.add_argument("output", type=Path)
    args = p.parse_args()
    if args.command == "write":
        return write(args.folder, args.output, args.max_chars, args.max_tokens, args.pattern)
    return read(args.output)


if __name__ == "__main__":
    sys.exit(main())
