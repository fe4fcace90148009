#!/bin/bash
# usage: run_tree.sh TREE OUTJSON ; runs a broker and one fixed-time worker of TREE, then bench run (this tree's bench)
set -u
TREE=$1; OUT=$2
PY=/work/main/.venv/bin/python
RT=$(mktemp -d /tmp/ovl/rt.XXXX)
export XDG_RUNTIME_DIR=$RT
cd $TREE
PYTHONPATH=$TREE:$TREE/tests/e2e $PY -m broker --frontend ipc://$RT/fe.ipc --backend ipc://$RT/be.ipc > $RT/broker.out 2> $RT/broker.err &
B=$!
for i in $(seq 100); do [ -S $RT/be.ipc ] && break; sleep 0.1; done
FIXED_MS=20 PYTHONPATH=$TREE:$TREE/tests/e2e $PY -m gpu_worker --broker ipc://$RT/be.ipc --model bench_models:fixed --max-batch 1 > $RT/worker.out 2> $RT/worker.err &
W=$!
for i in $(seq 300); do grep -q READY $RT/worker.out 2>/dev/null && break; sleep 0.1; done
cd /work/main
$PY -m bench run --endpoint ipc://$RT/fe.ipc --service fixed --input x=16:uint8 --request-rate-range 25:125:50 \
   --timeout-s 0.1 --window-s 4 --warmup-s 1 --json $OUT --quiet > $RT/bench.out 2>&1
echo "bench rc=$?"
kill -TERM $W; wait $W; kill -TERM $B; wait $B
rm -rf $RT
