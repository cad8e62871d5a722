"""The pinned Claude Code's window arithmetic: where it compacts, where it refuses to send, and
the window, answer cap and compaction line the doctor sizes together.

Claude Code plans with a window it must be told for a model id it does not know
(CLAUDE_CODE_MAX_CONTEXT_TOKENS; 1,000,000 otherwise), keeps room for its answer, and compacts
(summarises the session and starts again from the summary) 13,000 tokens before that. The three
numbers a learner sets (the server's window, the agent's answer cap, and so the compaction line)
are one budget: choose the cap alone and the line can fall on the first request, so every call
compacts; choose a small window and no answer fits. `claude_budget` sizes them together and
`budget_line` prints the arithmetic. Pure functions (no I/O); read from the pinned version's code,
measured by notebook 20.
"""
from __future__ import annotations

__all__ = ["CLAUDE_WINDOW_ENV", "CLAUDE_ASSUMED_WINDOW", "CLAUDE_OUTPUT_RESERVE_CAP", "CLAUDE_COMPACT_BUFFER",
           "CLAUDE_BLOCKING_BUFFER", "CLAUDE_AUTO_COMPACT_WINDOW_FLOOR", "CLAUDE_ANSWER_CAP", "CLAUDE_MIN_ANSWER_CAP",
           "CLAUDE_GROWTH", "claude_window_limits", "claude_budget", "budget_line", "WINDOW_PAD", "padded_window"]

WINDOW_PAD = 256   # llama.cpp rounds a context's window up to a multiple of this (llama_context: GGML_PAD(n_ctx, 256))


def padded_window(tokens: int) -> int:
    """The window llama.cpp gives a context asked for `tokens` (`-c`): rounded up to `WINDOW_PAD`."""
    return -(-int(tokens) // WINDOW_PAD) * WINDOW_PAD

# Claude Code's own window arithmetic, read from the pinned 2.1.328's code (another version may
# differ; notebook 20 measures where it compacts). For a model id it does not know it assumes
# 1,000,000 tokens unless CLAUDE_CODE_MAX_CONTEXT_TOKENS names the window. It plans with that
# window less min(its max output tokens, 20,000); it compacts when a prompt passes that less
# 13,000 (room for the summary) and refuses to send one ("Prompt is too long") past that less
# 3,000. CLAUDE_CODE_AUTO_COMPACT_WINDOW is no substitute on a small server: a value under
# 100,000 tokens is read as 100,000, so on a smaller server it never compacts in time (and the
# window the agent reports, modelUsage.*.contextWindow, stays 1,000,000).
CLAUDE_WINDOW_ENV = "CLAUDE_CODE_MAX_CONTEXT_TOKENS"
CLAUDE_ASSUMED_WINDOW = 1_000_000
CLAUDE_OUTPUT_RESERVE_CAP = 20_000
CLAUDE_COMPACT_BUFFER = 13_000
CLAUDE_BLOCKING_BUFFER = 3_000
CLAUDE_AUTO_COMPACT_WINDOW_FLOOR = 100_000


# What the doctor aims for when it sizes a window for Claude Code: an answer cap an agent can
# work with (a file, a patch, a compaction summary: 64 or 403 tokens end tasks with "exceeded
# the N output token maximum") and room for the session to grow (a dozen tool steps) before the
# first compaction, so that it compacts after it has grown, not at every call.
CLAUDE_ANSWER_CAP = 4_096
CLAUDE_MIN_ANSWER_CAP = 1_024
CLAUDE_GROWTH = 8_192


def claude_budget(first: int, window: int | None = None, *, growth: int = CLAUDE_GROWTH,
                  answer_cap: int = CLAUDE_ANSWER_CAP) -> dict[str, int | bool]:
    """Window, answer cap and compaction line computed together for the pinned Claude Code.

    It compacts when a prompt passes window - min(cap, 20,000) - 13,000 (`claude_window_limits`),
    so the three cannot be chosen apart: a cap of window - 13,000 - first puts the line *on* the
    first request (every call compacts), and a small window leaves no room for an answer.
    Without `window`: the smallest window (llama-server's steps of 256) with `answer_cap` and
    `growth` tokens of session under the line. With it: the largest cap (at most 32,000) that
    still leaves `growth` under the line; `fits` says whether that cap is at least
    CLAUDE_MIN_ANSWER_CAP (if not, the window is too small for both and the cap falls back to
    that minimum, the line then below first + growth).

    Args:
        first: the agent's first request, tokens.
        window: the slot's window (CLAUDE_CODE_MAX_CONTEXT_TOKENS), or None to size one.
        growth: tokens the session should grow past `first` before it compacts.
        answer_cap: the cap to size a window for (CLAUDE_CODE_MAX_OUTPUT_TOKENS).
    """
    if window is None:
        need = first + growth + CLAUDE_COMPACT_BUFFER + min(answer_cap, CLAUDE_OUTPUT_RESERVE_CAP)
        window = padded_window(need)
    room = window - CLAUDE_COMPACT_BUFFER - first - growth          # what is left for the answer's reserve
    cap = 32_000 if room >= CLAUDE_OUTPUT_RESERVE_CAP else room
    fits = cap >= CLAUDE_MIN_ANSWER_CAP
    cap = max(cap, CLAUDE_MIN_ANSWER_CAP)
    lim = claude_window_limits(window, cap)
    return {**lim, "answer_cap": cap, "first": first, "growth_before_compaction": lim["compacts_above"] - first,
            "fits": fits}


def claude_window_limits(window: int, max_output: int = 32_000) -> dict[str, int]:
    """Where the pinned Claude Code compacts and where it refuses to send, told `window`
    (CLAUDE_CODE_MAX_CONTEXT_TOKENS) with answers capped at `max_output`
    (CLAUDE_CODE_MAX_OUTPUT_TOKENS; 32,000 unset). A limit below the first prompt: at every call."""
    planned = window - min(max_output, CLAUDE_OUTPUT_RESERVE_CAP)
    return {"window": window, "max_output": max_output, "planned": planned,
            "compacts_above": planned - CLAUDE_COMPACT_BUFFER, "refuses_above": planned - CLAUDE_BLOCKING_BUFFER}


def budget_line(first: int, window: int, label: str = "Claude Code on this window") -> str:
    """`claude_budget` as arithmetic a learner can check: window - answer reserve - 13,000 = the
    compaction line; the line less the first request is the room the session has to grow."""
    b = claude_budget(first, window)
    reserve = b["window"] - b["planned"]
    return (f"{label}: window {b['window']:,} - answer reserve {reserve:,} (cap {b['answer_cap']:,}) - 13,000 = "
            f"compaction line {b['compacts_above']:,}; the first request ({first:,}) leaves "
            f"{b['growth_before_compaction']:,} tokens of session before it compacts"
            + ("" if b["fits"] else " (too little: a bigger window, or fewer tools and a shorter system prompt)"))
