#!/bin/bash
# The broker from the tree before (OLD: a clone of 9f66065) and after (this tree), alternating,
# each with two sleepy workers and the same client (this tree's); acct.py compares what the
# caller saw with the broker's outcome counts.  acct.py, sleepy.py: ../deadline_edge_1207's.
# usage: OLD=<clone of 9f66065> ./run.sh > out.txt
set -u
PY=/work/main/.venv/bin/python
S=/work/main/bench/results/deadline_edge_1207
for r in 1 2 3; do
  for tree in old new; do
    if [ $tree = old ]; then T=$OLD; else T=/work/main; fi
    RD=$(mktemp -d); chmod 700 $RD
    export XDG_RUNTIME_DIR=$RD FE=ipc://$RD/fe.ipc BE=ipc://$RD/be.ipc HTTP=127.0.0.1:18804
    PYTHONPATH=$T $PY -m broker --frontend $FE --backend $BE --http $HTTP > $RD/broker.log 2>&1 &
    B=$!
    for i in 1 2; do PYTHONPATH=/work/main:$S $PY -m gpu_worker --broker $BE --model sleepy:make --device cpu > $RD/w$i.log 2>&1 & done
    sleep 6
    echo "== broker $tree, run $r"
    PYTHONPATH=/work/main:$S timeout 200 $PY $S/acct.py --mode deadline --n 2000 "$@" 2>&1 | tail -3
    kill $(jobs -p) 2>/dev/null; wait
    rm -rf "$RD"
  done
done
