"""How many workers (`--workers N|auto`), and the cores each one runs on.

`auto` is one worker per two cores (or CPUs of a cgroup quota), and no more than the memory allows: the memory
available now, divided by what one worker is expected to hold (WORKER_BYTES plus the repository's model files).
Each worker is pinned to its own share of the cores (cores[i::n]; not under a CPU quota smaller than the
cores), so that what sizes itself by the cores it may use (a lone request's intra-op threads, the compute
threads' cores, ORCA's core count) takes its share, and N workers' intra-op threads together stay within the
cores.
"""

from __future__ import annotations

from pathlib import Path

from service.errors import ConfigError
from service.priority import cpu_budget, usable_cores

__all__ = ["WORKER_BYTES", "available_memory", "cores_of", "pinned", "worker_count"]

CGROUP = Path("/sys/fs/cgroup")
WORKER_BYTES = 512 << 20  # a worker's own memory besides its models' weights: interpreter, gRPC, aiohttp, arenas
MAX_WORKERS = 256


def pinned(index: int, count: int, cgroup: Path = CGROUP) -> list[int]:
    """The cores worker `index` is pinned to: its share, or none (the kernel's choice) under a CPU quota
    smaller than the cores, where every container would pin onto the same first cores."""
    cores = usable_cores()
    return cores_of(index, count, cores) if cpu_budget(cgroup) >= len(cores) else []


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes of memory available to start new work (MemAvailable); None when not known."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _repository_bytes(repository: Path) -> int:
    """The bytes of the model files of a repository: what one worker's sessions hold, roughly."""
    total = 0
    for path in repository.rglob("*"):
        if path.suffix in (".onnx", ".data", ".bin", ".safetensors") and path.is_file():
            total += path.stat().st_size
    return total


def worker_count(value: str, repository: Path, cores: int | None = None, memory: int | None = None) -> int:
    """`--workers`: a number (1..MAX_WORKERS) or `auto` (one per two cores, within the memory available);
    ConfigError naming the flag otherwise."""
    text = value.strip().lower()
    if text == "auto":
        cores = cpu_budget() if cores is None else cores
        by_cores = max(1, cores // 2)
        memory = available_memory() if memory is None else memory
        if memory is None:
            return by_cores
        per_worker = WORKER_BYTES + (_repository_bytes(repository) if repository.is_dir() else 0)
        return max(1, min(by_cores, memory // per_worker))
    try:
        count = int(text)
    except ValueError:
        raise ConfigError("--workers", f"--workers {value!r}: give a number of worker processes, or auto") from None
    if not 1 <= count <= MAX_WORKERS:
        raise ConfigError("--workers", f"--workers {count}: give 1 to {MAX_WORKERS}, or auto")
    return count


def cores_of(index: int, count: int, cores: list[int]) -> list[int]:
    """Worker `index`'s share of `cores`: every count-th from its own; all of them when there are fewer cores
    than workers (they share)."""
    if count <= 1 or len(cores) < count:
        return list(cores)
    return cores[index::count]
