#!/bin/bash
# Capture time and peak memory of zoo presets: one `tag inspect --no-cache` process per model,
# timed by /usr/bin/time -v (wall clock, user + system CPU seconds, maximum resident set size).
# Usage: evaluation/capture_scale.sh gpt2-small llama-7b ...   (PYTHON, OUT optional)
set -u
out=${OUT:-/tmp/capture-scale}
mkdir -p "$out"
cd "$(git rev-parse --show-toplevel)"
export HF_HUB_OFFLINE=1 PYTHONPATH=. TAG_CACHE_DIR="$out/cache"
for m in "$@"; do
  /usr/bin/time -v "${PYTHON:-python}" -m tag inspect --model "$m" --no-cache --json > "$out/$m.json" 2> "$out/$m.time"
  field() { grep "$1" "$out/$m.time" | awk '{print $NF}'; }
  echo "$m wall=$(field Elapsed) user=$(field 'User time') sys=$(field 'System time')" \
       "rss_kb=$(field 'Maximum resident') load=$(cut -d' ' -f1 /proc/loadavg)" >> "$out/summary.txt"
done
