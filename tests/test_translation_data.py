"""Translation data pipeline and metrics, on the real Tatoeba English–Spanish file (CC-BY 2.0 FR, tatoeba.org / manythings.org/anki)."""
import sys
import types

import numpy as np
import pytest
import sacrebleu
import torch
from tokenizers.pre_tokenizers import Whitespace

from headsearch.errors import ConfigError, DataError
from headsearch.tasks import translation_data as td
from headsearch.tasks.text_metrics import cer, corpus_bleu, wer

# make test-oldest runs this module on the floor: datasets and tokenizers.
pytestmark = pytest.mark.floor

N_PAIRS = 118_964


@pytest.fixture(scope="module")
def corpus(spa_file):
    return td.read_parallel_tsv(spa_file)


@pytest.fixture(scope="module")
def sample(corpus):
    """5,000 random real pairs (the file is sorted by length, so its head is all one-word sentences)."""
    idx = np.sort(np.random.default_rng(0).choice(len(corpus), 5000, replace=False))
    return [corpus.src[i] for i in idx], [corpus.tgt[i] for i in idx]


@pytest.fixture(scope="module")
def tokenizers_(sample):
    src, tgt = sample
    return td.train_tokenizer(src, 100_000), td.train_tokenizer(tgt, 100_000)


@pytest.fixture(scope="module")
def encoded(sample, tokenizers_):
    (src, tgt), (tok_src, tok_tgt) = sample, tokenizers_
    return td.encode(tok_src, src), td.encode(tok_tgt, tgt)


def _pretokenize(text):
    return [t for t, _ in Whitespace().pre_tokenize_str(text)]


# --- reading ---------------------------------------------------------------------------------------


