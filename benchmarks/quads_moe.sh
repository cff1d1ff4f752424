#!/bin/bash
# QUADS in the MoE setting, every arm at once: bf16, naive NVFP4, QUADS, QAT alone, naive +
# token-level IS (one comparison) and naive / QUADS with routing replay (a second one, on the
# same warm start, copied once the first has trained it), 3 seeds each, as parallel processes.
#
#   bash benchmarks/quads_moe.sh OUT_DIR [MINUTES] [extra lowbit rl flags]
#
# OUT_DIR gets main/ and replay/, each a `lowbit rl --compare` folder (compare-add-worked/ holds
# the paired tables on the bf16 and W4A16 evaluators). MINUTES (default: none) is each
# comparison's --stop-after-minutes, counted from that comparison's start (the replay one starts
# once the warm start is trained); calling again with the same OUT_DIR continues the runs
# (--resume is added when run folders exist). Flags after MINUTES go to both comparisons and
# override the defaults below (e.g. --steps 300 --device cpu). On one GPU: 21 processes, bound by
# the host at this size.
set -eu
USAGE="usage: bash benchmarks/quads_moe.sh OUT_DIR [MINUTES] [lowbit rl flags]"
if [ $# -lt 1 ] || [ -z "$1" ]; then echo "give an output folder; $USAGE" >&2; exit 2; fi
OUT_DIR=$1
MINUTES=${2:-}
if [ -n "$MINUTES" ] && ! [[ "$MINUTES" =~ ^[0-9]+([.][0-9]+)?$ ]]; then
    echo "MINUTES must be a number of minutes, got '$MINUTES'; $USAGE" >&2; exit 2
fi
shift $(( $# < 2 ? $# : 2 ))
PY=${PYTHON:-python}
MAIN=$OUT_DIR/main; REPLAY=$OUT_DIR/replay
mkdir -p "$MAIN" "$REPLAY"
FLAGS=(--parallel-runs 15 --model tiny --n-experts 8 --task add-worked --task-size 3 --max-completion-length 40
       --warmstart-steps 1500 --warmstart-target 0.3 --warmstart-seed 0 --eval-problems 256
       --steps 1000 --eval-every 25 --prompts-per-step 16 --num-generations 8 --lr 1e-4
       --checkpoint-every 50 --seeds 0,1,2 --no-progress)
[ -n "$MINUTES" ] && FLAGS+=(--stop-after-minutes "$MINUTES")
FLAGS+=("$@")
resume() { if ls -d "$1"/rl-* > /dev/null 2>&1; then echo --resume; fi; }
main=; replay=
trap 'kill $main $replay 2> /dev/null || true' EXIT INT TERM   # no comparison outlives the script

$PY -m lowbit rl "${FLAGS[@]}" --out-dir "$MAIN" $(resume "$MAIN") \
    --compare bf16,nvfp4,nvfp4+quads,nvfp4+qat,nvfp4+is > "$OUT_DIR/main.log" 2>&1 &
main=$!
until [ -d "$REPLAY/warmstart" ]; do   # the replay arms start from the same warm start
    if ls "$MAIN"/warmstart/*/final.json > /dev/null 2>&1; then
        sleep 5   # its checkpoint is written with final.json; copied whole, then moved in
        rm -rf "$REPLAY/.warmstart.partial"
        cp -r "$MAIN/warmstart" "$REPLAY/.warmstart.partial" && mv "$REPLAY/.warmstart.partial" "$REPLAY/warmstart"
    elif ! kill -0 $main 2> /dev/null; then
        echo "the main comparison ended before its warm start did: see $OUT_DIR/main.log" >&2; exit 1
    else
        sleep 2
    fi
done
$PY -m lowbit rl "${FLAGS[@]}" --parallel-runs 6 --out-dir "$REPLAY" $(resume "$REPLAY") \
    --compare nvfp4,nvfp4+quads --routing-replay > "$OUT_DIR/replay.log" 2>&1 &
replay=$!
status=0
wait $main || status=$?
wait $replay || status=$?
tail -n 30 "$OUT_DIR/main.log" "$OUT_DIR/replay.log"
exit $status
