"""What the MoE run showed, in sentences computed from its numbers, and the card arithmetic.

`lessons.moe` measures; this module judges and words it. Every sentence below flips with the
numbers: which model decoded faster (a permutation test against the MoE's A/A rerun), which
bytes the memory followed (total or active), whether a measured speed beat the ceiling of the
total bytes (proof that not every byte is read per token), how many experts a batched step
really read against the uniform expectation, and whether batching moved the MoE's step cost the
way bytes predict or the way arithmetic does. `card_arithmetic` is labelled as what it is:
arithmetic for a model this machine does not run.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import pandas as pd

from infercourse.measure import claims, noise

__all__ = ["batch1_comparisons", "speed_sentence", "ceiling_sentence", "memory_sentence", "routing_sentence",
           "batch_sentence", "card_arithmetic"]

_MB = 1e6


def batch1_comparisons(trials: pd.DataFrame) -> dict[str, Any]:
    """The MoE's batch-1 step against each other model's, judged with its A/A rerun as a second
    reference in every block (`noise.compare`; times, so lower is better).

    Returns {"floor": NoiseFloor, "<model>": Comparison (labels (ref, model))}.

    Args:
        trials: `lessons.moe.step_trials` rows (its attrs name the reference and A/A arms).
    """
    vals, ref, aa = trials.attrs["values"], trials.attrs["ref"], trials.attrs["aa"]
    a = vals[f"{ref}@1"]
    floor = noise.noise_floor(a, vals[aa])
    out: dict[str, Any] = {"floor": floor}
    for arm, v in vals.items():
        model = arm.split("@")[0]
        if arm.endswith("@1") and model != ref:
            out[model] = noise.compare(a, v, floor, higher_is_better=False, labels=(ref, model))
    return out


def speed_sentence(comps: Mapping[str, Any], sizes: pd.DataFrame) -> str:
    """Batch-1 decode: the MoE against the wide model (same total bytes) and the dense one,
    each verdict quoted, and what the bytes predicted for each ratio.

    Args:
        comps: `batch1_comparisons`; sizes: `lessons.moe.size_table`.
    """
    moe = sizes.loc["moe"]
    parts = []
    for other in ("wide", "dense"):
        if other not in comps:
            continue
        c, o = comps[other], sizes.loc[other]
        pred = o["active_bytes"] / moe["active_bytes"]     # step time other ÷ moe, if bytes set it
        head = claims.verdict_sentence(c, f"decode step time at batch 1, {other} ÷ moe")
        parts.append(f"{head} Bytes read per token predict {pred:.2f}× ({o['active_bytes'] / _MB:.0f} MB ÷ "
                     f"{moe['active_bytes'] / _MB:.0f} MB).")
    cw = comps.get("wide")
    if cw is not None and cw.decided:
        if cw.verdict == "moe faster":
            parts.append("The MoE holds as many bytes as the wide model and decoded faster: single-stream speed "
                         "followed the bytes it **reads** (active), not the bytes it **holds** (total).")
        else:
            parts.append("The wide model, which reads every byte the MoE holds, decoded faster than the MoE here: "
                         "this run does not show the active-bytes advantage (look at the noise and the threads).")
    elif cw is not None:
        parts.append("This run cannot rank the MoE against the wide model, so it does not show that speed "
                     "follows the active bytes; more repeats, or a quieter machine, may.")
    return " ".join(parts)


def ceiling_sentence(sizes: pd.DataFrame, moe_tok_per_s: float, bandwidth_gbs: float,
                     llc_bytes: int | None | str = "this machine") -> str:
    """The MoE's measured batch-1 decode rate against its two bandwidth ceilings: bandwidth ÷
    total bytes (if every byte were read per token) and bandwidth ÷ active bytes. A rate above
    the total-bytes ceiling proves fewer bytes came from memory only where the file cannot sit
    in the CPU's last-level cache; where it fits, its bytes may come from the cache, faster than
    the probed memory, and the rate cannot tell the two ceilings apart.

    Args:
        sizes: `size_table` with ceilings (its `bandwidth_gbs` given).
        moe_tok_per_s: the measured rate (1 / median step at batch 1).
        bandwidth_gbs: the bandwidth the ceilings used.
        llc_bytes: the last-level cache (None: unknown; default: read it here,
            `hardware.last_level_cache_bytes`).
    """
    if llc_bytes == "this machine":
        from infercourse.measure.hardware import last_level_cache_bytes
        llc_bytes = last_level_cache_bytes()
    m = sizes.loc["moe"]
    tot, act = m["ceiling_total_tok_per_s"], m["ceiling_active_tok_per_s"]
    head = (f"At {bandwidth_gbs:.3g} GB/s the MoE's ceilings are {tot:.3g} tok/s from its total bytes "
            f"({m['total_bytes'] / _MB:.0f} MB) and {act:.3g} tok/s from its active bytes "
            f"({m['active_bytes'] / _MB:.0f} MB); it decoded at {moe_tok_per_s:.3g} tok/s, "
            f"{moe_tok_per_s / act:.0%} of the active ceiling")
    if moe_tok_per_s > tot and llc_bytes and m["total_bytes"] <= llc_bytes:
        return (head + f", **above** the total-bytes ceiling ({moe_tok_per_s / tot:.2f}×), but all {m['total_bytes'] / _MB:.0f} "
                f"MB fit in this CPU's last-level cache ({llc_bytes / _MB:.0f} MB): a token may have read every byte from "
                "the cache, faster than the probed memory, so the rate cannot tell which ceiling applies.")
    if moe_tok_per_s > tot:
        where = (f" (and, at {m['total_bytes'] / _MB:.0f} MB, more than this CPU's {llc_bytes / _MB:.0f} MB last-level "
                 "cache holds)" if llc_bytes else " (this machine names no cache size to rule a cache out)")
        return (head + f", **above** the total-bytes ceiling ({moe_tok_per_s / tot:.2f}×): a token cannot have "
                f"read every byte the file holds from memory{where}, so the active ceiling is the one that applies.")
    return (head + f", below both ceilings ({moe_tok_per_s / tot:.0%} of the total one): the rate alone cannot show "
            "that only the active bytes are read (something else, arithmetic or threads, sets the pace).")


def memory_sentence(sizes: pd.DataFrame, rss: Mapping[str, Mapping[str, float]]) -> str:
    """Resident memory each load added (fresh processes), and the MoE's extra over the dense
    model against two predictions: its extra total bytes (every expert resident) or its extra
    active bytes. Differences, so that what every load adds alike (KV cache, buffers) cancels.

    Args:
        sizes: `size_table`; rss: {model: `rss_fresh` result}.
    """
    grow = {m: float(r["after_eval_bytes"]) for m, r in rss.items()}
    moe, dense = sizes.loc["moe"], sizes.loc["dense"]
    extra = grow["moe"] - grow["dense"]
    by_total = moe["total_bytes"] - dense["total_bytes"]
    by_active = moe["active_bytes"] - dense["total_bytes"]
    nums = ", ".join(f"{m} {g / _MB:.0f} MB (file {sizes.loc[m, 'file_bytes'] / _MB:.0f} MB)" for m, g in grow.items())
    head = (f"Resident memory each load added: {nums}. The MoE's load added {extra / _MB:.0f} MB more than the "
            f"dense model's; its total bytes predict {by_total / _MB:.0f} MB more, its active bytes "
            f"{by_active / _MB:.0f} MB")
    if abs(extra - by_total) < abs(extra - by_active):
        return head + ": memory followed the **total** parameters: every expert is resident, used or not."
    return (head + ": memory followed the **active** parameters here, so not every expert was resident "
            "(a loader that maps the file lazily, or memory pressure, left unused experts on disk).")


def routing_sentence(routing: pd.DataFrame, tol: float = 0.1) -> str:
    """Experts a batched step read (observed in llama.cpp) against the uniform expectation
    E·(1 − (1 − k/E)^N), at the largest batch, and how evenly the experts were picked.

    Args:
        routing: `lessons.moe.observed_routing`; tol: relative gap called "as uniform".
    """
    last = routing.iloc[-1]
    obs, uni, n = float(last["experts_read"]), float(last["experts_read_uniform"]), int(last["batch"])
    e = int(last["n_expert"])
    share = routing.attrs.get("expert_share")
    spread = (f" Picks per expert ranged from {min(share):.0%} to {max(share):.0%} of all (even: {1 / e:.0%})."
              if share else "")
    head = (f"At batch {n} a layer read {obs:.2f} of {e} experts per step on average; uniform, independent "
            f"routing predicts {uni:.2f}")
    if abs(obs / uni - 1) <= tol:
        return head + f": **as uniform** (within {tol:.0%}), so the formula is a fair guide for this router." + spread
    if obs < uni:
        return (head + f": **fewer** ({obs / uni:.0%} of it): tokens decoded together picked overlapping experts "
                "(their hidden states are alike, and the router is a function of them), so a batched step read "
                "less than the formula says." + spread)
    return (head + f": **more** ({obs / uni:.0%} of it): the sequences avoided each other's experts more than "
            "chance would." + spread)


def batch_sentence(table: pd.DataFrame, floor: float | None) -> str:
    """Did batching raise the MoE's step cost over the dense model's as bytes predict (it reads
    more distinct experts per step) or stay at the arithmetic ratio (k experts per token,
    whatever N)? Judged at the largest batch, against the A/A noise band ±floor.

    Args:
        table: `lessons.moe.batch_table`; floor: the A/A floor of the MoE's batch-1 arm.
    """
    t = table.dropna(subset=["moe_over_dense"])
    first, last = t.iloc[0], t.iloc[-1]
    n0, n = int(t.index[0]), int(t.index[-1])
    m, b, a = float(last["moe_over_dense"]), float(last["bytes_model"]), float(last["arithmetic_model"])
    head = (f"MoE step ÷ dense step: {float(first['moe_over_dense']):.2f}× at batch {n0}, {m:.2f}× at batch {n} "
            f"(the MoE read {float(last['experts_read']):.2f} experts per layer there). At batch {n} bytes predict "
            f"{b:.2f}×, arithmetic (active ÷ dense parameters, per token) {a:.2f}×")
    band = math.log1p(floor) if floor is not None and math.isfinite(floor) else 0.0
    if abs(math.log(b / a)) <= band:
        return head + (": the two predictions lie within this run's A/A noise of each other, so it cannot say "
                       "which applies.")
    d_b, d_a = abs(math.log(m / b)), abs(math.log(m / a))
    if d_b <= band and d_a <= band:
        return head + ": the measurement lies within noise of both, so this run cannot say which applies."
    between = min(a, b) < m < max(a, b)
    if d_b < d_a:
        return (head + ": the measurement is closer to **bytes**" + (
            ", between the two: the step paid mostly for the distinct experts it read, partly per token"
            if between else ": a batched MoE step paid for every expert any sequence picked")
            + ", so batching eroded the advantage of reading only k experts per token.")
    return (head + ": the measurement is closer to **arithmetic**" + (
        ", between the two: the step paid mostly per token and expert (compute), partly for the extra experts read"
        if between else ": the step paid per token and expert (compute-bound)")
        + ", so here reading more distinct experts in a batch cost less than bytes predict.")


def card_arithmetic(total_params: float = 30e9, active_params: float = 3e9, bits: float = 4.5,
                    bandwidth_gbs: float = 800.0, *, n_expert: int | None = 128, n_used: int | None = 8,
                    batches: Sequence[int] = (1, 8, 32)) -> dict[str, Any]:
    """Printed arithmetic, not a measurement: what a model this machine does not run holds and
    reads. Memory = total × bits ÷ 8; a token reads active × bits ÷ 8, so single-stream decode
    ≤ bandwidth ÷ that. With E and k, a step of N tokens reads the shared weights plus
    E·(1 − (1 − k/E)^N) experts, from expert = (total − active) ÷ (E − k) and shared =
    active − k × expert (uniform routing assumed; the KV cache left out).

    Returns {"text": the lines, labelled, and the numbers}.

    Args:
        total_params, active_params: e.g. 30e9 and 3e9 for a 30B-A3B model.
        bits: bits per weight of the file (Q4_K_M ≈ 4.5-4.9 with its scales).
        bandwidth_gbs: memory bandwidth (Mac Studio M2/M3 Ultra: ~800 GB/s).
        n_expert, n_used: E and k (Qwen3-30B-A3B: 128 and 8); None skips the batch lines.
        batches: batch sizes for the batch lines.
    """
    if not 0 < active_params <= total_params:
        raise ValueError(f"need 0 < active <= total parameters, got {active_params:g} and {total_params:g}")
    gb = bits / 8 / 1e9
    total_gb, active_gb = total_params * gb, active_params * gb
    out: dict[str, Any] = {"total_gb": total_gb, "active_gb": active_gb,
                           "ceiling_active_tok_per_s": bandwidth_gbs / active_gb,
                           "ceiling_total_tok_per_s": bandwidth_gbs / total_gb}
    lines = ["Arithmetic, not a measurement (nothing below was run):",
             f"- memory holds the total: {total_params / 1e9:.3g} B × {bits:g} bits ÷ 8 = {total_gb:.3g} GB",
             f"- a token reads the active part: {active_params / 1e9:.3g} B × {bits:g} ÷ 8 = {active_gb:.3g} GB",
             f"- single-stream decode ≤ {bandwidth_gbs:g} GB/s ÷ {active_gb:.3g} GB = "
             f"{out['ceiling_active_tok_per_s']:.0f} tok/s (a dense model of the same total: "
             f"{bandwidth_gbs:g} ÷ {total_gb:.3g} = {out['ceiling_total_tok_per_s']:.0f} tok/s)"]
    if n_expert and n_used and n_used < n_expert:
        expert = (total_params - active_params) / (n_expert - n_used)
        shared = active_params - n_used * expert
        rows = []
        for n in batches:
            d = n_expert * (1 - (1 - n_used / n_expert) ** n)
            step_gb = (shared + d * expert) * gb
            rows.append({"batch": n, "experts_read": d, "step_gb": step_gb,
                         "agg_ceiling_tok_per_s": n * bandwidth_gbs / step_gb})
            lines.append(f"- batch {n}: {n_expert} × (1 − (1 − {n_used}/{n_expert})^{n}) = {d:.1f} experts "
                         f"per layer read per step, {step_gb:.3g} GB, so ≤ {n} × {bandwidth_gbs:g} ÷ "
                         f"{step_gb:.3g} = "
                         f"{rows[-1]['agg_ceiling_tok_per_s']:.0f} tok/s in all")
        out["batches"] = rows
    out["text"] = "\n".join(lines)
    return out
