"""What a quantization ladder showed, in sentences computed from its numbers.

`measure_ladder` (lessons.quantization) records per file its bytes, the resident memory its
load added, its decode speed and MBU, and per-token NLLs. The sentences here read those:

- **Quality**: `paired_nll_difference` and `nll_verdict` compare two files on the same
  tokens (the text's hard and easy tokens cancel); a file is called worse or better only
  beyond two standard errors (`same_scores_sentence`, `ladder_reading`).
- **Memory**: each file's load measured alone (`measure.load_memory`): the weights' pages
  mapped in from the file, and anonymous memory beside them. Every load pays some of the
  latter (KV cache, buffers); llama.cpp's CPU backend also keeps some block types (Q4_0,
  Q4_K, IQ4_NL on x86 with AVX2; more on ARM) a second time, rearranged ("repacked") for
  kernels that work on several rows at once. `held_twice` looks for the storage types whose
  bytes match what a file paid beyond the others, read from the GGUF's tensor table;
  `memory_line` and `repack_line` say what it found.
- **F16**: whether this CPU can compute in 16 bits, and whether this llama.cpp build does
  (`f16_path`): otherwise every F16 weight is converted to F32 before it is multiplied.
  `cache_line` sets the weights against the largest CPU cache.

Every sentence flips with its numbers; where they cannot decide, it says so.
"""
from __future__ import annotations

from itertools import combinations

import numpy as np

from infercourse.core.errors import ModelLayerError

__all__ = ["paired_nll_difference", "nll_verdict", "same_scores_sentence", "ladder_reading", "cache_line",
           "held_twice", "memory_line", "repack_line", "f16_path", "f16_line", "f16_exercise"]


def paired_nll_difference(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean per-token NLL difference a - b (nats) and its standard error.

    Both models score the same tokens, so the difference is taken token by token: the
    text's own hard and easy tokens cancel, and what remains is the models' difference.

    Args:
        a, b: per-token NLLs of the same text under two models (same tokenizer).
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape:
        raise ModelLayerError(f"NLL arrays differ in length ({a.size} vs {b.size}): the two "
                              "models tokenized the text differently", hint="compare models with one tokenizer")
    d = a - b
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size))


def nll_verdict(a: np.ndarray, b: np.ndarray) -> tuple[float, float, str]:
    """(mean NLL difference a − b, its standard error, "same" / "worse" / "better"): a is
    called worse or better than b only when the paired difference clears two standard errors."""
    diff, se = paired_nll_difference(a, b)
    return diff, se, "same" if abs(diff) <= 2 * se else "worse" if diff > 0 else "better"


def same_scores_sentence(nlls: dict, a: str, b: str) -> str:
    """Do two files score the text the same? The paired per-token NLL difference against two
    standard errors, in words (for the F16-derived-from-Q4_1 check)."""
    diff, se, v = nll_verdict(nlls[a], nlls[b])
    head = (f"Per-token NLL difference {a} − {b}: {diff:+.5f} ± {2 * se:.5f} nats (2 standard errors) over "
            f"{len(nlls[a])} tokens")
    if v == "same":
        return head + ": the two files score the text **the same** within two standard errors."
    return head + f": {a} scores the text **{v}** than {b}, beyond two standard errors."


