"""What keeps a GPU run sound when its fast path fails, runs short of memory or runs on another GPU:

- a CUDA graph capture that fails puts back the current stream and CUDA's random number generator, which
  torch leaves broken (torch.cuda.graph.__exit__ skips restoring the stream when capture_end throws; up to
  torch 2.12 the default generator stays in capture mode), or says that the process must be restarted;
- the graphs of every batch shape share one memory pool, and replay correctly in any order;
- running out of memory while warming up a fast mode falls back to the next mode with a note;
- captures and step timings happen on the run's device (cuda:1 while cuda:0 is current).

The CUDA behaviour needs a GPU: those tests skip without one (this machine and CI have none), each saying
why. What of it runs on a CPU is tested here on the CPU: the fallback chain (warm-ups made to raise), and
the capture recovery's logic with CUDA's calls faked (what the code does with them; the CUDA tests check
that torch behaves as the fakes assume).
"""
from __future__ import annotations

import gc
import itertools
import json
import weakref

import pytest
import torch

from headsearch.tasks import apply_overrides, get_task, resolve_config
from headsearch.training import prepare
from headsearch.training.fastpath import StepMode
from headsearch.training.steps import (
    CaptureBrokeCuda, EagerSteps, GraphSteps, capture_stream, clone_batch, recover_failed_capture,
)
from headsearch.training.clock import StepClock
from headsearch.training.prepare import prepare_steps
from headsearch.training.runtime import steps_per_epoch

# make test-oldest runs this module on the floor: torch's CUDA-graph and generator APIs.
pytestmark = pytest.mark.floor

VIT = get_task("vit-cifar10")
GRAPHS = StepMode("graphs", None, True)

# A ViT small enough to capture in seconds; 300 images = 4 batches of 64 and a partial one of 44 (two shapes).
TINY_VIT = {
    "seed": 0,
    "arch": {"d_model": 16, "enc_layers": 1, "enc_heads": 2, "d_ff": 32},
    "train": {"epochs": 1, "batch_size": 64},
    "data": {"train_limit": 300, "val_size": 200, "test_limit": 200},
}

needs_gpu_to_fail_a_capture = pytest.mark.skipif(not torch.cuda.is_available(), reason=(
    "needs a CUDA GPU: makes a CUDA graph capture fail, then checks CUDA's current stream and its default"
    " generator; a CPU has no graph capture, streams or CUDA generator (on a CPU GraphSteps runs uncaptured)"))
needs_gpu_to_capture_shapes = pytest.mark.skipif(not torch.cuda.is_available(), reason=(
    "needs a CUDA GPU: captures two batch shapes into CUDA graphs sharing one memory pool and replays them;"
    " graphs and their pools exist only on CUDA devices (on a CPU GraphSteps runs uncaptured)"))
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs: checks that steps on cuda:1 capture and are timed there while cuda:0 is current")


def vit_config(train=None, arch=None):
    over = json.loads(json.dumps(TINY_VIT))
    over["train"].update(train or {})
    over["arch"].update(arch or {})
    return apply_overrides(VIT, resolve_config(VIT), over)


def out_of_memory() -> torch.cuda.OutOfMemoryError:
    # torch.cuda.OutOfMemoryError is torch._C.OutOfMemoryError, a RuntimeError: constructible without a GPU.
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has 1.00 GiB free")


# ------------------------------------------------------------------------ the fallback chain, on the CPU


def test_out_of_memory_warming_up_a_graph_mode_falls_back_to_eager_steps_with_a_note(cifar, monkeypatch):
    """An OOM while capturing is the fast path's cost (graph pools hold their temporaries), not the model's:
    the trial goes on in eager steps, says why in one line, and keeps nothing of the failed attempt."""
    monkeypatch.setattr(prepare, "resolve_mode", lambda *a: GRAPHS)  # GraphSteps on the CPU (uncaptured)
    failed = []

    def runs_out(self, batches):
        failed.append(weakref.ref(self))
        self.step_body(clone_batch(batches[0]))  # leaves grads on the model, as a failed capture does
        raise out_of_memory()

    monkeypatch.setattr(GraphSteps, "warm_up", runs_out)
    cfg = vit_config({"max_steps_per_epoch": 2})
    bound = VIT.setup(cfg, cifar, "cpu")
    model = bound.build_model()
    steps, seconds, note = prepare_steps(VIT, cfg.train, bound, model, torch.device("cpu"), 2)
    assert isinstance(steps, EagerSteps) and steps.mode.name == "off"
    assert note == ("graphs: eager, whole step in a CUDA graph ran out of device memory (OutOfMemoryError: CUDA out"
                    " of memory. Tried to allocate 2.00 GiB. GPU 0 has 1.00 GiB free)")
    assert seconds >= 0
    gc.collect()
    assert len(failed) == 1 and failed[0]() is None  # prepare_steps keeps no reference to the failed steps
    assert all(p.grad is None for p in model.parameters())  # nor their grads on the model


