"""English→Spanish translation data: parallel corpora, their train/val/test splits and word-level tokenizers.

Two sources of sentence pairs:

* `load_opus_books` — opus_books en-es from the Hugging Face hub (`Helsinki-NLP/opus_books` at the
  revision `data.revision` pins, or the default branch; the commit loaded is recorded), the corpus of the
  Deep Head repository (Cruz et al.). Needs the network.
* `read_parallel_tsv` — any local tab-separated parallel file, one pair per line. The copy used for
  tests and examples is the Tatoeba English–Spanish file `spa.txt` from manythings.org/anki
  (sentences from tatoeba.org), released under CC-BY 2.0 (France): credit tatoeba.org and
  manythings.org/anki wherever that data is used or shipped.

Tokenizers are word-level (one id per whitespace/punctuation-separated word, as in the Deep Head repository) and one
per language. Their special tokens are in `translation_tokens`, the length-bucketed batches in `translation_batches`.
"""
from __future__ import annotations

import hashlib
import itertools
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from headsearch.errors import ConfigError, DataError
from headsearch.io import write_atomic
from headsearch.tasks.translation_batches import BucketBatcher, bucket_ladder  # noqa: F401  (re-exported)
from headsearch.tasks.translation_tokens import EOS_ID, PAD_ID, SOS_ID, SPECIAL_TOKENS, UNK, UNK_ID, detokenize

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Bump when the tokenizer recipe changes, so stale caches are not reused.
_TOKENIZER_RECIPE = "wordlevel-whitespace-v1"


# -- Corpora ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelCorpus:
    """Aligned sentence pairs: `src[i]` translates to `tgt[i]`."""

    src: tuple[str, ...]
    tgt: tuple[str, ...]
    source: str  # human-readable origin
    # Where a downloaded corpus came from exactly (dataset id, config, revision asked, commit loaded); None for a file.
    provenance: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.src) != len(self.tgt):
            raise ValueError(f"{len(self.src)} source sentences but {len(self.tgt)} target sentences")

    def __len__(self) -> int:
        return len(self.src)


def read_parallel_tsv(path: str | os.PathLike, src_col: int = 0, tgt_col: int = 1) -> ParallelCorpus:
    """Read a local tab-separated parallel file, one sentence pair per line.

    Fields are stripped and blank lines skipped. Extra columns (such as the attribution column of
    newer manythings.org files) are ignored. The Tatoeba English–Spanish file used in this project
    is CC-BY 2.0 (France), from tatoeba.org via manythings.org/anki: keep that attribution.
    """
    if src_col < 0 or tgt_col < 0 or src_col == tgt_col:
        raise ConfigError(
            f"bad column numbers src_col={src_col}, tgt_col={tgt_col}: give two different columns counted from 0"
        )
    path = Path(path)
    if not path.is_file():
        raise DataError(f"parallel corpus not found: {path} — pass an existing tab-separated file (source<TAB>target per line)")

    src, tgt = [], []
    needed = max(src_col, tgt_col) + 1
    # Decode line by line, so an encoding error can name its line.
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        line = _decode_line(raw, lineno, path).rstrip("\r")
        if not line.strip():
            continue  # blank lines are allowed; a tab is not stripped away, so an empty column is seen
        fields = line.split("\t")
        if len(fields) < needed:
            raise DataError(
                f"{path}, line {lineno}: found {len(fields)} tab-separated column(s), need {needed} — "
                "separate source and target with a tab"
            )
        s, t = fields[src_col].strip(), fields[tgt_col].strip()
        if not s or not t:
            raise DataError(f"{path}, line {lineno}: empty source or target sentence — fix or remove that line")
        src.append(s)
        tgt.append(t)

    if not src:
        raise DataError(f"{path} holds no sentence pairs — pass a file with source<TAB>target lines")
    return ParallelCorpus(tuple(src), tuple(tgt), source=str(path))


def _decode_line(raw: bytes, lineno: int, path: Path) -> str:
    try:
        # utf-8-sig on the first line only: drops a byte-order mark some editors write.
        return raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}, line {lineno}: not valid UTF-8 — re-save the file as UTF-8") from None


OPUS_BOOKS_ID = "Helsinki-NLP/opus_books"  # the canonical id ("opus_books" is the legacy alias)


