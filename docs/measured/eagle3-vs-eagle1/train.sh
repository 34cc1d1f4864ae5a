#!/usr/bin/env bash
# Equal-minutes comparison on the default model (this 2-core CPU, bf16): an EAGLE-3 head and the
# EAGLE-1 head of today's recipe (stage 1 of assets/smolvlm-toyworld-drafter, shortened), each from
# scratch, the same data (ToyWorld in the target's answer style + the same 128 Magpie text pairs,
# written once by the first run and copied to the second), the same steps, batch, lr and budget.
set -euo pipefail
cd "$(dirname "$0")/../../.."
COMMON="--target models/smolvlm-toyworld --dtype bfloat16 --steps 230 --batch-size 6 --lr 1e-3 --draft-vocab 4096 \
  --text-pairs 128 --text-share 0.34 --answer-style tally --eval-n 0 --minutes 10"
flock /tmp/vlmspec-heavy.lock .venv/bin/vlmspec train --arch eagle3 --out runs/cmp-e3 $COMMON
mkdir -p runs/cmp-e1 && cp runs/cmp-e3/magpie.json runs/cmp-e1/
flock /tmp/vlmspec-heavy.lock .venv/bin/vlmspec train --arch eagle1 --out runs/cmp-e1 $COMMON
# the budget diagnostic: EAGLE-3 with twice the steps (the same data, the same pairs)
if [ "${LONG:-0}" = 1 ]; then
  mkdir -p runs/cmp-e3-long && cp runs/cmp-e3/magpie.json runs/cmp-e3-long/
  flock /tmp/vlmspec-heavy.lock .venv/bin/vlmspec train --arch eagle3 --out runs/cmp-e3-long --target models/smolvlm-toyworld \
    --dtype bfloat16 --steps 460 --batch-size 6 --lr 1e-3 --draft-vocab 4096 --text-pairs 128 --text-share 0.34 \
    --answer-style tally --eval-n 0 --minutes 20
fi
# the unroll diagnostic: EAGLE-3 trained with training-time test over 5 steps (the tree's depth) instead of 2
if [ "${TTT5:-0}" = 1 ]; then
  mkdir -p runs/cmp-e3-ttt5 && cp runs/cmp-e3/magpie.json runs/cmp-e3-ttt5/
  flock /tmp/vlmspec-heavy.lock .venv/bin/vlmspec train --arch eagle3 --out runs/cmp-e3-ttt5 --target models/smolvlm-toyworld \
    --dtype bfloat16 --steps 230 --batch-size 6 --lr 1e-3 --draft-vocab 4096 --text-pairs 128 --text-share 0.34 \
    --answer-style tally --eval-n 0 --minutes 12 --ttt-steps 5
fi
# the shipped head's budget: the two stages of assets/smolvlm-toyworld-drafter (700 + 250 steps, 512 + 512
# text pairs, the acceptance head), with EAGLE-3 and training-time test over the tree's depth (5)
if [ "${FULL:-0}" = 1 ]; then
  flock /tmp/vlmspec-heavy.lock .venv/bin/vlmspec train --arch eagle3 --ttt-steps 5 --target models/smolvlm-toyworld --out runs/e3-full1 \
    --dtype bfloat16 --steps 700 --batch-size 6 --lr 1e-3 --draft-vocab 4096 --text-pairs 512 --text-share 0.34 \
    --acceptance-head --answer-style tally --eval-every 700 --minutes 75
  flock /tmp/vlmspec-heavy.lock .venv/bin/vlmspec train --arch eagle3 --ttt-steps 5 --target models/smolvlm-toyworld --out runs/e3-full2 \
    --init-from runs/e3-full1/drafter --dtype bfloat16 --steps 250 --batch-size 6 --lr 5e-4 --draft-vocab 4096 --text-pairs 512 \
    --text-style varied --text-share 0.5 --acceptance-head --answer-style tally --eval-every 250 --minutes 40
fi
# the layer diagnostic: the TTT5 run with the upper half's layers [15, 22, 29] in place of EAGLE-3's [2, 15, 27]
if [ "${LAYERS:-0}" = 1 ]; then
  flock /tmp/vlmspec-heavy.lock .venv/bin/vlmspec train --arch eagle3 --feature-layers 15,22,29 --out runs/cmp-e3-upper --target models/smolvlm-toyworld \
    --dtype bfloat16 --steps 230 --batch-size 6 --lr 1e-3 --draft-vocab 4096 --text-pairs 128 --text-share 0.34 \
    --answer-style tally --eval-n 0 --minutes 12 --ttt-steps 5
fi
# the unroll diagnostic, deeper: training-time test over 7 steps (the shipped tree's depth), the TTT5 run otherwise
if [ "${TTT7:-0}" = 1 ]; then
  mkdir -p runs/cmp-e3-ttt7 && cp runs/cmp-e3-upper/magpie.json runs/cmp-e3-ttt7/
  flock /tmp/vlmspec-heavy.lock .venv/bin/vlmspec train --arch eagle3 --out runs/cmp-e3-ttt7 --target models/smolvlm-toyworld \
    --dtype bfloat16 --steps 230 --batch-size 6 --lr 1e-3 --draft-vocab 4096 --text-pairs 128 --text-share 0.34 \
    --answer-style tally --eval-n 0 --minutes 15 --ttt-steps 7
fi
