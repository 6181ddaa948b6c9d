"""bitext-en-es: parallel-sentence detection on an English–Spanish corpus, as a headsearch task plugin.

Is the Spanish sentence a translation of the English one? Filtering crawled bitext this way decides what
a translation model learns from (Koehn et al. 2018, "Findings of the WMT 2018 Shared Task on Parallel
Corpus Filtering"). An encoder reads ``english <sep> spanish`` as word-prefix tokens shared by both
languages (a word's first 5 letters, hashed: "important" and "importante", "Tom" and "Tom" are one token),
so its heads can find what the two sides share; headsearch searches its per-layer heads, skips and
soft-attention fusion.

Examples: each pair of the file is a positive; its negative keeps the English and takes the Spanish of
another pair of nearly the same length (the next few in length order), so length does not give the label
away. The split is by English sentence (a hash of it), the same for every seed, so no English sentence of
the test set is trained on, with any of its translations.
"""
from __future__ import annotations

import hashlib
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from headsearch.errors import ConfigError, DataError
from headsearch.io import write_atomic
from headsearch.tasks import (ArchConfig, DataOptions, DataSource, Metric, RunConfig, Task, TokenAttention, TrainConfig,
                              coerce_fields, limited, path_problem, rebound)

NAME = "bitext-en-es"
PAD, SEP = 0, 1  # then the word-prefix buckets
WORD = re.compile(r"\w+|[^\w\s]")
NEIGHBOURS = 8  # a negative's Spanish comes from one of this many pairs next in length order
SPLIT_PERCENT = {"test": 5, "val": 5}  # of English sentences, by hash; the rest train


@dataclass(frozen=True)
class BitextData(DataOptions):
    n_train: int = 80_000  # examples per epoch (half positive; the training split holds ~107,000 pairs)
    n_val: int = 2_000
    n_test: int = 2_000
    max_words: int = 16  # tokens (words, punctuation) of each sentence; longer ones are cut
    vocab: int = 8192  # word-prefix buckets (+ padding and separator)
    prefix: int = 5  # letters of a word that make its token
    hard_negatives: float = 0.5  # the share of negatives whose Spanish has nearly the English's pair's length
    eval_batch_size: int = 512

    def __post_init__(self) -> None:
        ints = ("n_train", "n_val", "n_test", "max_words", "vocab", "prefix", "eval_batch_size")
        coerce_fields(self, ints=ints, floats=("hard_negatives",))
        for name in ints:
            if getattr(self, name) < 2:
                raise ConfigError(f"data.{name} = {getattr(self, name)} must be at least 2")
        if not 0.0 <= self.hard_negatives <= 1.0:
            raise ConfigError(f"data.hard_negatives = {self.hard_negatives} must be a share in [0, 1]")


# -- data ---------------------------------------------------------------------------------------------


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """(English, Spanish) from lines 'English<TAB>Spanish[<TAB>anything]'; other lines are skipped."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            if len(cols) >= 2 and cols[0].strip() and cols[1].strip():
                pairs.append((cols[0].strip(), cols[1].strip()))
    return pairs


def split_of(english: str) -> str:
    """test, val or train, fixed by the English sentence alone (the same for every seed and run)."""
    bucket = int(hashlib.sha1(english.encode("utf-8")).hexdigest()[:8], 16) % 100
    if bucket < SPLIT_PERCENT["test"]:
        return "test"
    return "val" if bucket < SPLIT_PERCENT["test"] + SPLIT_PERCENT["val"] else "train"


def examples(pairs: list[tuple[str, str]], n: int, generator, hard: float) -> tuple[list[tuple[str, str]], list[int]]:
    """n examples drawn from `pairs` with `generator`: half positives, half negatives, a share `hard` of
    them length-matched (a Spanish sentence a few places away in length order), the others any Spanish."""
    import torch

    by_length = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][1]), pairs[i][1]))
    rank = {i: r for r, i in enumerate(by_length)}
    chosen = torch.randperm(len(pairs), generator=generator)[: (n + 1) // 2].tolist()
    texts, labels = [], []
    for i in chosen:
        english, spanish = pairs[i]
        texts.append((english, spanish))
        labels.append(1)
        matched = float(torch.rand(1, generator=generator)) < hard
        for _ in range(4 * NEIGHBOURS):  # another pair's Spanish, with other English and other Spanish
            if matched:
                step = int(torch.randint(1, NEIGHBOURS + 1, (1,), generator=generator))
                j = by_length[(rank[i] + step) % len(by_length)]
            else:
                j = int(torch.randint(0, len(pairs), (1,), generator=generator))
            if pairs[j][0] != english and pairs[j][1] != spanish:
                texts.append((english, pairs[j][1]))
                labels.append(0)
                break
    return texts[:n], labels[:n]


def words(text: str, max_words: int) -> list[str]:
    return WORD.findall(text.lower())[:max_words]


def token(word: str, opts: BitextData) -> int:
    """A word's token: its first `prefix` characters, hashed into `vocab` buckets (the same in both languages)."""
    return 2 + zlib.crc32(word[: opts.prefix].encode("utf-8")) % opts.vocab


