#!/usr/bin/env bash
# bench/bench_regress_ab.sh BASE_TREE AFTER_TREE ROUNDS: interleaved rows, a fresh process each; prints one line a row
# REGRESS_DIR: where the 1 GiB checkpoints go (default ./bench-regress, on the disk to measure); PYTHON: the interpreter.
# Run as root (cold loads drop the page cache). Round nine: BASE = e56bad4 (the round-eight start), AFTER = the final tree.
set -u
B=$1; A=$2; R=${3:-5}
mkdir -p "${REGRESS_DIR:-$PWD/bench-regress}" /dev/shm/regress
for r in $(seq 1 $R); do
  if [ $((r % 2)) = 1 ]; then order="$B $A"; else order="$A $B"; fi
  for kind in llm_save llm_load small_save; do
    for t in $order; do
      mkdir -p "${REGRESS_DIR:-$PWD/bench-regress}"/$(basename $t)
      v=$(PYTHONPATH=$t "${PYTHON:-python}" "$(dirname "$0")"/bench_regress_row.py $kind "${REGRESS_DIR:-$PWD/bench-regress}"/$(basename $t) 2>/dev/null | tail -1)
      echo "$r $kind $(basename $t) $v $(cut -d' ' -f1 /proc/loadavg)"
    done
  done
  v=$("${PYTHON:-python}" "$(dirname "$0")"/bench_regress_row.py stock_save "${REGRESS_DIR:-$PWD/bench-regress}" 2>/dev/null | tail -1)
  echo "$r stock_save stock $v $(cut -d' ' -f1 /proc/loadavg)"
done
rm -rf "${REGRESS_DIR:-$PWD/bench-regress}" /dev/shm/regress
