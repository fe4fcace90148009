#!/bin/bash
# usage: run_pair.sh TREE OUTPREFIX ; a broker and one fixed-time worker of TREE; two bench run processes
# (two principals) at once: a flood (125 req/s) and a light client (5 req/s), 100 ms timeouts;
# WORKER_ARGS: more gpu_worker arguments (e.g. "--credit 8"); LIGHT_PY: a script run as the light client instead;
# WORKER_PY: a script run as the worker instead of -m gpu_worker (with the same arguments: a traced worker);
# FIXED_MS: the model's time (20); FLOOD_RATE: the flood's requests a second (125);
# LIGHT_LOAD: the light client's load (default --request-rate-range 5:5; e.g. --streams-range 1:1 --fps 30);
# BROKER_PY: a script run as the broker instead of -m broker (newcomer_turn_1207/trace/traced_broker.py);
# BROKER_ARGS: more broker arguments (e.g. "--log-level info --log-format json"); KEEP_LOGS=DIR:
# the broker's and the worker's stderr copied there (read_wake_1207c/broker_trace/an_tr.py reads them)
set -u
TREE=$1; OUT=$2
PY=/work/main/.venv/bin/python
RT=$(mktemp -d /tmp/ovl/rt.XXXX)
export XDG_RUNTIME_DIR=$RT
cd $TREE
PYTHONPATH=$TREE:$TREE/tests/e2e $PY ${BROKER_PY:--m broker} ${BROKER_ARGS:-} --frontend ipc://$RT/fe.ipc --backend ipc://$RT/be.ipc > $RT/broker.out 2> $RT/broker.err &
B=$!
for i in $(seq 100); do [ -S $RT/be.ipc ] && break; sleep 0.1; done
FIXED_MS=${FIXED_MS:-20} PYTHONPATH=$TREE:$TREE/tests/e2e $PY ${WORKER_PY:--m gpu_worker} --broker ipc://$RT/be.ipc --model bench_models:fixed --max-batch 1 ${WORKER_ARGS:-} > $RT/worker.out 2> $RT/worker.err &
W=$!
for i in $(seq 300); do grep -q READY $RT/worker.out 2>/dev/null && break; sleep 0.1; done
cd /work/main
$PY -m bench run --endpoint ipc://$RT/fe.ipc --service fixed --input x=16:uint8 --request-rate-range ${FLOOD_RATE:-125}:${FLOOD_RATE:-125} \
   --timeout-s 0.1 --window-s 4 --warmup-s 1 --json ${OUT}_flood.json --quiet > $RT/flood.out 2>&1 &
F=$!
if [ -n "${LIGHT_PY:-}" ]; then  # a script in the light client's place: LIGHT_PY FRONTEND, its output to OUT_light.txt
  $PY $LIGHT_PY ipc://$RT/fe.ipc > ${OUT}_light.txt 2>&1
else
  $PY -m bench run --endpoint ipc://$RT/fe.ipc --service fixed --input x=16:uint8 ${LIGHT_LOAD:---request-rate-range 5:5} \
     --timeout-s 0.1 --window-s 4 --warmup-s 1 --json ${OUT}_light.json --quiet > $RT/light.out 2>&1
fi
echo "light rc=$?"; wait $F; echo "flood rc=$?"
kill -TERM $W; wait $W; kill -TERM $B; wait $B
[ -n "${KEEP_LOGS:-}" ] && cp $RT/broker.err $RT/worker.err $KEEP_LOGS/
rm -rf $RT