def test_reads_the_real_file(corpus, spa_file):
    assert len(corpus) == len(corpus.src) == len(corpus.tgt) == N_PAIRS
    assert (corpus.src[0], corpus.tgt[0]) == ("Go.", "Ve.")
    assert corpus.source == str(spa_file)
    assert all(s == s.strip() and s for s in corpus.src[:1000] + corpus.tgt[:1000])


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_line_without_tab_is_named(tmp_path):
    f = tmp_path / "bad.tsv"
    f.write_text("Hello.\tHola.\n\nNo tab here\nBye.\tAdiós.\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"line 3\b") as err:
        td.read_parallel_tsv(f)
    assert str(f) in _one_line(err)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found") as err:
        td.read_parallel_tsv(tmp_path / "nope.tsv")
    _one_line(err)


def test_undecodable_and_empty_files(tmp_path):
    f = tmp_path / "latin1.tsv"
    f.write_bytes("Yes.\tSí.\n".encode() + "Where?\t¿Dónde?\n".encode("latin-1"))
    with pytest.raises(DataError, match="line 2.*UTF-8"):
        td.read_parallel_tsv(f)
    f.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(DataError, match="no sentence pairs"):
        td.read_parallel_tsv(f)


def test_columns_blank_lines_and_bom(tmp_path):
    f = tmp_path / "three.tsv"
    f.write_text("\ufeffGo.\tVe.\tCC-BY 2.0\n\n  Run! \t ¡Corre! \tCC-BY 2.0\r\n", encoding="utf-8")
    c = td.read_parallel_tsv(f, src_col=1, tgt_col=0)
    assert c.src == ("Ve.", "¡Corre!") and c.tgt == ("Go.", "Run!")
    with pytest.raises(ConfigError):
        td.read_parallel_tsv(f, src_col=1, tgt_col=1)


def test_opus_books_rows_and_network_failure(monkeypatch):
    rows = [{"en": " Hello. ", "es": "Hola."}, {"en": "", "es": "Vacío."}, {"en": "Bye.", "es": "Adiós."}]
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, pair, split, revision: {"translation": rows}
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setattr(td, "resolve_hub_commit", lambda dataset_id, revision: None)
    c = td.load_opus_books("en-es")
    assert c.src == ("Hello.", "Bye.") and c.tgt == ("Hola.", "Adiós.")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hugging Face Hub\nmore detail")

    fake.load_dataset = offline
    with pytest.raises(DataError, match="--data-file") as err:
        td.load_opus_books("en-es")
    _one_line(err)


def test_opus_books_loads_the_canonical_id_at_a_resolved_commit_and_records_it(monkeypatch):
    """No network: `datasets.load_dataset` and the hub's commit lookup are stand-ins that record what they were
    asked. The corpus is loaded by its canonical id at the commit the revision resolved to, and its provenance
    (what the run directory's split.json keeps under "data") names the id, config, revision and commit."""
    calls = []

    def load_dataset(name, config, split, revision):
        calls.append((name, config, split, revision))
        return {"translation": [{"en": "Hello.", "es": "Hola."}]}

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    asked = []
    monkeypatch.setattr(td, "resolve_hub_commit", lambda dataset_id, revision: asked.append((dataset_id, revision)) or "c0ffee" * 6 + "abcd")
    commit = "c0ffee" * 6 + "abcd"

    c = td.load_opus_books("en-es")  # no revision: the default branch, resolved to its commit
    assert asked == [("Helsinki-NLP/opus_books", None)]
    assert calls == [("Helsinki-NLP/opus_books", "en-es", "train", commit)]
    assert c.provenance == {"dataset": "Helsinki-NLP/opus_books", "config": "en-es", "revision": None, "commit": commit}
    assert c.source == f"Helsinki-NLP/opus_books en-es @ {commit} (Hugging Face hub)"

    # A revision pinned (data.revision); the hub cannot be asked (offline): loaded at the revision as given.
    monkeypatch.setattr(td, "resolve_hub_commit", lambda dataset_id, revision: None)
    calls.clear()
    c = td.load_opus_books("en-es", "v1.0")
    assert calls == [("Helsinki-NLP/opus_books", "en-es", "train", "v1.0")]
    assert c.provenance == {"dataset": "Helsinki-NLP/opus_books", "config": "en-es", "revision": "v1.0", "commit": None}
    assert c == td.ParallelCorpus(c.src, c.tgt, c.source)  # provenance takes no part in equality


def test_data_revision_is_a_config_field(tmp_path, cli):
    """`--set data.revision=...` (or `data: {revision: ...}` in a config) picks the opus_books revision
    (test_a_run_directory_records_the_downloaded_corpus_revision: what reaches the download). Bad values get one line."""
    from headsearch.tasks import get_task, resolve_config
    from headsearch.tasks.registry import parse_sets

    task = get_task("translation-en-es")
    cfg = resolve_config(task, preset="tiny", overrides={"data": parse_sets(["data.revision=refs/convert/parquet"])["data"]})
    assert cfg.data.revision == "refs/convert/parquet"
    assert resolve_config(task, config=cfg.to_dict()).data.revision == "refs/convert/parquet"  # round-trips (config.yaml)
    assert resolve_config(task, preset="tiny").data.revision is None
    assert resolve_config(task, overrides={"data": {"revision": "2"}}).data.revision == "2"
    for bad in ("two words", "", True):
        with pytest.raises(ConfigError, match="must be a branch, tag or commit"):
            resolve_config(task, overrides={"data": {"revision": bad}})
    assert parse_sets(["data.revision=1.10"])["data"]["revision"] == 1.1  # YAML's reading of a tag: refused, not guessed
    assert parse_sets(["data.revision='1.10'"])["data"]["revision"] == "1.10"  # quoted, as the refusal says
    for number in (2, 1.1):
        with pytest.raises(ConfigError, match="was read as a number: quote it"):
            resolve_config(task, overrides={"data": {"revision": number}})

    line = cli.error_line(cli(["train", "--task", "translation-en-es", "--set", "data.revision=a b", "--out",
                               str(tmp_path / "bad")]), "data.revision")
    assert not (tmp_path / "bad").exists(), line


# --- splits ----------------------------------------------------------------------------------------


def test_split_is_seeded_disjoint_and_complete():
    a = td.split_indices(1000, 0.1, 50, seed=7)
    b = td.split_indices(1000, 0.1, 50, seed=7)
    c = td.split_indices(1000, 0.1, 50, seed=8)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["val"], c["val"])
    assert (len(a["train"]), len(a["val"]), len(a["test"])) == (850, 100, 50)
    assert np.array_equal(np.sort(np.concatenate(list(a.values()))), np.arange(1000))
    for idx in a.values():
        assert idx.dtype == np.int64 and np.all(np.diff(idx) > 0)
    assert len(td.split_indices(10, 0, 0, seed=0)["train"]) == 10


