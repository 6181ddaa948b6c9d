"""English→Spanish translation data: parallel corpora, word-level tokenizers and length-bucketed batches.

Two sources of sentence pairs:

* `load_opus_books` — opus_books en-es from the Hugging Face hub (`Helsinki-NLP/opus_books` at the
  revision `data.revision` pins, or the default branch; the commit loaded is recorded), the corpus of the
  Deep Head repository (Cruz et al.). Needs the network.
* `read_parallel_tsv` — any local tab-separated parallel file, one pair per line. The copy used for
  tests and examples is the Tatoeba English–Spanish file `spa.txt` from manythings.org/anki
  (sentences from tatoeba.org), released under CC-BY 2.0 (France): credit tatoeba.org and
  manythings.org/anki wherever that data is used or shipped.

Tokenizers are word-level (one id per whitespace/punctuation-separated word, as in the Deep Head repository) and one
per language. The four special tokens have the same ids in every tokenizer (`UNK_ID` … `EOS_ID`), so
models and batches can use the constants without asking the tokenizer.
"""
from __future__ import annotations

import copy
import hashlib
import math
import numbers
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from headsearch.errors import ConfigError, DataError
from headsearch.io import write_atomic

if TYPE_CHECKING:
    from tokenizers import Tokenizer

UNK, PAD, SOS, EOS = "[UNK]", "[PAD]", "[SOS]", "[EOS]"
SPECIAL_TOKENS = (UNK, PAD, SOS, EOS)  # ids 0, 1, 2, 3 in every tokenizer
UNK_ID, PAD_ID, SOS_ID, EOS_ID = 0, 1, 2, 3

# Bump when the tokenizer recipe changes, so stale caches are not reused.
_TOKENIZER_RECIPE = "wordlevel-whitespace-v1"


# ---------------------------------------------------------------------------------------------------
# Corpora
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# Detokenization
# ---------------------------------------------------------------------------------------------------

# A heuristic: the Whitespace pre-tokenizer forgets where the spaces were, so the spacing is
# rebuilt from the punctuation conventions shared by English and Spanish. It is exact on ordinary
# sentences; unusual spacing (e.g. "a - b", or the possessive "dogs' bone") comes back differently.
_NO_SPACE_BEFORE = frozenset(",.!?;:)]}»%”’…")
_NO_SPACE_AFTER = frozenset("¿¡([{«“‘$")
_STRAIGHT_QUOTES = frozenset("\"'")
# Glued on both sides when between two words ("don't", "well-known") or two numbers ("3.50", "1,000", "3:00").
_WORD_JOINERS = frozenset(["'", "-", "’"])
_NUMBER_JOINERS = frozenset([".", ",", ":"])
_APOSTROPHES = frozenset(["'", "’"])
_CONTRACTION_TAILS = frozenset(["s", "t", "re", "ve", "ll", "d", "m"])  # Tom's, don't, we're, I've, I'll, I'd, I'm
_WORD = re.compile(r"\w")


def _is_word(tok: str) -> bool:
    return bool(tok) and (tok in SPECIAL_TOKENS or _WORD.match(tok) is not None)


def detokenize(tokens: Sequence[str]) -> str:
    """Join whitespace-pre-tokenized tokens into natural text ("¿ Dónde ?" -> "¿Dónde?"). A heuristic.

    No space before closing punctuation (, . ! ? ; : ) ] } » % and closing quotes), none after opening
    punctuation (¿ ¡ ( [ { « $ and opening quotes); apostrophes and hyphens inside words ("don't"),
    dots of abbreviations ("p.m.") and separators inside numbers ("3:00", "1,000") are glued on both
    sides, a plural possessive's apostrophe ("parents' house") to the left only; straight quotes
    alternate between opening and closing. About 3 in 10,000 Tatoeba sentences come back with
    different spacing.
    """
    pieces: list[str] = []
    quote_open = {q: False for q in _STRAIGHT_QUOTES}
    glue_next = True  # nothing before the first token
    for i, tok in enumerate(tokens):
        prev = tokens[i - 1] if i > 0 else ""
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if _is_word(tok):
            glue_left = glue_right = False
        else:
            glue = _joiner_glue(tok, prev, nxt)
            glue_left, glue_right = glue if glue is not None else _punctuation_glue(tok, quote_open)
        if pieces and not (glue_next or glue_left):
            pieces.append(" ")
        pieces.append(tok)
        glue_next = glue_right
    return "".join(pieces)


