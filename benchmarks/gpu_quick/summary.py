"""benchmarks/gpu.sh quick: one short summary per step, from the run directories and the study it wrote.

    python3 benchmarks/gpu_quick/summary.py vit OUT        # S1: the default ViT against --compile off
    python3 benchmarks/gpu_quick/summary.py search OUT     # S3: every trial of the short default search
    python3 benchmarks/gpu_quick/summary.py translation OUT  # S5: tiny translation on the default path
"""
import glob
import json
import sys


def run_line(name: str, path: str) -> dict | None:
    try:
        f = json.load(open(f"{path}/final.json"))
        epochs = [json.loads(line) for line in open(f"{path}/metrics.jsonl")]
    except OSError as e:
        print(f"{name}: NO RESULT ({e})")
        return None
    print(f"{name}: {f['status']} | {f['step_mode']} | note {f['step_note']} | uncaptured {f['uncaptured_steps']}"
          f" | warm-up {f['compile_seconds']:.1f} s | {f['samples_per_s']:,.0f} samples/s | test {f['test_metrics']}")
    print("   train loss", [round(e["train_loss"], 4) for e in epochs])
    return f


def vit(out: str) -> None:
    auto, off = run_line("default", f"{out}/vit-auto"), run_line("--compile off", f"{out}/vit-off")
    if auto and off:
        print(f"default / off samples/s: {auto['samples_per_s'] / off['samples_per_s']:.2f}x (passes at >= 2.5x,"
              f" with 'compiled blocks' in the mode, note None, uncaptured 0)")


def search(out: str) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{out}/h.db"
    for name in optuna.get_all_study_names(storage):
        trials, samples = optuna.load_study(study_name=name, storage=storage).trials, 0.0
        trained = [t for t in trials if "duplicate_of" not in t.user_attrs]
        for t in trained:
            a = t.user_attrs
            samples += (a.get("samples_per_s") or 0) * (a.get("train_seconds") or 0)
            print(t.number, t.state.name, a.get("arch"), "|", a.get("step_mode"), "| note", a.get("step_note"),
                  "| warm-up", a.get("compile_seconds"), "| alone", a.get("epoch_seconds_alone"), "| samples/s",
                  a.get("samples_per_s"), "|", a.get("fail_reason") or a.get("rejected") or "")
        print(f"{len(trials) - len(trained)} duplicate proposals skipped (not trained)")
        done = [t for t in trained if t.datetime_complete]
        if done:
            wall = (max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)).total_seconds()
            print(f"aggregate {samples:,.0f} samples / {wall:.0f} s wall = {samples / wall:,.0f} samples/s (warm-ups included)")
    for f in glob.glob(f"{out}/runs/*/workers/*.failed"):
        print("FAILED WORKER", f, open(f).read().strip())


def translation(out: str) -> None:
    run_line("translation", f"{out}/tr-auto")


if __name__ == "__main__":
    {"vit": vit, "search": search, "translation": translation}[sys.argv[1]](sys.argv[2])
