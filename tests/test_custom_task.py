"""A third task, defined and registered by this test alone: `train`, `run`, `report`, `export` and `analyze`
work on it with no change outside this file. That is the task protocol's promise (docs/architecture.md).

The task: sequences of 12 random tokens from a vocabulary of 8; the label says whether the planted token 0
occurs in the sequence. An encoder with per-layer heads over the tokens, mean-pooled, classifies them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from headsearch.config import ArchConfig, DataOptions, RunConfig, TrainConfig, coerce_fields
from headsearch.errors import ConfigError
from headsearch.io import write_atomic
from headsearch.models.transformer import Encoder
from headsearch.tasks import DataSource, Metric, Task, TokenAttention, limited, rebound, register

NAME = "planted-token"
PLANTED = 0


@dataclass(frozen=True)
class PlantedData(DataOptions):
    n_train: int = 512
    n_eval: int = 128
    seq_len: int = 12
    vocab: int = 8
    eval_batch_size: int = 64

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("n_train", "n_eval", "seq_len", "vocab", "eval_batch_size"))
        if min(self.n_train, self.n_eval, self.seq_len, self.eval_batch_size) < 1 or self.vocab < 2:
            raise ConfigError("planted-token data options must be positive (vocab at least 2)")


class TokenClassifier(nn.Module):
    """Token and position embeddings, headsearch's encoder stack, mean pooling, a linear classifier."""

    def __init__(self, cfg: ArchConfig, vocab: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(1, seq_len, cfg.d_model) * 0.02)
        self.encoder = Encoder(cfg)
        self.head = nn.Linear(cfg.d_model, 2)

    def forward(self, tokens, need_weights: bool = False):
        x, weights = self.encoder(self.embed(tokens) + self.pos, need_weights=need_weights)  # (B, T, D)
        logits = self.head(x.mean(1))  # (B, 2)
        return (logits, weights) if need_weights else logits


def _sequences(n: int, opts: PlantedData, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, opts.vocab, (n, opts.seq_len), generator=generator)
    # Balance the classes: half the sequences have the planted token removed.
    absent = torch.rand(n, generator=generator) < 0.5
    x[absent] = torch.where(x[absent] == PLANTED, torch.ones_like(x[absent]), x[absent])
    return x, (x == PLANTED).any(1).long()


