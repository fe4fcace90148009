#!/bin/bash
# three alternating pairs at credit 2 and 8: BEFORE (a checkout of the tree before: the request given
# back for a newcomer's turn goes to the front of its FIFO) against AFTER (by age); from the repository root
BEFORE=${BEFORE:?a checkout of the tree before}; AFTER=${AFTER:-$PWD}; OUT=bench/results/turn_by_age_1207
for i in 1 2 3; do for c in 2 8; do for t in before after; do
  tree=$AFTER; [ $t = before ] && tree=$BEFORE
  WORKER_ARGS="--credit $c" timeout 120 bench/results/overload_1206b/pair/run_pair.sh $tree $OUT/c${c}_${t}_$i > /dev/null 2>&1
done; done; done
