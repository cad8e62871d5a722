"""What a speculative-decoding run showed, in words written from its own verdicts and counts.

Notebook 08's markdown explains mechanisms (why a copied answer lets prompt lookup hit, why
a same-size draft cannot pay); which of them showed on this machine can only come from the
run. Each function here reads the rows of `speculative.compare_speculation`,
`spec_server.server_speculation` or `draft_verify.compare_drafters` and returns markdown
that flips when the numbers flip: a difference inside the A/A noise is called that, never a
gain or a loss, and too few pairs to test is said as such.

Each speed-up keeps the name of its clock: `speed_up_e2e` (whole requests, in process),
`speed_up_decode` (llama-server's own decode rate), `speed_up_cpu` (the hand loop's CPU time).
"""
from __future__ import annotations

from typing import Mapping

from infercourse.measure.claims import interval_word
from infercourse.measure.noise import TOO_FEW, band_text

__all__ = ["outcome", "speedup_text", "proposals_sentence", "explain_speculation", "loop_verdicts", "helps_guess_text",
           "plot_speedup", "baseline_regimes", "regime_text"]


def outcome(verdict: str, config: str, baseline: str) -> str:
    """A `noise.compare` verdict on `config` against `baseline`, as a phrase that says which
    way, or that the run cannot tell."""
    if verdict == f"{config} faster":
        return f"faster than {baseline}, beyond the A/A noise"
    if verdict == f"{baseline} faster":
        return f"slower than {baseline}, beyond the A/A noise"
    if verdict == "within noise":
        return f"within noise of {baseline}: this run cannot rank them"
    if verdict == TOO_FEW:
        return f"too few pairs to rank against {baseline}: no verdict either way"
    return verdict


def speedup_text(r, col: str = "speed_up_e2e") -> str:
    """"1.23× (range [1.01, 1.40] of 4 pairs)": the median paired speed-up `col` of row `r`
    with its bracket (`col`_lo, _hi), called a range when too few pairs make it one
    (`claims.interval_word`)."""
    exact, n = bool(getattr(r, f"{col}_exact", False)), getattr(r, f"{col}_pairs", None)
    pairs = f" of {int(n)} pairs" if n is not None and n == n else ""
    return (f"{getattr(r, col):.2f}× ({interval_word(exact)} [{getattr(r, f'{col}_lo'):.2f}, "
            f"{getattr(r, f'{col}_hi'):.2f}]{pairs})")


def proposals_sentence(r) -> str:
    """How often prompt lookup proposed and how much of it was right, from the replayed
    counts of one `compare_speculation` row: proposals are "rare" when under half the
    target passes had one ("frequent" over half), and "mostly wrong" when under half the
    proposed tokens were accepted ("mostly right" over half). Empty for a row without lookup
    counts."""
    steps, with_p = getattr(r, "lookup_steps", float("nan")), getattr(r, "lookup_proposing_steps", float("nan"))
    if not (steps == steps and steps > 0):
        return ""
    proposed, accepted = int(r.lookup_proposed), int(r.lookup_accepted)
    head = (f"**{r.config}** / {r.prompt}: proposals in {int(with_p)} of {int(steps)} target passes, "
            f"{proposed} tokens proposed, {accepted} accepted")
    if proposed == 0:
        return head + ": the lookup never found its key earlier in the context, so nothing was guessed."
    often = "were **rare**" if 2 * with_p < steps else "were **frequent**" if 2 * with_p > steps else \
        "came in **half** the passes"
    right = "**mostly wrong**" if 2 * accepted < proposed else "**mostly right**" if 2 * accepted > proposed else \
        "**right half the time**"
    return head + f" ({accepted / proposed:.0%}): proposals {often} and {right}."