class BoundPlanted:
    def __init__(self, cfg: RunConfig, device):
        g = torch.Generator().manual_seed(cfg.seed)
        self.cfg, self.device, opts = cfg, torch.device(device), cfg.data
        self.train = _sequences(opts.n_train, opts, g)
        self.eval_sets = {"val": _sequences(opts.n_eval, opts, g), "test": _sequences(opts.n_eval, opts, g)}
        self.n_train = opts.n_train

    def rebind(self, cfg):
        return rebound(self, cfg)

    def with_eval_limit(self, n):
        return limited(self, n, lambda xy, k: (xy[0][:k], xy[1][:k]))

    def build_model(self):
        return TokenClassifier(self.cfg.arch, self.cfg.data.vocab, self.cfg.data.seq_len)

    def batches_per_epoch(self):
        return -(-self.n_train // self.cfg.train.batch_size)

    def train_batches(self, epoch):
        order = torch.randperm(self.n_train, generator=torch.Generator().manual_seed(self.cfg.seed * 1000 + epoch))
        bs = self.cfg.train.batch_size
        for i in range(0, self.n_train, bs):
            idx = order[i : i + bs]
            yield self.train[0][idx], self.train[1][idx]

    def warmup_batches(self, steps_per_epoch):
        return [next(iter(self.train_batches(1)))]

    def loss(self, model, batch, label_smoothing):
        x, y = batch
        return F.cross_entropy(model(x), y, label_smoothing=label_smoothing), len(y)

    def evaluate(self, model, split):
        x, y = self.eval_sets[split]
        logits = model(x).float()
        return {"accuracy": float((logits.argmax(-1) == y).float().mean()), "loss": float(F.cross_entropy(logits, y))}

    def write_artifacts(self, run_dir: Path):
        write_atomic(run_dir / "planted.json", json.dumps({"planted": PLANTED, "train": self.n_train}))

    def write_outputs(self, run_dir: Path):
        pass

    def analysis_batches(self, split, samples, batch_size):
        x, y = self.with_eval_limit(samples).eval_sets[split]
        return [{"inputs": (x[i : i + batch_size],), "masks": {}, "targets": y[i : i + batch_size]}
                for i in range(0, len(y), batch_size)]

    def summed_loss(self, model, batch):
        logits = model(*batch["inputs"]).float()
        return F.cross_entropy(logits, batch["targets"], reduction="sum"), len(batch["targets"])

    def attention_views(self, model, samples=2):
        x, _ = self.eval_sets["test"]
        _, weights = model(x[:samples], need_weights=True)
        return [TokenAttention(source_tokens=[str(t) for t in x[i].tolist()], output_tokens=[str(t) for t in x[i].tolist()],
                               layers=[w.self_attn[i].detach().float().numpy() for w in weights]) for i in range(samples)]


def _default_config() -> RunConfig:
    return RunConfig(task=NAME, arch=ArchConfig(d_model=16, enc_layers=2, enc_heads=2, d_ff=32),
                     train=TrainConfig(epochs=3, batch_size=64, lr=3e-3), data=PlantedData())


TASK = Task(
    name=NAME,
    description="does the planted token occur? (a test task)",
    metrics=(Metric("accuracy", "maximize"), Metric("loss", "minimize")),
    default_config=_default_config,
    presets={"tiny": {"train": {"epochs": 2}, "search": {"data": {"n_train": 256}}}},
    data_options=PlantedData,
    check_source=lambda source: None,
    setup=lambda cfg, source, device, run_dir=None: BoundPlanted(cfg, device),
    static_shapes=True,
)

SPACE = """\
description: "a small space for the planted-token task"
tasks: [planted-token]
schedule:
  families: [uniform, halving]
  heads: [1, 2, 4]
skip: [none, output, scores]
fusion: [none, add]
"""


@pytest.fixture()
def planted(monkeypatch):
    from headsearch.tasks import registry

    monkeypatch.setitem(registry._REGISTRY, NAME, TASK)  # registered for this test only
    return TASK


@pytest.mark.slow
def test_a_task_defined_in_a_test_trains_searches_reports_exports_and_analyzes(planted, tmp_path, invoke):
    run_dir = tmp_path / "run"
    result = invoke(["train", "--task", NAME, "--out", str(run_dir), "--device", "cpu", "--seed", "1"])
    assert result.exit_code == 0, result.output
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "completed" and final["epochs_run"] == 3
    assert final["test_metrics"]["accuracy"] > 0.6  # measured 0.9+: the rule is learnt, not guessed (chance 0.5)
    assert (run_dir / "planted.json").is_file()  # the task's own artifacts
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["seq_len"] == 12

    space = tmp_path / "planted.yaml"
    space.write_text(SPACE)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    common = ["--storage", storage, "--study", "planted"]
    result = invoke(["run", "--task", NAME, "--space", str(space), "--trials", "2", "--preset", "tiny", "--device", "cpu",
                     "--run-root", str(tmp_path / "runs"), *common])
    assert result.exit_code == 0, result.output

    result = invoke(["report", *common, "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [o["name"] for o in report["objectives"]] == ["accuracy", "time"]
    assert report["counts"]["complete"] == 2
    assert all(row["values"]["accuracy"] is not None for row in report["trials"])

    result = invoke(["export", *common, "--pareto", "--out", str(tmp_path / "best")])
    assert result.exit_code == 0, result.output
    exported = sorted((tmp_path / "best").glob("trial-*.yaml"))
    assert exported
    saved = yaml.safe_load(exported[0].read_text())
    assert saved["task"] == NAME and saved["data"]["n_train"] == 256  # the search preset's data
    retrained = tmp_path / "retrained"
    result = invoke(["train", "--task", NAME, "--config", str(exported[0]), "--out", str(retrained), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    trial = int(exported[0].stem.split("-")[1])
    trial_dir = tmp_path / "runs" / "planted" / f"trial-{trial:05d}"
    original = json.loads((trial_dir / "final.json").read_text())
    again = json.loads((retrained / "final.json").read_text())
    assert again["best_metrics"] == original["best_metrics"]  # same seed, same CPU: the same run

    result = invoke(["analyze", str(trial_dir), "--samples", "32", "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.output
    analysis = json.loads(result.output)
    assert analysis["task"] == NAME and len(analysis["layers"]) == 2
    names = {Path(f).name for f in analysis["figures"]}
    assert {"head_importance.png", "pruning_curve.png", "cross_attention_sample0.png"} <= names
    assert analysis["uploaded"]  # a search trial: the figures went to its study


def test_its_data_options_are_typed_and_checked_before_anything_runs(planted, tmp_path, invoke):
    result = invoke(["train", "--task", NAME, "--out", str(tmp_path / "run"), "--device", "cpu", "--config",
                     str(_write(tmp_path / "bad.yaml", {"task": NAME, "arch": {}, "data": {"vocab": 1}}))])
    assert result.exit_code == 2 and "vocab at least 2" in result.output
    assert not (tmp_path / "run").exists()
    result = invoke(["train", "--task", NAME, "--out", str(tmp_path / "run"), "--device", "cpu", "--config",
                     str(_write(tmp_path / "bad.yaml", {"task": NAME, "arch": {}, "data": {"max_len": 3}}))])
    assert result.exit_code == 2 and "unknown data option(s) max_len for task planted-token" in result.output


def _write(path: Path, d: dict) -> Path:
    path.write_text(yaml.safe_dump(d))
    return path
