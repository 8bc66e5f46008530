"""Which device runs a model: one rule for the trainer, evaluation, the service and the worker.

torch is imported when a device is resolved, not with this module: the settings objects read
DEVICE_PATTERN, and the worker's healthcheck imports its settings without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# A device setting as the service and the worker accept it (BERT_DEVICE, BERT_WORKER_DEVICE).
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"


def resolve_device(setting: str | torch.device = "auto") -> torch.device:
    """ "auto": CUDA when torch sees a GPU, else the CPU; "cpu", "cuda" or "cuda:N" as given.

    Asking for CUDA where torch sees none is a ValueError quoting the setting, not a failure later
    in the first forward pass.
    """
    import torch

    if str(setting) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(setting)
    except RuntimeError:
        raise ValueError(f"unknown device {str(setting)!r}; expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(setting)!r} was asked for, but torch sees no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {str(setting)!r} was asked for, but torch sees only {torch.cuda.device_count()} CUDA device(s)"
        )
    return device


# cgroup v2, then v1: the container's memory limit ("max", or v1's huge number, when there is none).
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_bytes(device: torch.device) -> int:
    """The memory a process can use on `device`: a CUDA device's free memory now (torch.cuda.mem_get_info: its
    total less what other processes, a worker's job beside `bert up`'s service say, already hold); on the CPU
    the physical RAM, or the cgroup's memory limit (a container's) when that is smaller."""
    import os

    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_MEMORY_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(physical, int(text))
    return physical


def return_freed_memory() -> bool:
    """Hand the C heap's free pages back to the operating system (glibc's `malloc_trim(0)`); whether it ran.

    glibc keeps memory that freed tensors leave in its arenas for reuse, so after a model is unloaded the
    process's RSS stays where the model took it until something reuses the room. A service that loads and
    unloads models within a memory budget calls this before each load, so its RSS is what it holds. A no-op
    elsewhere (musl, macOS, Windows)."""
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        return False
    return True
