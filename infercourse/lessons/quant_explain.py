"""07's conclusions, written from the run's own table, never from an earlier run.

A sentence such as "bf16 decodes slower than float32 here" is true on one machine and false
on the next (one CPU lacks bfloat16 instructions, another has them). So every sentence that
reports what the run showed is produced here from `measure_methods`' table: rankings only
where `noise.compare` gave a verdict against an A/A rerun, ratios with their intervals,
quality differences against their ± 2 standard errors. Each function's wording follows its
numbers; tests feed synthetic tables both ways.
"""
from __future__ import annotations

import math
from pathlib import Path

__all__ = ["speed_class", "bytes_text", "speed_text", "bf16_text", "cpu_has_bf16", "memory_text",
           "quality_text", "explain", "method_regimes", "regime_text"]

BF16_FLAGS = ("avx512_bf16", "amx_bf16")   # x86 instructions that multiply bfloat16 directly


def speed_class(row) -> str:
    """"reference", "faster", "slower", "within noise" or "too few pairs", from the row's
    `decode_verdict` (`noise.compare` says "<winner> faster", "within noise" or "too few pairs")."""
    v = row["decode_verdict"]
    if v == "reference":
        return v
    if v == f"{row['format']} faster":
        return "faster"
    if v == f"{row['speedup_vs']} faster":
        return "slower"
    return "too few pairs" if v == "too few pairs" else "within noise"


def _ratio(row) -> str:
    lo, hi = row["decode_speedup_lo"], row["decode_speedup_hi"]
    iv = f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    return f"{row['format']} {row['decode_speedup']:.2f}×{iv}"


def bytes_text(df) -> str:
    """The range of weight bytes and the largest speed-up the bytes predict (HF formats)."""
    hf = df[df.speedup_vs == "fp32"].set_index("format")
    return (f"- **Bytes.** The transformers formats hold {hf.weight_bytes.min() / 1e6:.0f}–"
            f"{hf.weight_bytes.max() / 1e6:.0f} MB of weights (fp32: {hf.loc['fp32', 'weight_bytes'] / 1e6:.0f} MB); "
            f"their bytes predict up to {hf.bytes_speedup.max():.1f}× faster decoding than fp32.")


def speed_text(df) -> str:
    """Per runtime, which formats decoded faster than, slower than, or within noise of their
    reference, and which fell short of their bytes' prediction over the whole range measured."""
    out = []
    for ref, g in df.groupby("speedup_vs", sort=False):
        g = g[g.format != ref]
        if g.empty:
            continue
        first = g.iloc[0]
        classes = {c: [_ratio(r) for _, r in g.iterrows() if speed_class(r) == c]
                   for c in ("faster", "slower", "within noise", "too few pairs")}
        said = "; ".join(f"{c} than {ref}: {', '.join(v)}" if c in ("faster", "slower") else f"{c}: {', '.join(v)}"
                         for c, v in classes.items() if v)
        short = [r.format for _, r in g.iterrows() if r.decode_speedup_hi < r.bytes_speedup]
        out.append(f"- **Speed against {ref}** (decode tok/s, median paired ratio [range] over {int(first.repeats)} "
                   f"interleaved requests; A/A noise floor ±{first.decode_floor:.0%}): {said}. "
                   + (f"Below their bytes' prediction over the whole range: {', '.join(short)}."
                      if short else "None fell below its bytes' prediction over the whole range."))
    return "\n".join(out)


def cpu_has_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU lists bfloat16 multiply instructions; None where it cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), None)
    return None if flags is None else any(f in flags for f in BF16_FLAGS)


def bf16_text(df, has_bf16: bool | None) -> str:
    """What the bf16 row showed against fp32, and what this CPU's flags say about why."""
    rows = df[df.format == "bf16"]
    if rows.empty:
        return ""
    r = rows.iloc[0]
    cls = speed_class(r)
    cpu = {True: f"This CPU lists bfloat16 instructions ({'/'.join(BF16_FLAGS)}), so the multiply itself can "
                 f"run in bfloat16.",
           False: f"This CPU lists no bfloat16 instructions ({'/'.join(BF16_FLAGS)}): each bfloat16 weight is "
                  f"widened to float32 before the multiply, work that float32 weights skip.",
           None: "Whether this CPU has bfloat16 instructions could not be read here."}[has_bf16]
    said = {"faster": "decoded faster than fp32: halving the bytes paid off",
            "slower": "decoded slower than fp32 despite half the bytes",
            "within noise": "decoded within noise of fp32: half the bytes bought no speed measurable here",
            "too few pairs": "was measured on too few pairs to rank against fp32, either way"}[cls]
    return f"**bf16 on this machine.** bf16 {said} ({_ratio(r)}). {cpu}"


