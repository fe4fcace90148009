#!/bin/bash
# usage: matrix.sh "EVENTS" "CLIENTS" REPS  (run from anywhere; REPO defaults to /tmp/audit_roll)
REPO=${REPO:-/tmp/audit_roll}; PY=${PY:-/work/main/.venv/bin/python}; HERE=$(cd "$(dirname "$0")" && pwd)
for ev in $1; do for cl in $2; do for r in $(seq 1 ${3:-3}); do
  lw=0; c=$cl; case $cl in stream-lw) c=stream; lw=1;; astream-lw) c=astream; lw=1;; esac
  echo "=== $ev $cl rep $r"
  (cd $REPO && ROLL_BRIEF=1 PYTHONPATH=$REPO timeout 150 $PY $HERE/roll.py --client $c --lw $lw --event $ev --secs ${SECS:-10} $EXTRA 2>&1 | grep -v '^\[')
done; done; done
