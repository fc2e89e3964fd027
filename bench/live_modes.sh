#!/usr/bin/env bash
# Live cached / on_demand / cpu_assist on CPU with the random demo model (the live-modes row in bench/RESULTS.md):
# one daemon per mode, the same `loraplex bench serve` workload against each; rows to
# bench/results/live_cpu_modes.json. Run on a quiet host: the figures are wall-clock.
set -u
cd "$(dirname "$0")/.."
out=$(mktemp -d)
for mode in cached on_demand cpu_assist; do
  rt=$out/rt-$mode; st=$out/st-$mode
  LORAPLEX_DEMO=random LORAPLEX_RUNTIME_DIR=$rt LORAPLEX_STATE_DIR=$st .venv/bin/loraplex serve --device cpu \
    --adapter-load-mode $mode --cache-policy none --num-pages 600 --max-num-seqs 16 --cpu-workers 2 > $out/daemon-$mode.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do [ -S $rt/client.sock ] && .venv/bin/loraplex stats --runtime-dir $rt >/dev/null 2>&1 && break; sleep 0.5; done
  echo "load before $mode: $(cut -d' ' -f1 /proc/loadavg)" >&2
  .venv/bin/loraplex bench serve --runtime-dir $rt --json --seed 0 --rate 1 --duration 30 --adapters 6 \
    --prompt-mean 64 --output-mean 16 > $out/row-$mode.json 2> $out/bench-$mode.err
  echo "load after $mode: $(cut -d' ' -f1 /proc/loadavg)" >&2
  kill -TERM $pid; wait $pid
done
OUT=$out .venv/bin/python - <<'PY'
import json, os
OUT = os.environ["OUT"]
rows = []
for mode in ("cached", "on_demand", "cpu_assist"):
    row = json.load(open(f"{OUT}/row-{mode}.json")); row["label"] = mode; rows.append(row)
json.dump(rows, open("bench/results/live_cpu_modes.json", "w"), indent=1)
for r in rows:
    print(r["label"], {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                       if k in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpt_ms", "throughput_rps", "slo_attainment", "cache_hit_rate", "requests")})
PY
rm -rf "$out"