def encode(texts: list[tuple[str, str]], opts: BitextData):
    """(N, 2 * max_words + 1) token ids: the English words, padded to max_words, <sep>, the Spanish ones,
    padded. Each side starts at a fixed position, so position tells the model which language it reads."""
    import torch

    m = opts.max_words
    ids = torch.full((len(texts), 2 * m + 1), PAD, dtype=torch.long)
    for row, (english, spanish) in enumerate(texts):
        en = [token(w, opts) for w in words(english, m)]
        es = [token(w, opts) for w in words(spanish, m)]
        ids[row, : len(en)] = torch.tensor(en, dtype=torch.long)
        ids[row, m] = SEP
        ids[row, m + 1 : m + 1 + len(es)] = torch.tensor(es, dtype=torch.long)
    return ids


# -- model --------------------------------------------------------------------------------------------


def build_classifier(arch: ArchConfig, vocab: int, length: int):
    """Token and position embeddings, headsearch's encoder, mean pooling over the real tokens, two logits."""
    import torch
    from torch import nn

    from headsearch.models.transformer import Encoder

    class PairClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab + 2, arch.d_model, padding_idx=PAD)
            self.pos = nn.Parameter(torch.randn(1, length, arch.d_model) * 0.02)
            self.encoder = Encoder(arch)
            self.head = nn.Linear(arch.d_model, 2)

        def forward(self, ids, need_weights: bool = False):
            real = ids != PAD  # (B, T)
            x, weights = self.encoder(self.embed(ids) + self.pos, real[:, None, None, :], need_weights)  # (B, T, D)
            pooled = (x * real[..., None]).sum(1) / real.sum(1, keepdim=True)  # (B, D)
            logits = self.head(pooled)  # (B, 2)
            return (logits, weights) if need_weights else logits

    return PairClassifier()


# -- the bound task -----------------------------------------------------------------------------------


