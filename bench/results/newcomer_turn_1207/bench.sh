#!/bin/bash
# three alternating pairs, credit 8 and the default 2: the tree before (/tmp/wt_before) and after (/work/main)
for i in 1 2 3; do for c in 8 2; do for t in before after; do
  tree=/work/main; [ $t = before ] && tree=/tmp/wt_before
  WORKER_ARGS="--credit $c" timeout 120 bench/results/overload_1206b/pair/run_pair.sh $tree bench/results/newcomer_turn_1207/c${c}_${t}_$i > /dev/null 2>&1
done; done; done
echo finished
