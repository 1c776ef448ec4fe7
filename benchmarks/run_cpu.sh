#!/usr/bin/env bash
# Run `make bench` on this machine's CPU and write its summary: benchmarks/results/cpu-<date>.md (the command,
# machine, versions, load, wall time and the table). The run's JSON stays in benchmarks/results/latest.json,
# which git ignores: raw run files are not kept in the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
day=$(date -u +%F)
SECONDS=0
make bench
wall=$SECONDS
.venv/bin/python - benchmarks/results/latest.json "benchmarks/results/cpu-$day.md" "$wall" <<'PY'
import json, sys
from logitless.tools.bench import format_report
result = json.load(open(sys.argv[1]))
text = format_report(result).replace("\n\nN=", f"\n- `make bench` wall time: {float(sys.argv[3]):.0f} s\n\nN=", 1)
open(sys.argv[2], "w").write(text)
PY
echo "wrote benchmarks/results/cpu-$day.md"
