export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
for i in 1 2; do
  echo "== M2 call timing $i"; PYTHONPATH=. timeout 120 python3 benchmarks/engine_call_timing.py --m2 --device cuda --steps 2000 2>&1 | tail -40
done
echo "== M2p call timing"; PYTHONPATH=. timeout 120 python3 benchmarks/engine_call_timing.py --m2 --device cuda --requests 1 --tokens 2048 --steps 600 2>&1 | tail -40
echo "== M2 unprofiled"; PYTHONPATH=. timeout 120 python3 -c "
from prefix_cache import devices
from prefix_cache.tools.metrics.engine_thread import STEP_FORWARD_US, engine_thread_us
from prefix_cache.tools.metrics.workload import bench_dtype
b=devices.get_backend('cuda')
for r in range(3):
    print('M2', round(engine_thread_us(b,64,1,bench_dtype(b),400,forward_us=STEP_FORWARD_US).median_us,1), 'M2p', round(engine_thread_us(b,1,2048,bench_dtype(b),200,forward_us=STEP_FORWARD_US).median_us,1))
"