class BoundBitext:
    """The encoded examples on the device: a training set, validation and test sets."""

    def __init__(self, cfg: RunConfig, source: DataSource, device):
        import torch

        opts, self.cfg, self.device = cfg.data, cfg, torch.device(device)
        pairs = read_pairs(Path(source.data_file))
        by_split: dict[str, list[tuple[str, str]]] = {"train": [], "val": [], "test": []}
        for pair in pairs:
            by_split[split_of(pair[0])].append(pair)
        sizes = {"train": opts.n_train, "val": opts.n_val, "test": opts.n_test}
        for split, rows in by_split.items():
            if len(rows) < NEIGHBOURS + 2:
                raise DataError(f"{source.data_file}: its {split} split holds {len(rows)} pairs; give a larger file")
        g = torch.Generator().manual_seed(cfg.seed)
        self.sets, self.counts, self.texts = {}, {}, {}
        for split in ("train", "val", "test"):
            texts, labels = examples(by_split[split], sizes[split], g, opts.hard_negatives)
            self.sets[split] = (encode(texts, opts).to(self.device), torch.tensor(labels, device=self.device))
            self.texts[split] = texts
            self.counts[split] = {"pairs": len(by_split[split]), "examples": len(labels), "positives": sum(labels)}
        self.train = self.sets["train"]
        self.eval_sets = {"val": self.sets["val"], "test": self.sets["test"]}
        self.n_train = len(self.train[1])
        self.source = str(source.data_file)

    def rebind(self, cfg: RunConfig):
        return rebound(self, cfg)

    def with_eval_limit(self, n):
        return limited(self, n, lambda xy, k: (xy[0][:k], xy[1][:k]))

    def build_model(self):
        return build_classifier(self.cfg.arch, self.cfg.data.vocab, 2 * self.cfg.data.max_words + 1)

    def batches_per_epoch(self) -> int:
        return -(-self.n_train // self.cfg.train.batch_size)

    def train_batches(self, epoch: int):
        import torch

        g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
        order = torch.randperm(self.n_train, generator=g).to(self.device)
        bs = self.cfg.train.batch_size
        for start in range(0, self.n_train, bs):
            idx = order[start : start + bs]
            yield self.train[0][idx], self.train[1][idx]

    def warmup_batches(self, steps_per_epoch: int):
        """A full batch and, when the epoch ends on a shorter one, that one too (every shape an epoch shows)."""
        batches = list(self.train_batches(0))
        return [batches[0]] if len(batches[-1][1]) == len(batches[0][1]) else [batches[0], batches[-1]]

    def loss(self, model, batch, label_smoothing: float):
        import torch.nn.functional as F

        ids, labels = batch
        return F.cross_entropy(model(ids).float(), labels, label_smoothing=label_smoothing), len(labels)

    def evaluate(self, model, split: str) -> dict[str, float]:
        import torch
        import torch.nn.functional as F

        ids, labels = self.eval_sets[split]
        step = self.cfg.data.eval_batch_size
        logits = torch.cat([model(ids[i : i + step]).float() for i in range(0, len(labels), step)])
        predicted = logits.argmax(-1)
        tp = float(((predicted == 1) & (labels == 1)).sum())
        precision = tp / max(float((predicted == 1).sum()), 1.0)
        recall = tp / max(float((labels == 1).sum()), 1.0)
        return {"accuracy": float((predicted == labels).float().mean()), "f1": 2 * precision * recall / max(precision + recall, 1e-12),
                "loss": float(F.cross_entropy(logits, labels))}

    def write_artifacts(self, run_dir: Path) -> None:
        write_atomic(Path(run_dir) / "bitext_split.json", json.dumps(
            {"data_file": self.source, "split": "sha1(English) % 100: test < 5, val < 10", "counts": self.counts}, indent=1))

    def write_outputs(self, run_dir: Path) -> None:
        pass

    def analysis_batches(self, split: str, samples: int | None, batch_size: int):
        ids, labels = self.with_eval_limit(samples).eval_sets[split]
        return [{"inputs": (ids[i : i + batch_size],), "masks": {"src": ids[i : i + batch_size] != PAD},
                 "targets": labels[i : i + batch_size]} for i in range(0, len(labels), batch_size)]

    def summed_loss(self, model, batch):
        import torch.nn.functional as F

        logits = model(*batch["inputs"]).float()
        return F.cross_entropy(logits, batch["targets"], reduction="sum"), len(batch["targets"])

    def attention_views(self, model, samples: int = 2):
        ids, _ = self.eval_sets["test"]
        _, weights = model(ids[:samples], need_weights=True)
        views = []
        m = self.cfg.data.max_words
        for i in range(min(samples, len(ids))):
            english, spanish = self.texts["test"][i]
            en, es = words(english, m), words(spanish, m)
            keep = list(range(len(en))) + [m] + list(range(m + 1, m + 1 + len(es)))  # real tokens, both sides
            tokens = en + ["<sep>"] + es
            layers = [w.self_attn[i][:, keep][:, :, keep].detach().float().cpu().numpy() for w in weights]
            views.append(TokenAttention(source_tokens=tokens, output_tokens=tokens, layers=layers))
        return views


def check_source(source: DataSource) -> None:
    if source.data_dir is not None or source.data_file is None:
        raise DataError(f"{NAME} reads one tab-separated English-Spanish file: pass --data-file PATH (e.g. Tatoeba's spa.txt)")
    if problem := path_problem(source.data_file, "file"):
        raise DataError(f"data file {source.data_file} {problem}: pass a UTF-8 file of 'English<TAB>Spanish' lines")


def default_config() -> RunConfig:
    return RunConfig(task=NAME, arch=ArchConfig(d_model=128, enc_layers=4, enc_heads=4, d_ff=512, dropout=0.1),
                     train=TrainConfig(epochs=10, batch_size=256, lr=1e-3, weight_decay=0.01), data=BitextData())


TASK = Task(
    name=NAME,
    description="is the Spanish a translation of the English? pair encoder over shared word-prefix tokens, Tatoeba en-es (a plugin)",
    metrics=(Metric("accuracy", "maximize", "pair accuracy"), Metric("f1", "maximize", "F1 of 'is a translation'"),
             Metric("loss", "minimize", "cross-entropy")),
    default_config=default_config,
    # tiny: a minute on a laptop CPU, test accuracy ~0.76 (docs/plugins.md); "search" is a trial's budget.
    presets={"tiny": {"arch": {"d_model": 64, "enc_layers": 2, "enc_heads": 4, "d_ff": 128},
                      "train": {"epochs": 4, "batch_size": 64, "lr": 2e-3},
                      "data": {"n_train": 16384, "n_val": 1024, "n_test": 1024, "max_words": 12, "vocab": 4096},
                      "search": {"data": {"n_train": 8192}}}},
    data_options=BitextData,
    check_source=check_source,
    setup=lambda cfg, source, device, run_dir=None: BoundBitext(cfg, source, device),
    static_shapes=True,
)
