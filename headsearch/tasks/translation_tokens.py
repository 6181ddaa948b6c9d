"""The special tokens every translation tokenizer shares (at the same ids in each, so models and batches can use
the constants without asking the tokenizer), and `detokenize`, which joins tokens back into natural text."""
from __future__ import annotations

import re
from typing import Sequence

UNK, PAD, SOS, EOS = "[UNK]", "[PAD]", "[SOS]", "[EOS]"
SPECIAL_TOKENS = (UNK, PAD, SOS, EOS)  # ids 0, 1, 2, 3 in every tokenizer
UNK_ID, PAD_ID, SOS_ID, EOS_ID = 0, 1, 2, 3

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
