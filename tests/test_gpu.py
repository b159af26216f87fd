"""GPU acceptance tests, run by ``make gpu-check`` (benchmarks/gpu_check.py) on a machine with CUDA;
skipped everywhere else (CI has no GPU).

Each test drives the engine in this process on a one-rank loopback world placed on ``cuda:0``
(the communicator is in-process; the stages, buffers and policies are the real CUDA paths), but
the spatial one, which launches two MPI ranks sharing the GPU.
Figures a test measures go to the JSON-lines file named by ``GEMS_GPU_REPORT`` (when set) so
that gpu_check.py can put them in its report.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import time

import pytest
import torch
from torch import nn

from gems import models, partition
from gems.comm import loopback
from gems.obs.memory import PeakMeter
from gems.pipeline.engine import Engine
from gems.pipeline.oom import OutOfMemory
from conftest import DISTRIBUTED, run_mpi

# GEMS_GPU_TEST_TIMEOUT: seconds per test (gpu_check.py lowers it to fit its own limit)
TIMEOUT = float(os.environ.get("GEMS_GPU_TEST_TIMEOUT", 900))
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(TIMEOUT, method="thread"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by make gpu-check)")]

DEVICE = torch.device("cuda", 0)


def report(**figures) -> None:
    """Append ``figures`` (one JSON object) to $GEMS_GPU_REPORT, if set."""
    path = os.environ.get("GEMS_GPU_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(figures) + "\n")


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


@contextlib.contextmanager
def exact_convolutions():
    """cuDNN's convolutions in float32, not TF32: runs that compare parameters use the same precision."""
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def timed_steps(engine: Engine, images: torch.Tensor, labels: torch.Tensor, n: int) -> list[float]:
    """Seconds of each of ``n`` steps, the device synchronized around each."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize(DEVICE)
        start = time.perf_counter()
        engine.step(images, labels)
        torch.cuda.synchronize(DEVICE)
        times.append(time.perf_counter() - start)
    return times


def batch(size: int, side: int, classes: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, side, side, generator=g), torch.randint(0, classes, (size,), generator=g)


def one_rank(fn, *args, **kwargs):
    """``fn(comm, ...)`` on a one-rank loopback world; its result."""
    return loopback.run(1, fn, *args, timeout=600, **kwargs)[0]


def engine_for(comm, model: nn.Sequential, plan, **kwargs) -> Engine:
    return Engine(model, plan, sgd, nn.CrossEntropyLoss(), comm=comm, device=DEVICE, **kwargs)


@pytest.mark.parametrize("side", [1024, 2048])
def test_the_plans_tensor_peak_is_within_10_percent_of_the_allocators(side):
    """resnet50, batch 2, one stage: the plan's peak vs torch.cuda.max_memory_allocated over a
    step after a warm-up step; the CUDA context and other non-tensor memory are reported apart
    (mem_get_info's used bytes minus the allocator's reserved bytes)."""
    model = models.build("resnet50", num_classes=10)
    plan = partition.plan(model, (3, side, side), batch_size=2, stages=1, schedule="mp", device="cuda")

    def measure(comm):
        engine = engine_for(comm, model, plan)
        images, labels = batch(2, side)
        engine.step(images, labels)          # warm-up: cuDNN picks algorithms, allocator fills
        meter = PeakMeter(DEVICE)
        meter.start()
        engine.step(images, labels)
        peak = meter.stop()
        free, total = torch.cuda.mem_get_info(DEVICE)
        outside = (total - free) - torch.cuda.memory_reserved(DEVICE)
        return peak, outside

    measured, outside = one_rank(measure)
    estimate = plan.positions[0].peak_bytes
    error = estimate / measured - 1
    report(test="memory", side=side, measured=measured, estimated=estimate, error=error,
           outside_allocator=outside)
    assert abs(error) < 0.10, f"plan {estimate} vs measured {measured} bytes ({error:+.1%}) at {side}"


def test_bf16_autocast_trains_like_float32_within_bf16_precision():
    """resnet18 at 256², three steps under bf16 autocast: losses close to float32's (bf16
    keeps 8 bits of mantissa) and the parameters stay float32."""
    torch.manual_seed(0)
    model = models.build("resnet18", num_classes=10)
    plan = partition.plan(model, (3, 256, 256), batch_size=4, stages=1, schedule="mp", device="cuda", amp="bf16")
    images, labels = batch(4, 256)

    def losses(comm, autocast):
        torch.manual_seed(0)
        fresh = models.build("resnet18", num_classes=10)
        engine = engine_for(comm, fresh, plan, autocast=autocast)
        out = [engine.step(images, labels) for _ in range(3)]
        assert all(p.dtype == torch.float32 for p in fresh.parameters())
        return out

    full, half = one_rank(losses, None), one_rank(losses, torch.bfloat16)
    report(test="bf16", float32_losses=full, bf16_losses=half)
    assert all(abs(h - f) <= 0.05 * abs(f) + 0.05 for f, h in zip(full, half)), (full, half)


def test_a_step_never_synchronizes_a_whole_stream_and_times_actions_with_events(monkeypatch):
    """Inside engine.step nothing calls torch.cuda.synchronize or Stream.synchronize (each would
    stall the host on all queued work); the action timer records CUDA events instead."""
    model = models.build("resnet18", num_classes=10)
    plan = partition.plan(model, (3, 256, 256), batch_size=2, stages=1, schedule="mp", device="cuda")
    images, labels = batch(2, 256)
    calls: list[str] = []

    def run(comm):
        engine = engine_for(comm, model, plan)
        engine.step(images, labels)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("torch.cuda.synchronize"))
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: calls.append("Stream.synchronize"))
        engine.step(images, labels)
        monkeypatch.undo()
        return engine.timer.timeline()

    spans = one_rank(run)
    assert calls == []
    assert spans and all(end >= start for _, start, end in spans)
    assert sum(end - start for label, start, end in spans if label.startswith("forward")) > 0


def test_the_budget_is_enforced_through_the_allocators_fraction():
    """--enforce-memory-budget on CUDA: a budget far below the step's need makes the step fail
    with OutOfMemory naming the action, and the fraction is restored afterwards."""
    from gems.train.trainer import enforce_memory_budget  # noqa: PLC0415

    model = models.build("resnet50", num_classes=10)
    plan = partition.plan(model, (3, 1024, 1024), batch_size=2, stages=1, schedule="mp", device="cuda")
    images, labels = batch(2, 1024)

    def run(comm):
        engine = engine_for(comm, model, plan)
        enforce_memory_budget(engine, plan.positions[0].peak_bytes // 4)
        try:
            engine.step(images, labels)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, DEVICE)
            torch.cuda.empty_cache()

    with pytest.raises(OutOfMemory, match="stage 0"):
        one_rank(run)


def wide_convs(classes: int = 10, width: int = 1024, blocks: int = 4) -> nn.Sequential:
    """3x3 convolutions of ``width`` channels: float32 compute per saved byte high enough that a
    GPU computes a forward longer than PCIe takes to move what it saves (a ResNet on an H200
    does not: its activations outrun the copies, and no order could hide them)."""
    units = [nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU())]
    units += [nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU()) for _ in range(blocks)]
    return nn.Sequential(*units, nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)))


def test_offload_gives_the_same_gradients_and_hides_its_copies():
    """wide_convs at 64², batch 2 as two micro-batches of gpipe on one stage, every unit offloaded
    (gpipe's forwards all wait for their backward, so each one offloads; under mp a forward is
    followed by its own backward and offloads nothing, by design): parameters after the steps equal
    those without offload (copies are exact), offload moved bytes, and the step costs at most 30%
    of the copy time more than no offload, measured against a run that waits for each copy
    (GEMS_OFFLOAD_WAIT=1): hidden = (t_wait - t_async) / (t_wait - t_none). TF32 off and
    deterministic cuDNN: the same kernels in every run."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    side = 64
    torch.manual_seed(0)
    model = wide_convs()
    layout = dict(batch_size=2, stages=1, schedule="gpipe", micro_batches=2, device="cuda")
    base = partition.plan(model, (3, side, side), **layout)
    offload = partition.plan(model, (3, side, side), **layout, offload="all")
    assert all(p.offload for p in offload.policies), offload.policies
    images, labels = batch(2, side)

    def train(comm, plan):
        fresh = copy.deepcopy(model)
        engine = engine_for(comm, fresh, plan)
        times = timed_steps(engine, images, labels, 6)
        moved = sum(r.offload.bytes for r in engine.runners.values() if r.offload is not None)
        return sorted(times[1:])[2], moved, {k: v.detach().cpu() for k, v in fresh.state_dict().items()}

    with exact_convolutions():
        t_none, _, plain = one_rank(train, base)
        t_async, moved, offloaded = one_rank(train, offload)
        os.environ["GEMS_OFFLOAD_WAIT"] = "1"
        try:
            t_wait, _, _ = one_rank(train, offload)
        finally:
            del os.environ["GEMS_OFFLOAD_WAIT"]
    for key in plain:
        torch.testing.assert_close(offloaded[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)
    hidden = (t_wait - t_async) / max(t_wait - t_none, 1e-9)
    report(test="offload", side=side, model="wide_convs", moved_bytes_per_step=moved / 6, step_none=t_none,
           step_offload=t_async, step_offload_waiting=t_wait, hidden=hidden)
    assert moved > 0
    assert hidden >= 0.7, f"offload hid {hidden:.0%} of its copy time (none {t_none:.4f} s, " \
                          f"async {t_async:.4f} s, waiting {t_wait:.4f} s)"


def test_spatial_tiles_on_cuda_train_like_one_process():
    """A GroupNorm CNN (5x5 stride-2 stem, max pooling, residual blocks) at side 100 on a 2x1 tile
    grid of two MPI ranks sharing cuda:0, K = 1: halo exchanges, group sums and the gather on
    CUDA tensors through MPI; three SGD steps equal one process's (tests/distributed/
    spatial_worker.py, which says why this needs real processes on CUDA). Not resnet18 at batch 2:
    its gradients move by 7% for a 1e-7 change of the input (BatchNorm over two images,
    max-pooling ties), in one process too."""
    result = run_mpi(2, DISTRIBUTED / "spatial_worker.py", "--device", "cuda", timeout=TIMEOUT)
    line = next(line for line in result.stdout.splitlines() if line.startswith("ok spatial"))
    report(test="spatial", grid="2x1", result=line)


def test_host_optimizer_on_cuda_trains_like_the_device_and_frees_the_optimizer_state():
    """wide_convs at 64², gpipe m=2 on one stage, three steps with the model state on the device and
    with ``--state-placement host-optimizer`` (pinned host copies, the copy out on its own stream,
    torch's CPU optimizer). SGD with momentum: the parameters agree within float32 rounding (CPU and
    CUDA kernels round differently). AdamW (not compared: its first steps divide by |g|, so a
    rounding difference of a near-zero gradient moves a weight by up to lr): its state lives on the
    host and the device peak drops by at least 80% of it (two float32 tensors per parameter)."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False   # one algorithm per shape
    side = 64
    torch.manual_seed(0)
    model = wide_convs()
    images, labels = batch(2, side)
    factories = {"sgd": sgd, "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)}

    def train(comm, placement, optimizer):
        plan = partition.plan(model, (3, side, side), batch_size=2, stages=1, schedule="gpipe", micro_batches=2,
                              device="cuda", optimizer=optimizer, state_placement=placement)
        assert all(p.state_placement == placement for p in plan.policies), plan.policies
        gc.collect()   # the runs before, gone: the peak is this engine's, above what is left allocated
        base = torch.cuda.memory_allocated(DEVICE)
        fresh = copy.deepcopy(model)
        engine = Engine(fresh, plan, factories[optimizer], nn.CrossEntropyLoss(), comm=comm, device=DEVICE)
        engine.step(images, labels)
        first = {k: v.detach().cpu() for k, v in engine.state_dict().items()}
        meter = PeakMeter(DEVICE)
        meter.start()
        times = timed_steps(engine, images, labels, 2)
        peak = meter.stop() - base
        state = [t for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
        return dict(peak=peak, step=min(times), where={t.device.type for t in state},
                    state=sum(t.numel() * t.element_size() for t in state), first=first,
                    params={k: v.detach().cpu() for k, v in engine.state_dict().items()})

    def furthest(a: dict, b: dict) -> tuple[float, str]:
        """The largest |a - b| beyond rtol 1e-5 (in units of atol 1e-6 + 1e-5 |b|), and its tensor."""
        return max((float(((a[k] - v).abs() / (1e-6 + 1e-5 * v.abs())).max()), k) for k, v in b.items())

    with exact_convolutions():
        runs = {(placement, optimizer): one_rank(train, placement, optimizer)
                for optimizer in factories for placement in ("device", "host-optimizer")}
    sgd_device, sgd_host = runs[("device", "sgd")], runs[("host-optimizer", "sgd")]
    after_one, after_three = furthest(sgd_host["first"], sgd_device["first"]), furthest(sgd_host["params"],
                                                                                      sgd_device["params"])
    report(test="host-optimizer-sgd", side=side, model="wide_convs", after_one_step=after_one,
           after_three_steps=after_three,
           max_abs_difference={k: float((sgd_host["params"][k] - v).abs().max())
                               for k, v in sgd_device["params"].items()})
    assert after_one[0] <= 1 and after_three[0] <= 1, \
        f"SGD's parameters beyond rtol 1e-5, atol 1e-6: {after_one} after one step, {after_three} after three"
    device, host = runs[("device", "adamw")], runs[("host-optimizer", "adamw")]
    saved = device["peak"] - host["peak"]
    apart = {k: (host["params"][k] - v).abs() for k, v in device["params"].items()}
    beyond = {k: int((d > 1e-6 + 1e-4 * device["params"][k].abs()).sum()) for k, d in apart.items()}
    report(test="host-optimizer", side=side, model="wide_convs", optimizer="adamw", device_peak=device["peak"],
           host_optimizer_peak=host["peak"], optimizer_state_bytes=device["state"], saved=saved,
           step_device=device["step"], step_host_optimizer=host["step"],
           sgd_step_device=runs[("device", "sgd")]["step"],
           sgd_step_host_optimizer=runs[("host-optimizer", "sgd")]["step"],
           adamw_max_difference=max(float(d.max()) for d in apart.values()),
           adamw_elements_beyond_rtol_1e_4={k: n for k, n in beyond.items() if n})
    assert device["where"] == {"cuda"} and host["where"] == {"cpu"}, (device["where"], host["where"])
    assert saved >= 0.8 * device["state"], f"the device peak dropped by {saved} bytes, the state is {device['state']}"


@pytest.mark.parametrize("schedule, K, m, optim, group_units, policy, grouped", [
    ("gpipe", 2, 4, "adamw", 1, "recompute", True),
    ("1f1b", 1, 2, "sgd", 2, "offload", False),
    ("mast", 2, 1, "adamw", 1, "none", False)])
def test_host_weights_on_cuda_equal_the_host_optimizer_bit_for_bit(schedule, K, m, optim, group_units, policy, grouped):
    """``--state-placement host`` on cuda:0 (loopback ranks): weights copied in per group on the copy
    stream, gradients out through pinned buffers, group-major runs where asked. Both host placements
    update on the host from the same gradients, so the parameters after three steps are bitwise
    those of host-optimizer, close to the device's, and no device parameter storage remains."""
    from equivalence import OPTIMIZERS, build, data, make_plan   # noqa: PLC0415 - the CPU harness's pieces

    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    def train(placement):
        plan = make_plan("transparency", schedule, K, m, 1, placement=placement, policy=policy,
                         group_units=group_units if placement == "host" else 0, grouped=grouped and placement == "host")
        model = build("transparency")
        copies, plans = [copy.deepcopy(model) for _ in range(K)], [copy.deepcopy(plan) for _ in range(K)]

        def rank(comm):
            engine = Engine(copies[comm.rank], plans[comm.rank], OPTIMIZERS[optim], nn.CrossEntropyLoss(), comm=comm,
                            device=DEVICE)
            losses = [engine.step(*data(plan.batch_size, s)) for s in range(3)]
            torch.cuda.synchronize(DEVICE)
            held = sum(r.weights.device_bytes for r in engine.runners.values() if r.weights is not None)
            return losses, engine.state_dict(), held
        return loopback.run(K, rank, timeout=300)

    runs = {p: train(p) for p in ("device", "host-optimizer", "host")}
    host, optimizer, device = runs["host"][0], runs["host-optimizer"][0], runs["device"][0]
    worst = max(float((device[1][k] - v).abs().max() / device[1][k].abs().max().clamp_min(1e-12))
                for k, v in host[1].items() if v.is_floating_point())
    report(test="host-weights", schedule=schedule, K=K, m=m, optimizer=optim, grouped=grouped,
           max_relative_difference_to_device=worst)
    assert host[0] == optimizer[0] and all(torch.equal(v, host[1][k]) for k, v in optimizer[1].items())
    assert all(r[2] == 0 for r in runs["host"]), [r[2] for r in runs["host"]]
    assert worst < 1e-3, worst
