"""Decoding with multi-token-prediction heads: the heads as a drafter, at a chosen length.

Trained heads (`lessons.mtp`) guess the tokens after the next one from the hidden state the
verifying pass has just computed, so drafting costs a few small matrix products, not a
second model. `heads_drafter` turns them into a drafter for `draft_verify.speculative_greedy`
(optionally proposing only guesses the heads are confident in, as EAGLE-2 and transformers'
`assistant_confidence_threshold` do); `draft_length_run` keeps only the first guesses, to
see what each further head adds.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["heads_drafter", "draft_length_run"]


def heads_drafter(heads, min_prob: float = 0.0, max_draft: int | None = None):
    """A `speculative_greedy` drafter: the heads' guesses from the verified hidden state,
    only as far as each guess has probability >= `min_prob` (0: always all heads), and at
    most the first `max_draft` of them (None: every head; 1: draft length one)."""
    return lambda seq, h: heads.draft(h, seq[-1], min_prob)[:max_draft]


def draft_length_run(model, ids: Sequence[int], heads, draft_len: int, max_new: int, *, compare,
                     repeats: int = 1):
    """Self-speculative decoding that keeps only the first `draft_len` guesses of `heads`,
    beside plain decoding (`draft_verify.compare_drafters`, plain first: the reference).
    Returns the heads' row: `tokens_per_pass`, `speed_up_cpu` (with `repeats` >= 2, judged
    against plain decoding's A/A rerun in `verdict`), `identical`...

    Args:
        model: the frozen base model; ids: prompt token ids; heads: trained heads.
        draft_len: guesses proposed per pass (1 .. heads.n_heads).
        compare: `draft_verify.compare_drafters` (passed in: a lesson never imports another).
        max_new: tokens to generate; repeats: interleaved runs per drafter.
    """
    if not 1 <= draft_len <= heads.n_heads:
        raise ValueError(f"draft_len must be 1..{heads.n_heads} (the heads there are), got {draft_len}")
    drafters = {"plain (no drafts)": lambda seq, h: [],
                f"first {draft_len} head(s)": heads_drafter(heads, max_draft=draft_len)}
    return compare(model, ids, max_new, drafters, repeats=repeats).set_index("drafter").iloc[-1]
