"""Start-up checks, so nothing dies of SIGBUS later: memory, /dev/shm, GPU, pillow-simd, Docker.

``feedline doctor`` runs them all and says what to change; the sidecar and the trainer run the
ones that concern them at start-up and refuse to start into a certain bus error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryBudget:
    """How much memory this process may still use, and what bounds it."""

    available: int  # bytes this process can still allocate (host and cgroup)
    cgroup_limit: int | None
    source: str  # what bounded it, for messages


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_dir() -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) == 3 and parts[0] == "0":
                    return "/sys/fs/cgroup" + parts[2]
    except OSError:
        pass
    return None


def memory_budget() -> MemoryBudget:
    """The smaller of the host's MemAvailable and the cgroup's limit minus its usage."""
    host = _meminfo_available()
    limit = usage = None
    d = _cgroup_dir()
    if d is not None:
        for sub in (d, "/sys/fs/cgroup"):
            limit = _read_int(os.path.join(sub, "memory.max"))
            if limit is not None:
                usage = _read_int(os.path.join(sub, "memory.current")) or 0
                break
    if limit is None:  # cgroup v1
        v1 = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        if v1 is not None and v1 < 1 << 60:
            limit = v1
            usage = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0
    if limit is not None and usage is not None and limit - usage < host:
        return MemoryBudget(max(0, limit - usage), limit, "the cgroup (container) memory limit")
    return MemoryBudget(host, limit, "the host's available memory")


def fs_space(path: str) -> tuple[int, int]:
    """(size, free) bytes of the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# -- the checks behind `feedline doctor` (and the sidecar's and trainer's start-up) -------------------

@dataclass(frozen=True)
class Check:
    """One preflight result: ok, failed (with the fix), or not applicable here."""

    name: str
    ok: bool | None  # None: not applicable here (skipped), with the reason in detail
    detail: str
    fix: str = ""


SHM_HEADROOM = 16 << 20  # at least; or 5 % of the budget


def check_shm(path: str, budget: int, extra: int = 0) -> Check:
    """The cache filesystem must hold the budget, the downloads in flight and some headroom."""
    try:
        size, free = fs_space(path if os.path.exists(path) else os.path.dirname(path) or "/")
    except OSError as exc:
        return Check("cache filesystem", False, f"cannot stat {path}: {exc.strerror}", "create it or set --cache")
    need = budget + extra + max(SHM_HEADROOM, budget // 20)
    detail = (f"{path}: {fmt_bytes(size)} in all, {fmt_bytes(free)} free; the cache budget {fmt_bytes(budget)} "
              f"plus downloads in flight and headroom need {fmt_bytes(need)}")
    if size >= need:
        return Check("cache filesystem", True, detail)
    return Check("cache filesystem", False, detail,
                 f"give /dev/shm at least {fmt_bytes(need)}: docker compose `shm_size` (FEEDLINE_SHM_SIZE in .env), "
                 f"`docker run --shm-size`, or the Kubernetes emptyDir's `sizeLimit`; or lower --budget")


def check_memory_for(what: str, need: int) -> Check:
    """tmpfs pages and the ring are charged to the memory limit of the container that writes them."""
    mb = memory_budget()
    limit = f"cgroup limit {fmt_bytes(mb.cgroup_limit)}" if mb.cgroup_limit else "no cgroup limit"
    detail = f"{what} needs {fmt_bytes(need)}; {mb.source} leaves {fmt_bytes(mb.available)} ({limit})"
    if need <= mb.available:
        return Check(f"memory for {what}", True, detail)
    return Check(f"memory for {what}", False, detail,
                 "raise the container's memory limit (compose `mem_limit`, Kubernetes `resources.limits.memory`) "
                 "to cover it, or lower the budget / ring")


def check_gpu() -> Check:
    try:
        import torch
    except ImportError:
        return Check("GPU", False, "torch is not installed", "install torch (the CUDA build on GPU hosts)")
    if torch.cuda.is_available():
        return Check("GPU", True, f"{torch.cuda.device_count()} visible: {torch.cuda.get_device_name(0)} "
                                  f"(torch {torch.__version__})")
    return Check("GPU", None, f"no CUDA device visible (torch {torch.__version__}); the loader runs on the CPU",
                 "on a GPU host: reserve the GPU (compose `deploy.resources.reservations.devices`, Kubernetes "
                 "`nvidia.com/gpu`) and use the NVIDIA container runtime")


def pil_is_simd() -> bool:
    """The PIL in use is pillow-simd (its versions end in .postN; stock Pillow's never do)."""
    import PIL

    return ".post" in PIL.__version__


def check_pillow_simd() -> Check:
    """The one pillow-simd check: ./scripts/setup, the tests, the benchmark and `feedline doctor` use it."""
    try:
        import PIL
        import PIL.features
    except ImportError:
        return Check("pillow-simd", False, "PIL is not installed", "run ./scripts/setup")
    simd = pil_is_simd()
    turbo = bool(PIL.features.check_feature("libjpeg_turbo"))
    detail = f"PIL {PIL.__version__}, libjpeg-turbo {'yes' if turbo else 'no'}"
    if simd and turbo:
        return Check("pillow-simd", True, detail)
    return Check("pillow-simd", False, detail, "plain Pillow decodes JPEG ~1.6x slower: pip uninstall pillow, then "
                 "build pillow-simd (./scripts/setup does; the Dockerfile's build stage does)")


def check_docker(budget: int) -> list[Check]:
    """With a reachable Docker engine: the NVIDIA runtime and the running appliance's /dev/shm."""
    try:
        import docker
    except ImportError:
        return [Check("docker", None, "the docker Python SDK is not installed")]
    try:
        client = docker.from_env(timeout=3)
        client.ping()
    except Exception as exc:  # no engine here: nothing to check
        return [Check("docker", None, f"no Docker engine reachable ({type(exc).__name__})")]
    checks = []
    runtimes = client.info().get("Runtimes", {})
    checks.append(Check("docker NVIDIA runtime", "nvidia" in runtimes, f"runtimes: {', '.join(runtimes)}",
                        "install the NVIDIA Container Toolkit and run `nvidia-ctk runtime configure --runtime=docker`"))
    for c in client.containers.list(filters={"label": "com.docker.compose.service=sampler"}):
        hc = c.attrs.get("HostConfig", {})
        shm = int(hc.get("ShmSize") or 0)
        need = budget + max(SHM_HEADROOM, budget // 20)
        checks.append(Check(f"container {c.name} /dev/shm", shm >= need,
                            f"shm_size {fmt_bytes(shm)}, ipc {hc.get('IpcMode')}; the budget needs {fmt_bytes(need)}",
                            f"set FEEDLINE_SHM_SIZE (compose shm_size) to at least {fmt_bytes(need)}"))
    return checks
