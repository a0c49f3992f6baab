"""The host-wait detector on its own: what counts as the host waiting on the device, what does not,
and its error mode (the engine-level assertions: tests/integration/test_host_waits.py)."""

from __future__ import annotations

import pytest
import torch

from specserve.errors import ConfigError
from specserve.runtime.host_waits import HostWaitDetector, HostWaitError, device_code, host_resident
from specserve.runtime.stream import staged
from specserve.runtime.stream import Event, Stream, async_d2h


def watched(body, mode="count", exempt=()):
    """Run body() under a fresh detector; the ops of each wait recorded."""
    detector = HostWaitDetector(mode, exempt)
    with detector.watching():
        body()
    return [w.op for w in detector.waits]


@pytest.fixture
def dev():
    """A tensor made outside the detector: the weights, K/V and buffers a step reads (device memory)."""
    return torch.arange(6)


@pytest.mark.parametrize("read", [
    lambda t: t.tolist(), lambda t: t[0].item(), lambda t: bool(t[1]), lambda t: int(t[2]), lambda t: float(t[2]),
    lambda t: t.cpu(), lambda t: t.numpy(), lambda t: t.nonzero(), lambda t: t[t > 2], lambda t: torch.unique(t),
    lambda t: f"{t[0]}", lambda t: range(t[3]), lambda t: torch.equal(t, t), lambda t: 3 in t,
    lambda t: torch.where(t > 2), lambda t: torch.arange(3).repeat_interleave(t[:3]),
])
def test_every_read_of_device_values_is_a_wait(dev, read):
    assert len(watched(lambda: read(dev))) == 1


def test_results_of_device_ops_stay_on_the_device(dev):
    ops = watched(lambda: ((dev * 2 + 1).argmax(-1) + torch.zeros_like(dev)).tolist())
    assert ops == ["tolist()"]


def test_values_copied_up_live_on_the_device():
    # staged: built on the host, copied without blocking; its values then live on the device.
    assert watched(lambda: staged([1, 2], torch.int64, "cpu").tolist()) == ["tolist()"]
    assert watched(lambda: torch.zeros(3).to("cpu", non_blocking=True).sum().item()) == ["item()"]
    assert watched(lambda: torch.arange(4, device="cpu").sum().item()) == ["item()"]  # made there: no copy


def test_a_blocking_copy_up_is_a_wait():
    # On CUDA a blocking copy from pageable memory synchronises the stream (runtime/stream.py's `staged`).
    assert watched(lambda: torch.tensor([1, 2], device="cpu")) == ["tensor() to the device, blocking"]
    assert watched(lambda: torch.ones(2).to("cpu")) == ["to() to the device, blocking"]
    assert watched(lambda: torch.tensor([1.0]).to(torch.device("cpu"), non_blocking=True)) == []


def test_host_tensors_are_read_freely(dev):
    def body():
        host = torch.zeros(4, dtype=torch.int64)  # no device named: host memory
        host[1] = 7
        assert (host + 1).tolist() == [1, 8, 1, 1] and int(host.max()) == 7
        staged = host_resident(torch.ones(2))  # made elsewhere, marked host memory
        assert staged.sum().item() == 2.0
    assert watched(body) == []


def test_device_values_written_into_a_host_tensor_are_a_copy_back(dev):
    def body():
        host = torch.zeros(6, dtype=torch.int64)
        host.copy_(dev)
        host[:2] = dev[:2]
    assert watched(body) == ["copy_()", "__setitem__()"]


def test_launching_device_work_and_writing_device_tensors_is_no_wait(dev):
    def body():
        out = torch.empty_like(dev)
        out.copy_(dev * 3)
        out[staged([0, 1], torch.int64, "cpu")] = dev[:2]  # an integer index: a gather, no count needed
        out.index_copy_(0, torch.arange(2, device="cpu"), dev[2:4])
    assert watched(body) == []


def test_event_synchronize_inside_is_a_wait_and_the_exempt_stream_copies_freely(dev):
    forward, copy = Stream("forward"), Stream("copy")

    def body():
        Event().record(forward).wait(copy)
        async_d2h(dev * 2, copy)  # the copy stream's device-to-host copy: the one the design allows
        forward.synchronize()

    ops = watched(body, exempt=(copy,))
    assert len(ops) == 1 and ops[0].startswith("Event.synchronize")


def test_a_cpu_kernels_own_reads_are_not_host_waits(dev):
    def kernel():
        with device_code():
            return dev[dev > 1].sum()
    assert watched(kernel) == []


def test_error_mode_raises_at_the_first_wait_naming_the_site(dev):
    with pytest.raises(HostWaitError, match="item"):
        watched(lambda: dev[0].item(), mode="error")


def test_the_switch_reads_count_or_error(monkeypatch):
    monkeypatch.delenv("SPECSERVE_HOST_WAITS", raising=False)
    assert HostWaitDetector.from_env() is None
    monkeypatch.setenv("SPECSERVE_HOST_WAITS", "Error")
    assert HostWaitDetector.from_env().mode == "error"
    monkeypatch.setenv("SPECSERVE_HOST_WAITS", "loud")
    with pytest.raises(ConfigError, match="SPECSERVE_HOST_WAITS must be one of count, error"):
        HostWaitDetector.from_env()


def test_sync_warnings_count_and_other_warnings_pass_on():
    """CUDA's sync debug mode warns in count mode (emulated here): each such warning is a wait."""
    import warnings

    detector = HostWaitDetector("count")
    with pytest.warns(UserWarning, match="unrelated"):
        with detector.watching():
            warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("unrelated")
    assert [w.op for w in detector.waits] == ["CUDA: called a synchronizing CUDA operation"]