@pytest.mark.parametrize("val, test", [(-1, 10), (0.5, 0.5), (60, 40), (1.5, 10), (0.0, 10), (True, 10)])
def test_bad_split_sizes(val, test):
    with pytest.raises(ConfigError):
        td.split_indices(100, val, test, seed=0)


def test_filter_by_length():
    src = [[5] * 3, [5] * 4, [5] * 2, []]
    tgt = [[6] * 3, [6] * 1, [6] * 4, [6] * 4]
    assert td.filter_by_length(src, tgt, max_len=4).tolist() == [0]
    assert td.filter_by_length(src, tgt, max_len=5).tolist() == [0, 1, 2, 3]


# --- tokenizers ------------------------------------------------------------------------------------


def test_tokenizer_specials_unknowns_and_vocab_size(sample, tokenizers_):
    src, _ = sample
    tok = tokenizers_[0]
    assert [tok.token_to_id(t) for t in td.SPECIAL_TOKENS] == [0, 1, 2, 3]

    counts = {}
    for s in src:
        for w in _pretokenize(s):
            counts[w] = counts.get(w, 0) + 1
    once = next(w for w, c in counts.items() if c == 1)
    twice = next(w for w, c in counts.items() if c == 2)
    assert tok.token_to_id(once) is None and td.encode(tok, [once]) == [[td.UNK_ID]]
    assert tok.token_to_id(twice) is not None
    assert tok.get_vocab_size() == len(td.SPECIAL_TOKENS) + sum(c >= 2 for c in counts.values())

    small = td.train_tokenizer(src, vocab_size=200)
    assert small.get_vocab_size() == 200
    assert small.token_to_id("Tom") is not None  # the most frequent words are the ones kept


def test_encode_and_decode(tokenizers_):
    tok = tokenizers_[1]
    [ids] = td.encode(tok, ["¿Dónde está Tom?"])
    assert td.SOS_ID not in ids and td.EOS_ID not in ids and len(ids) == 5
    assert td.encode(tok, ["¿Dónde está Tom?"], max_len=2) == [ids[:2]]
    generated = [td.SOS_ID, *ids, td.EOS_ID, ids[0], td.PAD_ID]
    assert td.decode_ids(tok, generated) == "¿Dónde está Tom?"
    assert td.decode_ids(tok, [td.UNK_ID, ids[-1]]) == "[UNK]?"


def test_tokenizer_cache(sample, tmp_path, monkeypatch):
    src, tgt = sample
    src, tgt = src[:2000], tgt[:2000]
    first = td.load_or_train_tokenizers(src, tgt, 5000, 2, tmp_path)
    files = sorted(tmp_path.glob("*/*.json"))
    assert [f.name for f in files] == ["src.json", "tgt.json"] and len(files[0].parent.name) == 64
    assert not list(tmp_path.glob("*/*.tmp"))
    stamps = [f.stat().st_mtime_ns for f in files]

    def no_training(*args, **kwargs):
        raise AssertionError("cache miss: trained again")

    monkeypatch.setattr(td, "train_tokenizer", no_training)
    second = td.load_or_train_tokenizers(src, tgt, 5000, 2, tmp_path)
    assert [f.stat().st_mtime_ns for f in files] == stamps
    for a, b, texts in zip(first, second, (src, tgt)):
        assert td.encode(a, texts) == td.encode(b, texts)

    monkeypatch.undo()
    td.load_or_train_tokenizers(src, tgt, 5000, 3, tmp_path)  # other settings: another cache entry
    assert len(list(tmp_path.glob("*/src.json"))) == 2


# --- detokenization --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "¿Dónde está el baño?",
        "Hola, mundo.",
        "I don't know.",
        "¡Qué alto eres!",
        '"Hello," he said.',
        "My parents' house is at 3:00 p.m. (really)!?",
        "It costs $1,000.50, or 20% more.",
        "Tom's well-known «casa».",
    ],
)
def test_detokenize_round_trips(text):
    assert td.detokenize(_pretokenize(text)) == text


def test_detokenize_on_real_sentences(corpus):
    rng = np.random.default_rng(1)
    texts = [corpus.src[i] for i in rng.choice(len(corpus), 10_000)] + [corpus.tgt[i] for i in rng.choice(len(corpus), 10_000)]
    exact = sum(td.detokenize(_pretokenize(t)) == t for t in texts)
    assert exact / len(texts) > 0.995  # a heuristic: about 3 in 10,000 sentences differ, in spacing only


