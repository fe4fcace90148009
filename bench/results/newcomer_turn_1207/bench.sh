#!/bin/bash
# three alternating pairs, credit 8 and the default 2, then two at credit 8 with --direct (the worker says BUSY):
# BEFORE (a checkout of the tree before) against AFTER; run from the repository root
BEFORE=${BEFORE:?a checkout of the tree before}; AFTER=${AFTER:-$PWD}; OUT=bench/results/newcomer_turn_1207
for i in 1 2 3; do for c in 8 2; do for t in before after; do
  tree=$AFTER; [ $t = before ] && tree=$BEFORE
  WORKER_ARGS="--credit $c" timeout 120 bench/results/overload_1206b/pair/run_pair.sh $tree $OUT/c${c}_${t}_$i > /dev/null 2>&1
done; done; done
for i in 1 2; do for t in before after; do
  tree=$AFTER; [ $t = before ] && tree=$BEFORE
  WORKER_ARGS="--credit 8 --direct" timeout 120 bench/results/overload_1206b/pair/run_pair.sh $tree $OUT/d8_${t}_$i > /dev/null 2>&1
done; done
