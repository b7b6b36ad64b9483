"""Reading a running job's devices for jobs.utilization: its GPUs through NVML where the
driver is there, else its process tree (CPU time and memory) through psutil.

Both are cheap enough for the runner's loop: NVML answers from the driver in microseconds; the
process tree is read from the job's cgroup (one small file) where it has one, else by walking
/proc from the job's process, and each process costs two small /proc reads."""

import logging
import time

from jobs.utilization import Reading

# psutil (10 ms) is imported at the first reading, not when the agent starts: inside a Slurm job
# the agent's start is on the meter, and the first reading comes once the job has started.

log = logging.getLogger(__name__)

_nvml = None  # the pynvml module once initialized, False when it cannot be


def nvml():
    """pynvml, initialized once per process; None where there is no NVIDIA driver."""
    global _nvml
    if _nvml is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml = pynvml
        except Exception as error:  # noqa: BLE001 - no library, no driver, no GPU: all the same here
            log.debug("NVML is not available (%s): utilization is read from the process tree", error)
            _nvml = False
    return _nvml or None


class GpuSampler:
    """The job's own GPUs, by their index on the node (the indices CUDA_VISIBLE_DEVICES names:
    NVML counts in PCI bus order, as CUDA does among GPUs of one model)."""

    kind = "gpu"

    def __init__(self, lib, devices, prefix=""):
        self.lib = lib
        self.handles = [lib.nvmlDeviceGetHandleByIndex(int(d)) for d in devices]
        self.series = []
        for position, handle in enumerate(self.handles):
            total = lib.nvmlDeviceGetMemoryInfo(handle).total
            self.series.append({"name": f"{prefix}gpu{position}", "kind": "gpu", "memory_total": int(total)})

    def read(self):
        readings = []
        for handle in self.handles:
            try:
                util = self.lib.nvmlDeviceGetUtilizationRates(handle).gpu
                used = self.lib.nvmlDeviceGetMemoryInfo(handle).used
            except Exception:  # noqa: BLE001 - a device that does not answer reads as idle this time
                util, used = 0, 0
            readings.append(Reading(float(util), int(used)))
        return readings


class ProcessTreeSampler:
    """A CPU job: its process tree as one series, utilization in percent of one core.

    CPU time is counted per process since its previous reading (a process first seen is counted
    from its start if it started since the last reading), so processes coming and going between
    readings are counted, except for the last slice of one that exited in between."""

    kind = "cpu"

    def __init__(self, pid, pids=None, memory_total=None, prefix=""):
        self.pid = pid
        self.pids = pids  # a callable giving the job's pids (its cgroup), or None: walk the tree
        self.series = [{"name": f"{prefix}cpu", "kind": "cpu", "memory_total": memory_total}]
        self.cpu = {}  # pid -> (create time, cpu seconds at the last reading)
        self.last = None  # time.time() of the last reading

    def processes(self):
        import psutil

        if self.pids is not None:
            found = self.pids()
            if found:
                return [p for p in map(_process, found) if p is not None]
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def read(self):
        """[Reading], or None the first time."""
        import psutil

        now = time.time()
        busy, memory, seen = 0.0, 0, {}
        for process in self.processes():
            try:
                with process.oneshot():
                    created = process.create_time()
                    times = process.cpu_times()
                    rss = process.memory_info().rss
            except psutil.Error:
                continue
            total = times.user + times.system
            before = self.cpu.get(process.pid)
            if before is not None and before[0] == created:
                busy += max(total - before[1], 0.0)
            elif self.last is not None and created >= self.last - 0.01:
                busy += total  # started since the last reading
            seen[process.pid] = (created, total)
            memory += rss
        previous, self.cpu, self.last = self.last, seen, now
        if previous is None or now <= previous:
            return None  # the first reading is only where counting starts
        return [Reading(round(busy / (now - previous) * 100, 1), memory)]


def _process(pid):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def sampler_for(*, pid, devices, device_type, prefix="", pids=None, memory_total=None):
    """NVML for a GPU node where the driver answers, the process tree otherwise."""
    if device_type != "cpu" and devices:
        lib = nvml()
        if lib is not None:
            try:
                return GpuSampler(lib, devices, prefix)
            except Exception:  # noqa: BLE001 - a GPU NVML does not know: fall back to the processes
                log.exception("NVML cannot read devices %s; sampling the process tree instead", devices)
    return ProcessTreeSampler(pid, pids=pids, memory_total=memory_total, prefix=prefix)
