"""The growing session's plan: what each turn pastes, the server's window, and the last paste.

Notebook 20 runs one Claude Code session twice on one server: as is (the agent assumes a
1,000,000-token window and never compacts before the server refuses) and told the window
(`CLAUDE_CODE_MAX_CONTEXT_TOKENS`: it compacts 13,000 tokens below it). The window is sized
from where the told agent should compact (`compaction_plan`); the session as is must then
pass that line and the agent's 13,000-token buffer before the server refuses it. Grown one
equal paste at a time, every one of those turns is a prefill at the far end of the window, the
most expensive place on a CPU. With `outgrow`, the last turn pastes instead what takes the
session as is past the window in one step (a long file pasted at the end, `last_paste_words`),
while, after a compaction, the same paste still fits under the told agent's refuse line: the
turn that tells the two apart, paid once, near the start of the window.

Token counts are the embedded model's (`agent_anatomy.embedded_counter`); the agent's own count
of a prompt it has not sent runs above them, which is why the plan keeps margins and the
notebook measures what the agent did. Written here because no library plans an agent session.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

from infercourse.ops.agent_anatomy import embedded_counter, fewest_words
from infercourse.ops.agent_budget import claude_budget, claude_window_limits

__all__ = ["session_pastes", "compaction_plan", "last_paste_words"]


def _cycled(words: list[str], start: int, n: int) -> str:
    """`n` words of `words` from `start`, read in a cycle (a long paste is longer than the text)."""
    return " ".join(words[(start + i) % len(words)] for i in range(n))


def session_pastes(turns: int, paste_words: int, last_words: int | None = None) -> list[str]:
    """What each turn of the growing session pastes: `paste_words` words of the course's
    evaluation text (the last turn `last_words` where given), read in a cycle, each turn going
    on where the one before stopped."""
    from infercourse.measure.workloads import eval_text
    words = eval_text().split()
    sizes = [paste_words] * turns
    if last_words is not None and turns:
        sizes[-1] = last_words
    return [_cycled(words, start, n) for start, n in zip(itertools.accumulate([0, *sizes[:-1]]), sizes)]


def last_paste_words(turns: int, paste_words: int, target: int, count: Callable[[str], int]) -> tuple[int, int]:
    """The fewest words (at least one), and their tokens, for the last turn's paste (going on where
    the turns before stopped) to hold at least `target` tokens (`fewest_words`; a word is a token or
    more, so `target` words always do)."""
    from infercourse.measure.workloads import eval_text
    words, start = eval_text().split(), (turns - 1) * paste_words
    make = lambda n: _cycled(words, start, n)   # noqa: E731
    n = max(1, fewest_words(make, target, count, max(1, target)))
    return n, count(make(n))


def compaction_plan(first_tokens: int, turns: int, paste_words: int, *, max_output: int, growth_pastes: float,
                    outgrow: bool = False, count: Callable[[str], int] | None = None) -> dict[str, int]:
    """The server window for the growing session, the pinned agent's limits told it, and (with
    `outgrow`) the last turn's paste.

    Args:
        first_tokens: a one-line task's first request at the session's size (`first_tokens_at`; each
            turn adds its paste, counted by the embedded model's tokenizer, and an answer).
        max_output: the agents' answer cap (CLAUDE_CODE_MAX_OUTPUT_TOKENS).
        growth_pastes: pastes (the largest) the session grows past its first turn before the told
            agent compacts. It compacts before sending a turn its own count puts past the line and sends
            that turn after the summary: too close a line (about a paste) and it compacts at every turn.
        outgrow: size the last paste so that the session as is passes the window by half a paste in
            that turn (`last_words`, `last_paste_tokens`); `told_last` is what the told agent's last
            turn holds after a compaction (first request and last paste, the summary left out), against
            its refuse line. Without it every turn pastes `paste_words` and `last_turn` says whether
            the session as is outgrows the window at all.

    The told agent compacts a prompt past window - min(cap, 20,000) - 13,000 (`claude_window_limits`),
    so the window is sized from the line plus the agent's reserves (`claude_budget`)."""
    count = count or embedded_counter()
    pastes = [count(p) for p in session_pastes(turns, paste_words)]
    first_turn = first_tokens + pastes[0]
    growth = math.ceil(growth_pastes * max(pastes))
    window = claude_budget(first_turn, growth=growth, answer_cap=max_output)["window"]
    plan = {**claude_window_limits(window, max_output), "first_turn": first_turn, "paste_tokens": max(pastes),
            "growth": growth}
    if outgrow and turns > 1:
        before = first_tokens + sum(pastes[:-1])
        words, last = last_paste_words(turns, paste_words, window - before + max(pastes) // 2, count)
        pastes[-1] = last
        plan.update(last_words=words, last_paste_tokens=last, told_last=first_tokens + last)
    return {**plan, "last_turn": first_tokens + sum(pastes)}
