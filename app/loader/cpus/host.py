"""What this process may run on: its CPUs, the cores and NUMA nodes they belong to, its CPU quota, the GPU's node.

Read from the files Linux keeps, under a root (``/`` on a host; a made-up tree in the tests):

- the CPUs this process may use, ``Cpus_allowed_list`` of ``/proc/self/status`` (what ``sched_getaffinity``
  says: ``taskset``, a cgroup cpuset, torchrun's ``--numa-binding`` all narrow it), and the cgroup's cpuset
  (``cpuset.cpus.effective``, v2; ``cpuset.cpus``, v1), which tells a container's own set from a rank's share;
- the CPU quota, cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the smallest on the
  way from the process's cgroup to the root: a container limited to 6 CPUs of 64 can run 6 at a time;
- the cores: each CPU's ``topology/thread_siblings_list`` (hyperthreads of one core run on one core's units);
- the NUMA nodes: ``/sys/devices/system/node/node*/cpulist``; a GPU's node: ``/sys/bus/pci/devices/<address>/
  numa_node``, the address from CUDA where it is present.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field


def parse_cpus(text: str) -> tuple[int, ...]:
    """``0-3,8,10-11`` as sorted CPU numbers; ValueError on anything else."""
    out: set[int] = set()
    for part in text.replace("\n", "").split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"not a CPU range: {part!r}")
        out.update(range(first, last + 1))
    return tuple(sorted(out))


def format_cpus(cpus: tuple[int, ...] | list[int]) -> str:
    """Sorted CPU numbers as ``0-3,8`` (what Linux writes)."""
    cpus = sorted(cpus)
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class Host:
    """This process's CPUs as the kernel sees them."""

    allowed: tuple[int, ...]  # the CPUs this process may run on
    cpuset: tuple[int, ...]  # its cgroup's (a container's) CPUs; ``allowed`` narrower: bound by someone else
    cores: tuple[tuple[int, ...], ...]  # the allowed CPUs grouped by core (hyperthread siblings together)
    nodes: dict[int, int] = field(default_factory=dict)  # CPU -> NUMA node (absent: one node)
    quota: float | None = None  # CPUs' worth of time the cgroup may use (None: no quota)

    @property
    def siblings(self) -> int:
        """Logical CPUs a core (the most any core has)."""
        return max((len(c) for c in self.cores), default=1)

    def node_of(self, core: tuple[int, ...]) -> int:
        return self.nodes.get(core[0], 0)

    @classmethod
    def read(cls, root: str = "/", allowed: set[int] | None = None) -> "Host":
        """The host under ``root``; a file that is missing leaves its part at the plain default (one core a CPU,
        one node, no quota). ``allowed``: the CPUs to take as this process's (its mask before it was pinned)."""
        mine = tuple(sorted(allowed)) if allowed else _allowed(root)
        cpuset = _cpuset(root) or mine
        return cls(mine, cpuset, _cores(root, mine), _nodes(root), _quota(root))

    def without(self, cpus: set[int]) -> "Host":
        """This host less ``cpus`` (and the cores they are on: a core is its hyperthreads' together)."""
        cores = tuple(core for core in self.cores if not set(core) & cpus)
        allowed = tuple(sorted(c for core in cores for c in core))
        return Host(allowed, self.cpuset, cores, self.nodes, self.quota)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _allowed(root: str) -> tuple[int, ...]:
    status = _read(os.path.join(root, "proc/self/status")) or ""
    for line in status.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpus(line.split(":", 1)[1])
    if root == "/":
        return tuple(sorted(os.sched_getaffinity(0)))
    raise FileNotFoundError(f"{root}proc/self/status has no Cpus_allowed_list")


