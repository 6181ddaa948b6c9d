"""translation-en-es: seed 000's English->Spanish encoder-decoder, scored with sacrebleu, CER and WER.

Data: opus_books en-es through `datasets` (the seed's corpus) or any local tab-separated parallel
file via --data-file (e.g. the Tatoeba English-Spanish pairs, CC-BY 2.0 FR, tatoeba.org / manythings.org/anki).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from headsearch.config import ArchConfig, RunConfig, TrainConfig
from headsearch.errors import ConfigError, DataError
from headsearch.tasks import DataSource, Metric, Task, register

DATA_OPTIONS = {
    "val_size": 2000,  # pairs (an int) or a fraction (a float in (0, 1)) of the corpus, seeded
    "test_size": 5000,
    "train_limit": None,  # train on a seeded subset of this many pairs
    "max_len": 350,  # tokens per side including SOS/EOS (the seed's seq len); longer training pairs are dropped
    "vocab_size": 30000,  # per language; the WordLevel trainer keeps the most frequent words
    "min_frequency": 2,
    "eval_batch_size": 256,
}


def default_config() -> RunConfig:
    """Seed 000's baseline: d_model 512, 6+6 layers, 8 heads, d_ff 2048, dropout 0.1, ReLU, Adam lr 1e-4."""
    return RunConfig(
        task="translation-en-es",
        arch=ArchConfig(d_model=512, enc_layers=6, enc_heads=8, dec_layers=6, dec_heads=8, d_ff=2048,
                        dropout=0.1, activation="relu"),
        train=TrainConfig(epochs=20, batch_size=32, optimizer="adam", lr=1e-4, eps=1e-9, label_smoothing=0.1),
        data=dict(DATA_OPTIONS),
    )


PRESETS = {
    # A CPU smoke run: a small model on 24,000 short Tatoeba-like pairs, minutes on two cores.
    "tiny": {
        "arch": {"d_model": 64, "enc_layers": 2, "enc_heads": 4, "dec_layers": 2, "dec_heads": 4, "d_ff": 256},
        "train": {"epochs": 5, "batch_size": 64, "lr": 2e-3, "warmup_epochs": 1, "schedule": "cosine", "grad_clip": 1.0},
        "data": {"train_limit": 24000, "val_size": 300, "test_size": 1000, "max_len": 32, "vocab_size": 8000},
        "search": {"train": {"epochs": 3}, "data": {"train_limit": 8000, "val_size": 200, "test_size": 500}},
    },
}


def check_source(source: DataSource) -> None:
    if source.data_dir is not None:
        raise DataError("translation-en-es reads one tab-separated file: pass --data-file, not --data-dir")
    if source.data_file is not None and not Path(source.data_file).is_file():
        raise DataError(f"data file {source.data_file} does not exist: pass a UTF-8 file of 'English<TAB>Spanish' lines")


def cache_dir() -> Path:
    return Path(os.environ.get("HEADSEARCH_CACHE", Path.home() / ".cache" / "headsearch"))


