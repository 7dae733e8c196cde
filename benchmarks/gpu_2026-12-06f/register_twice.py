"""Issue 54 item 8 against whichever prefix_cache is imported: a host registration the CUDA runtime
refuses (the range is registered already), then an unrelated kernel and a synchronization.

Prints "refused: ..." and "next kernel: ok" where the refusal is cleared from the runtime's last
error; where it is not, torch's launch check raises it from the kernel ("next kernel: raised").
"""

import torch

from prefix_cache.devices.cuda import host_memory

device = torch.device("cuda", 0)
pool = host_memory.register_host((64, 16), torch.float32, device)
allocate = torch.empty
torch.empty = lambda *args, **kwargs: pool.tensor  # register_host's allocation: the same bytes
try:
    host_memory.register_host((64, 16), torch.float32, device)
    print("refused: no (registered twice)")
except RuntimeError as exc:
    print(f"refused: {exc}")
finally:
    torch.empty = allocate
try:
    doubled = torch.arange(8.0, device=device) * 2
    torch.cuda.synchronize()
    print(f"next kernel: ok ({doubled.sum().item()})")
except Exception as exc:  # noqa: BLE001 - what the kernel's launch check raises
    print(f"next kernel: raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
pool.close()
