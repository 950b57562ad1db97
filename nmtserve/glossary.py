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
        for key, i in seen.items():
            for other, j in seen.items():
                if i != j and _pattern(key).search(other):
                    raise ConfigError(f"{labels[i]}: source term {entries[i][0]!r} overlaps {labels[j]}'s "
                                      f"{entries[j][0]!r}, which contains it")
        self.entries = [(source.strip(), target.strip()) for source, target in entries]
        self._patterns = [_pattern(_folded(source)) for source, _ in self.entries]

    def targets_for(self, sentence: str) -> list[str]:
        """The target terms of the source terms the sentence contains, in the glossary's order."""
        folded = _folded(sentence)
        return [target for (_, target), pattern in zip(self.entries, self._patterns) if pattern.search(folded)]

    def constraints_for(self, sentence: str, encode_target: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
        """targets_for as the model's target tokens (`encode_target`: the tokenizer's)."""
        return tuple(tuple(encode_target(target)) for target in self.targets_for(sentence))


def _folded(text: str) -> str:
    return " ".join(text.casefold().split())


def _pattern(term: str) -> re.Pattern:
    """A folded term as a whole word or phrase: not inside a longer word."""
    return re.compile(r"(?<!\w)" + re.escape(term) + r"(?!\w)")
