# what a CUDA kernel event of this torch's profiler carries (for the cadence benchmark's warp/SM fill)
import torch
from torch.profiler import ProfilerActivity, profile
a = torch.randn(512, 512, device="cuda")
with profile(activities=[ProfilerActivity.CUDA]) as p:
    (a @ a).sum()
    torch.cuda.synchronize()
evs = [e for e in p.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
print([m for m in dir(evs[0]) if not m.startswith("_")])
for e in evs[:2]:
    print(e.name()[:60], repr(getattr(e, "metadata_json", lambda: "n/a")())[:600])