def ladder_reading(df, reference: str = "F16", f16: str | None = None) -> str:
    """What the ladder showed, in words, from `measure_ladder`'s table: whether decode speed
    followed the bytes, which file sat furthest below its ceiling (MBU), which files scored
    the text worse than `reference` beyond two standard errors (paired NLL), and whether
    greedy agreement moved where perplexity did not.

    Args:
        df: `measure_ladder` output (per-token NLLs in `df.attrs["token_nlls"]` when it scored a text).
        reference: the file the others are compared with.
        f16: `f16_path(...)` of this CPU and build ("convert", "16-bit", "unknown"; None: not known).
    """
    r = df.set_index("quant")
    by_bytes = r.sort_values("weight_bytes", ascending=False)
    speeds = by_bytes["decode_tok_per_s"].to_numpy(float)
    seq = ", ".join(f"{q} {v:.0f}" for q, v in by_bytes["decode_tok_per_s"].items())
    if len(speeds) > 1 and (np.diff(speeds) > 0).all():
        speed = f"- **Speed vs bytes.** Decode speed rose at every step down in bytes ({seq} tok/s), as a bandwidth-bound decoder's would."
    else:
        speed = (f"- **Speed vs bytes.** Decode speed did not rise at every step down in bytes ({seq} tok/s, from most "
                 "to fewest weight bytes): a purely bandwidth-bound decoder's would.")
    lines = [speed + " One run per file, no noise band: two close speeds are not a ranking."]
    if "mbu" in r:
        lo, bits = r["mbu"].idxmin(), r["bits_per_weight"]
        if lo == reference:
            why = {"convert": "this build converts each of its weights to F32 before multiplying: per-weight work "
                              "beside its bytes",
                   "16-bit": "although this build multiplies F16 in 16 bits, without conversion: look at its kernels"
                   }.get(f16, "per-weight work beside its bytes (conversion, where the build has no 16-bit "
                              "arithmetic) is the likely brake")
        elif bits[lo] < bits.median():
            why = "a small file far from its ceiling is held back by per-weight arithmetic (unpacking), not by bytes"
        else:
            why = "not one of the small files, so unpacking small fields is not what held this run back most"
        lines.append(f"- **MBU.** The lowest, {r['mbu'][lo]:.0%}, belongs to {lo} ({bits[lo]:.2f} bits a weight): {why}.")
    nlls = df.attrs.get("token_nlls") or {}
    if reference in nlls and len(nlls) > 1:
        ladder = [q for q in r.sort_values("bits_per_weight", ascending=False).index if q != reference and q in nlls]
        verdicts = {q: nll_verdict(nlls[q], nlls[reference]) for q in ladder}
        parts = "; ".join(f"{q} {d:+.3f} ± {2 * se:.3f} ({v})" for q, (d, se, v) in verdicts.items())
        worse = [q for q in ladder if verdicts[q][2] == "worse"]
        tail = (f"the first file down the ladder that scores clearly worse is **{worse[0]}** "
                f"({r['bits_per_weight'][worse[0]]:.2f} bits a weight)" if worse else
                f"no file scored clearly worse than {reference} on this text")
        lines.append(f"- **Quality.** Mean NLL per token against {reference} (± 2 SE, nats): {parts}; {tail}.")
        early = [q for q in ladder if verdicts[q][2] == "same" and r["greedy_agreement"][q] < 1]
        lines.append(
            f"- **Agreement vs perplexity.** {', '.join(f'{q} ({r.greedy_agreement[q]:.0%})' for q in early)} kept "
            f"{reference}'s perplexity within 2 SE yet changed greedy answers: agreement reacts to the first "
            "flipped token, before perplexity moves." if early else
            f"- **Agreement vs perplexity.** No file changed its greedy answers while keeping {reference}'s "
            "perplexity within 2 SE: here agreement did not move before perplexity.")
    return "\n".join(lines)


def cache_line(llc_bytes: int | None, weight_bytes: float, mbu: float) -> str:
    """The summary's sentence on the weights against the largest CPU cache, from the
    numbers: bigger than the cache, every token streams them from memory; smaller, they
    could stay cached, and the measured MBU (decode speed / the DRAM-bandwidth ceiling)
    says whether they did (above 1) or not. "" where the OS gives no cache size.

    Args:
        llc_bytes: `last_level_cache_bytes()`; weight_bytes: the file's weight bytes;
        mbu: that file's measured decode speed / its bandwidth ceiling.
    """
    if not llc_bytes:
        return ""
    ratio = weight_bytes / llc_bytes
    head = f"This CPU's largest cache is {llc_bytes / 1e6:.0f} MB; the F16 weights are {weight_bytes / 1e6:.0f} MB"
    if ratio > 1:
        return f"{head}, {ratio:.1f}× more, so every decoded token streams them from memory again."
    verdict = ("above 100%: some of them stay cached" if mbu > 1 else
               "at least half of it: reading them could be its limit (the regime lines say), and no cache hit "
               "shows" if mbu >= 0.5 else
               "under half of it: whatever the cache held, decode ran far below the memory ceiling, so bytes "
               "were not its limit (the F16 line says what per-weight work it does)")
    return f"{head} ({ratio:.0%} of it): they could fit, and F16's MBU of {mbu:.0%} is {verdict}."


