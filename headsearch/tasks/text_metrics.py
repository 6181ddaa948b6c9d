"""Corpus-level translation metrics: BLEU, character error rate (CER) and word error rate (WER).

All three are corpus scores, never means of sentence scores: a mean of sentence rates lets a
two-word sentence weigh as much as a forty-word one, and sentence BLEU is mostly smoothing noise.

* BLEU — Papineni, Roukos, Ward and Zhu, "BLEU: a Method for Automatic Evaluation of Machine
  Translation", ACL 2002. Computed by sacrebleu (Post, "A Call for Clarity in Reporting BLEU Scores",
  WMT 2018) on detokenized text with its standard tokenization, and reported with sacrebleu's
  signature so the number can be compared with other papers.
  (The Deep Head repository (Cruz et al.) passed bare strings to a BLEU metric that expects lists of words, which scores
  character n-grams, and on a single sentence. We do not do that.)
* CER / WER — Levenshtein edit distance (insertions + deletions + substitutions) summed over the
  corpus, divided by the total reference length in characters / whitespace-separated words.
  Computed by rapidfuzz.
"""
from __future__ import annotations

from typing import Sequence

from rapidfuzz.distance import Levenshtein


def _check_pairs(hyps: Sequence[str], refs: Sequence[str]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references: they must pair up one to one")
    if len(refs) == 0:
        raise ValueError("no sentences to score")


def corpus_bleu(hyps: Sequence[str], refs: Sequence[str]) -> tuple[float, str]:
    """Corpus BLEU (0–100) of detokenized hypotheses against one reference each, and sacrebleu's signature."""
    from sacrebleu.metrics import BLEU

    _check_pairs(hyps, refs)
    bleu = BLEU()
    score = bleu.corpus_score(list(hyps), [list(refs)])  # one reference stream
    return float(score.score), str(bleu.get_signature())


def _error_rate(hyps: Sequence[str], refs: Sequence[str], units) -> float:
    _check_pairs(hyps, refs)
    edits = total = 0
    for h, r in zip(hyps, refs):
        h_units, r_units = units(h), units(r)
        edits += Levenshtein.distance(h_units, r_units)
        total += len(r_units)
    if total == 0:
        raise ValueError("the references are all empty: the error rate is undefined")
    return edits / total


def cer(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus character error rate: total character edits / total reference characters (can exceed 1)."""
    return _error_rate(hyps, refs, units=lambda s: s)


def wer(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus word error rate: total word edits / total reference words, words split on whitespace (can exceed 1)."""
    return _error_rate(hyps, refs, units=str.split)
