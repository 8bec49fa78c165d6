import os, sys, time, ctypes
sys.path.insert(0, os.getcwd())
import torch
from lightwell.distributed.comm.hostmem_copy import _DriverOps
from lightwell.distributed.comm.host import pin
dev = torch.device("cuda", 0)
torch.cuda.init()
n = 64 << 20
path = "/dev/shm/probe_ce"
with open(path, "wb") as f: f.truncate(n)
mem = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
print("registered", pin(mem, 3), "is_pinned", mem.is_pinned())
ops = _DriverOps(mem, dev)
x = torch.randn(4 << 20, device=dev, dtype=torch.bfloat16)  # 8 MB
s = torch.cuda.current_stream()
def host_time(fn, label):
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU work ahead
    t0 = time.perf_counter(); fn(); t1 = time.perf_counter()
    torch.cuda.synchronize(); t2 = time.perf_counter()
    print(f"{label:40s} call {1e3*(t1-t0):8.3f} ms   total {1e3*(t2-t0):8.3f} ms", flush=True)
host_time(lambda: None, "nothing")
host_time(lambda: ops.d2h(4096, x, 0, x.numel(), s), "cuMemcpyDtoHAsync 8MB")
host_time(lambda: ops.h2d(x, 0, x.numel(), 4096, s), "cuMemcpyHtoDAsync 8MB")
host_time(lambda: ops.write_flag(0, 5, s), "cuStreamWriteValue32")
host_time(lambda: ops.wait_flag(0, 5, s), "cuStreamWaitValue32 (already set)")
cpu_view = mem[4096:4096 + 8 * (1 << 20)].view(torch.bfloat16)
host_time(lambda: cpu_view.copy_(x, non_blocking=True), "torch copy_ non_blocking d2h")
# wait on a flag that a second stream sets after a sleep
s2 = torch.cuda.Stream()
def waiter():
    with torch.cuda.stream(s2):
        torch.cuda._sleep(50_000_000)
        ops.write_flag(64, 7, s2)
    ops.wait_flag(64, 7, s)
host_time(waiter, "wait on a flag set later by another stream")
# many chunks
def chunks():
    for c in range(4):
        ops.d2h(4096 + c * (2 << 20), x, c * (1 << 20), (c + 1) * (1 << 20), s)
        ops.write_flag(128 + 4 * c, 9, s)
host_time(chunks, "4 x (d2h 2MB + flag)")
print(open("/proc/driver/nvidia/version").read() if os.path.exists("/proc/driver/nvidia/version") else "")
os.unlink(path)
