#!/usr/bin/env bash
# Run `make bench` on this machine's CPU and keep its results as benchmarks/results/cpu-<date>.{json,md}.
# The .md holds the command, machine, versions, load, wall time and the table.
set -euo pipefail
cd "$(dirname "$0")/.."
day=$(date -u +%F)
SECONDS=0
make bench
wall=$SECONDS
cp benchmarks/results/latest.json "benchmarks/results/cpu-$day.json"
.venv/bin/python - "benchmarks/results/cpu-$day.json" "benchmarks/results/cpu-$day.md" "$wall" <<'PY'
import json, sys
from logitless.tools.bench import format_report
result = json.load(open(sys.argv[1]))
text = format_report(result).replace("\n\nN=", f"\n- `make bench` wall time: {float(sys.argv[3]):.0f} s\n\nN=", 1)
open(sys.argv[2], "w").write(text)
PY
echo "wrote benchmarks/results/cpu-$day.json and .md"
