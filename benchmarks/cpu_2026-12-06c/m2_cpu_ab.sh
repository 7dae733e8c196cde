#!/usr/bin/env bash
# CPU M2 (64-request decode, engine_thread_us, 3000 steps) in turn: base13 (A) and the work tree (B)
root=/work/main
for r in 1 2 3 4 5; do
  for t in A B; do
    d=$root; [ $t = A ] && d=$root/devrun/base13
    (cd $d && PYTHONPATH=. $root/.venv/bin/python -c "
from prefix_cache import devices
from prefix_cache.tools.metrics.engine_thread import engine_thread_us
from prefix_cache.tools.metrics.workload import bench_dtype
b = devices.get_backend('cpu')
print('$t', round(engine_thread_us(b, 64, 1, bench_dtype(b), 3000).median_us, 1))")
  done
done
