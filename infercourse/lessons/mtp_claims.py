"""What a multi-token-prediction run showed, in words written from its own tables.

Notebook 09's markdown explains mechanisms (why a chained module has more to go on than a
blind head, why verification cost decides the speed-up); whether the heads beat their
yardstick, which kind guessed better, what shape the pass cost took and how each drafter's
verdict came out can only come from the run. Each function reads `mtp.heldout_acceptance`,
`draft_verify.compare_drafters` and `draft_verify.pass_cost` tables and returns text that
flips when the numbers flip (`measure.claims` holds the sentence rules they share).
"""
from __future__ import annotations

from infercourse.measure import claims

__all__ = ["versus_yardstick", "findings"]


def versus_yardstick(share: float, yardstick: float, positions: int) -> str:
    """A head's held-out share right against its yardstick (always the commonest token), in
    words (`claims.share_vs_yardstick`): "clear of" only beyond 2 SE allowing for correlated
    neighbouring positions; between that and 2 independent SEs, both readings are given."""
    return claims.share_vs_yardstick(share, yardstick, positions)


def findings(acc, runs, cost) -> list[str]:
    """Bullets on what this run showed, from its tables: held-out acceptance of each kind
    against its yardstick and against the other kind, the pass-cost shape, and each heads
    drafter's verdict on the open prompt. Every comparison flips with the numbers."""
    last = acc.groupby(level="kind")["tokens_per_pass"].last()
    kinds = list(last.index)
    out = [claims.marginal_cost_sentence(list(cost.index), cost["cost_vs_1"], list(cost["verdict"]))]
    if len(kinds) == 2:
        a, b = kinds
        t2 = acc.groupby(level="kind")["head_alone"].first()
        n = int(acc.groupby(level="kind")["positions"].first().min())
        out.append(f"t+2 guesses right: {a} {t2[a]:.1%}, {b} {t2[b]:.1%}: {b} is "
                   + claims.share_vs_yardstick(t2[b], t2[a], n, name=a) + ".")
    for r in runs[runs.drafter.str.contains("heads") & (runs.prompt == "open")].itertuples():
        out.append(f"{r.drafter}, open prompt: CPU-time speed-up {r.speed_up_cpu:.2f}× plain decoding "
                   f"({claims.interval_word(bool(getattr(r, 'speed_up_cpu_exact', False)))} "
                   f"[{r.speed_up_cpu_lo:.2f}, {r.speed_up_cpu_hi:.2f}]): {r.verdict}.")
    return out