def _joiner_glue(tok: str, prev: str, nxt: str) -> tuple[bool, bool] | None:
    """Glue for punctuation inside a word or number; None when `tok` is not between two words."""
    if not (_is_word(prev) and _is_word(nxt)):
        return None
    if tok in _APOSTROPHES and prev[-1] in "sS" and nxt.lower() not in _CONTRACTION_TAILS:
        return True, False  # plural possessive, "my parents' house": the apostrophe ends the word
    if tok in _WORD_JOINERS:
        return True, True
    if tok == "." and len(prev) == 1 and len(nxt) == 1:
        return True, True  # abbreviations: "p.m.", "U.S.A."
    if tok == "," and not (len(nxt) == 3 and nxt.isdigit()):
        return None  # "10, 1972" is a list; only "1,000" is one number
    if tok in _NUMBER_JOINERS and prev[-1].isdigit() and nxt[0].isdigit():
        return True, True
    return None


def _punctuation_glue(tok: str, quote_open: dict[str, bool]) -> tuple[bool, bool]:
    """(no space before, no space after) for a run of punctuation; updates which straight quotes are open.

    The pre-tokenizer keeps adjacent punctuation together (',"' or ')!?'), so the first character
    decides the left side and the last character the right side.
    """
    first, last = tok[0], tok[-1]
    glue_left = first in _NO_SPACE_BEFORE or (first in _STRAIGHT_QUOTES and quote_open[first])
    for ch in tok:
        if ch in _STRAIGHT_QUOTES:
            quote_open[ch] = not quote_open[ch]
    glue_right = last in _NO_SPACE_AFTER or (last in _STRAIGHT_QUOTES and quote_open[last])
    return glue_left, glue_right


def decode_ids(tok: "Tokenizer", ids: Sequence[int]) -> str:
    """Text of a generated id sequence: stops at [EOS], drops [PAD]/[SOS], then `detokenize`."""
    tokens = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i in (PAD_ID, SOS_ID):
            continue
        tokens.append(tok.id_to_token(i) or UNK)  # an id outside the vocabulary reads as [UNK]
    return detokenize(tokens)


# ---------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------


