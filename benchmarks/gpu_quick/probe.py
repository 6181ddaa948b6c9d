"""benchmarks/gpu.sh quick, S2: a capture made to fail in the real fallback chain, then two more trials in the
same process. Passes when the failure falls back one mode (to graphs, still captured), the next trials capture
again in the default mode, memory above the data returns to the same figure after each trial, and
`empty_cache` and eager dropout still work. Needs CUDA; run from the checkout with HEADSEARCH_DATA set."""
import os
import sys

import torch

from headsearch.tasks import DataSource, get_task, resolve_config
from headsearch.training.steps import GraphSteps
from headsearch.training.prepare import prepare_steps
from headsearch.training.runtime import steps_per_epoch


def main() -> int:
    if not torch.cuda.is_available():
        print("probe: needs CUDA")
        return 2
    dev, task = torch.device("cuda"), get_task("vit-cifar10")
    cfg = resolve_config(task, overrides={"train": {"epochs": 1}, "data": {"val_size": 1000, "train_limit": 8960}})
    bound = task.setup(cfg, DataSource(data_dir=os.environ["HEADSEARCH_DATA"] + "/cifar10"), dev)
    spe, base, orig = steps_per_epoch(bound, cfg.train), torch.cuda.memory_allocated(), GraphSteps.step_body

    def bad(self, batch):  # a host read inside the reduce-overhead capture: cudaStreamEndCapture fails
        n = orig(self, batch)
        if torch.cuda.is_current_stream_capturing() and self.mode.name == "reduce-overhead":
            float(self.state.last_loss)
        return n

    modes, above = [], []
    for tag, body in (("injected failure", bad), ("next trial", orig), ("third trial", orig)):
        GraphSteps.step_body = body
        try:
            model = bound.build_model().to(dev)
            steps, _, note = prepare_steps(task, cfg.train, bound, model, dev, spe)
            for batch, _ in zip(bound.train_batches(1), range(5)):
                steps.step(batch)
            torch.cuda.synchronize()
            modes.append(steps.mode.name)
            print(f"{tag}: {steps.mode.describe()} | note: {note} | default stream current: "
                  f"{torch.cuda.current_stream() == torch.cuda.default_stream()}")
            del model, steps
        except Exception as e:  # noqa: BLE001 - the probe reports, then judges
            modes.append(f"raised {type(e).__name__}")
            print(f"{tag}: RAISED {type(e).__name__}: {' '.join(str(e).split())[:200]}")
        above.append((torch.cuda.memory_allocated() - base) / 2**20)
        print(f"   allocated above the data: {above[-1]:.1f} MiB, reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB")
    GraphSteps.step_body = orig
    ok = modes == ["graphs", "reduce-overhead", "reduce-overhead"] and max(above) - min(above) < 64
    for what, fn in (("empty_cache", torch.cuda.empty_cache),
                     ("eager dropout", lambda: torch.nn.functional.dropout(torch.ones(1024, device=dev), 0.5).sum().item())):
        try:
            fn()
            print(what, "OK")
        except Exception as e:  # noqa: BLE001
            ok = False
            print(what, "RAISED:", " ".join(str(e).split())[:200])
    print("probe:", "PASS" if ok else f"FAIL (modes {modes}, MiB above the data {[round(a) for a in above]})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
