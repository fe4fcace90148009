#!/bin/bash
# cpu.sh TREE OUT: broker + fixed worker (FIXED_MS, max batch 1), closed loop CONC clients for 4 s; worker CPU per request
# MODEL=module:factory SVC=service (spin_models:spin, spin: the GIL held); CONC (8); WORKER_ARGS
set -u
TREE=$1; OUT=$2
PY=/work/main/.venv/bin/python
mkdir -p /tmp/ovl; RT=$(mktemp -d /tmp/ovl/rt.XXXX)
export XDG_RUNTIME_DIR=$RT
cd $TREE
PYTHONPATH=$TREE:$TREE/tests/e2e $PY -m broker --frontend ipc://$RT/fe.ipc --backend ipc://$RT/be.ipc > $RT/broker.out 2> $RT/broker.err &
B=$!
for i in $(seq 100); do [ -S $RT/be.ipc ] && break; sleep 0.1; done
FIXED_MS=${FIXED_MS:-1.5} PYTHONPATH=$TREE:$TREE/tests/e2e:/work/main/bench/results/read_wake_1207c $PY -m gpu_worker --broker ipc://$RT/be.ipc --model ${MODEL:-bench_models:fixed} --max-batch 1 ${WORKER_ARGS:-} > $RT/worker.out 2> $RT/worker.err &
W=$!
for i in $(seq 300); do grep -q READY $RT/worker.out 2>/dev/null && break; sleep 0.1; done
cd /work/main
c0=$(awk '{print $14+$15}' /proc/$W/stat)
$PY -m bench run --endpoint ipc://$RT/fe.ipc --service ${SVC:-fixed} --input x=16:uint8 --concurrency-range ${CONC:-8} \
   --window-s 4 --warmup-s 0 --windows 1 --json ${OUT}.json --quiet > $RT/run.out 2>&1
c1=$(awk '{print $14+$15}' /proc/$W/stat)
$PY - ${OUT}.json $c0 $c1 <<'P'
import json,sys
d=json.load(open(sys.argv[1]))
r=d["results"][0] if "results" in d else d
def find(o,k):
    if isinstance(o,dict):
        if k in o: return o[k]
        for v in o.values():
            x=find(v,k)
            if x is not None: return x
    if isinstance(o,list):
        for v in o:
            x=find(v,k)
            if x is not None: return x
n=find(d,"completed") or find(d,"ok") or find(d,"count")
thr=find(d,"throughput") or find(d,"throughput_rps")
print("throughput", thr, "n", n, "worker cpu ticks", int(sys.argv[3])-int(sys.argv[2]))
P
kill -TERM $W; wait $W; kill -TERM $B; wait $B
rm -rf $RT
