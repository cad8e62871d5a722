"""A cold prefill forecast for an agent's first request, from a curve measured on the server.

`doctor agent` used to divide the first request by one short probe's prefill rate ("an
optimistic bound"): 34 s forecast where notebook 20 then measured 80 s for Claude Code's
10,661 tokens, because the rate falls with length once attention's n² term counts
(`measure.prefill_curve`). Here the doctor prefills one cold prompt (a new random head) grown
in three steps, each step's prompt the one before plus as much again: the server's prefix
cache then evaluates only the new tokens of each step, so the three points cost one prefill of
the longest (notebook 20's four doctors' servers: 2,048 tokens each, not 3,584). It reads the
server's own prefill time for each step (`timings.prompt_ms`, no HTTP in it), adds the step
before's time for the cached part (`grown_point`), fits time = a + b·n + c·n² and forecasts
the agent's first request from the fit, saying when that is an extrapolation past the longest
probe.

Where the probes cannot be made (no timings: a server other than llama-server), the check
falls back to the short probe's rate and says it is a lower bound. Pure except
`probe_curve`, which sends the three requests (loopback, by the doctor's own guard).
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx

from infercourse.measure.prefill_curve import fit_prefill, predict_prefill_s

__all__ = ["cold_text", "curve_lengths", "grown_point", "probe_curve", "cold_forecast", "forecast_against_capture"]

_TEXT = "The quick brown fox reads the build log, edits one file and runs the tests again. "


def cold_text(n: int, head: str | None = None) -> str:
    """About `n` tokens of text behind `head` (None: a new random one, so no server has any of
    it cached: the doctors' probes, a cold prefill every time; one head for several lengths: each
    text begins with the shorter ones)."""
    return (head or uuid.uuid4().hex) + " " + _TEXT * max(1, n // 18)


def grown_point(points: list[tuple[int, float]], prompt_tokens: int, evaluated: int,
                seconds: float) -> tuple[int, float]:
    """The curve's point for a step that prefilled `evaluated` of its `prompt_tokens` in
    `seconds`: the cold prefill of the whole prompt. The cached part is the step before's
    prompt (less its last few tokens, the template's turn end), priced at that point's time;
    for the first step (no point yet: a few template tokens another request left cached) at the
    step's own rate. A server that cached nothing gives the step's own time."""
    cached = max(0, prompt_tokens - evaluated)
    if not cached:
        return evaluated, seconds
    if not points:
        return prompt_tokens, seconds * prompt_tokens / max(1, evaluated)
    n0, s0 = points[-1]
    return prompt_tokens, s0 * min(cached, n0) / n0 + seconds


def curve_lengths(n_ctx: int | None, longest: int = 2048) -> list[int]:
    """Three probe lengths, each twice the one before, the longest at most a third of the
    slot's window and `longest` (a few seconds on a small model)."""
    top = min(longest, (n_ctx or 3 * longest) // 3)
    return [max(16, top // 4), max(32, top // 2), max(64, top)]


def probe_curve(url: str, model: str, lengths: list[int], timeout_s: float = 300.0) -> list[tuple[int, float]]:
    """(prompt tokens, seconds of a cold prefill of them) at each of `lengths`: one cold prompt
    (a new random head) grown step by step, each step's prompt beginning with the step before's,
    one /v1/chat/completions call per step (`grown_point` prices the cached part, so a server
    that reuses the step before evaluates only the new tokens). Steps without timings are left out."""
    head, points = uuid.uuid4().hex, []
    for n in sorted(lengths):
        r = httpx.post(url.rstrip("/") + "/v1/chat/completions", timeout=timeout_s,
                       json={"model": model, "max_tokens": 1,
                             "messages": [{"role": "user", "content": cold_text(n, head)}]})
        doc = r.json() if r.status_code == 200 else {}
        t = doc.get("timings") or {}
        if t.get("prompt_n") and t.get("prompt_ms"):
            total = int((doc.get("usage") or {}).get("prompt_tokens") or t["prompt_n"])
            points.append(grown_point(points, total, int(t["prompt_n"]), float(t["prompt_ms"]) / 1e3))
    return points


def cold_forecast(first: int, ev: dict[str, Any]) -> tuple[float, str] | None:
    """(seconds, how it was forecast) of a cold prefill of `first` tokens: from the fitted
    curve when three probes were measured (`ev["prefill_points"]`), else from the short
    probe's rate (`ev["prefill_tok_per_s"]`, a lower bound: the rate falls with length);
    None without either."""
    points = ev.get("prefill_points") or []
    if len(points) >= 3:
        fit = fit_prefill([n for n, _ in points], [s for _, s in points])
        p = predict_prefill_s(first, fit)
        how = (f"from a + b·n + c·n² fitted to {len(points)} cold prefills on this server "
               f"({p.tok_per_s:.0f} tok/s at that length; {p.note})")
        if first > 2 * fit.n_max:   # far past the probes (a small window): the longest probe's rate as the other end
            how += f"; at the longest probe's own rate it would be {first * fit.time_s(fit.n_max) / fit.n_max:.0f} s"
        return p.seconds, how
    rate = ev.get("prefill_tok_per_s")
    if rate:
        return first / rate, (f"{first} tokens at the short probe's {rate:.0f} tok/s: a lower bound, the rate "
                              "falls as the prompt grows")
    return None


def forecast_against_capture(ev: dict[str, Any], capture: str | Path) -> list[str]:
    """The forecast beside what a lab run measured: the capture's first answered call that found
    nothing cached (its prompt tokens, its seconds to first token) and what the same fit forecasts
    for that many tokens. One line, or none where the capture holds no such call or the probe no rate.
    The measured call ran on the lab's own server (the same model and machine; its window may differ)."""
    from infercourse.ops.agent_lab import calls_table
    calls = calls_table(capture)
    if not {"status", "cached_tokens", "prompt_tokens", "ttft_s"} <= set(calls):
        return []
    cold = calls[(calls["status"] == "ok") & (calls["cached_tokens"] == 0) & calls["ttft_s"].notna()]
    if not len(cold):
        return []
    n, s = int(cold["prompt_tokens"].iloc[0]), float(cold["ttft_s"].iloc[0])
    fc = cold_forecast(n, ev)
    if not fc:
        return []
    return [f"forecast against this run's capture: its cold call of {n:,} tokens waited {s:.1f} s for its first token "
            f"on the lab's server; the probes above forecast {fc[0]:.0f} s for it ({fc[0] / s:.2f}x)"]
