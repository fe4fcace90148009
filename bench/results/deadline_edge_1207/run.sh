#!/bin/bash
# broker + 2 sleepy workers from /work/main; acct.py with the old client (2a00929 tree) and the new one, alternating
# usage: OLD=<a clone of the tree before> ./run.sh > out.txt   (acct.py, sleepy.py: the game-server audit's scripts)
set -u
PY=/work/main/.venv/bin/python
RD=$(mktemp -d); rm -rf $RD; mkdir -p $RD; chmod 700 $RD
export XDG_RUNTIME_DIR=$RD FE=ipc://$RD/fe.ipc BE=ipc://$RD/be.ipc HTTP=127.0.0.1:18803
S=/work/main/bench/results/deadline_edge_1207
PYTHONPATH=/work/main $PY -m broker --frontend $FE --backend $BE --http $HTTP > $RD/broker.log 2>&1 &
B=$!
for i in 1 2; do PYTHONPATH=/work/main:$S $PY -m gpu_worker --broker $BE --model sleepy:make --device cpu > $RD/w$i.log 2>&1 & done
sleep 6
for r in 1 2 3; do
  for tree in old new; do
    if [ $tree = old ]; then T=$OLD; else T=/work/main; fi
    echo "== $tree run $r"
    PYTHONPATH=$T:$S timeout 200 $PY $S/acct.py --mode deadline --n 2000 $@ 2>&1 | tail -3
  done
done
kill $(jobs -p) 2>/dev/null; wait
rm -rf "$RD"
