"""runtime/cluster/device.py: detection on this machine, the MetaX and NVIDIA rules on a faked
`torch.cuda`, and the copy-engine check of a plan."""
import dataclasses

import pytest
import torch

import mxgraph as mx
from mxgraph.errors import PlanError
from mxgraph.plan import OverlapOptions
from mxgraph.runtime.cluster import device as device_mod
from mxgraph.runtime.cluster.device import check_copy_engine, copy_engine_available, detect


def test_this_machine_is_a_cpu_with_gloo():
    info = detect(torch.device("cpu"))
    assert (info.kind, info.backend, info.collective_library) == ("cpu", "gloo", "gloo")
    assert info.torch_device == torch.device("cpu") and info.name
    assert (info.copy_engines, info.warp_width, info.symmetric_memory) == (0, 1, False)
    if not torch.cuda.is_available():
        assert detect() == info


def test_default_device_is_still_importable_from_mesh():
    from mxgraph.runtime.cluster.device import default_device
    from mxgraph.runtime.cluster.mesh import default_device as from_mesh
    assert from_mesh is default_device


@pytest.fixture
def fake_cuda(monkeypatch):
    """A `torch.cuda` that reports one GPU of the name given to the returned function."""
    for key in device_mod.MACA_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delattr(torch.version, "maca", raising=False)

    def install(name: str, capability=(9, 0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return install


def test_nvidia_names(fake_cuda):
    fake_cuda("NVIDIA H100 80GB HBM3")
    info = detect()
    assert info.torch_device == torch.device("cuda", 0)
    assert (info.kind, info.backend, info.collective_library) == ("nvidia", "nccl", "NCCL")
    assert (info.copy_engines, info.warp_width, info.bf16_atomics) == (3, 32, True)
    assert info.symmetric_memory  # torch 2.13 has torch.distributed._symmetric_memory
    fake_cuda("Tesla V100-SXM2-16GB", capability=(7, 0))
    info = detect(torch.device("cuda", 0))
    assert (info.kind, info.copy_engines, info.bf16_atomics) == ("nvidia", 2, False)


@pytest.mark.parametrize("name", ["MetaX C500", "MXC500"])
def test_metax_by_name(fake_cuda, name):
    fake_cuda(name)
    info = detect()
    assert (info.kind, info.backend, info.collective_library) == ("metax", "nccl", "MCCL")
    assert (info.warp_width, info.symmetric_memory) == (64, False)
    assert info.copy_engines > 0 and "name" in info.detected_by


def test_metax_by_environment_or_torch_version(fake_cuda, monkeypatch):
    fake_cuda("Generic GPU")
    assert detect().kind == "nvidia"
    monkeypatch.setenv("MACA_PATH", "/opt/maca")
    assert detect().kind == "metax" and "MACA_PATH" in detect().detected_by
    monkeypatch.delenv("MACA_PATH")
    monkeypatch.setattr(torch.version, "maca", "3.0", raising=False)
    assert detect().kind == "metax" and "torch.version" in detect().detected_by


def test_maca_environment_without_a_gpu_is_the_cpu(monkeypatch):
    monkeypatch.setenv("MACA_HOME", "/opt/maca")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect().kind == "cpu"


def _plan(**overlap):
    return mx.Plan(overlap=OverlapOptions(**overlap))


def test_copy_engine_check():
    cpu = detect(torch.device("cpu"))
    gpu = dataclasses.replace(cpu, kind="nvidia", name="NVIDIA X", copy_engines=2)
    bare = dataclasses.replace(gpu, name="Bare GPU", copy_engines=0)
    assert copy_engine_available(cpu) and copy_engine_available(gpu)
    assert not copy_engine_available(bare)
    for info in (cpu, gpu, bare):  # nothing asked: nothing refused
        check_copy_engine(mx.Plan(), info)
        check_copy_engine(_plan(), info)
        check_copy_engine(_plan(copy_engine=True, fallback=True), info)
    check_copy_engine(_plan(copy_engine=True), cpu)  # a thread does the transfers
    with pytest.raises(PlanError, match=r"on NVIDIA X: copy-engine transfer kernels .* not "
                                        r"built yet; set overlap.fallback=True"):
        check_copy_engine(_plan(copy_engine=True), gpu)
    with pytest.raises(PlanError, match=r"this device \(Bare GPU\) has no copy engines; "
                                        r"set overlap.fallback=True"):
        check_copy_engine(_plan(copy_engine=True), bare)
