#!/bin/bash
# usage: run.sh TREE OUTJSON: a broker and one fixed 20 ms worker of TREE, then measure.py with TREE's client
set -u
TREE=$1; OUT=$(realpath -m $2)
PY=/work/main/.venv/bin/python
HERE=$(cd $(dirname $0) && pwd)
RT=$(mktemp -d /tmp/sb.XXXX)
export XDG_RUNTIME_DIR=$RT
cd $TREE
PYTHONPATH=$TREE $PY -m broker --frontend ipc://$RT/fe.ipc --backend ipc://$RT/be.ipc > $RT/broker.out 2> $RT/broker.err &
B=$!
for i in $(seq 100); do [ -S $RT/be.ipc ] && break; sleep 0.1; done
FIXED_MS=20 PYTHONPATH=$TREE:$TREE/tests/e2e $PY -m gpu_worker --broker ipc://$RT/be.ipc --model bench_models:fixed --max-batch 1 > $RT/worker.out 2> $RT/worker.err &
W=$!
for i in $(seq 300); do grep -q READY $RT/worker.out 2>/dev/null && break; sleep 0.1; done
PYTHONPATH=$TREE $PY $HERE/measure.py ipc://$RT/fe.ipc $OUT
kill -TERM $W; wait $W; kill -TERM $B; wait $B
rm -rf $RT
