"""Speculative decoding: guess several tokens cheaply, let the big model check them at once.

Decode is slow because each token needs one full forward pass of the target model, and
that pass is dominated by reading the weights. Checking k guessed tokens costs about the
same as producing one (one pass over k+1 positions reads the weights once), so a cheap
*drafter* proposes k tokens and the target verifies them in one pass: it keeps the longest
prefix it agrees with, plus one token of its own (the correction, or a bonus after a full
match). Under greedy decoding the output is exactly the target's own; only the number of
target passes changes (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023 for the sampling case).

Drafters: *prompt lookup* copies the tokens that followed the last n-gram's earlier
occurrence in the context (free, and good when the answer quotes its input); a *draft
model* is a smaller model run k times per step. `truncated_draft` derives one from the
target itself by keeping its first layers (the idea behind self-speculative/LayerSkip
drafting, here without the training that makes it good).

Acceptance is measured two ways: from the chunks transformers streams (one chunk per
target pass, holding accepted drafts + 1), and by `replay_acceptance`, which re-runs the
drafter offline on the final greedy output and counts proposals and acceptances. The
replay is hand-written (a dozen lines) because neither in-process runtime reports
proposal counts (llama-server does: `lessons.spec_server`). The draft-and-verify step
itself, written out by hand, is in `lessons.draft_verify`; what a run showed, in words
written from its verdicts and counts, is in `lessons.spec_claims`.

Speed-ups are named by their clock: `speed_up_e2e` here (whole requests, prefill
included), `speed_up_decode` in `spec_server` (the server's own decode rate),
`speed_up_cpu` in `draft_verify` (this process's CPU time).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from infercourse.core.errors import ModelLayerError

__all__ = ["lookup_draft", "lookup_proposer", "replay_acceptance", "chunk_acceptance", "truncated_draft",
           "output_ids", "compare_speculation", "expected_tokens_per_step", "expected_speedup", "break_even_acceptance",
           "acceptance_from_tokens_per_step"]

Proposer = Callable[[np.ndarray], np.ndarray]


def lookup_draft(ids: Sequence[int], k: int = 10, max_ngram: int = 2) -> np.ndarray:
    """Prompt-lookup drafter (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding),
    as transformers' `prompt_lookup_num_tokens` and llama-cpp-python's
    `LlamaPromptLookupDecoding` implement it: find the last `max_ngram` tokens (then
    fewer) at their first earlier occurrence and propose the up to `k` tokens that
    followed. Written out here so the replay runs without importing either runtime."""
    ids = np.asarray(ids)
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids, n)
        for start in np.nonzero((windows == ids[-n:]).all(axis=1))[0] + n:
            if start < len(ids):  # the match at the very end has nothing after it
                return ids[start:start + k]
    return ids[:0]


def lookup_proposer(k: int = 10, max_ngram: int = 2) -> Proposer:
    """A `replay_acceptance` drafter: `lookup_draft` with fixed `k` and `max_ngram`."""
    return lambda ids: lookup_draft(ids, k, max_ngram)


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one target pass yields when each draft token is accepted independently with
    probability `alpha`: 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)
    (Leviathan et al. 2023, eq. 1)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, draft_cost: float) -> float:
    """Predicted speed-up over plain decoding: tokens per step / cost of a step, in units
    of one target pass (1 for verifying, `draft_cost` for each of the k draft passes).
    Verifying k+1 positions is taken to cost one pass: true while decode is memory-bound.

    Args:
        alpha: per-token acceptance rate (0..1).
        k: draft tokens per step.
        draft_cost: one draft pass / one target pass (0 for prompt lookup, 1 for a
            same-size draft).
    """
    return expected_tokens_per_step(alpha, k) / (1 + k * draft_cost)


def break_even_acceptance(k: int, draft_cost: float) -> float:
    """Smallest acceptance rate at which speculation stops being slower (speed-up = 1);
    nan when none can (a draft as costly as the target never breaks even before 1.0)."""
    if expected_speedup(1.0, k, draft_cost) < 1:
        return float("nan")
    lo, hi = 0.0, 1.0
    for _ in range(50):  # bisection: expected_speedup rises with alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_speedup(mid, k, draft_cost) < 1 else (lo, mid)
    return hi


def acceptance_from_tokens_per_step(tokens_per_step: float, k: int) -> float:
    """The per-token acceptance alpha that `expected_tokens_per_step` turns into the measured
    tokens per target pass at draft length `k`: the inverse of (1 - alpha^(k+1)) / (1 - alpha),
    by bisection. Not the same number as accepted / proposed: a step stops at its first
    rejection, so the later proposals of a step are never checked one by one, and that ratio
    sits under alpha.

    Args:
        tokens_per_step: measured tokens per target pass (1 .. k+1; clipped to that range).
        k: tokens the drafter could propose per step.
    """
    if k < 1:
        raise ValueError("k must be at least 1")
    t = min(max(float(tokens_per_step), 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):  # expected_tokens_per_step rises with alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < t else (lo, mid)
    return (lo + hi) / 2


def replay_acceptance(context: Sequence[int], output: Sequence[int], propose: Proposer) -> dict:
    """Count what speculative greedy decoding did, by replaying its drafter.

    At each step the drafter sees context + output so far and proposes tokens; greedy
    verification accepts the longest prefix equal to the true output, and the target adds
    one token. Since the greedy output is known, every step can be replayed exactly.

    Args:
        context: prompt token ids.
        output: the generated token ids (the target's greedy output).
        propose: drafter, token ids -> proposed next ids.
    Returns steps (target passes), proposing_steps (passes where the drafter proposed
    anything), proposed, accepted, acceptance_rate (accepted / proposed) and tokens_per_step.
    """
    seq, out = list(context), list(output)
    pos = steps = proposing = proposed = accepted = 0
    while pos < len(out):
        draft = list(propose(np.array(seq + out[:pos])))[: len(out) - pos - 1]
        n = 0
        while n < len(draft) and draft[n] == out[pos + n]:
            n += 1
        steps, proposed, accepted, pos = steps + 1, proposed + len(draft), accepted + n, pos + n + 1
        proposing += bool(draft)
    return {"steps": steps, "proposing_steps": proposing, "proposed": proposed, "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else float("nan"),
            "tokens_per_step": len(out) / steps if steps else float("nan")}


def chunk_acceptance(chunk_tokens: Sequence[int], k: int | None = None) -> dict:
    """Acceptance seen in a stream where each chunk is one target pass (transformers
    assisted decoding): a chunk of n tokens = n - 1 accepted drafts + 1 target token.

    Args:
        chunk_tokens: tokens per streamed chunk.
        k: draft tokens proposed per step, when the drafter always proposes k (a draft
            model on a constant schedule); near the end transformers proposes only up to
            the tokens still allowed minus one, and so do we. None: no acceptance rate.
    """
    n = [c for c in chunk_tokens if c > 0]
    total = sum(n)
    out = {"steps": len(n), "accepted": total - len(n),
           "tokens_per_step": total / len(n) if n else float("nan"),
           "drafted_share": (total - len(n)) / total if total else float("nan")}
    if k is not None:
        pos, proposed = 0, 0
        for c in n:
            proposed += max(0, min(k, total - pos - 1))
            pos += c
        out.update(proposed=proposed,
                   acceptance_rate=out["accepted"] / proposed if proposed else float("nan"))
    return out


def truncated_draft(n_layers: int, target: str | Path | None = None) -> Path:
    """A draft model made from the target's first `n_layers` decoder layers (same
    embeddings, final norm and head, same tokenizer), saved once next to the target.

    Args:
        n_layers: layers to keep (fewer = cheaper draft, worse guesses).
        target: HF folder of the target (None: the embedded model's derived HF folder).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from infercourse.models.formats import hf_folder
    src = Path(target) if target else hf_folder()
    out = src.parent / f"{src.name}-draft-L{n_layers}"
    total = AutoConfig.from_pretrained(str(src)).num_hidden_layers
    if not 1 <= n_layers < total:
        raise ModelLayerError(f"a draft needs 1..{total - 1} layers (the target has {total}), "
                              f"got {n_layers}")
    if (out / "config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.model.layers = model.model.layers[:n_layers]
    model.config.num_hidden_layers = n_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:n_layers]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(tmp))
    try:
        os.replace(tmp, out)  # the folder appears only when complete
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def output_ids(engine, request, text: str) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) of a finished request, with the engine's own tokenizer.
    The output is re-tokenized from its text (engines stream text, not ids)."""
    if hasattr(engine, "prompt_ids"):  # transformers
        return engine.prompt_ids(request), engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    if hasattr(engine, "prompt_tokens"):  # llama.cpp
        return engine.prompt_tokens(request), engine.llm.tokenize(text.encode(), add_bos=False,
                                                                  special=False)
    raise ModelLayerError(f"{type(engine).__name__} exposes no tokenizer to count acceptance with")


def compare_speculation(engine_factories: Mapping[str, Callable[[], object]],
                        prompts: Mapping[str, str], *, max_tokens: int = 48,
                        baselines: Mapping[str, str] | None = None, lookup_k: int = 10,
                        writer=None, repeats: int = 1):
    """Run every prompt on every engine configuration; one row per (config, prompt).

    Columns: config, prompt, output_tokens, e2e_s, decode_tok_per_s, chunk_steps and
    chunk_tokens_per_step (from the stream; 1.0 where an engine streams token by token),
    lookup_acceptance, lookup_tokens_per_step, lookup_steps, lookup_proposing_steps,
    lookup_proposed and lookup_accepted (the replayed prompt-lookup drafter's counts, for
    configs using it), speed_up_e2e (baseline e2e / e2e, same prompt: the median paired
    ratio over `repeats`; end to end, prefill included) and identical_output (text equal to
    the baseline's). With repeats >= 2 each baseline also runs as its own A/A rerun, and
    each row gets `speed_up_e2e_lo`/`_hi` (a 95% interval where `speed_up_e2e_exact`, else
    the range of its `speed_up_e2e_pairs` ratios),
    `noise_floor` (the A/A floor for that baseline and prompt) and `verdict`
    (`measure.noise.compare`: the baseline, its rerun and the config tested as one block).

    The repeats run in rounds (`measure.noise.schedule`): each round builds every
    configuration once, warms it, runs every prompt once and drops it, in an order shuffled
    per round (seeded). Pair i is round i, minutes apart at most, and which configuration
    ran first in a round is chance, as the verdict's relabelling test assumes.

    Args:
        engine_factories: {config name: zero-argument callable returning an engine};
            engines are built one at a time (memory for one) and dropped after use.
        prompts: {label: user message}.
        max_tokens: tokens per request (greedy, forced length so runs are comparable).
        baselines: {config: its baseline config}; default: the first config for all.
        lookup_k: tokens the lookup drafter proposes, for the replay.
        writer: optional `results.RunWriter` for the request traces.
        repeats: rounds, i.e. requests per (config, prompt); e2e_s is their median.
    """
    import gc

    import pandas as pd

    from infercourse.core.types import Request
    from infercourse.core.metrics import decode_tok_per_s, e2e_s
    from infercourse.core.trace import record
    from infercourse.measure import noise

    names = list(engine_factories)
    if not names or not prompts:
        raise ValueError("compare_speculation needs at least one engine factory and one prompt")
    baselines = dict(baselines or {n: names[0] for n in names})
    aa = {f"{b} (A/A)": b for b in dict.fromkeys(baselines.values())} if repeats > 1 else {}
    rows = []
    for rep, name in noise.schedule(names + list(aa), repeats):     # rounds, each shuffled
        engine = engine_factories[aa.get(name, name)]()
        flags = getattr(engine, "flags", {})
        uses_lookup = "prompt-lookup" in (flags.get("draft"), flags.get("assistant"))
        warm = Request(messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        list(engine.stream(warm))  # first call pays one-off costs (allocations, kernels)
        for label, text in prompts.items():
            req = Request(messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                          ignore_eos=True, cache_prompt=False)
            tr = record(engine, req, request_id=len(rows), raise_errors=True, config=name, prompt=label)
            if writer is not None:
                writer.write(tr)
            ch = chunk_acceptance(tr.chunk_tokens, getattr(engine, "draft_k", None))
            row = {"config": name, "prompt": label, "rep": rep, "output_tokens": tr.completion_tokens,
                   "e2e_s": e2e_s(tr), "decode_tok_per_s": decode_tok_per_s(tr),
                   "chunk_steps": ch["steps"], "chunk_tokens_per_step": ch["tokens_per_step"],
                   "draft_acceptance": ch.get("acceptance_rate", float("nan")),
                   "text": tr.text}
            if uses_lookup:
                ctx, out = output_ids(engine, req, tr.text)
                replay = replay_acceptance(ctx, out, lookup_proposer(lookup_k))
                row.update(lookup_acceptance=replay["acceptance_rate"], lookup_tokens_per_step=replay["tokens_per_step"],
                           **{f"lookup_{k}": replay[k] for k in ("steps", "proposing_steps", "proposed", "accepted")})
            rows.append(row)
        if hasattr(getattr(engine, "llm", None), "close"):
            engine.llm.close()  # free llama.cpp memory now, not at interpreter exit
        del engine
        gc.collect()
    return _judge(pd.DataFrame(rows), baselines, aa)


def _judge(trials, baselines: Mapping[str, str], aa: Mapping[str, str]):
    """One row per (config, prompt) from `compare_speculation`'s trials: the first trial's
    columns, the median e2e_s, and the paired speed-up against the baseline, judged
    against the baseline's A/A floor where there is one."""
    from infercourse.measure import noise
    e2e = trials.pivot_table(index=["config", "prompt"], columns="rep", values="e2e_s")
    df = trials[trials["rep"] == 0].drop(columns="rep")
    df = df[~df["config"].isin(list(aa))].reset_index(drop=True)
    df["e2e_s"] = [float(e2e.loc[(c, p)].median()) for c, p in zip(df["config"], df["prompt"])]
    first = df.set_index(["config", "prompt"])
    rerun = {b: a for a, b in aa.items()}
    cols = {k: [] for k in ("speed_up_e2e", "speed_up_e2e_lo", "speed_up_e2e_hi", "speed_up_e2e_exact",
                            "speed_up_e2e_pairs", "noise_floor", "verdict", "fewest_pairs")}
    for c, p in zip(df["config"], df["prompt"]):
        b = baselines[c]
        iv = noise.paired_interval(e2e.loc[(c, p)], e2e.loc[(b, p)])        # baseline / this: > 1 is faster
        floor = noise.noise_floor(e2e.loc[(b, p)], e2e.loc[(rerun[b], p)]) if b in rerun else None
        cmp = noise.compare(e2e.loc[(b, p)], e2e.loc[(c, p)], floor, labels=(b, c)) if floor and c != b else None
        verdict = "reference" if c == b else cmp.verdict if cmp else "1 run: not judged"
        for k, v in zip(cols, (iv.median, iv.lo, iv.hi, iv.exact, iv.n, floor.floor if floor else float("nan"), verdict,
                               cmp.fewest if cmp else 0)):
            cols[k].append(v)
    df = df.assign(**cols)
    df["identical_output"] = [first.loc[(baselines[c], p), "text"] == t for c, p, t in
                              zip(df["config"], df["prompt"], df["text"])]
    return df
