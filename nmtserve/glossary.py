"""Glossaries: source terms and the target terms a translation must use for them. A sentence that contains a
source term (a whole word or phrase, case-insensitive) gets that term's target as a constraint of its search
(nmtserve/search.py: ConstrainedBeamSearch). Below the server and the runtime: protobuf-, numpy- and torch-free."""

from __future__ import annotations

import re
from collections.abc import Callable

from nmtserve.errors import ConfigError

MAX_ENTRIES = 1000  # a glossary's entries


class Glossary:
    """Entries (source term, target term), checked: both terms non-empty, no source term twice, none inside
    another (which of the two would apply would depend on the sentence), at most MAX_ENTRIES. ConfigError
    naming the entry otherwise: `field`[i], or labels[i] where given (a file's line)."""

    def __init__(self, entries: list[tuple[str, str]], field: str = "glossary", labels: list[str] | None = None):
        if len(entries) > MAX_ENTRIES:
            raise ConfigError(f"{field}: {len(entries)} entries; at most {MAX_ENTRIES}")
        labels = labels or [f"{field}[{i}]" for i in range(len(entries))]
        seen: dict[str, int] = {}
        for i, (source, target) in enumerate(entries):
            if not source.strip() or not target.strip():
                raise ConfigError(f"{labels[i]}: source {source!r} and target {target!r} must both be non-empty")
            key = _folded(source)
            if key in seen:
                raise ConfigError(f"{labels[i]}: source term {source!r} is also {labels[seen[key]]}'s")
            seen[key] = i
        self.entries = [(source.strip(), target.strip()) for source, target in entries]
        self._index = seen  # folded source term -> its entry
        # every source term as a whole word or phrase, in one pattern: a zero-width match at each place a term
        # starts, so that terms that overlap in a sentence are all found. Shortest first: where two terms start at
        # one place, the one inside the other is the one found (which the check below refuses)
        terms = sorted(seen, key=len)
        self._any = re.compile(r"(?<!\w)(?=(" + "|".join(map(re.escape, terms)) + r")(?!\w))") if seen else None
        for key, i in seen.items():
            inside = [j for j in self._found(key) if j != i]
            if inside:
                j = inside[0]
                raise ConfigError(f"{labels[j]}: source term {entries[j][0]!r} overlaps {labels[i]}'s "
                                  f"{entries[i][0]!r}, which contains it")

    def _found(self, folded: str) -> list[int]:
        """The entries whose source terms a folded text contains, in the glossary's order."""
        return sorted({self._index[m.group(1)] for m in self._any.finditer(folded)}) if self._any else []

    def targets_for(self, sentence: str) -> list[str]:
        """The target terms of the source terms the sentence contains, in the glossary's order."""
        return [self.entries[i][1] for i in self._found(_folded(sentence))]

    def constraints_for(self, sentence: str, encode_target: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
        """targets_for as the model's target tokens (`encode_target`: the tokenizer's)."""
        return tuple(tuple(encode_target(target)) for target in self.targets_for(sentence))


def _folded(text: str) -> str:
    return " ".join(text.casefold().split())

