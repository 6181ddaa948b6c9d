"""English→Spanish translation data: parallel corpora, word-level tokenizers and length-bucketed batches.

Two sources of sentence pairs:

* `load_opus_books` — opus_books en-es from the Hugging Face hub, the corpus of the Deep Head
  repository (Cruz et al.). Needs the network.
* `read_parallel_tsv` — any local tab-separated parallel file, one pair per line. The copy used for
  tests and examples is the Tatoeba English–Spanish file `spa.txt` from manythings.org/anki
  (sentences from tatoeba.org), released under CC-BY 2.0 (France): credit tatoeba.org and
  manythings.org/anki wherever that data is used or shipped.

Tokenizers are word-level (one id per whitespace/punctuation-separated word, as in the Deep Head repository) and one
per language. The four special tokens have the same ids in every tokenizer (`UNK_ID` … `EOS_ID`), so
models and batches can use the constants without asking the tokenizer.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

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


def load_opus_books(pair: str = "en-es") -> ParallelCorpus:
    """opus_books (Tiedemann, OPUS) from the Hugging Face hub: the Deep Head repository's corpus. Needs the network."""
    langs = pair.split("-")
    if len(langs) != 2 or not all(langs):
        raise ConfigError(f"bad language pair {pair!r}: write it as source-target, e.g. 'en-es'")
    src_lang, tgt_lang = langs
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataError("opus_books needs the 'datasets' package — pip install datasets, or pass --data-file") from None
    try:
        rows = load_dataset("opus_books", pair, split="train")["translation"]
    except Exception as e:  # the hub raises many unrelated types (connection, HTTP, not-found, offline mode)
        reason = str(e).splitlines()[0] if str(e) else ""
        raise DataError(
            f"could not load opus_books {pair} from the Hugging Face hub ({type(e).__name__}: {reason}) — "
            "check the network, or pass a local tab-separated file with --data-file"
        ) from e
    pairs = [(r[src_lang].strip(), r[tgt_lang].strip()) for r in rows]
    pairs = [(s, t) for s, t in pairs if s and t]
    if not pairs:
        raise DataError(f"opus_books {pair} came back empty — pass a local tab-separated file with --data-file")
    src, tgt = zip(*pairs)
    return ParallelCorpus(tuple(src), tuple(tgt), source=f"opus_books {pair} (Hugging Face hub)")


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


@dataclass
class TranslationBatch:
    src: torch.Tensor  # (B, S) long: source ids + [EOS], PAD-padded
    tgt_in: torch.Tensor  # (B, T) long: [SOS] + target ids (decoder input), PAD-padded
    tgt_out: torch.Tensor  # (B, T) long: target ids + [EOS] (labels), PAD where padded
    index: torch.Tensor  # (B,) long: positions of these pairs in the lists given to the batcher
    n_tokens: int  # non-pad target tokens (the loss is summed over these)


class BucketBatcher:
    """Length-bucketed batches: sentences of similar length share a batch, so little compute is spent on padding.

    Shuffled epochs stay random at two levels: which pairs meet in a bucket (a seeded permutation cut
    into chunks of batch_size * bucket_factor pairs, each sorted by length) and the order of the
    batches. bucket_factor=1 is plain random batching.
    """

    def __init__(self, src_ids: list[list[int]], tgt_ids: list[list[int]], batch_size: int, *, bucket_factor: int = 50):
        if len(src_ids) != len(tgt_ids):
            raise ValueError(f"{len(src_ids)} source but {len(tgt_ids)} target sequences")
        if batch_size < 1 or bucket_factor < 1:
            raise ConfigError(f"batch_size={batch_size}, bucket_factor={bucket_factor}: both must be at least 1")
        if not src_ids:
            raise DataError("no sentence pairs to batch — the split is empty; use more data or a larger max_len")
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.batch_size, self.bucket_factor = batch_size, bucket_factor
        self._src_len = np.fromiter(map(len, src_ids), dtype=np.int64, count=len(src_ids))
        self._tgt_len = np.fromiter(map(len, tgt_ids), dtype=np.int64, count=len(tgt_ids))

    def __len__(self) -> int:
        # Chunks hold a multiple of batch_size pairs, so only the very last batch can be short.
        return math.ceil(len(self.src_ids) / self.batch_size)

    def batches(self, *, shuffle: bool, seed: int | None = None, device: str | torch.device = "cpu") -> Iterator[TranslationBatch]:
        """One epoch: every pair exactly once. Not shuffled: sorted by length, always the same batches."""
        for idx in self._batch_indices(shuffle, seed):
            yield self._make_batch(idx, device)

    def _by_length(self, idx: np.ndarray) -> np.ndarray:
        # Sort by source length, ties by target length; stable, so equal keys keep their order.
        order = np.lexsort((self._tgt_len[idx], self._src_len[idx]))
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
        # Otherwise each chunk would run from short to long sentences, a visible pattern in the loss.
        return [batches[i] for i in rng.permutation(len(batches))]

    def _make_batch(self, idx: np.ndarray, device: str | torch.device) -> TranslationBatch:
        b = len(idx)
        s_len, t_len = self._src_len[idx] + 1, self._tgt_len[idx] + 1  # + EOS (source), + SOS/EOS (target)
        src = np.full((b, s_len.max()), PAD_ID, dtype=np.int64)
        tgt_in = np.full((b, t_len.max()), PAD_ID, dtype=np.int64)
        tgt_out = np.full((b, t_len.max()), PAD_ID, dtype=np.int64)
        for row, i in enumerate(idx):
            s, t = self.src_ids[i], self.tgt_ids[i]
            src[row, : len(s)] = s
            src[row, len(s)] = EOS_ID
            tgt_in[row, 0] = SOS_ID
            tgt_in[row, 1 : len(t) + 1] = t
            tgt_out[row, : len(t)] = t
            tgt_out[row, len(t)] = EOS_ID

        def to(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        return TranslationBatch(
            src=to(src), tgt_in=to(tgt_in), tgt_out=to(tgt_out), index=to(idx.astype(np.int64)), n_tokens=int(t_len.sum())
        )