def memory_text(df) -> str:
    """Resident growth of each transformers format (each loaded in a fresh process) against
    its weight bytes."""
    hf = df[(df.speedup_vs == "fp32") & df.rss_bytes.notna()].set_index("format")
    if hf.empty:
        return "- **Memory.** Not measured in fresh processes this run: the column is not compared."
    ratio = hf.rss_bytes / hf.weight_bytes
    fat = ratio.idxmax()
    head = (f"- **Memory** (each format loaded in a fresh process). {fat} grew resident memory by "
            f"{hf.loc[fat, 'rss_bytes'] / 1e6:.0f} MB for {hf.loc[fat, 'weight_bytes'] / 1e6:.0f} MB of weights "
            f"({ratio[fat]:.2f}×), the most relative to its bytes")
    if ratio[fat] > 1.1:
        return head + ": a load keeps more than the packed weights (a float copy, buffers, the allocator's pools)."
    return head + ": every format's growth stayed within 10% of its weight bytes."


def quality_text(df) -> str:
    """Which formats' NLL stayed within ± 2 s.e. of fp32's, which lost, and the caveat of
    the reference: fp32 is the Q4_1 model dequantized."""
    q = df[(df.format != "fp32") & df.nll_diff.notna()].set_index("format")
    within = [f for f in q.index if abs(q.loc[f, "nll_diff"]) <= q.loc[f, "nll_diff_2se"]]
    worse = [f for f in q.index if q.loc[f, "nll_diff"] > q.loc[f, "nll_diff_2se"]]
    better = [f for f in q.index if q.loc[f, "nll_diff"] < -q.loc[f, "nll_diff_2se"]]
    parts = [f"within ± 2 s.e. of fp32: {', '.join(within)}" if within else "",
             f"measurably worse: {', '.join(worse)}" if worse else "",
             f"measurably better: {', '.join(better)}" if better else ""]
    out = "- **Quality** (NLL per token against fp32): " + "; ".join(p for p in parts if p) + "."
    if len(q):
        lossy = q.nll_diff.idxmax()
        out += (f" The largest difference is {lossy}'s: {q.loc[lossy, 'nll_diff']:+.3f} ± "
                f"{q.loc[lossy, 'nll_diff_2se']:.3f} nats a token, top-1 agreement {q.loc[lossy, 'top1_agreement']:.0%}.")
    if {"awq-int4", "torchao-int4"} <= set(q.index):
        a, t = q.loc["awq-int4"], q.loc["torchao-int4"]
        d, band = a.nll_diff - t.nll_diff, math.hypot(a.nll_diff_2se, t.nll_diff_2se)
        how = ("less than" if d < 0 else "more than") if abs(d) > band else "within noise of"
        out += (f" Calibrated AWQ lost {how} round-to-nearest torchao-int4 ({d:+.3f} nats, "
                f"combined ± {band:.3f}; the same int4 format and float type elsewhere).")
    return out + (" fp32 is the shipped Q4_1 model dequantized, so its weights already sit on a 4-bit grid: "
                  "a 4-bit row is a re-rounding onto another grid, and a loss near zero may mean it landed "
                  "on the same one, not that 4 bits cost nothing.")


def explain(df, has_bf16: bool | None = None) -> str:
    """The Explain cell's bullets and the bf16 paragraph, all from `df`."""
    return "\n".join([bytes_text(df), speed_text(df), memory_text(df), quality_text(df), "",
                      bf16_text(df, has_bf16)])


# -- what bound each format's decode: the run's shares of its roofs (measure.stream_regime) ------
def method_regimes(df, n_params: float, bandwidth_gbs: float, *, f32_gflops: float | None = None,
                   f32_source: str = "", bandwidth_source: str = "") -> dict:
    """{format: stream_regime.PhaseRegime} of every row's decode: its weight bytes a token at its
    measured rate against the probed bandwidth, and 2 x params FLOPs against a compute roof
    of its own data type, which only the float32 reference has here (a float32 matmul on the
    same threads); the quantized rows have no such probe, and their label says so.

    Args:
        df: `measure_methods` rows (format, weight_bytes, decode_tok_per_s).
        n_params: the model's parameters; bandwidth_gbs: probed on the engines' threads.
        f32_gflops, f32_source: the float32 matmul roof and where it came from.
        bandwidth_source: how the bandwidth was probed, for the sentence.
    """
    from infercourse.measure import stream_regime
    out = {}
    for r in df[df["decode_tok_per_s"] > 0].itertuples():     # a row that did not run has no rate
        f32 = r.format == "fp32"
        out[r.format] = stream_regime.phase_regime(
            f"{r.format} decode", r.decode_tok_per_s, bytes_per_token=r.weight_bytes, flops_per_token=2 * n_params,
            bandwidth_gbs=bandwidth_gbs, compute_gflops=f32_gflops if f32 else None,
            compute_source=f32_source if f32 else "no probe runs this format's kernel", bandwidth_source=bandwidth_source)
    return out


def regime_text(regimes: dict) -> str:
    """One line per format (its label and shares), then the rows that reached half their
    bandwidth roof: where fewer bytes could have bought speed."""
    from infercourse.measure.regime import NEAR_ROOF
    lines = [f"- **{name}**: {r.rate:.1f} tok/s, {r.short}." for name, r in regimes.items()]
    bound = [name for name, r in regimes.items() if r.label == "bandwidth-bound"]
    lines.append(f"- Reached {NEAR_ROOF:.0%} of the bandwidth roof: " + (", ".join(bound) if bound else
                 "**no format**: none of them was held by memory here, so bytes alone could not set their speed")
                 + ". One speed per format against one probe: each label is a reading.")
    return "\n".join(lines)