def explain_speculation(df, baselines: Mapping[str, str], server_df=None, *, self_draft: str | None = None,
                        hit: float = 1.5) -> str:
    """The Explain text of `compare_speculation` (and `spec_server.server_speculation`),
    written from the verdicts: one line per configuration and prompt, then where the
    drafters hit (at least `hit` tokens per target pass) and what that bought, what the
    lookup proposed and how much was right (`proposals_sentence`), and the self draft's
    outcome. A difference inside the A/A noise is called that, never a gain or a loss.

    Args:
        df: `compare_speculation` rows; baselines: {config: its baseline}.
        server_df: `server_speculation` rows (no A/A rerun there: not judged, and said so).
        self_draft: the config whose drafter is the target itself (every guess right).
        hit: tokens per pass from which a drafter counts as hitting.
    """
    tps = df["lookup_tokens_per_step"].fillna(df["chunk_tokens_per_step"]) \
        if "lookup_tokens_per_step" in df else df["chunk_tokens_per_step"]
    acc = df["lookup_acceptance"].fillna(df["draft_acceptance"]) if "lookup_acceptance" in df else df["draft_acceptance"]
    lines, hits, misses = [], [], []
    for i, r in df.iterrows():
        b = baselines[r.config]
        if r.config == b:
            continue
        what = outcome(r.verdict, r.config, b)
        a = f"{acc[i]:.0%} accepted" if acc[i] == acc[i] else "acceptance not counted"
        band = band_text(r.noise_floor) if r.noise_floor == r.noise_floor else "none"
        lines.append(f"- **{r.config}** / {r.prompt}: {a}, {tps[i]:.2f} tokens/pass, end-to-end speed-up "
                     f"{speedup_text(r)}, noise band {band}: **{what}**")
        (hits if tps[i] >= hit else misses).append(f"{r.config} / {r.prompt}: {what.split(',')[0].split(':')[0]}")
    out = "\n".join(lines)
    judged = df[df["config"] != df["config"].map(baselines)]
    if "fewest_pairs" in df and len(judged) and (judged["speed_up_e2e_pairs"] < judged["fewest_pairs"]).any():
        n, need = int(judged["speed_up_e2e_pairs"].min()), int(judged["fewest_pairs"].max())
        out += (f"\n\nWith {n} pairs the permutation test can never pass (it needs at least {need}): those rows "
                "are unranked by construction, whatever their medians, not alike. Raise `REPEATS` to rank anything.")
    out += (f"\n\nWhere the guesses hit (≥ {hit:g} tokens per target pass): {'; '.join(hits) or 'nowhere'}. "
            f"Where they rarely did: {'; '.join(misses) or 'nowhere'}.")
    for _, r in df[df["config"] == self_draft].iterrows():
        out += (f" The self draft on the {r.prompt} prompt (every guess right by construction): "
                f"{outcome(r.verdict, r.config, baselines[r.config])}.")
    said = [proposals_sentence(r) for r in df.itertuples()]
    if any(said):
        out += "\n\nWhat prompt lookup proposed (replayed over each output):\n" + "\n".join(f"- {x}" for x in said if x)
    if server_df is not None and len(server_df):
        base = server_df["config"].iloc[0]
        rows = [f"{r.config} / {r.prompt}: {r.draft_n_accepted}/{r.draft_n} drafts accepted, decode speed-up "
                f"{r.speed_up_decode:.2f}× {base}" for r in server_df.itertuples() if r.config != base]
        out += ("\n\nllama-server (decode only, on the server's clock; each the fastest of its runs; no A/A rerun, so "
                "these ratios are not judged against noise): " + ("; ".join(rows) or "no drafter ran") + ".")
    return out


def loop_verdicts(loops) -> str:
    """One line per drafter of `draft_verify.compare_drafters`: its CPU-time speed-up with
    its interval or range and the verdict against the A/A floor, in words."""
    ref = loops["drafter"].iloc[0]
    out = "\n".join(f"- **{r.drafter}**: {r.tokens_per_pass:.2f} tokens per pass, CPU-time speed-up "
                    f"{speedup_text(r, 'speed_up_cpu')}: **{outcome(r.verdict, r.drafter, ref)}**"
                    for r in loops.itertuples() if r.drafter != ref)
    rest = loops[loops["drafter"] != ref]
    if "fewest_pairs" in loops and len(rest) and (rest["speed_up_cpu_pairs"] < rest["fewest_pairs"]).any():
        out += (f"\n\nWith {int(rest['speed_up_cpu_pairs'].min())} pairs the test can never pass (it needs at least "
                f"{int(rest['fewest_pairs'].max())}): too few pairs to rank, by construction.")
    return out