# -- memory: resident growth against the file, and what a second copy would take ---------------
def _tolerance(file_bytes: float) -> float:
    """How far a memory reading may sit from a byte count and still be called equal to it:
    2% of the file or 1 MB (page rounding, a buffer touched more or less)."""
    return max(1e6, 0.02 * float(file_bytes))


def held_twice(excess_bytes: float, types: dict[str, dict[str, int]], tol_bytes: float
               ) -> tuple[list[str], int, int] | None:
    """The storage types whose tensors together take about `excess_bytes` (what a file's load
    added beyond what every load adds): what a second copy of them would take. Returns (types,
    their bytes, their tensor count) for the set nearest the excess, fewest types first on a
    tie, or None when no set comes within `tol_bytes`. Types smaller than the tolerance are
    left out: they cannot be told apart from noise.

    Args:
        excess_bytes: the file's extra anonymous memory.
        types: `quantization.tensor_types(path)` of the file.
        tol_bytes: the largest distance still called a match.
    """
    cands = [t for t, e in types.items() if e["bytes"] > tol_bytes]
    best = None
    for k in range(1, len(cands) + 1):
        for combo in combinations(cands, k):
            total = sum(types[t]["bytes"] for t in combo)
            off = abs(total - excess_bytes)
            if off <= tol_bytes and (best is None or off < best[0]):
                best = (off, list(combo), total, sum(types[t]["count"] for t in combo))
    return None if best is None else tuple(best[1:])


def _extras(df) -> tuple[dict[str, float], str, float]:
    """Each file's anonymous memory beyond the ladder's smallest (the part every load pays:
    KV cache, buffers, set-up): ({quant: extra bytes}, the file with the smallest, its bytes).
    Anonymous = `other_bytes` where the mapping was read, else resident growth minus the weights."""
    r = df.set_index("quant")
    other = r["other_bytes"] if "other_bytes" in r and r["other_bytes"].notna().all() else \
        r["rss_delta_bytes"] - r["weight_bytes"]
    base = other.idxmin()
    return (other - other[base]).to_dict(), base, float(other[base])


def _copies(df) -> dict:
    """{quant: (types, bytes, count)} of the files whose extra anonymous memory `held_twice`
    matched."""
    types, out = df.attrs.get("tensor_types") or {}, {}
    extras, _, _ = _extras(df)
    for q, row in df.set_index("quant").iterrows():
        tol = _tolerance(row["file_bytes"])
        if extras[q] > tol and (hit := held_twice(extras[q], types.get(q, {}), tol)):
            out[q] = hit
    return out


