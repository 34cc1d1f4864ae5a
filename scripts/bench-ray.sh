#!/usr/bin/env bash
# docs/scale-out.md's load figures: `vlmspec bench load --url` against `vlmspec serve --replicas N` on
# a local Ray, for each "REPLICAS:CPUS_EACH" given, on the toy model, fp32; "one" is the one-process
# service (no Ray). Default: one, then 1 replica of 2 CPUs, then 2 of 1 CPU (the same 2 cores each time).
# Each service is started, measured, stopped (SIGTERM: the app deleted, the local Ray shut down)
# before the next. Figures: OUT/replicas-N/ (OUT/one-process/ for "one"). BENCH_ARGS replaces the
# sweep's options (default below).
#   scripts/bench-ray.sh [OUT] [one | REPLICAS:CPUS ...]      (OUT: docs/serving-ray)
set -euo pipefail
cd "$(dirname "$0")/.."
VLMSPEC=${VLMSPEC:-.venv/bin/vlmspec}
out=${1:-docs/serving-ray}
shift || true
[ $# -gt 0 ] && configs=("$@") || configs=(one 1:2 2:1)
port=${PORT:-18500}
BENCH_ARGS=${BENCH_ARGS:---ways plain,goodput --concurrency 1,2,4,8 --requests 16 --max-new-tokens 64}
for config in "${configs[@]}"; do
    if [ "$config" = one ]; then
        serve=() name=one-process
    else
        n=${config%%:*} cpus=${config##*:}
        serve=(--replicas "$n" --replica-cpus "$cpus") name=replicas-$n
    fi
    # a cost-model cache of its own: each service's replicas measure their goodput cost model at start
    VLMSPEC_CACHE_DIR=$(mktemp -d)
    export VLMSPEC_CACHE_DIR
    $VLMSPEC serve --model toy --dtype float32 "${serve[@]}" --port "$port" --no-ui --log-level warning &
    pid=$!
    trap 'kill -TERM $pid 2>/dev/null; wait $pid' EXIT
    for _ in $(seq 1 300); do
        curl -sf -m 5 "http://127.0.0.1:$port/healthz" >/dev/null && break
        kill -0 $pid 2>/dev/null || { echo "bench-ray: vlmspec serve ${serve[*]} exited"; exit 1; }
        sleep 1
    done
    $VLMSPEC bench load --url "http://127.0.0.1:$port" $BENCH_ARGS --out "$out/$name"
    kill -TERM $pid
    wait $pid || true
    trap - EXIT
done