# --- batches ---------------------------------------------------------------------------------------


def _pad_fraction(batches):
    pads = total = 0
    for b in batches:
        for t in (b.src, b.tgt_out):
            pads += int((t == td.PAD_ID).sum())
            total += t.numel()
    return pads / total


LADDER = (8, 12, 16, 24, 32, 48, 64)  # bucket_ladder(64)


def _need(src, tgt, i):
    return max(len(src[i]), len(tgt[i])) + 1  # with EOS (source) / SOS or EOS (target)


@pytest.mark.parametrize("buckets", [None, LADDER])
def test_every_pair_once_with_correct_rows(encoded, buckets):
    src, tgt = encoded
    batcher = td.BucketBatcher(src, tgt, batch_size=64, buckets=buckets)
    for shuffle in (True, False):
        batches = list(batcher.batches(shuffle=shuffle, seed=3))
        assert len(batches) == len(batcher) == -(-len(src) // 64)
        seen = torch.cat([b.index for b in batches]).sort().values
        assert torch.equal(seen, torch.arange(len(src)))

    for b in batches:
        assert b.src.dtype == b.tgt_in.dtype == b.tgt_out.dtype == b.index.dtype == torch.long
        assert b.tgt_in.shape == b.tgt_out.shape
        if buckets is None:  # each side padded to its own longest sentence
            assert b.src.shape[1] == max(len(src[i]) for i in b.index.tolist()) + 1
            assert b.tgt_in.shape[1] == max(len(tgt[i]) for i in b.index.tolist()) + 1
        else:  # one length for both sides, one of the buckets
            assert b.src.shape == b.tgt_in.shape and b.src.shape[1] in LADDER
        assert b.n_tokens == int((b.tgt_out != td.PAD_ID).sum())
        assert b.src_len == int((b.src != td.PAD_ID).sum(1).max())
        for t in (b.src, b.tgt_in, b.tgt_out):  # real tokens first, then only padding
            real = (t != td.PAD_ID).int()
            assert torch.all(real[:, 1:] <= real[:, :-1])
        for row, i in enumerate(b.index.tolist()):
            s, t = src[i], tgt[i]
            assert b.src[row, : len(s) + 1].tolist() == s + [td.EOS_ID]
            assert b.tgt_in[row, : len(t) + 1].tolist() == [td.SOS_ID] + t
            assert b.tgt_out[row, : len(t) + 1].tolist() == t + [td.EOS_ID]
            assert torch.equal(b.tgt_in[row, 1 : len(t) + 1], b.tgt_out[row, : len(t)])  # shifted by one


def test_fixed_buckets_pad_each_batch_to_the_smallest_length_that_holds_it(encoded):
    src, tgt = encoded
    batcher = td.BucketBatcher(src, tgt, batch_size=64, buckets=LADDER)
    n_partial = len(src) % 64
    assert n_partial  # 5,000 pairs: 78 full batches and one of 8
    longest = min(n for n in LADDER if n >= max(_need(src, tgt, i) for i in range(len(src))))
    assert batcher.lengths[-1] == longest and set(batcher.lengths) <= set(LADDER)
    for epoch in (1, 2):
        batches = list(batcher.batches(shuffle=True, seed=epoch))
        *full, last = batches
        assert tuple(last.src.shape) == (n_partial, longest)  # the partial batch: last, and one shape
        for b in full:
            need = max(_need(src, tgt, i) for i in b.index.tolist())
            assert b.src.shape == (64, min(n for n in LADDER if n >= need))
    assert {b.src.shape[1] for b in full} == set(batcher.lengths)  # most lengths fill a batch in an epoch


def test_padding_to_buckets_costs_little_over_each_batchs_own_lengths(encoded):
    src, tgt = encoded
    own = list(td.BucketBatcher(src, tgt, 64).batches(shuffle=True, seed=0))
    fixed = list(td.BucketBatcher(src, tgt, 64, buckets=LADDER).batches(shuffle=True, seed=0))
    assert [b.index.tolist() for b in own] == [b.index.tolist() for b in fixed]  # the same batches
    for o, f in zip(own, fixed):
        assert f.src.shape[1] >= o.src.shape[1] and f.tgt_in.shape[1] >= o.tgt_in.shape[1]
    positions = lambda batches: sum(b.src.numel() + b.tgt_in.numel() for b in batches)  # noqa: E731
    assert positions(fixed) / positions(own) < 1.35  # each bucket is at most 1.5x the one below it


@pytest.mark.parametrize("buckets", [None, LADDER])
def test_buckets_cut_padding(encoded, buckets):
    src, tgt = encoded
    bucketed = _pad_fraction(td.BucketBatcher(src, tgt, 64, buckets=buckets).batches(shuffle=True, seed=0))
    # bucket_factor=1: each bucket is one batch of a random permutation, i.e. plain random batching.
    random = _pad_fraction(td.BucketBatcher(src, tgt, 64, bucket_factor=1).batches(shuffle=True, seed=0))
    assert bucketed < (0.5 if buckets is None else 0.75) * random, (bucketed, random)


def test_batches_are_reproducible(encoded):
    src, tgt = encoded
    batcher = td.BucketBatcher(src, tgt, batch_size=32, bucket_factor=10)

    def order(**kw):
        return [b.index.tolist() for b in batcher.batches(**kw)]

    assert order(shuffle=True, seed=5) == order(shuffle=True, seed=5)
    assert order(shuffle=True, seed=5) != order(shuffle=True, seed=6)
    fixed = order(shuffle=False)
    assert fixed == order(shuffle=False)
    need = [_need(src, tgt, i) for batch in fixed for i in batch]
    assert need == sorted(need)


def test_shape_samples_show_every_shape_of_an_epoch_once(encoded):
    src, tgt = encoded
    batcher = td.BucketBatcher(src, tgt, batch_size=64, buckets=LADDER)
    samples = batcher.shape_samples(seed=0)
    shapes = [tuple(b.src.shape) for b in samples]
    assert shapes == [(64, n) for n in batcher.lengths] + [(len(src) % 64, batcher.lengths[-1])]
    shown = {tuple(b.src.shape) for epoch in range(1, 6) for b in batcher.batches(shuffle=True, seed=epoch)}
    assert shown <= set(shapes)
    assert [tuple(b.src.shape) for b in batcher.shape_samples(seed=0, partial=False)] == shapes[:-1]
    for b in samples:  # real rows, each fitting its padded length
        assert all(_need(src, tgt, i) <= b.src.shape[1] for i in b.index.tolist())
        assert torch.equal(b.tgt_in != td.PAD_ID, b.tgt_out != td.PAD_ID)  # SOS + words, words + EOS
    # Divisible: no partial batch. Fewer pairs than a batch: the one batch is the partial one.
    even = td.BucketBatcher(src[:4992], tgt[:4992], batch_size=64, buckets=LADDER)
    assert all(b.src.shape[0] == 64 for b in even.shape_samples(seed=0))
    few = td.BucketBatcher(src[:40], tgt[:40], batch_size=64, buckets=LADDER)
    assert [tuple(b.src.shape) for b in few.shape_samples(seed=0)] == [(40, few.lengths[-1])]
    assert [tuple(b.src.shape) for b in few.batches(shuffle=True, seed=1)] == [(40, few.lengths[-1])]


def test_without_buckets_shape_samples_are_three_batches_of_different_shapes(encoded):
    """Shapes vary without a fixed set there: a few, for a compiler to see the lengths change."""
    src, tgt = encoded
    batcher = td.BucketBatcher(src, tgt, batch_size=64)
    samples = batcher.shape_samples(seed=0)
    first_of_each_shape = {}  # the epoch drawn with the same seed, in order
    for batch in batcher.batches(shuffle=True, seed=0):
        first_of_each_shape.setdefault((*batch.src.shape, batch.tgt_in.shape[1]), batch.index.tolist())
    assert [b.index.tolist() for b in samples] == list(first_of_each_shape.values())[:3]
    assert len({(*b.src.shape, b.tgt_in.shape[1]) for b in samples}) == 3


def test_the_pairs_live_on_the_device_once_and_another_batch_size_shares_them(encoded):
    src, tgt = encoded
    batcher = td.BucketBatcher(src, tgt, batch_size=64, buckets=LADDER)
    assert batcher.table.shape == (3, len(src), batcher.lengths[-1]) and batcher.table.dtype == torch.int16
    other = batcher.with_batch_size(100)
    assert other.table is batcher.table and batcher.batch_size == 64
    assert len(other) == -(-len(src) // 100)
    seen = torch.cat([b.index for b in other.batches(shuffle=True, seed=1)]).sort().values
    assert torch.equal(seen, torch.arange(len(src)))


def test_bucket_ladder():
    assert td.bucket_ladder(32) == (8, 12, 16, 24, 32)
    assert td.bucket_ladder(16) == (8, 12, 16)
    assert td.bucket_ladder(64) == LADDER
    assert td.bucket_ladder(4) == (4,)
    assert td.bucket_ladder(350) == (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 350)
    for n in range(4, 400):
        ladder = td.bucket_ladder(n)
        assert ladder[-1] == n and list(ladder) == sorted(set(ladder))
        assert all(b <= 1.5 * a for a, b in zip(ladder, ladder[1:]))


def test_batcher_rejects_bad_input():
    with pytest.raises(ConfigError):
        td.BucketBatcher([[4]], [[5]], batch_size=0)
    with pytest.raises(DataError):
        td.BucketBatcher([], [], batch_size=8)
    with pytest.raises(ConfigError, match=r"end below the longest pair \(4 tokens"):
        td.BucketBatcher([[4, 5, 6]], [[5]], batch_size=8, buckets=(2, 3))


# --- metrics ---------------------------------------------------------------------------------------


def test_cer_and_wer_by_hand():
    assert cer(["abc"], ["abd"]) == pytest.approx(1 / 3)
    assert wer(["the cat sat"], ["the cat sat down"]) == pytest.approx(1 / 4)
    assert cer(["kitten"], ["sitting"]) == pytest.approx(3 / 7)


def test_error_rates_are_corpus_level():
    # One wrong short sentence, one perfect long one: corpus rates weigh by reference length.
    hyps, refs = ["b", "abcdefghij"], ["a", "abcdefghij"]
    assert cer(hyps, refs) == pytest.approx(1 / 11)  # the mean of sentence CERs would be 0.5
    hyps, refs = ["x", "one two three four five six seven"], ["y", "one two three four five six seven"]
    assert wer(hyps, refs) == pytest.approx(1 / 8)  # the mean of sentence WERs would be 0.5


def test_bleu():
    refs = ["El gato está en la alfombra.", "¿Dónde está el baño?"]
    score, signature = corpus_bleu(refs, refs)
    assert score == pytest.approx(100.0)
    assert "nrefs:1" in signature and "tok:13a" in signature

    # By hand: 1- to 4-gram precisions 5/6, 3/5, 2/4, 1/3, same length (no brevity penalty).
    score, _ = corpus_bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert score == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25)

    hyps = ["El perro duerme.", "¿Dónde está la cocina?"]
    assert corpus_bleu(hyps, refs)[0] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert corpus_bleu(["x y z w"], ["a b c d"])[0] == 0.0


def test_metrics_need_paired_inputs():
    for metric in (corpus_bleu, cer, wer):
        with pytest.raises(ValueError):
            metric(["a", "b"], ["a"])


def test_a_run_directory_records_the_downloaded_corpus_revision(spa_file, tmp_path, monkeypatch):
    """The bound translation task writes the corpus's provenance into the run directory's split.json."""
    import json

    from headsearch.tasks import DataSource, apply_overrides, get_task, resolve_config

    monkeypatch.setenv("HEADSEARCH_CACHE", str(tmp_path))
    pairs = td.read_parallel_tsv(spa_file)
    provenance = {"dataset": "Helsinki-NLP/opus_books", "config": "en-es", "revision": "v2", "commit": "ab" * 20}
    corpus = td.ParallelCorpus(pairs.src[:300], pairs.tgt[:300], "stand-in", provenance=provenance)
    asked = []
    monkeypatch.setattr(td, "load_opus_books", lambda pair, revision: asked.append((pair, revision)) or corpus)
    task = get_task("translation-en-es")
    cfg = apply_overrides(task, resolve_config(task, preset="tiny"), {
        "data": {"train_limit": 200, "val_size": 40, "test_size": 20, "max_len": 16, "vocab_size": 300, "revision": "v2"}})
    bound = task.setup(cfg, DataSource(), torch.device("cpu"))  # no --data-file: the hub's corpus, at data.revision
    bound.write_artifacts(tmp_path)
    assert asked == [("en-es", "v2")]
    split = json.loads((tmp_path / "split.json").read_text())
    assert split["data"] == provenance and split["source"] == "stand-in"