def memory_line(df, repack: bool | None = None) -> str:
    """The Memory bullet, from `measure_ladder`'s fresh-process readings: the weights' pages
    mapped in against the tensor bytes; the anonymous memory every load paid (the ladder's
    smallest); and, for a file that paid more, the tensors whose second copy would take that
    much (`held_twice`), or that nothing in the file matches.

    Args:
        df: `measure_ladder` output (rss_delta_bytes, mapped_bytes, other_bytes, weight_bytes,
            file_bytes; tensor types in its attrs).
        repack: whether this llama.cpp build lists REPACK (`hardware.llamacpp_features()`);
            None: not known.
    """
    r, copies = df.set_index("quant"), _copies(df)
    extras, base, base_bytes = _extras(df)
    out = "- **Memory** (each file loaded alone in a fresh process, one short request)."
    if "mapped_bytes" in r and r["mapped_bytes"].notna().all():
        off = {q: row["mapped_bytes"] - row["weight_bytes"] for q, row in r.iterrows()}
        short = [f"{q} only {r.loc[q, 'mapped_bytes'] / 1e6:.1f} of {r.loc[q, 'weight_bytes'] / 1e6:.1f} MB"
                 for q, d in off.items() if d < -_tolerance(r.loc[q, "file_bytes"])]
        out += (" The weights' pages, mapped in from the file: " + (
            "as many bytes as each file's tensors, within 2% (" + ", ".join(
                f"{q} {r.loc[q, 'mapped_bytes'] / 1e6:.1f} MB" for q in r.index) + ")" if not short else
            "fewer than its tensors for " + "; ".join(short) + ": not every page was touched") + ".")
    out += (f" Beside them every file added at least {base_bytes / 1e6:.1f} MB ({base}): the KV cache for the "
            "context, compute buffers and the runtime's set-up, whatever the weights.")
    more = []
    for q in r.index:
        tol = _tolerance(r.loc[q, "file_bytes"])
        if extras[q] <= tol:
            continue
        if q in copies:
            names, nbytes, count = copies[q]
            more.append(f"{q} **+{extras[q] / 1e6:.1f} MB**, as much as its {count} {' + '.join(names)} tensors "
                        f"({nbytes / 1e6:.1f} MB): what a second copy of them takes")
        else:
            more.append(f"{q} **+{extras[q] / 1e6:.1f} MB**, matching no group of its tensors: this run cannot say "
                        "what took it")
    if more:
        out += " Beyond that: " + "; ".join(more) + "; the others, nothing beyond 2% of their file."
    else:
        out += " No file added more than 2% of its size beyond that."
    if copies:
        out += (" llama.cpp's CPU backend keeps some block types a second time, repacked for kernels that work "
                "on several rows at once" + {True: " (this build lists REPACK)",
                                             False: ", but this build does not list REPACK: the match may be chance",
                                             None: ""}[repack] + ".")
    return out


def repack_line(df) -> str:
    """Which files held part of their weights twice (`held_twice`), what share, and how their
    decode rates sat against the other files' (one run per file: a pattern, never a ranking).
    "" when no file did.

    Args:
        df: `measure_ladder` output.
    """
    copies = _copies(df)
    if not copies:
        return ""
    r = df.set_index("quant")
    rate = r["decode_tok_per_s"]
    shares = ", ".join(f"{q} {nb / r.loc[q, 'weight_bytes']:.0%} ({' + '.join(t)})"
                       for q, (t, nb, _) in sorted(copies.items(), key=lambda kv: -kv[1][1] / r.loc[kv[0], 'weight_bytes']))
    rest = [q for q in r.index if q not in copies]
    fast = rate.idxmax()
    out = (f"- **Repacked copies.** Share of the weight bytes held a second time: {shares}; "
           f"{', '.join(rest) or 'no other file'}: none. The highest decode rate of this run, {fast} "
           f"({rate[fast]:.0f} tok/s), {'is' if fast in copies else 'is not'} one of them.")
    if rest:
        w, wo = rate[list(copies)], rate[rest]
        rel = ("every file with a copy decoded faster than every file without one" if w.min() > wo.max() else
               "every file with a copy decoded slower than every file without one" if w.max() < wo.min() else
               "the rates of the files with and without a copy overlap")
        span = lambda x: f"{x.min():.0f}" if round(x.min()) == round(x.max()) else f"{x.min():.0f}–{x.max():.0f}"  # noqa: E731
        out += (f" Here {rel} ({span(w)} against {span(wo)} tok/s; one run per "
                "file: a pattern to test with repeats, not a ranking).")
    return out


