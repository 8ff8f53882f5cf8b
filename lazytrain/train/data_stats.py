"""What the training data turned into (``Stats``, counted by ``tokens.build_rows``), and how a run
says it: the line on truncated and skipped examples, and why data of examples alone gave no row."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stats:
    """What the data turned into. ``examples``: examples kept; ``truncated``: examples longer than
    ``seq_len``, cut to it (``truncated_away`` of them skipped: nothing learnt was left in the
    row); ``nothing_to_learn``: examples skipped that have no learnt token even whole
    (``no_assistant`` of them conversations without an assistant turn)."""

    documents: int = 0
    examples: int = 0
    truncated: int = 0
    truncated_away: int = 0
    nothing_to_learn: int = 0
    no_assistant: int = 0

    @property
    def skipped(self) -> int:
        """Examples that gave no row (their loss would be empty)."""
        return self.truncated_away + self.nothing_to_learn

    def describe(self, seq_len: int) -> str | None:
        """One line on what was cut or skipped, or None when every example was kept whole."""
        total = self.examples + self.skipped
        parts = []
        if self.truncated:
            parts.append(f"{self.truncated} of {total} examples truncated to seq_len {seq_len}"
                         + (f", {self.truncated_away} of them skipped: nothing left to learn after truncation"
                            if self.truncated_away else ""))
        if self.nothing_to_learn:
            chats = f" ({_count(self.no_assistant, 'conversation')} without an assistant turn)" if self.no_assistant else ""
            parts.append(f"{self.nothing_to_learn} of {total} examples skipped: nothing to learn{chats}")
        return "data: " + "; ".join(parts) if parts else None

    def nothing_learnt(self, seq_len: int, names: str) -> str:
        """Why data whose examples were all skipped gave no row, and the fix."""
        why, fixes = [], []
        if self.no_assistant:
            why.append(f"{_count(self.no_assistant, 'conversation')} {_has(self.no_assistant)} no assistant turn, "
                       "and only the assistant's tokens are learnt")
            fixes.append("add the assistant's reply to each conversation")
        if self.nothing_to_learn > self.no_assistant:
            other = self.nothing_to_learn - self.no_assistant
            why.append(f"{_count(other, 'example')} {_has(other)} no learnt token (an empty completion, or labels "
                       "all -100)")
            fixes.append("give each example a completion or labels to learn")
        if self.truncated_away:
            why.append(f"{_count(self.truncated_away, 'example')} {'was' if self.truncated_away == 1 else 'were'} "
                       f"truncated to seq_len {seq_len} before the first learnt token")
            fixes.append("pass a larger seq_len (--seq-len) or shorten the prompts")
        every = f"all {self.skipped} examples" if self.skipped > 1 else "its 1 example"
        return (f"no example in {names} has anything to learn, so the training data has no tokens: {every} "
                f"skipped ({'; '.join(why)}); {', or '.join(fixes)}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _has(n: int) -> str:
    return "has" if n == 1 else "have"