def resolve_hub_commit(dataset_id: str, revision: str | None) -> str | None:
    """The commit the hub resolves `revision` (None: the default branch) of dataset `dataset_id` to, through
    huggingface_hub's public `HfApi.dataset_info(...).sha`; None when the hub cannot be asked (offline, no
    huggingface_hub): then the load itself says what went wrong."""
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(dataset_id, revision=revision).sha
    except Exception:
        return None


def load_opus_books(pair: str = "en-es", revision: str | None = None) -> ParallelCorpus:
    """opus_books (Tiedemann, OPUS) from the Hugging Face hub: the Deep Head repository's corpus. Needs the network.

    Loaded by its canonical id at `revision` (a branch, tag or commit of the dataset repository; None: the
    default branch; the translation task's `data.revision`), resolved to a commit first (`resolve_hub_commit`)
    so that the commit loaded is the one recorded: `ParallelCorpus.provenance` holds the id, the config, the
    revision asked for and that commit (None when it could not be resolved)."""
    langs = pair.split("-")
    if len(langs) != 2 or not all(langs):
        raise ConfigError(f"bad language pair {pair!r}: write it as source-target, e.g. 'en-es'")
    src_lang, tgt_lang = langs
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataError("opus_books needs the 'datasets' package — pip install datasets, or pass --data-file") from None
    commit = resolve_hub_commit(OPUS_BOOKS_ID, revision)
    try:
        rows = load_dataset(OPUS_BOOKS_ID, pair, split="train", revision=commit or revision)["translation"]
    except Exception as e:  # the hub raises many unrelated types (connection, HTTP, not-found, offline mode)
        reason = str(e).splitlines()[0] if str(e) else ""
        at = f" at revision {revision}" if revision else ""
        raise DataError(
            f"could not load {OPUS_BOOKS_ID} {pair}{at} from the Hugging Face hub ({type(e).__name__}: {reason}) — "
            "check the network, or pass a local tab-separated file with --data-file"
        ) from e
    pairs = [(r[src_lang].strip(), r[tgt_lang].strip()) for r in rows]
    pairs = [(s, t) for s, t in pairs if s and t]
    if not pairs:
        raise DataError(f"{OPUS_BOOKS_ID} {pair} came back empty — pass a local tab-separated file with --data-file")
    src, tgt = zip(*pairs)
    provenance = {"dataset": OPUS_BOOKS_ID, "config": pair, "revision": revision, "commit": commit}
    at = commit or revision or "the default branch, commit not resolved"
    return ParallelCorpus(tuple(src), tuple(tgt), source=f"{OPUS_BOOKS_ID} {pair} @ {at} (Hugging Face hub)",
                          provenance=provenance)


# -- Splits -----------------------------------------------------------------------------------------


def split_indices(n: int, val_size: int | float, test_size: int | float, seed: int) -> dict[str, np.ndarray]:
    """Seeded random split of range(n) into "train", "val" and "test" index arrays (sorted, int64).

    A float size in (0, 1) is a fraction of n (at least one pair); an int is a count.
    """
    n_val = _split_count(val_size, n, "val_size")
    n_test = _split_count(test_size, n, "test_size")
    if n_val + n_test >= n:
        raise ConfigError(
            f"val ({n_val}) + test ({n_test}) pairs leave no training data out of {n} — make val_size/test_size smaller"
        )
    perm = np.random.default_rng(seed).permutation(n)
    parts = {"val": perm[:n_val], "test": perm[n_val : n_val + n_test], "train": perm[n_val + n_test :]}
    return {name: np.sort(idx).astype(np.int64) for name, idx in parts.items()}


def _split_count(size: int | float, n: int, name: str) -> int:
    if isinstance(size, bool):  # bool is an int subclass; True as "1 pair" is surely a mistake
        raise ConfigError(f"{name}={size!r}: give a fraction in (0, 1) or a count of pairs")
    if isinstance(size, numbers.Integral):
        if size < 0:
            raise ConfigError(f"{name}={size} is negative: give a count >= 0 or a fraction in (0, 1)")
        return int(size)
    if isinstance(size, numbers.Real) and 0 < size < 1:
        return max(1, round(float(size) * n))
    raise ConfigError(f"{name}={size!r}: give a fraction in (0, 1) or a whole number of pairs")