class BoundTranslation:
    # Length-bucketed batches: each has its own sequence lengths (torch.compile runs with dynamic shapes).
    static_shapes = False
    shape_note = "translation batches vary in length"

    def __init__(self, cfg: RunConfig, source: DataSource, device, run_dir: Path | None = None):
        import numpy as np
        import torch

        from headsearch.tasks import translation_data as td

        self.cfg, self.device, opts = cfg, torch.device(device), cfg.data
        self.td = td
        corpus = td.read_parallel_tsv(source.data_file) if source.data_file else td.load_opus_books("en-es")
        split = td.split_indices(len(corpus.src), opts["val_size"], opts["test_size"], cfg.seed)
        train_idx = split["train"]
        if opts["train_limit"]:
            limit = int(opts["train_limit"])
            if not 0 < limit <= len(train_idx):
                raise ConfigError(f"train_limit = {limit} must be between 1 and {len(train_idx)}")
            train_idx = np.sort(np.random.default_rng(cfg.seed + 1).permutation(train_idx)[:limit])
        max_len = int(opts["max_len"])
        if max_len < 4:
            raise ConfigError(f"max_len = {max_len} is too short: it counts SOS/EOS, use at least 4")

        pick = lambda texts, idx: [texts[i] for i in idx]  # noqa: E731
        if run_dir is not None and (Path(run_dir) / "tokenizer_src.json").exists():
            # A trained run: its checkpoint's embeddings index these exact vocabularies.
            from tokenizers import Tokenizer

            self.src_tok = Tokenizer.from_file(str(Path(run_dir) / "tokenizer_src.json"))
            self.tgt_tok = Tokenizer.from_file(str(Path(run_dir) / "tokenizer_tgt.json"))
        else:
            self.src_tok, self.tgt_tok = td.load_or_train_tokenizers(
                pick(corpus.src, train_idx), pick(corpus.tgt, train_idx),
                int(opts["vocab_size"]), int(opts["min_frequency"]), cache_dir() / "tokenizers",
            )
        src_ids = td.encode(self.src_tok, pick(corpus.src, train_idx))
        tgt_ids = td.encode(self.tgt_tok, pick(corpus.tgt, train_idx))
        keep = td.filter_by_length(src_ids, tgt_ids, max_len)
        if len(keep) == 0:
            raise DataError(f"no training pair fits in max_len = {max_len} tokens: raise max_len")
        self.batcher = td.BucketBatcher([src_ids[i] for i in keep], [tgt_ids[i] for i in keep], cfg.train.batch_size)
        self.n_train = len(keep)
        self.max_len = max_len
        # Validation and test keep every pair (a shorter test set would flatter the model): sources
        # longer than max_len are truncated, references are scored whole.
        self.eval_sets = {name: self._eval_set(corpus, split[name]) for name in ("val", "test")}
        self.split = {"seed": cfg.seed, "source": corpus.source, "pairs": len(corpus.src),
                      "train": len(train_idx), "train_used": self.n_train, "train_dropped_too_long": len(train_idx) - self.n_train,
                      "val_indices": split["val"].tolist(), "test_indices": split["test"].tolist()}
        self.last_outputs: dict[str, list[str]] = {}

    def _eval_set(self, corpus, idx) -> dict:
        src = [ids[: self.max_len - 1] for ids in self.td.encode(self.src_tok, [corpus.src[i] for i in idx])]
        return {"src": src, "refs": [corpus.tgt[i] for i in idx], "src_text": [corpus.src[i] for i in idx],
                "tgt": self.td.encode(self.tgt_tok, [corpus.tgt[i] for i in idx])}

    def rebind(self, cfg: RunConfig) -> "BoundTranslation":
        """The same tokenised data under another architecture/training config (a search trial)."""
        import copy

        new = copy.copy(self)
        new.cfg = cfg
        new.last_outputs = {}
        if cfg.train.batch_size != self.cfg.train.batch_size:
            new.batcher = self.td.BucketBatcher(self.batcher.src_ids, self.batcher.tgt_ids, cfg.train.batch_size)
        return new

    def with_eval_limit(self, n: int | None) -> "BoundTranslation":
        """A copy whose validation and test sets keep their first `n` pairs (analysis on a sample)."""
        import copy

        new = copy.copy(self)
        if n:
            new.eval_sets = {k: {f: v[:n] for f, v in d.items()} for k, d in self.eval_sets.items()}
        return new

    def build_model(self):
        from headsearch.models import Seq2Seq

        return Seq2Seq(self.cfg.arch, self.src_tok.get_vocab_size(), self.tgt_tok.get_vocab_size(),
                       self.max_len, self.td.PAD_ID)

    def train_batches(self, epoch: int):
        return self.batcher.batches(shuffle=True, seed=self.cfg.seed * 100003 + epoch, device=self.device)

    def loss(self, model, batch, label_smoothing: float):
        import torch.nn.functional as F

        logits = model(batch.src, batch.tgt_in)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=self.td.PAD_ID,
                               label_smoothing=label_smoothing)
        return loss, batch.src.shape[0]

    def evaluate(self, model, split: str) -> dict[str, float]:
        """Teacher-forced loss, then batched greedy decoding scored on the whole split."""
        import torch
        import torch.nn.functional as F

        from headsearch.tasks.text_metrics import cer, corpus_bleu, wer

        td, data = self.td, self.eval_sets[split]
        tgt = [ids[: self.max_len - 1] for ids in data["tgt"]]
        batcher = td.BucketBatcher(data["src"], tgt, int(self.cfg.data["eval_batch_size"]))
        hyps: list[str] = [""] * len(data["refs"])
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for batch in batcher.batches(shuffle=False, device=self.device):
            logits = model(batch.src, batch.tgt_in).float()
            loss_sum += F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=td.PAD_ID, reduction="sum")
            tokens += batch.n_tokens
            # Outputs rarely exceed 1.5x the source length; the cap keeps decoding from running to max_len.
            limit = min(self.max_len - 1, int(batch.src.shape[1] * 1.5) + 10)
            out = model.greedy_decode(batch.src, td.SOS_ID, td.EOS_ID, max_new_tokens=limit)
            for i, ids in zip(batch.index.tolist(), out.tolist()):
                hyps[i] = td.decode_ids(self.tgt_tok, ids)
        bleu, signature = corpus_bleu(hyps, data["refs"])
        self.last_outputs[split] = hyps
        self.bleu_signature = signature
        return {"bleu": bleu, "cer": cer(hyps, data["refs"]), "wer": wer(hyps, data["refs"]), "loss": loss_sum.item() / max(tokens, 1)}

    def write_artifacts(self, run_dir: Path) -> None:
        self.src_tok.save(str(run_dir / "tokenizer_src.json"))
        self.tgt_tok.save(str(run_dir / "tokenizer_tgt.json"))
        (run_dir / "split.json").write_text(json.dumps(self.split))

    def write_outputs(self, run_dir: Path) -> None:
        """Test-set translations next to sources and references, for reading what the metric scored."""
        if "test" not in self.last_outputs:
            return
        data = self.eval_sets["test"]
        lines = ["source\treference\thypothesis"]
        lines += [f"{s}\t{r}\t{h}" for s, r, h in zip(data["src_text"], data["refs"], self.last_outputs["test"])]
        (run_dir / "test_translations.tsv").write_text("\n".join(lines) + "\n")
        (run_dir / "bleu_signature.txt").write_text(self.bleu_signature + "\n")


def check_config(cfg: RunConfig) -> None:
    """What can be refused before the corpus and tokenizers load."""
    from headsearch.training.fastpath import check_compile

    check_compile(cfg.train, BoundTranslation)


def setup(cfg: RunConfig, source: DataSource, device, run_dir: Path | None = None) -> BoundTranslation:
    return BoundTranslation(cfg, source, device, run_dir)


TASK = register(
    Task(
        name="translation-en-es",
        description="English->Spanish encoder-decoder (seed 000): sacrebleu BLEU, CER, WER",
        metrics=(
            Metric("bleu", "maximize", "corpus BLEU (sacrebleu)"),
            Metric("cer", "minimize", "character error rate"),
            Metric("wer", "minimize", "word error rate"),
            Metric("loss", "minimize", "teacher-forced cross-entropy per token"),
        ),
        default_config=default_config,
        presets=PRESETS,
        data_options=DATA_OPTIONS,
        check_source=check_source,
        setup=setup,
        check_config=check_config,
    )
)
