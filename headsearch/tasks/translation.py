"""translation-en-es: the English->Spanish encoder-decoder of Deep Head (Cruz et al.), scored with sacrebleu, CER and WER.

Data: opus_books en-es through `datasets` (the corpus Deep Head used) or any local tab-separated parallel
file via --data-file (e.g. the Tatoeba English-Spanish pairs, CC-BY 2.0 FR, tatoeba.org / manythings.org/anki).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from headsearch.config import ArchConfig, DataOptions, RunConfig, TrainConfig, coerce_fields, whole_number, path_problem
from headsearch.errors import ConfigError, DataError
from headsearch.environment import cache_root
from headsearch.io import write_atomic
from headsearch.tasks.base import DataSource, Metric, Task, TokenAttention, limited, rebound, seeded_subset

SPECIAL_TOKENS = 4  # [UNK] [PAD] [SOS] [EOS]


def _split_size(name: str, value) -> int | float:
    """A count of pairs (a whole number >= 0) or a fraction of the corpus in (0, 1)."""
    if isinstance(value, bool):
        raise ConfigError(f"data.{name} = {value!r} must be a count of pairs or a fraction in (0, 1)")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"data.{name} = {value!r} must be a count of pairs or a fraction in (0, 1)") from None
    if 0 < number < 1:
        return number
    if number.is_integer() and number >= 0:
        return int(number)
    raise ConfigError(f"data.{name} = {value!r} must be a whole number of pairs (>= 0) or a fraction in (0, 1)")


def _revision(value) -> str | None:
    """A hub revision: a branch, tag or commit, one word. YAML reads 2 or 1.10 as a number (1.10 becomes 1.1),
    so a number is refused with the way to quote it rather than turned back into a string that may differ."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ConfigError(f"data.revision = {value!r} was read as a number: quote it, e.g. --set \"data.revision='v2'\""
                          " or revision: 'v2' in YAML")
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value.strip()):
        raise ConfigError(f"data.revision = {value!r} must be a branch, tag or commit of opus_books on the hub"
                          " (one word), or null for the default branch")
    return value.strip()


@dataclass(frozen=True)
class TranslationData(DataOptions):
    """Data options of translation-en-es, checked on construction (before the corpus loads)."""

    val_size: int | float = 2000  # pairs (an int) or a fraction (a float in (0, 1)) of the corpus, seeded
    test_size: int | float = 5000
    train_limit: int | None = None  # train on a seeded subset of this many pairs
    max_len: int = 350  # tokens per side including SOS/EOS (Deep Head's seq len); longer training pairs are dropped
    vocab_size: int = 30000  # per language; the WordLevel trainer keeps the most frequent words
    min_frequency: int = 2
    eval_batch_size: int = 256
    # Padded lengths of batches (source and target share one). null: a few fixed lengths up to max_len on
    # CUDA (8, 12, 16, 24, 32, ...; see bucket_lengths); elsewhere each side of a batch to its longest sentence.
    buckets: tuple[int, ...] | None = None
    # The opus_books revision to download (a branch, tag or commit of Helsinki-NLP/opus_books on the Hugging
    # Face hub). null: the default branch. Either way the commit loaded is recorded in split.json ("data").
    # Pin a commit to get the same corpus on every rerun. A --data-file run reads its file and ignores it.
    revision: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "revision", _revision(self.revision))
        object.__setattr__(self, "val_size", _split_size("val_size", self.val_size))
        object.__setattr__(self, "test_size", _split_size("test_size", self.test_size))
        coerce_fields(self, ints=("train_limit", "max_len", "vocab_size", "min_frequency", "eval_batch_size"), optional=("train_limit",))
        if self.train_limit is not None and self.train_limit < 1:
            raise ConfigError(f"data.train_limit = {self.train_limit} must be at least 1, or null for every pair")
        if self.max_len < 4:
            raise ConfigError(f"data.max_len = {self.max_len} is too short: it counts SOS/EOS, use at least 4")
        if self.vocab_size <= SPECIAL_TOKENS:
            raise ConfigError(f"data.vocab_size = {self.vocab_size} must exceed the {SPECIAL_TOKENS} special tokens")
        for name in ("min_frequency", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name} = {getattr(self, name)} must be at least 1")
        if self.buckets is not None:
            object.__setattr__(self, "buckets", self._checked_buckets())

    def _checked_buckets(self) -> tuple[int, ...]:
        from headsearch.tasks.translation_batches import bucket_ladder

        value, example = self.buckets, list(bucket_ladder(self.max_len))
        if not isinstance(value, (list, tuple)) or not value:
            raise ConfigError(f"data.buckets = {value!r} must be a list of padded lengths, e.g. {example}, or null")
        lengths = tuple(whole_number(n) for n in value)
        if None in lengths:
            raise ConfigError(f"data.buckets = {list(value)} must hold whole numbers of tokens, e.g. {example}")
        if any(a >= b for a, b in zip(lengths, lengths[1:])):
            raise ConfigError(f"data.buckets = {list(lengths)} must be increasing lengths, e.g. {example}")
        if lengths[0] < 2 or lengths[-1] > self.max_len:
            raise ConfigError(f"data.buckets = {list(lengths)}: each length must be between 2 (a word and EOS)"
                              f" and max_len = {self.max_len}")
        return lengths

    def bucket_lengths(self, device_type: str) -> tuple[int, ...] | None:
        """The padded lengths of batches on a device (data.buckets, with max_len last), or None: each
        side of each batch padded to its own longest sentence.

        Unset, CUDA gets `bucket_ladder(max_len)` (8, 12, 16, 24, 32, ... max_len): a few fixed shapes,
        each compiled and captured in a CUDA graph once, for at most 50% more padding than a batch's
        longest pair. Other devices pay for every padded position and have no graphs to gain, so each
        side of a batch is padded to its own longest sentence there. Padding never changes the loss or
        the translations (masks), only the time they take (tests/test_translation_buckets.py).
        """
        from headsearch.tasks.translation_batches import bucket_ladder

        if self.buckets is None:
            return bucket_ladder(self.max_len) if device_type == "cuda" else None
        return self.buckets if self.buckets[-1] == self.max_len else self.buckets + (self.max_len,)