def helps_guess_text(guess: Mapping[str, str | None], df, baselines: Mapping[str, str]) -> str:
    """The learner's prediction ({prompt: the configuration expected to beat its baseline,
    or "none"}) against this run's verdicts, prompt by prompt. A guess is confirmed or
    refuted only by a verdict; a configuration the run could not rank (within noise, too
    few pairs, not judged) neither confirms nor refutes it, and the text says so.

    Args:
        guess: {prompt: config name or "none"} (None values: not answered yet).
        df: `compare_speculation` rows; baselines: {config: its baseline}.
    """
    if not any(v is not None for v in guess.values()):
        return "Not answered yet: fill in `MY_HELPS` before the Measure step next time, then re-run this cell."
    lines = []
    for prompt, g in guess.items():
        rows = df[(df["prompt"] == prompt) & (df["config"] != df["config"].map(baselines))]
        won = [r.config for r in rows.itertuples() if r.verdict == f"{r.config} faster"]
        open_ = [r.config for r in rows.itertuples()     # within noise, too few pairs, or not judged
                 if r.verdict not in (f"{r.config} faster", f"{baselines[r.config]} faster")]
        ran = f"faster beyond noise: {', '.join(won) or 'none'}" + (f"; not ranked: {', '.join(open_)}" if open_ else "")
        verdict = dict(zip(rows["config"], rows["verdict"])).get(g)
        if g is None:
            lines.append(f"- {prompt}: not answered yet.")
        elif g != "none" and verdict is None:
            lines.append(f"- {prompt}: **{g}** is not a configuration of this run: pick one of "
                         f"{', '.join(rows['config'])}, or \"none\".")
        elif g in won or (g == "none" and not won and not open_):
            lines.append(f"- {prompt}: you said **{g}**: ✓ confirmed by this run ({ran}).")
        elif (bool(won) if g == "none" else verdict == f"{baselines[g]} faster"):
            lines.append(f"- {prompt}: you said **{g}**: ✗ not what this run found ({ran}).")
        else:
            lines.append(f"- {prompt}: you said **{g}**: this run can neither confirm nor refute it ({ran}).")
    return "\n".join(lines)


def plot_speedup(df, ax=None):
    """End-to-end speed-up vs tokens per target pass, one point per (config, prompt) of
    `compare_speculation`; the dashed line is speed-up 1 (no gain)."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(6, 4))[1]
    tps = df["lookup_tokens_per_step"].fillna(df["chunk_tokens_per_step"]) \
        if "lookup_tokens_per_step" in df else df["chunk_tokens_per_step"]
    for prompt, marker in zip(df["prompt"].unique(), "os^vD"):
        m = df["prompt"] == prompt
        ax.scatter(tps[m], df.loc[m, "speed_up_e2e"], marker=marker, label=prompt)
        for x, y, c in zip(tps[m], df.loc[m, "speed_up_e2e"], df.loc[m, "config"]):
            ax.annotate(c, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(1, ls="--", c="grey")
    ax.set(xlabel="tokens per target pass", ylabel="speed-up vs its baseline (end to end)",
           title="Speculative decoding: acceptance vs speed-up")
    ax.legend(title="prompt")
    return ax


def baseline_regimes(df, weights: Mapping[str, tuple[float, bool]], n_params: float, machine: dict) -> dict:
    """{baseline: stream_regime.PhaseRegime} of each baseline's plain decode (median over prompts of
    its first run's rate): does a pass wait on memory, where verifying k+1 positions costs about
    one pass, or on the cores, where extra positions cost time?

    Args:
        df: `compare_speculation` rows (config, decode_tok_per_s).
        weights: {baseline: (bytes a token reads, True if it multiplies float32: then the
            probe's float32 matmul is its compute roof)}.
        n_params: parameters a token multiplies; machine: `roofline.machine_ceilings` output.
    """
    from infercourse.measure import stream_regime
    out = {}
    for name, (nbytes, f32) in weights.items():
        rate = float(df.loc[df["config"] == name, "decode_tok_per_s"].median())
        out[name] = stream_regime.phase_regime(
            f"{name} decode", rate, bytes_per_token=nbytes, flops_per_token=2 * n_params,
            bandwidth_gbs=machine["bandwidth_gbs"], compute_gflops=machine["gflops"] if f32 else None,
            compute_source=machine["gflops_source"] if f32 else "no probe runs llama.cpp's quantized kernels",
            bandwidth_source=f"{machine['bandwidth']['size_mb']:,} MiB array, {machine['threads']} thread(s)")
    return out


def regime_text(regimes: dict) -> str:
    """Each baseline's regime, and what it means for verification's cost on this machine."""
    lines = [f"- **{name}**: {r.text}" for name, r in regimes.items()]
    held = [name for name, r in regimes.items() if r.label == "bandwidth-bound"]
    lines.append("- So on this machine the cost model's premise (a pass over k+1 positions costs about one pass, "
                 "because it waits on memory) " + (f"holds for {', '.join(held)}." if held else
                 "holds for **no baseline**: their passes were not held by memory, so an extra position verified is "
                 "not free here (the hand loop's `passes` and `cpu_s` show what it cost)."))
    return "\n".join(lines)