def bucket_ladder(max_len: int, smallest: int = 8) -> tuple[int, ...]:
    """8, 12, 16, 24, 32, 48, 64, ...: the powers of two from `smallest` and the midpoints between them,
    below max_len, then max_len itself.

    Each length is at most 1.5x the one before, so padding a batch up to its bucket adds at most half
    of its longest pair. Only the lengths the data fills become batch shapes.
    """
    lengths, p = [], smallest
    while p < max_len:
        lengths += [n for n in (p, p * 3 // 2) if n < max_len]
        p *= 2
    return tuple(lengths) + (max_len,)


def _pack(seqs: Sequence[Sequence[int]], width: int, dtype, first: int | None = None, last: int | None = None) -> np.ndarray:
    """Rows [first] + seq + [last], left-aligned in an (N, width) array of PAD, without a loop over rows."""
    n = len(seqs)
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=n)
    flat = np.fromiter((i for seq in seqs for i in seq), dtype=np.int64, count=int(lens.sum()))
    out = np.full((n, width), PAD_ID, dtype=dtype)
    start = 0 if first is None else 1
    if first is not None:
        out[:, 0] = first
    cols = np.arange(width)
    out[(cols >= start) & (cols < start + lens[:, None])] = flat  # row-major order = the order of `flat`
    if last is not None:
        out[np.arange(n), start + lens] = last
    return out


@dataclass
class TranslationBatch:
    """One batch of pairs: with fixed lengths (buckets), source and target padded to one length L, the
    batch's bucket (S = T = L); without, each side padded to its own longest sentence in the batch.

    The tensors live on the batcher's device. The plain numbers describe the batch and differ between
    batches of one shape, and a training step (`BoundTranslation.loss`) reads none of them, so a step
    captured in a CUDA graph on one batch replays correctly on another of the same shape once the
    tensors are copied into its buffers.
    """

    src: torch.Tensor  # (B, S) long: source ids + [EOS], PAD-padded
    tgt_in: torch.Tensor  # (B, T) long: [SOS] + target ids (decoder input), PAD-padded
    tgt_out: torch.Tensor  # (B, T) long: target ids + [EOS] (labels), PAD where padded
    index: torch.Tensor  # (B,) long: positions of these pairs in the lists given to the batcher
    n_tokens: int  # non-pad target tokens (the loss is averaged over these)
    src_len: int  # the longest source in the batch, [EOS] included (S may be larger)


class BucketBatcher:
    """Length-bucketed batches of pairs resident on the device, padded to a few fixed lengths.

    Data: the pairs are copied to the device once, as a (3, N, W) table of source, decoder-input and
    label rows (PAD-padded to the longest length used, W; int16 when the ids fit). A batch is an
    `index_select` of its rows and a slice to its length: no Python loop over rows, and no copy to
    the device but the epoch's order of rows (one index tensor per epoch).

    Batching, as Transformer training usually does it: pairs of similar length share a batch, so
    little compute is spent on padding. Shuffled epochs stay random at two levels: which pairs meet (a
    seeded permutation cut into chunks of batch_size * bucket_factor pairs, each sorted by length) and
    the order of the batches. bucket_factor=1 is plain random batching. Every pair comes once an epoch.

    Padding with `buckets` (fixed lengths, for CUDA graphs): a pair needs max(len(source) + 1,
    len(target) + 1) positions (with EOS; with SOS), and a batch's source and target share one length
    L, the smallest bucket that holds all of its pairs: one length for both sides keeps the shapes few
    (a shape per bucket, not per pair of buckets). When batch_size does not divide the pairs, the one
    partial batch comes last in the epoch and is padded to the longest bucket the data uses, so a
    training epoch shows at most len(`lengths`) + 1 shapes, which `shape_samples` returns one batch of
    each. `buckets=None` pads each side of each batch to its own longest sentence instead: the least
    padding, in shapes that vary from batch to batch.
    """

    def __init__(self, src_ids: list[list[int]], tgt_ids: list[list[int]], batch_size: int, *,
                 buckets: Sequence[int] | None = None, bucket_factor: int = 50, device: str | torch.device = "cpu"):
        if len(src_ids) != len(tgt_ids):
            raise ValueError(f"{len(src_ids)} source but {len(tgt_ids)} target sequences")
        if batch_size < 1 or bucket_factor < 1:
            raise ConfigError(f"batch_size={batch_size}, bucket_factor={bucket_factor}: both must be at least 1")
        if not src_ids:
            raise DataError("no sentence pairs to batch — the split is empty; use more data or a larger max_len")
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.batch_size, self.bucket_factor, self.device = batch_size, bucket_factor, torch.device(device)
        self.buckets = None if buckets is None else tuple(buckets)
        self._src_len = np.fromiter(map(len, src_ids), dtype=np.int64, count=len(src_ids)) + 1  # + EOS
        self._tgt_len = np.fromiter(map(len, tgt_ids), dtype=np.int64, count=len(tgt_ids)) + 1  # + SOS (in) / EOS (out)
        self._need = need = np.maximum(self._src_len, self._tgt_len)  # positions each pair needs
        self._padded = None  # each pair's bucket length, with buckets
        if buckets is None:
            self.lengths = tuple(int(n) for n in np.unique(need))  # the lengths the data needs
        else:
            ladder = np.asarray(self.buckets, dtype=np.int64)
            if np.any(np.diff(ladder) <= 0):
                raise ConfigError(f"buckets {list(self.buckets)} must be increasing lengths")
            if need.max() > ladder[-1]:
                raise ConfigError(f"buckets {list(self.buckets)} end below the longest pair ({need.max()} tokens with SOS/EOS):"
                                  " make the last length at least that")
            self._padded = ladder[np.searchsorted(ladder, need)]
            self.lengths = tuple(int(n) for n in np.unique(self._padded))  # the bucket lengths the data uses
        width = self.lengths[-1]
        top_id = max(max((max(s) for s in side if s), default=0) for side in (src_ids, tgt_ids))
        dtype = np.int16 if top_id < 2**15 else np.int32  # converted to long per batch, after the slice
        table = np.stack([_pack(src_ids, width, dtype, last=EOS_ID), _pack(tgt_ids, width, dtype, first=SOS_ID),
                          _pack(tgt_ids, width, dtype, last=EOS_ID)])
        self.table = torch.from_numpy(table).to(self.device)  # (3, N, W): src, tgt_in, tgt_out rows

    def padded_lengths(self, buckets: Sequence[int] | None) -> np.ndarray:
        """Each pair's padded length under the bucket ladder `buckets` (the positions it needs without one):
        what its batch's length is, give or take its batch-mates (batches are sorted by length)."""
        if buckets is None:
            return self._need.copy()
        ladder = np.asarray(buckets, dtype=np.int64)
        return ladder[np.minimum(np.searchsorted(ladder, self._need), len(ladder) - 1)]

    def __len__(self) -> int:
        # Chunks hold a multiple of batch_size pairs, so only one batch can be short.
        return math.ceil(len(self.src_ids) / self.batch_size)

    def with_batch_size(self, batch_size: int) -> "BucketBatcher":
        """The same pairs (the same device table) in batches of another size."""
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be at least 1")
        new = copy.copy(self)
        new.batch_size = batch_size
        return new

    def batches(self, *, shuffle: bool, seed: int | None = None) -> Iterator[TranslationBatch]:
        """One epoch: every pair exactly once. Not shuffled: sorted by length, always the same batches."""
        groups = self._batch_indices(shuffle, seed)
        rows = self._to_device(np.concatenate(groups))  # the epoch's rows in batch order
        start = 0
        for idx in groups:
            end = start + len(idx)
            yield self._make_batch(idx, rows[start:end], self._widths(idx))
            start = end

    def shape_samples(self, seed: int, partial: bool = True) -> list[TranslationBatch]:
        """One batch of each shape an epoch can show, from real pairs drawn with their own generator:
        (batch_size, L) for each bucket length L the data uses (when there is a full batch), and the
        partial batch's (N mod batch_size, longest L) when `partial` (an epoch that reaches its last batch).

        Without buckets shapes vary from batch to batch, without a fixed set: then the first three
        batches of different shapes of an epoch drawn with `seed`, enough for a compiler to see the
        lengths change and compile once for dynamic shapes (there are no CUDA graphs to capture).
        """
        n, bs, out = len(self.src_ids), self.batch_size, []
        if self.buckets is None:
            shapes = set()
            for batch in self.batches(shuffle=True, seed=seed):
                shape = (*batch.src.shape, batch.tgt_in.shape[1])
                if shape not in shapes and (partial or len(batch.index) == bs):
                    shapes.add(shape)
                    out.append(batch)
                if len(out) == 3:
                    break
            return out
        rng = np.random.default_rng(seed)
        for length in self.lengths if n >= bs else ():
            fits = np.flatnonzero(self._padded <= length)
            out.append(self._sample(rng.choice(fits, bs, replace=len(fits) < bs), length))
        if partial and n % bs:
            out.append(self._sample(rng.choice(n, n % bs, replace=False), self.lengths[-1]))
        return out

    def _sample(self, idx: np.ndarray, length: int) -> TranslationBatch:
        return self._make_batch(idx, self._to_device(idx), (length, length))

    def _to_device(self, idx: np.ndarray) -> torch.Tensor:
        """Row indices on the device. On CUDA through pinned memory, so the copy does not wait for the
        work already queued (a copy from pageable memory synchronises the stream)."""
        rows = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))
        if self.device.type == "cuda":
            return rows.pin_memory().to(self.device, non_blocking=True)
        return rows.to(self.device)

    def _widths(self, idx: np.ndarray) -> tuple[int, int]:
        """A batch's padded (source, target) lengths: its bucket's, twice (the partial batch's is the
        longest bucket, so it has one shape); without buckets each side's longest sentence."""
        if self.buckets is None:
            return int(self._src_len[idx].max()), int(self._tgt_len[idx].max())
        length = self.lengths[-1] if len(idx) < self.batch_size else int(self._padded[idx].max())
        return length, length

    def _by_length(self, idx: np.ndarray) -> np.ndarray:
        # Sort by the positions a pair needs, ties by target then source length; stable. The target
        # decides more of the cost (the decoder and the vocabulary-wide output run over it).
        order = np.lexsort((self._src_len[idx], self._tgt_len[idx], self._need[idx]))
        return idx[order]

    def _batch_indices(self, shuffle: bool, seed: int | None) -> list[np.ndarray]:
        n, bs = len(self.src_ids), self.batch_size
        if not shuffle:
            ordered = self._by_length(np.arange(n))
            return [ordered[i : i + bs] for i in range(0, n, bs)]
        rng = np.random.default_rng(seed)
        perm = rng.permutation(n)
        chunk = bs * self.bucket_factor
        batches = []
        for start in range(0, n, chunk):
            ordered = self._by_length(perm[start : start + chunk])
            batches.extend(ordered[i : i + bs] for i in range(0, len(ordered), bs))
        # The partial batch (the last chunk's last) stays last: an epoch cut short never meets its shape.
        full, partial = (batches[:-1], batches[-1:]) if n % bs else (batches, [])
        # Otherwise each chunk would run from short to long sentences, a visible pattern in the loss.
        return [full[i] for i in rng.permutation(len(full))] + partial

    def _make_batch(self, idx: np.ndarray, rows: torch.Tensor, widths: tuple[int, int]) -> TranslationBatch:
        """idx: the pairs (host), rows: the same on the device; widths: the padded (S, T)."""
        s, t = widths
        # Rows first, then the slice: index_select from a sliced (non-contiguous) table is ~150x slower on the CPU.
        ids = self.table.index_select(1, rows)[:, :, : max(s, t)].long()  # (3, B, max(S, T))
        src, tgt_in, tgt_out = ids[0, :, :s], ids[1, :, :t], ids[2, :, :t]
        return TranslationBatch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, index=rows,
                                n_tokens=int(self._tgt_len[idx].sum()), src_len=int(self._src_len[idx].max()))