def test_out_of_memory_in_eager_steps_is_the_runs_own_and_raised(cifar, monkeypatch):
    """Eager steps are the last resort: an OOM there would meet any mode, so the trial fails with it."""
    def runs_out(self, batches):
        raise out_of_memory()

    monkeypatch.setattr(EagerSteps, "warm_up", runs_out)
    cfg = vit_config({"compile": "off", "max_steps_per_epoch": 2})
    bound = VIT.setup(cfg, cifar, "cpu")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        prepare_steps(VIT, cfg.train, bound, bound.build_model(), torch.device("cpu"), 2)


def test_a_capture_that_left_cuda_unusable_is_raised_not_fallen_back_from(cifar, monkeypatch):
    """After CaptureBrokeCuda every later random draw fails: eager steps would fail too, with a baffling
    error, so the trainer raises it as it is (it says to restart the process)."""
    monkeypatch.setattr(prepare, "resolve_mode", lambda *a: GRAPHS)

    def breaks_cuda(self, batches):
        raise CaptureBrokeCuda("a failed CUDA graph capture left CUDA's random number generator unusable")

    def must_not_run(self, *a, **k):
        raise AssertionError("no fallback after CaptureBrokeCuda")

    monkeypatch.setattr(GraphSteps, "warm_up", breaks_cuda)
    monkeypatch.setattr(EagerSteps, "__init__", must_not_run)
    cfg = vit_config({"max_steps_per_epoch": 2})
    bound = VIT.setup(cfg, cifar, "cpu")
    with pytest.raises(CaptureBrokeCuda):
        prepare_steps(VIT, cfg.train, bound, bound.build_model(), torch.device("cpu"), 2)


# ------------------------------------------------- the capture recovery's logic, CUDA's calls faked (CPU)


class FakeGenerator:
    """CUDA's default generator as the recovery uses it; `stuck`: its state left in capture mode."""

    def __init__(self, stuck: bool = False):
        self.stuck, self.state = stuck, None

    def clone_state(self) -> "FakeGenerator":
        return FakeGenerator(stuck=self.stuck)

    def graphsafe_set_state(self, state: "FakeGenerator") -> None:
        self.state, self.stuck = state, state.stuck