def filter_by_length(src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]], max_len: int) -> np.ndarray:
    """Indices (int64) of the pairs whose source + [EOS] and [SOS] + target both fit in max_len positions."""
    if len(src_ids) != len(tgt_ids):
        raise ValueError(f"{len(src_ids)} source but {len(tgt_ids)} target sequences")
    src_len = np.fromiter(map(len, src_ids), dtype=np.int64, count=len(src_ids))
    tgt_len = np.fromiter(map(len, tgt_ids), dtype=np.int64, count=len(tgt_ids))
    return np.flatnonzero((src_len + 1 <= max_len) & (tgt_len + 1 <= max_len)).astype(np.int64)


# -- Tokenizers -------------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int, min_frequency: int = 2) -> "Tokenizer":
    """A word-level tokenizer (WordLevel model, Whitespace pre-tokenizer), specials at ids 0..3.

    Words seen fewer than `min_frequency` times, or beyond the `vocab_size` most frequent (the
    special tokens count towards it), become [UNK].
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.trainers import WordLevelTrainer

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ConfigError(f"vocab_size={vocab_size} leaves no room for words: give more than {len(SPECIAL_TOKENS)}")
    tok = Tokenizer(WordLevel(unk_token=UNK))
    tok.pre_tokenizer = Whitespace()
    trainer = WordLevelTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS)
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    _check_special_ids(tok)
    return tok


def _check_special_ids(tok: "Tokenizer") -> None:
    # Models and batches hard-code these ids; a tokenizer that disagrees would silently corrupt training.
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == [UNK_ID, PAD_ID, SOS_ID, EOS_ID], f"special token ids are {ids}, expected 0..3"


def load_or_train_tokenizers(
    train_src: Sequence[str],
    train_tgt: Sequence[str],
    vocab_size: int,
    min_frequency: int,
    cache_dir: str | os.PathLike,
) -> tuple["Tokenizer", "Tokenizer"]:
    """Source and target tokenizers, cached under cache_dir/<sha256 of texts and settings>/{src,tgt}.json.

    Every trial of a search trains on the same split, so this trains once and loads afterwards.
    """
    from tokenizers import Tokenizer

    folder = Path(cache_dir) / _tokenizer_cache_key(train_src, train_tgt, vocab_size, min_frequency)
    files = folder / "src.json", folder / "tgt.json"
    if all(f.is_file() for f in files):
        try:
            toks = tuple(Tokenizer.from_file(str(f)) for f in files)
            for t in toks:
                _check_special_ids(t)
            return toks  # type: ignore[return-value]
        except Exception:
            # Writes are atomic, so only outside tampering gets here: retrain and overwrite.
            pass

    toks = (train_tokenizer(train_src, vocab_size, min_frequency), train_tokenizer(train_tgt, vocab_size, min_frequency))
    folder.mkdir(parents=True, exist_ok=True)
    for tok, f in zip(toks, files):
        # Parallel workers of a search may train the same tokenizer at once: readers must never see half a file.
        write_atomic(f, tok.to_str())
    return toks


def _tokenizer_cache_key(src: Sequence[str], tgt: Sequence[str], vocab_size: int, min_frequency: int) -> str:
    import tokenizers

    h = hashlib.sha256()
    settings = f"{_TOKENIZER_RECIPE}|tokenizers={tokenizers.__version__}|vocab={vocab_size}|minfreq={min_frequency}"
    h.update(settings.encode())
    for side, texts in (("src", src), ("tgt", tgt)):
        h.update(f"|{side}:{len(texts)}|".encode())
        for text in texts:
            # Length-prefixed, so no choice of separator can make two different corpora collide.
            b = text.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.hexdigest()


def encode(tok: "Tokenizer", texts: Sequence[str], max_len: int | None = None) -> list[list[int]]:
    """Token ids of each text, without [SOS]/[EOS]; cut to max_len ids when given."""
    ids = [e.ids for e in tok.encode_batch(list(texts))]
    return ids if max_len is None else [x[:max_len] for x in ids]


def decode_ids(tok: "Tokenizer", ids: Sequence[int]) -> str:
    """Text of a generated id sequence: stops at [EOS], drops [PAD]/[SOS], then `detokenize`."""
    kept = (i for i in itertools.takewhile(lambda i: i != EOS_ID, map(int, ids)) if i not in (PAD_ID, SOS_ID))
    return detokenize([tok.id_to_token(i) or UNK for i in kept])  # an id outside the vocabulary reads as [UNK]
