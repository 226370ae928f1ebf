"""The device layer: which device this process runs on (MetaX under MXMACA, NVIDIA, the
CPU), its torch.distributed backend and collective library, and what it can do.

MXMACA is CUDA-compatible: a MetaX GPU is PyTorch device `cuda`, and its collectives are
MCCL behind torch.distributed's "nccl" backend; so a MetaX GPU is told from an NVIDIA one
by the rules in `METAX_RULES`, not by the device type. Every choice that depends on the
kind of device (backend, copy engines, warp width) is read from `DeviceInfo`, made here by
`detect`, so the rules live in one place.
"""
from __future__ import annotations

import importlib.util
import os
import platform
from dataclasses import dataclass

import torch

from mxgraph.errors import PlanError
from mxgraph.plan import OverlapOptions, Plan

MACA_ENV = ("MACA_PATH", "MACA_HOME")
"""Environment variables an MXMACA installation sets."""


@dataclass(frozen=True)
class Probe:
    """What the rules look at: the CUDA device's name and the process's environment."""

    name: str
    environ: dict
    torch_version: object


METAX_RULES = (
    # (why this is a MetaX GPU, the test); a `cuda` device is MetaX when any rule holds
    ("the device name contains 'MetaX'", lambda p: "metax" in p.name.lower()),
    ("the device name contains 'MXC'", lambda p: "MXC" in p.name),
    ("MACA_PATH or MACA_HOME is set", lambda p: any(p.environ.get(k) for k in MACA_ENV)),
    ("torch.version has a 'maca' attribute", lambda p: hasattr(p.torch_version, "maca")),
)

BACKENDS = {"metax": ("nccl", "MCCL"), "nvidia": ("nccl", "NCCL"), "cpu": ("gloo", "gloo")}
"""kind -> (torch.distributed backend, the collective library behind it)."""

COPY_ENGINES = (
    # (kind, device-name substring, copy engines); the first match wins, "" matches any.
    # Counts as cudaDevAttrAsyncEngineCount gives them; check_copy_engine only asks > 0.
    ("nvidia", "A100", 3),
    ("nvidia", "H100", 3),
    ("nvidia", "", 2),
    ("metax", "", 2),  # MXMACA's SDMA engines
    ("cpu", "", 0),
)

WARP_WIDTH = {"metax": 64, "nvidia": 32, "cpu": 1}
"""Threads that execute one instruction together (a MetaX wave is 64 wide)."""


@dataclass(frozen=True)
class DeviceInfo:
    """One device: its kind, backend and capabilities (`detect` makes it)."""

    kind: str
    """"metax" (MetaX GPU under MXMACA), "nvidia" or "cpu"."""
    name: str
    """The device's name (torch.cuda.get_device_name), or the CPU's."""
    torch_device: torch.device
    backend: str
    """The torch.distributed backend: "nccl" on `cuda` (MCCL behind it on MXMACA), "gloo"."""
    collective_library: str
    """"MCCL", "NCCL" or "gloo"."""
    copy_engines: int
    """DMA engines that copy while kernels run (0 on the CPU)."""
    symmetric_memory: bool
    """torch.distributed._symmetric_memory is there and the device is `cuda` with NCCL."""
    bf16_atomics: bool
    """Native bfloat16 atomic add (NVIDIA compute capability 8.0 and later)."""
    warp_width: int
    detected_by: str
    """The rule that named the kind (e.g. "MACA_PATH or MACA_HOME is set")."""


def default_device() -> torch.device:
    """This process's GPU (`LOCAL_RANK` of the node's GPUs, as torchrun numbers them) when
    there is one (`cuda`: NVIDIA, or MetaX under MXMACA), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def detect(device: torch.device | None = None) -> DeviceInfo:
    """The `DeviceInfo` of `device` (default: `default_device()`)."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda" or not torch.cuda.is_available():
        return _info("cpu", _cpu_name(), torch.device("cpu"), "not a cuda device")
    name = torch.cuda.get_device_name(device)
    probe = Probe(name, dict(os.environ), torch.version)
    reason = next((why for why, holds in METAX_RULES if holds(probe)), None)
    if reason is not None:
        return _info("metax", name, device, reason)
    return _info("nvidia", name, device, "a cuda device no MetaX rule matched",
                 bf16_atomics=torch.cuda.get_device_capability(device)[0] >= 8)


def _info(kind: str, name: str, device: torch.device, reason: str, *,
          bf16_atomics: bool = False) -> DeviceInfo:
    backend, library = BACKENDS[kind]
    engines = next(n for k, part, n in COPY_ENGINES if k == kind and part in name)
    symmetric = library == "NCCL" and \
        importlib.util.find_spec("torch.distributed._symmetric_memory") is not None
    return DeviceInfo(kind=kind, name=name, torch_device=device, backend=backend,
                      collective_library=library, copy_engines=engines,
                      symmetric_memory=symmetric, bf16_atomics=bf16_atomics,
                      warp_width=WARP_WIDTH[kind], detected_by=reason)


def _cpu_name() -> str:
    """The processor's name: platform.processor(), else /proc/cpuinfo's model name, else
    the machine type (e.g. x86_64)."""
    if platform.processor():
        return platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "cpu"


def copy_engine_available(info: DeviceInfo) -> bool:
    """Whether copy-engine transfers can run on the device: it has copy engines, or it is
    the CPU (where the transfers run on a separate thread)."""
    return info.kind == "cpu" or info.copy_engines > 0


def check_copy_engine(plan: Plan, info: DeviceInfo) -> None:
    """PlanError when `plan.overlap.copy_engine` asks for copy engines the device lacks and
    `plan.overlap.fallback` does not allow ordinary collectives instead."""
    options = plan.overlap
    if not isinstance(options, OverlapOptions) or not options.copy_engine or options.fallback:
        return
    if not copy_engine_available(info):
        raise PlanError(f"overlap.copy_engine=True: this device ({info.name}) has no copy "
                        f"engines; set overlap.fallback=True to run the transfers as "
                        f"collectives, or turn copy_engine off")
    if info.kind != "cpu":
        raise PlanError(f"overlap.copy_engine=True on {info.name}: copy-engine transfer "
                        f"kernels (device-to-device copies, symmetric-memory puts) are not "
                        f"built yet; set overlap.fallback=True to run the transfers through "
                        f"{info.collective_library} from a dedicated stream, or turn "
                        f"copy_engine off")