def _cgroups(root: str) -> dict[str, str]:
    """Controller (``""`` for v2's unified line) -> this process's cgroup path."""
    out = {}
    for line in (_read(os.path.join(root, "proc/self/cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def _walk(mount: str, path: str) -> list[str]:
    """The cgroup folders from ``path`` up to the mount's root (a container sees its own cgroup as the root, with
    the host's path in /proc/self/cgroup: then the mount's root is where its files are)."""
    folders, p = [], path.strip("/")
    while True:
        folder = os.path.join(mount, p) if p else mount
        if os.path.isdir(folder):
            folders.append(folder)
        if not p:
            return folders
        p = os.path.dirname(p)


def _cpuset(root: str) -> tuple[int, ...]:
    groups = _cgroups(root)
    base = os.path.join(root, "sys/fs/cgroup")
    for mount, name, path in ((base, "cpuset.cpus.effective", groups.get("")),
                              (os.path.join(base, "cpuset"), "cpuset.effective_cpus", groups.get("cpuset")),
                              (os.path.join(base, "cpuset"), "cpuset.cpus", groups.get("cpuset"))):
        if path is None:
            continue
        for folder in _walk(mount, path):
            text = _read(os.path.join(folder, name))
            if text:
                return parse_cpus(text)
    return ()


def _quota(root: str) -> float | None:
    groups = _cgroups(root)
    base = os.path.join(root, "sys/fs/cgroup")
    limits = []
    if "" in groups:  # v2: "max 100000" or "250000 100000"
        for folder in _walk(base, groups[""]):
            text = _read(os.path.join(folder, "cpu.max"))
            if text and not text.startswith("max"):
                quota, _, period = text.partition(" ")
                limits.append(int(quota) / int(period or 100000))
    for controller in ("cpu", "cpuacct"):  # (/proc/self/cgroup's "cpu,cpuacct" line gives both)
        if controller not in groups:
            continue
        for mount in (os.path.join(base, "cpu,cpuacct"), os.path.join(base, "cpu")):
            for folder in _walk(mount, groups[controller]):
                quota, period = _read(os.path.join(folder, "cpu.cfs_quota_us")), \
                    _read(os.path.join(folder, "cpu.cfs_period_us"))
                if quota and period and int(quota) > 0:
                    limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def _cores(root: str, allowed: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The allowed CPUs grouped by core, in the order of each core's first CPU."""
    mine = set(allowed)
    cores: dict[tuple[int, ...], None] = {}
    for cpu in allowed:
        text = _read(os.path.join(root, f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"))
        siblings = parse_cpus(text) if text else (cpu,)
        cores[tuple(c for c in siblings if c in mine) or (cpu,)] = None
    return tuple(sorted(cores, key=lambda c: c[0]))


def _nodes(root: str) -> dict[int, int]:
    out = {}
    for path in glob.glob(os.path.join(root, "sys/devices/system/node/node[0-9]*/cpulist")):
        node = int(os.path.basename(os.path.dirname(path))[4:])
        for cpu in parse_cpus(_read(path) or ""):
            out[cpu] = node
    return out


def cpu_quota(root: str = "/") -> float | None:
    """The cgroup's CPU quota in CPUs (v2 ``cpu.max`` or v1 ``cfs_quota_us``, the smallest on the way to the
    root), or None."""
    return _quota(root)


def cpu_usage_file(root: str = "/") -> tuple[str, float] | None:
    """This process's cgroup's CPU-use file and its unit in seconds (v2 ``cpu.stat``'s ``usage_usec``, 1e-6;
    v1 ``cpuacct.usage``, 1e-9), the nearest on the way to the root that has one; None where there is none."""
    groups = _cgroups(root)
    base = os.path.join(root, "sys/fs/cgroup")
    if "" in groups:
        for folder in _walk(base, groups[""]):
            path = os.path.join(folder, "cpu.stat")
            if "usage_usec " in (_read(path) or ""):
                return path, 1e-6
    if "cpuacct" in groups:
        for mount in (os.path.join(base, "cpu,cpuacct"), os.path.join(base, "cpuacct")):
            for folder in _walk(mount, groups["cpuacct"]):
                path = os.path.join(folder, "cpuacct.usage")
                if _read(path):
                    return path, 1e-9
    return None


def cpu_used(file: tuple[str, float]) -> float | None:
    """CPU seconds the cgroup has used, read from ``cpu_usage_file``'s file; None if it cannot be read."""
    path, unit = file
    for line in (_read(path) or "").splitlines():
        words = line.split()
        if len(words) == 1 or words[0] == "usage_usec":
            try:
                return int(words[-1]) * unit
            except ValueError:
                return None
    return None


def gpu_node(root: str = "/", address: str | None = None, index: int | None = None) -> int | None:
    """The NUMA node of the GPU at PCI ``address`` (``0000:3b:00.0``), or of CUDA device ``index`` (the current
    one by default); None where unknown (no CUDA, one node, a kernel that says -1)."""
    if address is None:
        address = cuda_address(index)
    if address is None:
        return None
    text = _read(os.path.join(root, "sys/bus/pci/devices", address.lower(), "numa_node"))
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def cuda_address(index: int | None = None) -> str | None:
    """The PCI address of CUDA device ``index`` (the current one by default: ``0000:3b:00.0``), where torch
    knows it."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if index is None else index
    if not 0 <= index < torch.cuda.device_count():  # cuda:N of a GPU this process does not see
        return None
    p = torch.cuda.get_device_properties(index)
    bus, device, domain = (getattr(p, a, None) for a in ("pci_bus_id", "pci_device_id", "pci_domain_id"))
    if bus is None or device is None:
        return None
    return f"{domain or 0:04x}:{bus:02x}:{device:02x}.0"