class OldGenerator:
    """A generator without clone_state / graphsafe_set_state: the recovery cannot put its state back."""

    stuck = False


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream and generator calls, and torch.rand, as a failed capture on torch <= 2.12 leaves
    them: `capture()` makes the capture stream current and the generator stuck, then raises."""
    world = {"stream": "stream of cuda:0", "set_stream": [], "draws": 0, "generator": FakeGenerator()}

    def rand(*args, **kwargs):
        world["draws"] += 1
        if world["generator"].stuck:
            raise RuntimeError("Offset increment outside graph capture encountered\nunexpectedly.")
        return torch.zeros(1)

    def set_stream(stream):
        world["set_stream"].append(stream)
        world["stream"] = stream

    def capture(error: BaseException):
        world["stream"] = "capture stream"
        world["generator"].stuck = True
        raise error

    def use(generator):
        world["generator"] = generator
        monkeypatch.setattr(torch.cuda, "default_generators", (generator,), raising=False)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: world["stream"])
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch, "rand", rand)
    use(world["generator"])
    world["capture"], world["use"] = capture, use
    return world


CUDA0 = torch.device("cuda", 0)


def test_a_failed_capture_gets_its_stream_and_rng_back_and_its_own_error_re_raised(fake_cuda):
    error = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    generator = fake_cuda["generator"]
    with pytest.raises(RuntimeError) as raised:
        with recover_failed_capture(CUDA0):
            fake_cuda["capture"](error)
    assert raised.value is error  # the trainer falls back on it, with its note
    assert fake_cuda["stream"] == "stream of cuda:0"
    assert generator.state is not None and not generator.stuck  # the state cloned before capture, swapped back in
    assert fake_cuda["draws"] == 1  # the probe


def test_when_the_rng_cannot_be_put_back_the_error_says_to_restart_the_process(fake_cuda):
    fake_cuda["use"](OldGenerator())
    error = RuntimeError("CUDA error: operation failed due to a previous error during capture")
    with pytest.raises(CaptureBrokeCuda) as raised:
        with recover_failed_capture(CUDA0):
            fake_cuda["capture"](error)
    message = str(raised.value)
    assert "\n" not in message and "random number generator unusable" in message and "restart the process" in message
    assert "torch older than 2.13" in message and "Offset increment outside graph capture" in message
    assert raised.value.__cause__ is error
    assert fake_cuda["stream"] == "stream of cuda:0"


def test_a_capture_that_ran_out_of_memory_is_re_raised_even_when_the_probe_has_no_memory_either(fake_cuda, monkeypatch):
    """Too little memory for the probe's one number says nothing about the RNG: the capture's OOM goes on to
    the trainer, which frees the failed attempt and falls back."""
    def no_memory(*args, **kwargs):
        raise out_of_memory()

    error = out_of_memory()
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        with recover_failed_capture(CUDA0):
            monkeypatch.setattr(torch, "rand", no_memory)
            fake_cuda["capture"](error)
    assert raised.value is error and fake_cuda["stream"] == "stream of cuda:0"


def test_a_capture_that_succeeds_is_left_alone(fake_cuda):
    with recover_failed_capture(CUDA0):
        fake_cuda["stream"] = "capture stream"  # torch.cuda.graph puts its stream back itself on success
        fake_cuda["stream"] = "stream of cuda:0"
    assert fake_cuda["set_stream"] == [] and fake_cuda["generator"].state is None and fake_cuda["draws"] == 0


def test_an_interrupted_capture_gets_its_stream_and_rng_back_and_stays_an_interrupt(fake_cuda):
    with pytest.raises(KeyboardInterrupt):
        with recover_failed_capture(CUDA0):
            fake_cuda["capture"](KeyboardInterrupt())
    assert fake_cuda["stream"] == "stream of cuda:0" and not fake_cuda["generator"].stuck
    assert fake_cuda["draws"] == 0  # no probe: the interrupt goes on as it is


# ------------------------------------------------------------------------------------ on a GPU


def reads_the_device_under_capture(original):
    """`GraphSteps.step_body` that also reads the loss on the host when captured: the mistake that makes
    cudaStreamEndCapture fail ("operation not permitted when stream is capturing"), so capture_end throws."""
    def body(self, batch):
        n = original(self, batch)
        if torch.cuda.is_current_stream_capturing():
            float(self.state.last_loss)
        return n
    return body


@needs_gpu_to_fail_a_capture
def test_a_failed_capture_leaves_the_stream_and_random_draws_working_and_falls_back(cifar, monkeypatch):
    """A capture that fails (a host read inside it) with dropout in the model: the current stream is the one
    before, random numbers can be drawn (torch <= 2.12 would raise "Offset increment outside graph capture
    encountered unexpectedly" at the next dropout), and the trial falls back to eager steps, which train."""
    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(GraphSteps, "step_body", reads_the_device_under_capture(GraphSteps.step_body))
    cfg = vit_config({"compile": "graphs", "max_steps_per_epoch": 2}, arch={"dropout": 0.1})
    bound = VIT.setup(cfg, cifar, str(device))
    model = bound.build_model().to(device)
    before = torch.cuda.current_stream(device)
    steps, _, note = prepare_steps(VIT, cfg.train, bound, model, device, 2)
    assert torch.cuda.current_stream(device) == before
    assert not torch.cuda.is_current_stream_capturing()
    torch.rand(8, device=device)
    torch.cuda.synchronize(device)
    assert isinstance(steps, EagerSteps) and steps.mode.name == "off"
    assert note.startswith("graphs: eager, whole step in a CUDA graph failed (") and "\n" not in note
    model.train()
    steps.step(next(iter(bound.train_batches(1))))  # dropout: draws from CUDA's default generator
    steps.state.check_finite(1)
    assert torch.isfinite(steps.state.last_loss)
    # Nor is the caching allocator left mid-capture (a review of torch 2.11's source feared it): the cache
    # empties, and the next trial of this process captures again (as benchmarks/gpu_quick/probe.py saw on an H200).
    torch.cuda.empty_cache()
    monkeypatch.undo()
    again, _, note = prepare_steps(VIT, cfg.train, bound, bound.build_model().to(device), device, 2)
    assert again.mode.name == "graphs" and note is None


@needs_gpu_to_capture_shapes
def test_every_shapes_graph_shares_one_pool_and_replays_in_any_order(cifar, monkeypatch):
    """With HEADSEARCH_SHARED_GRAPH_POOL=1 (opt-in), the 64- and 44-image batches' graphs come from one memory
    pool (captured largest first), and replaying them in the reverse of capture order, alternating, trains as
    the same steps run uncaptured: nothing one graph keeps between replays lies in memory the other's capture
    reused."""
    monkeypatch.setenv("HEADSEARCH_SHARED_GRAPH_POOL", "1")
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = vit_config({"compile": "graphs"})
    bound = VIT.setup(cfg, cifar, str(device))
    spe = steps_per_epoch(bound, cfg.train)
    torch.manual_seed(cfg.seed)
    model = bound.build_model().to(device)
    steps = GraphSteps(model, model, bound, cfg.train, device, GRAPHS, spe)
    steps.warm_up(bound.warmup_batches(spe))  # also checks each graph against its uncaptured step
    entries = list(steps.graphs.values())  # in capture order
    assert [len(static[1]) for _, static, _ in entries] == [64, 44]
    graphs = [graph for graph, _, _ in entries]
    assert all(graph is not None for graph in graphs)
    assert steps.pool is not None
    if hasattr(graphs[0], "pool"):
        assert all(tuple(graph.pool()) == tuple(steps.pool) for graph in graphs)

    batches = list(itertools.islice(bound.train_batches(1), spe))
    full, partial = batches[0], batches[-1]
    assert len(partial[1]) == 44
    order = [partial, full, partial, batches[1]]  # the last-captured shape first
    start = steps.snapshot()
    rng = torch.cuda.get_rng_state(device)

    def train(step):
        steps.restore(start)
        torch.cuda.set_rng_state(rng, device)
        losses = []
        for batch in order:
            step(batch)
            losses.append(float(steps.state.last_loss))
        torch.cuda.synchronize(device)
        return losses, [p.detach().float().clone() for p in model.parameters()]

    replayed_losses, replayed = train(steps.step)
    assert steps.uncaptured == 0
    eager_losses, eager = train(lambda batch: steps.step_body(clone_batch(batch)))
    assert replayed_losses == pytest.approx(eager_losses, rel=1e-3)
    apart = max(float((a - b).abs().max()) for a, b in zip(replayed, eager))
    assert apart <= 0.5 * cfg.train.lr  # a step lost or taken on clobbered state moves weights by ~lr


@needs_two_gpus
def test_steps_on_a_second_gpu_capture_and_are_timed_there(cifar):
    """`--device cuda:1` with cuda:0 current: the capture stream and the graphs are cuda:1's, cuda:0's
    current stream and the current device are as before, and StepClock records on cuda:1's stream (on the
    current device's, as `Event.record()` does, device work on cuda:1 would not show: steps would time ~0)."""
    device = torch.device("cuda", 1)
    with torch.cuda.device(0):
        stream0 = torch.cuda.current_stream(0)
        cfg = vit_config({"compile": "graphs", "max_steps_per_epoch": 4})
        bound = VIT.setup(cfg, cifar, str(device))
        model = bound.build_model().to(device)
        steps, _, note = prepare_steps(VIT, cfg.train, bound, model, device, 4)
        assert note is None and isinstance(steps, GraphSteps)
        assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(0) == stream0
        assert capture_stream(device).device == device
        assert all(graph is not None for graph, _, _ in steps.graphs.values())

        model.train()
        clock = StepClock(device)
        torch.cuda.synchronize(device)
        for batch in itertools.islice(bound.train_batches(1), 4):
            clock.mark()
            steps.step(batch)
        clock.mark()
        torch.cuda.synchronize(device)
        assert steps.uncaptured == 0
        seconds = clock.seconds()
        assert len(seconds) == 4 and all(s > 0 for s in seconds)

        if hasattr(torch.cuda, "_sleep"):  # a kernel that spins for a number of cycles: ~30 ms here
            clock = StepClock(device)
            clock.mark()
            with torch.cuda.device(device):
                torch.cuda._sleep(50_000_000)
            clock.mark()
            torch.cuda.synchronize(device)
            assert clock.seconds()[0] > 0.005


def test_the_shared_graph_pool_is_opt_in(monkeypatch):
    """One pool for every shape has not run on a GPU yet: off unless HEADSEARCH_SHARED_GRAPH_POOL asks for it."""
    from headsearch.training.steps import shared_graph_pool

    monkeypatch.delenv("HEADSEARCH_SHARED_GRAPH_POOL", raising=False)
    assert not shared_graph_pool()
    for value, on in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("HEADSEARCH_SHARED_GRAPH_POOL", value)
        assert shared_graph_pool() is on
