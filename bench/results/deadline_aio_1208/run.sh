#!/bin/bash
# An AsyncClient's deadline (its loop's timer) against the broker's outcome counts, beside a
# blocking Client's, alternating, each with a fresh broker and two sleepy workers (this tree).
# acct.py, sleepy.py: ../deadline_edge_1207's.  usage: ./run.sh > out.txt
set -u
PY=/work/main/.venv/bin/python
S=/work/main/bench/results/deadline_edge_1207
for r in 1 2 3; do
  for twin in sync aio; do
    RD=$(mktemp -d); chmod 700 $RD
    export XDG_RUNTIME_DIR=$RD FE=ipc://$RD/fe.ipc BE=ipc://$RD/be.ipc HTTP=127.0.0.1:18805
    PYTHONPATH=/work/main $PY -m broker --frontend $FE --backend $BE --http $HTTP > $RD/broker.log 2>&1 &
    for i in 1 2; do PYTHONPATH=/work/main:$S $PY -m gpu_worker --broker $BE --model sleepy:make --device cpu > $RD/w$i.log 2>&1 & done
    sleep 6
    echo "== $twin, run $r"
    if [ $twin = aio ]; then X=--aio; else X=; fi
    PYTHONPATH=/work/main:$S timeout 200 $PY $S/acct.py --mode deadline --n 2000 $X 2>&1 | tail -3
    kill $(jobs -p) 2>/dev/null; wait
    rm -rf "$RD"
  done
done
