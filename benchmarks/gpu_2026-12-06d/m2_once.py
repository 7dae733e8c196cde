"""M2 and M2p (unprofiled medians), once each, with the prefix_cache found first on the path."""
import prefix_cache
from prefix_cache import devices
from prefix_cache.tools.metrics.engine_thread import STEP_FORWARD_US, engine_thread_us
from prefix_cache.tools.metrics.workload import bench_dtype

b = devices.get_backend("cuda")
m2 = engine_thread_us(b, 64, 1, bench_dtype(b), 400, forward_us=STEP_FORWARD_US).median_us
m2p = engine_thread_us(b, 1, 2048, bench_dtype(b), 200, forward_us=STEP_FORWARD_US).median_us
print(f"{prefix_cache.__file__}: M2 {m2:.1f} M2p {m2p:.1f}")