# -- F16: conversion or 16-bit arithmetic ----------------------------------------------------
def f16_path(fp16: dict[str, list[str]], build: dict[str, str]) -> str:
    """How this llama.cpp build multiplies F16 weights on this CPU: "16-bit" (ARM's FP16
    vector arithmetic compiled in: FP16_VA), "convert" (to F32 first: no 16-bit arithmetic in
    the CPU, or a build compiled without it) or "unknown" (an AVX-512 build on a CPU with
    AVX512-FP16: its system info does not say whether that was compiled in).

    Args:
        fp16: `hardware.fp16_support()`; build: `hardware.llamacpp_features()`.
    """
    if not build:
        return "unknown"
    if build.get("NEON") == "1":
        return "16-bit" if build.get("FP16_VA") == "1" else "convert"
    if "avx512_fp16" in fp16.get("arithmetic", []) and build.get("AVX512") == "1":
        return "unknown"
    return "convert"


def _path_words(fp16: dict[str, list[str]], build: dict[str, str]) -> str:
    path, arith = f16_path(fp16, build), fp16.get("arithmetic", [])
    if path == "16-bit":
        return "this llama.cpp build multiplies F16 weights in 16 bits (FP16_VA): no conversion"
    if path == "unknown":
        return ("whether this llama.cpp build's F16 kernels use " + (", ".join(arith) or "16-bit arithmetic")
                + " its system info does not say (only a build compiled with AVX512-FP16 does)")
    lacks = (f"was compiled without the CPU's {', '.join(arith)}" if arith else
             "runs on a CPU without 16-bit arithmetic")
    return (f"this llama.cpp build {lacks}, so it converts every F16 weight to F32 before multiplying "
            "(F16C's vcvtph2ps on x86) and the activations to F16 for that dot product")


def f16_line(fp16: dict[str, list[str]], build: dict[str, str]) -> str:
    """The F16 bullet: the CPU's 16-bit float flags (x86 and ARM names), the build's
    compiled-in features, and what that means for an F16 multiply.

    Args:
        fp16: `hardware.fp16_support()`; build: `hardware.llamacpp_features()`.
    """
    conv, arith = fp16.get("convert", []), fp16.get("arithmetic", [])
    cpu = (f"This CPU lists {', '.join(conv) or 'no conversion flag'} (F16↔F32 conversion) and "
           + (f"{', '.join(arith)} (16-bit arithmetic)" if arith else "no 16-bit arithmetic"))
    keys = ("AVX2", "F16C", "AVX512", "NEON", "FP16_VA", "SVE", "REPACK")
    built = " ".join(k for k in keys if build.get(k) == "1") or "none of " + ", ".join(keys)
    return f"- **F16 arithmetic.** {cpu}. llama.cpp's system info lists {built}, and {_path_words(fp16, build)}."


def f16_exercise(fp16: dict[str, list[str]], build: dict[str, str], llc_bytes: int | None,
                 f16_weight_bytes: float) -> tuple[str, str]:
    """(correct option, why) of the exercise "what does llama.cpp do to multiply an F16
    weight here": "d" (16-bit multiplies) where `f16_path` says so, else "b" (conversion),
    and a reason built from this machine's cache size and flags.

    Args:
        fp16, build: as in `f16_line`; llc_bytes: `hardware.last_level_cache_bytes()`;
        f16_weight_bytes: the F16 file's weight bytes.
    """
    if not llc_bytes:
        cache = "This OS gives no cache size"
    elif f16_weight_bytes > llc_bytes:
        cache = (f"The F16 weights ({f16_weight_bytes / 1e6:.0f} MB) are {f16_weight_bytes / llc_bytes:.1f}× this "
                 f"CPU's largest cache, so each token streams them from memory")
    else:
        cache = (f"The F16 weights ({f16_weight_bytes / 1e6:.0f} MB) would fit in this CPU's {llc_bytes / 1e6:.0f} MB "
                 f"largest cache ({f16_weight_bytes / llc_bytes:.0%} of it), so bytes alone do not explain its speed")
    return ("d" if f16_path(fp16, build) == "16-bit" else "b"), f"{cache}; {_path_words(fp16, build)}."