def default_config() -> RunConfig:
    """Deep Head's baseline: d_model 512, 6+6 layers, 8 heads, d_ff 2048, dropout 0.1, ReLU, Adam lr 1e-4."""
    return RunConfig(
        task="translation-en-es",
        arch=ArchConfig(d_model=512, enc_layers=6, enc_heads=8, dec_layers=6, dec_heads=8, d_ff=2048,
                        dropout=0.1, activation="relu"),
        train=TrainConfig(epochs=20, batch_size=32, optimizer="adam", lr=1e-4, eps=1e-9, label_smoothing=0.1),
        data=TranslationData(),
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


def load_run_tokenizer(path: Path):
    """A trained run's tokenizer (its checkpoint's embeddings index this exact vocabulary), or one
    DataError naming the file when it is missing, a folder or not a tokenizer."""
    from tokenizers import Tokenizer

    hint = "the run directory is damaged: restore the file from a copy, or train the run again"
    if problem := path_problem(path, "file"):
        raise DataError(f"{path} {problem}: {hint}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type for any unreadable file
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise DataError(f"{path} is not a tokenizer file ({first}): {hint}") from None


def check_config(cfg: RunConfig) -> None:
    """What the encoder-decoder needs of an architecture, checked before any data loads or directory exists."""
    from headsearch.models.checks import check_seq2seq_arch

    check_seq2seq_arch(cfg.arch)


def footprint(cfg: RunConfig):
    """At most `vocab_size` words a side, sentences of at most `max_len` tokens (a bound: most are shorter)."""
    from headsearch.models.size import seq2seq_footprint

    data = cfg.data
    return seq2seq_footprint(cfg.arch, cfg.train.batch_size, data.vocab_size, data.vocab_size, data.max_len)


def data_footprint(cfg: RunConfig, bound: "BoundTranslation"):
    """`footprint` with the FLOPs of an average step on this data, as CUDA batches it: the step FLOPs at
    each pair's bucket length (`TranslationData.bucket_lengths("cuda")`), averaged over the training
    pairs. Memory stays the bound at max_len (the longest bucket's batch must fit)."""
    import dataclasses

    import numpy as np

    from headsearch.models.size import seq2seq_footprint, seq2seq_step_flops

    lengths, counts = np.unique(bound.batcher.padded_lengths(cfg.data.bucket_lengths("cuda")), return_counts=True)
    vocab, batch = cfg.data.vocab_size, cfg.train.batch_size
    flops = sum(int(c) * seq2seq_step_flops(cfg.arch, batch, int(n), int(n), vocab) for n, c in zip(lengths, counts))
    # Each captured shape keeps its graph's activations in a pool of its own: one per length the data uses, and
    # the partial batch (at most a batch, at the longest length).
    captured = sum(seq2seq_footprint(cfg.arch, batch, vocab, vocab, int(n)).activation_bytes for n in lengths)
    captured += seq2seq_footprint(cfg.arch, batch, vocab, vocab, int(lengths.max())).activation_bytes
    return dataclasses.replace(footprint(cfg), step_flops=round(flops / counts.sum()), captured_activation_bytes=captured)


def check_source(source: DataSource) -> None:
    if source.data_dir is not None:
        raise DataError("translation-en-es reads one tab-separated file: pass --data-file, not --data-dir")
    if source.data_file is not None and (problem := path_problem(source.data_file, "file")):
        raise DataError(f"data file {source.data_file} {problem}: pass a UTF-8 file of 'English<TAB>Spanish' lines")


class BoundTranslation:
    """The tokenised corpus: length-bucketed training batches resident on the device (padded to a few
    fixed lengths on CUDA: `TranslationData.bucket_lengths`), whole validation and test splits."""

    def __init__(self, cfg: RunConfig, source: DataSource, device, run_dir: Path | None = None):
        import torch

        from headsearch.tasks import translation_data as td

        self.cfg, self.device, opts = cfg, torch.device(device), cfg.data
        self.td = td
        corpus = td.read_parallel_tsv(source.data_file) if source.data_file else td.load_opus_books("en-es", opts.revision)
        split = td.split_indices(len(corpus.src), opts.val_size, opts.test_size, cfg.seed)
        train_idx = seeded_subset(split["train"], opts.train_limit, cfg.seed, "training pairs")
        self.max_len = max_len = opts.max_len

        pick = lambda texts, idx: [texts[i] for i in idx]  # noqa: E731
        if run_dir is not None and (Path(run_dir) / "tokenizer_src.json").exists():
            # A trained run: its checkpoint's embeddings index these exact vocabularies.
            self.src_tok, self.tgt_tok = (load_run_tokenizer(Path(run_dir) / f"tokenizer_{side}.json") for side in ("src", "tgt"))
        else:
            self.src_tok, self.tgt_tok = td.load_or_train_tokenizers(
                pick(corpus.src, train_idx), pick(corpus.tgt, train_idx),
                opts.vocab_size, opts.min_frequency, cache_root() / "tokenizers",
            )
        src_ids = td.encode(self.src_tok, pick(corpus.src, train_idx))
        tgt_ids = td.encode(self.tgt_tok, pick(corpus.tgt, train_idx))
        keep = td.filter_by_length(src_ids, tgt_ids, max_len)
        if len(keep) == 0:
            raise DataError(f"no training pair fits in max_len = {max_len} tokens: raise max_len")
        self.buckets = opts.bucket_lengths(self.device.type)
        self.batcher = td.BucketBatcher([src_ids[i] for i in keep], [tgt_ids[i] for i in keep], cfg.train.batch_size,
                                        buckets=self.buckets, device=self.device)
        self.n_train = len(keep)
        # Validation and test keep every pair (a shorter test set would flatter the model): sources
        # longer than max_len are truncated, references are scored whole.
        self.eval_sets = {name: self._eval_set(corpus, split[name]) for name in ("val", "test")}
        self.split = {"seed": cfg.seed, "source": corpus.source, "pairs": len(corpus.src),
                      "train": len(train_idx), "train_used": self.n_train, "train_dropped_too_long": len(train_idx) - self.n_train,
                      "val_indices": split["val"].tolist(), "test_indices": split["test"].tolist()}
        if corpus.provenance is not None:  # a downloaded corpus: its dataset id, revision and commit
            self.split["data"] = dict(corpus.provenance)
        self.last_outputs: dict[str, list[str]] = {}

    def _eval_set(self, corpus, idx) -> dict:
        src = [ids[: self.max_len - 1] for ids in self.td.encode(self.src_tok, [corpus.src[i] for i in idx])]
        return {"src": src, "refs": [corpus.tgt[i] for i in idx], "src_text": [corpus.src[i] for i in idx],
                "tgt": self.td.encode(self.tgt_tok, [corpus.tgt[i] for i in idx])}

    def eval_batcher(self, split: str, batch_size: int):
        """Unshuffled length buckets over a whole split, targets cut to max_len - 1 tokens."""
        data = self.eval_sets[split]
        return self.td.BucketBatcher(data["src"], [ids[: self.max_len - 1] for ids in data["tgt"]], batch_size,
                                     buckets=self.buckets, device=self.device)

    # -- the same data under another config ------------------------------------------------------
    def rebind(self, cfg: RunConfig) -> "BoundTranslation":
        """The same tokenised data under another architecture/training config (a search trial)."""
        new = rebound(self, cfg, last_outputs={})
        new.buckets = cfg.data.bucket_lengths(self.device.type)
        if new.buckets != self.buckets:  # another padding: a new device table of the same pairs
            new.batcher = self.td.BucketBatcher(self.batcher.src_ids, self.batcher.tgt_ids, cfg.train.batch_size,
                                                buckets=new.buckets, device=self.device)
        elif cfg.train.batch_size != self.batcher.batch_size:  # the same device table, cut differently
            new.batcher = self.batcher.with_batch_size(cfg.train.batch_size)
        return new

    def with_eval_limit(self, n: int | None) -> "BoundTranslation":
        """A copy whose validation and test sets keep their first `n` pairs (analysis on a sample)."""
        return limited(self, n, lambda data, k: {field: values[:k] for field, values in data.items()})

    # -- training --------------------------------------------------------------------------------
    def build_model(self):
        from headsearch.models import Seq2Seq

        return Seq2Seq(self.cfg.arch, self.src_tok.get_vocab_size(), self.tgt_tok.get_vocab_size(),
                       self.max_len, self.td.PAD_ID)

    def batches_per_epoch(self) -> int:
        return len(self.batcher)

    def train_batches(self, epoch: int):
        """Epoch `epoch`'s `TranslationBatch`es, shuffled with (seed, epoch); the partial batch last."""
        return self.batcher.batches(shuffle=True, seed=self.epoch_seed(epoch))

    def warmup_batches(self, steps_per_epoch: int) -> list:
        """One batch of each shape an epoch can show: (batch_size, L) for each bucket length L the data
        fills, and the partial last batch (padded to the longest L) when an epoch of `steps_per_epoch`
        steps reaches it. Drawn with a generator of their own (epoch 0's): the run's data order is untouched.

        Without buckets (the CPU) shapes vary with every batch: three batches of different shapes, for a
        compiler to see that (`BucketBatcher.shape_samples`)."""
        return self.batcher.shape_samples(self.epoch_seed(0), partial=steps_per_epoch >= len(self.batcher))

    def epoch_seed(self, epoch: int) -> int:
        """The seed the training batches of `epoch` are shuffled with (`train_batches`)."""
        return self.cfg.seed * 100003 + epoch

    def loss(self, model, batch, label_smoothing: float):
        """Mean cross-entropy over the non-pad target tokens, and the batch's pair count (from its shape).

        Nothing here reads the device (no .item(), no data-dependent shapes), so a step can be captured
        in a CUDA graph; the padding up to the batch's bucket changes nothing (masks, ignore_index).
        """
        import torch.nn.functional as F

        logits = model(batch.src, batch.tgt_in)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=self.td.PAD_ID,
                               label_smoothing=label_smoothing)
        return loss, batch.src.shape[0]

    def evaluate(self, model, split: str) -> dict[str, float]:
        """Teacher-forced loss, then batched greedy decoding (key/value cache) scored on the whole split."""
        import torch
        import torch.nn.functional as F

        from headsearch.tasks.text_metrics import cer, corpus_bleu, wer

        td, data = self.td, self.eval_sets[split]
        hyps: list[str] = [""] * len(data["refs"])
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for batch in self.eval_batcher(split, self.cfg.data.eval_batch_size).batches(shuffle=False):
            logits = model(batch.src, batch.tgt_in).float()
            loss_sum += F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=td.PAD_ID, reduction="sum")
            tokens += batch.n_tokens
            # Outputs rarely exceed 1.5x the source length; the cap keeps decoding from running to max_len.
            # From the real longest source, not the padded width: translations do not depend on padding.
            limit = min(self.max_len - 1, int(batch.src_len * 1.5) + 10)
            out = model.greedy_decode(batch.src, td.SOS_ID, td.EOS_ID, max_new_tokens=limit)
            for i, ids in zip(batch.index.tolist(), out.tolist()):
                hyps[i] = td.decode_ids(self.tgt_tok, ids)
        bleu, signature = corpus_bleu(hyps, data["refs"])
        self.last_outputs[split] = hyps
        self.bleu_signature = signature
        return {"bleu": bleu, "cer": cer(hyps, data["refs"]), "wer": wer(hyps, data["refs"]), "loss": loss_sum.item() / max(tokens, 1)}

    def write_artifacts(self, run_dir: Path) -> None:
        write_atomic(run_dir / "tokenizer_src.json", self.src_tok.to_str())
        write_atomic(run_dir / "tokenizer_tgt.json", self.tgt_tok.to_str())
        write_atomic(run_dir / "split.json", json.dumps(self.split))

    def write_outputs(self, run_dir: Path) -> None:
        """Test-set translations next to sources and references, for reading what the metric scored."""
        if "test" not in self.last_outputs:
            return
        data = self.eval_sets["test"]
        lines = ["source\treference\thypothesis"]
        lines += [f"{s}\t{r}\t{h}" for s, r, h in zip(data["src_text"], data["refs"], self.last_outputs["test"])]
        write_atomic(run_dir / "test_translations.tsv", "\n".join(lines) + "\n")
        write_atomic(run_dir / "bleu_signature.txt", self.bleu_signature + "\n")

    # -- analysis --------------------------------------------------------------------------------
    def analysis_batches(self, split: str, samples: int | None, batch_size: int) -> list[dict]:
        """The first `samples` pairs of `split` in unshuffled length buckets: {"inputs": (src, tgt_in),
        "masks": {"src": src != PAD, "tgt": tgt_in != PAD}, "targets": tgt_out}."""
        pad = self.td.PAD_ID
        batcher = self.with_eval_limit(samples).eval_batcher(split, batch_size)
        return [{"inputs": (b.src, b.tgt_in), "masks": {"src": b.src != pad, "tgt": b.tgt_in != pad}, "targets": b.tgt_out}
                for b in batcher.batches(shuffle=False)]

    def summed_loss(self, model, batch):
        """Cross-entropy summed over the non-pad target tokens (no label smoothing), and their count."""
        import torch.nn.functional as F

        pad = self.td.PAD_ID
        logits = model(*batch["inputs"]).float()  # (B, T, V)
        targets = batch["targets"]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=pad, reduction="sum")
        return loss, int((targets != pad).sum())

    def attention_views(self, model, samples: int = 3) -> list[TokenAttention]:
        """Cross-attention while the model produces its own (greedy) translation of a few test sentences."""
        import torch

        td = self.td
        views = []
        for src_ids in self.eval_sets["test"]["src"][:samples]:
            src = torch.tensor([src_ids + [td.EOS_ID]], device=self.device)
            with torch.no_grad():
                hyp = model.greedy_decode(src, td.SOS_ID, td.EOS_ID, max_new_tokens=min(self.max_len - 1, 2 * src.shape[1] + 10))[0]
                hyp = [t for t in hyp.tolist() if t != td.PAD_ID]
                tgt_in = torch.tensor([[td.SOS_ID] + hyp[:-1] if hyp and hyp[-1] == td.EOS_ID else [td.SOS_ID] + hyp],
                                      device=self.device)
                _, weights = model(src, tgt_in, need_weights=True)
            views.append(TokenAttention(
                source_tokens=[self.src_tok.id_to_token(i) or "[UNK]" for i in src[0].tolist()],
                output_tokens=[self.tgt_tok.id_to_token(i) or "[UNK]" for i in (hyp if hyp else [td.EOS_ID])][: tgt_in.shape[1]],
                layers=[w.self_attn[0].float().cpu().numpy() for w in weights["decoder_cross"]],
            ))
        return views


TASK = Task(
    name="translation-en-es",
    description="English->Spanish encoder-decoder (Deep Head, Cruz et al.): sacrebleu BLEU, CER, WER",
    metrics=(
        Metric("bleu", "maximize", "corpus BLEU (sacrebleu)"),
        Metric("cer", "minimize", "character error rate"),
        Metric("wer", "minimize", "word error rate"),
        Metric("loss", "minimize", "teacher-forced cross-entropy per token"),
    ),
    default_config=default_config,
    presets=PRESETS,
    data_options=TranslationData,
    check_source=check_source,
    setup=BoundTranslation,
    # On CUDA, batches are padded to a few fixed lengths (data.buckets), all shown by warmup_batches.
    static_shapes=True,
    shape_note="translation batches are padded to a few fixed lengths (data.buckets) on CUDA",
    check_config=check_config,
    footprint=footprint,
    data_footprint=data_footprint,
)
