"""Two failures of the numbers under a tool call (notebook 19, "Four failures, live"; the
other two in `agent_failures`, the sentences in `agent_failures_claims`).

**A quantized KV cache at long context.** `-ctk q8_0 / q4_0` (with `-fa on`: llama.cpp needs
flash attention for a quantized V cache) stores every key and value in 8 or ~4.5 bits. Each
stored number is off by a little; attention sums over every cached token, so the longer the
context the more of those errors each new token reads. `kv_long_context` scores one reference
call (the call the agent's next request needs) after 1k, 3.5k and 7k tokens of a coding
session, in each cache type: the NLL of its tokens given everything before them (nats per
token: how surprised the model is by the right call) and the call it generates greedily
(valid? the right one?). In process (llama-cpp-python, `type_k`/`type_v`/`flash_attn`): the
only route here that gives the exact log-probability of *given* tokens. A server's
`n_probs` reports the tokens it sampled, and no endpoint of this build echoes the prompt's
log-probabilities. The session is cut at message boundaries, so each context is a prefix of
the next, and one prefill per cache type serves every length (the reference is scored, then
the cache is rewound to the context's end). The embedded model was trained to 8,192 tokens,
so the longest context stays under it: no RoPE scaling in play.

**Speculative decoding on tool calls.** A drafter proposes tokens and the target verifies
several in one batch. With greedy sampling the answer should not change, but the target's
logits for a token checked inside a batch are computed by other kernels, in another order,
than for the same token decoded alone; where two candidates are nearly tied, the argmax can
flip, and a tool call's name or argument changes. `spec_tool_calls` sends the same tool-call
requests to llama-server without a drafter, with n-gram lookup (`--spec-type ngram-simple`:
no second model) and with a draft model (the embedded Q4_1 drafting for its F16, the ladder
of `models.formats`), greedy, interleaved with an A/A rerun of the plain server, and compares
the generated token ids (`logprobs` carry them) and the decode speed (the server's
`predicted_per_second`).
"""
from __future__ import annotations

import functools
import json
import time
from typing import Any, Sequence

import httpx
import numpy as np
import pandas as pd

from infercourse.measure import noise
from infercourse.measure.agent_workload import coding_agent_session
from infercourse.measure.tool_calls import CALL_CLOSE, CALL_OPEN, call_validity, parse_call, synthetic_tools
from infercourse.measure.workloads import DATA_DIR

__all__ = ["KV_TYPES", "NLL_TOL", "REFERENCE_REQUEST", "REFERENCE_CALL", "render", "agent_context",
           "kv_long_context", "kv_row", "SPEC_ARMS", "spec_servers", "spec_tool_calls", "spec_table", "spec_row"]

KV_TYPES = ("f16", "q8_0", "q4_0")
# nats per token within which two caches' NLL of the same call counts as the same: a judgement of
# what matters to a call (exp(-0.05) = 5% less probability per token), not a property of the
# machine. For scale: an 8-bit cache moved this 29-token call's NLL by -0.02..+0.01 here
NLL_TOL = 0.05
_GGML_TYPE = {"f16": 1, "q8_0": 8, "q4_0": 2}      # llama.cpp's ggml_type ids for type_k / type_v
REFERENCE_REQUEST = "Now read textstats/cli.py again, from the top."
REFERENCE_CALL = {"name": "read_file", "arguments": {"path": "textstats/cli.py"}}
_TEMPLATE = DATA_DIR / "chatml_tools.jinja"


@functools.lru_cache(maxsize=1)
def _template():
    import jinja2
    env = jinja2.Environment(keep_trailing_newline=True)
    env.filters["tojson"] = json.dumps   # jinja2's own escapes `<` and `&` for HTML; llama-server's does not
    return env.from_string(_TEMPLATE.read_text())


def render(messages: list, tools: list | None, add_generation_prompt: bool = True) -> str:
    """The course's tools template rendered in Python (jinja2), `tojson` as plain `json.dumps`."""
    return _template().render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)


def agent_context(n_tools: int = 5) -> dict[str, Any]:
    """The coding session (notebook 19's, OpenAI shape: system, the task, each step's call
    and result) as far as the embedded model's window allows, with the reference request and
    call: {"messages", "tools", "tail" (the request, the generation prompt and the call's
    opening `<tool_call>`, prefilled as in the other experiments), "reference" (the rest of the
    call as the template writes it, in the session's own compact JSON, then the end of the turn)}."""
    req = coding_agent_session(api="openai", n_calls=None, n_tools=n_tools, static_chars=1200).requests[-1]
    messages, tools = list(req.messages), list(req.tools)
    ask = [*messages, {"role": "user", "content": REFERENCE_REQUEST}]
    whole = render(messages, tools, False)
    tail = render(ask, tools, True)[len(whole):] + CALL_OPEN
    args = json.dumps(REFERENCE_CALL["arguments"], separators=(",", ":"))   # the session's own style
    ref = f'{{"name": "{REFERENCE_CALL["name"]}", "arguments": {args}}}\n{CALL_CLOSE}<|im_end|>'
    return {"messages": messages, "tools": tools, "tail": tail, "reference": ref}


def _cuts(llm, ctx: dict[str, Any], contexts: Sequence[int]) -> list[tuple[int, list[int]]]:
    """For each target length, the longest message prefix of the session whose tokens fit it:
    (target, token ids). Each cut is a prefix of the next (ChatML renders turns one by one)."""
    out, k = [], 1
    ids = [llm.tokenize(render(ctx["messages"][:i], ctx["tools"], False).encode(), add_bos=False, special=True)
           for i in range(1, len(ctx["messages"]) + 1)]
    for target in sorted(contexts):
        while k < len(ids) and len(ids[k]) <= target:
            k += 1
        if len(ids[k - 1]) > target:
            raise ValueError(f"the session's system turn alone is {len(ids[0])} tokens, more than {target}")
        out.append((target, ids[k - 1]))
    for (_, a), (_, b) in zip(out, out[1:]):
        if b[:len(a)] != a:
            raise ValueError("a shorter context is not a prefix of the longer one: cannot share the prefill")
    return out


def _logits(llm) -> np.ndarray:
    """The logits after the last evaluated token (llama.cpp's C API, public)."""
    import llama_cpp
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).astype(np.float64)


def _logprob(logits: np.ndarray, token: int) -> float:
    m = logits.max()
    return float(logits[token] - m - np.log(np.exp(logits - m).sum()))


def kv_long_context(kv_types: Sequence[str] = KV_TYPES, contexts: Sequence[int] = (1024, 3584, 7168), *,
                    threads: int = 1, model=None, max_tokens: int = 32) -> pd.DataFrame:
    """The reference call after each context length, in each KV cache type: one row per
    (kv_type, context) with the context's real length, the reference's mean and total NLL
    (nats), the greedy call the model writes (its text, validity, the call as JSON, whether it is
    the reference call) and the seconds that cache type took in all (prefill, scoring, call).

    Args:
        kv_types: -ctk/-ctv types ("f16", "q8_0", "q4_0").
        contexts: target context lengths in tokens (each cut at a message boundary at or below).
        threads: CPU threads for the forward passes.
        model: a GGUF (None: the embedded model; keep the longest context under its window).
        max_tokens: cap on the generated call.
    """
    import llama_cpp

    from infercourse.models.embedded import resolve_model
    path, ctx, rows = str(resolve_model(model).path), agent_context(), []
    for kv in kv_types:
        t0 = time.perf_counter()
        llm = llama_cpp.Llama(model_path=path, n_ctx=8192, n_batch=512, n_ubatch=512, n_threads=threads,
                              n_threads_batch=threads, type_k=_GGML_TYPE[kv], type_v=_GGML_TYPE[kv],
                              flash_attn=True, verbose=False)
        try:
            tail = llm.tokenize(ctx["tail"].encode(), add_bos=False, special=True)
            ref = llm.tokenize(ctx["reference"].encode(), add_bos=False, special=True)
            end_turn = llm.tokenize(b"<|im_end|>", add_bos=False, special=True)[0]
            for target, ids in _cuts(llm, ctx, contexts):
                llm.eval(ids[llm.n_tokens:])          # extend the shared prefix; nothing before is redone
                base = len(ids)
                llm.eval(tail)
                nll = []
                for tok in ref:                       # teacher-forced: the reference's own tokens
                    nll.append(-_logprob(_logits(llm), tok))
                    llm.eval([tok])
                llm.n_tokens = base + len(tail) - 1   # rewind into the request: its last token again
                llm.eval(tail[-1:])                   # gives the logits the greedy call starts from
                out = []
                for _ in range(max_tokens):
                    tok = int(np.argmax(_logits(llm)))
                    if tok == end_turn:
                        break
                    out.append(tok)
                    if llm.detokenize(out, special=True).decode(errors="ignore").endswith(CALL_CLOSE):
                        break
                    llm.eval([tok])
                text = CALL_OPEN + llm.detokenize(out, special=True).decode(errors="replace")
                v, call = call_validity(text, ctx["tools"]), parse_call(text)[0]
                rows.append({"kv_type": kv, "target": target, "context_tokens": base, "ref_tokens": len(ref),
                             "nll_mean": float(np.mean(nll)), "nll_total": float(np.sum(nll)), "generated": text,
                             **v, "call": json.dumps(call) if call else None,
                             "right_call": v["args_valid"] and call == REFERENCE_CALL})
                llm.n_tokens = base                   # back to the context's end for the next length
        finally:
            llm.close()
        for r in rows:
            if r["kv_type"] == kv:
                r["seconds"] = time.perf_counter() - t0
    return pd.DataFrame(rows)


def kv_row(server=None, *, threads: int | None = 1, context: int = 1024):
    """Notebook 18's "tool calls break late in a long session" row: f16 against q4_0 after
    `context` tokens of the session (in process; the lab's server is not used), as (layer or
    None, evidence, values): "KV cache" when q4_0's NLL of the reference call is above f16's
    by more than `NLL_TOL`, or its greedy call differs from f16's."""
    t = kv_long_context(("f16", "q4_0"), (context,), threads=threads or 1).set_index("kv_type")
    f, q = t.loc["f16"], t.loc["q4_0"]
    d = q["nll_mean"] - f["nll_mean"]
    said = lambda r: r["call"] or "no call"   # noqa: E731
    evidence = (f"after {int(f['context_tokens']):,} tokens of a coding session the reference call's NLL was "
                f"{f['nll_mean']:.3f} nats/token with an f16 KV cache and {q['nll_mean']:.3f} with q4_0 ({d:+.3f}); "
                f"greedy call: {said(f)} vs {said(q)}")
    worse = d > NLL_TOL or f["call"] != q["call"]
    return ("KV cache" if worse else None), evidence, {"nll_f16": f["nll_mean"], "nll_q4_0": q["nll_mean"],
                                                       "table": t.reset_index().to_dict("records")}


# ---- speculative decoding ---------------------------------------------------------------------
# arm -> llama-server flags on the F16 target (the draft arm's --model-draft is filled in by spec_servers)
SPEC_ARMS = {"plain": [], "n-gram lookup": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                                            "--spec-ngram-simple-size-m", "8"],
             "draft Q4_1": ["--spec-type", "draft-simple", "--spec-draft-n-max", "4"]}


def spec_servers(arms: Sequence[str] = tuple(SPEC_ARMS), *, threads: int | None = 1, ctx: int = 4096) -> dict[str, Any]:
    """One started llama-server per arm, all on the embedded model's F16 (`models.formats`),
    the tools template, one slot: {arm: server}. The draft arm drafts with the embedded Q4_1."""
    from infercourse.models.embedded import embedded_gguf
    from infercourse.models.formats import f16_gguf
    from infercourse.servers import LlamaServer
    target, out = f16_gguf(), {}
    try:
        for arm in arms:
            extra = list(SPEC_ARMS[arm]) + (["--model-draft", str(embedded_gguf())] if "draft" in arm else [])
            out[arm] = LlamaServer(target, n_parallel=1, ctx_size=ctx, threads=threads, jinja=True,
                                   extra_args=["--chat-template-file", str(_TEMPLATE), *extra]).start()
    except Exception:
        for s in out.values():
            s.stop()
        raise
    return out


def _spec_call(url: str, text: str, tools: list, max_tokens: int) -> dict[str, Any]:
    """One tool-call request, greedy, `tool_choice: required` with the call's opening prefilled;
    the generated token ids (from `logprobs`), the call, and the server's decode timings."""
    body = {"messages": [{"role": "system", "content": "You are a coding agent. Answer with one tool call."},
                         {"role": "user", "content": text}, {"role": "assistant", "content": "<tool_call>\n"}],
            "tools": tools, "tool_choice": "required", "max_tokens": max_tokens, "temperature": 0, "seed": 0,
            "logprobs": True, "cache_prompt": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600.0)
    r.raise_for_status()
    j = r.json()
    ch, t = j["choices"][0], j["timings"]
    calls = ch["message"].get("tool_calls") or []
    return {"ids": [c["id"] for c in (ch.get("logprobs") or {}).get("content") or []],
            "call": calls[0]["function"] if calls else None, "predicted_n": t.get("predicted_n"),
            "predicted_ms": t.get("predicted_ms"), "draft_n": t.get("draft_n") or 0,
            "draft_accepted": t.get("draft_n_accepted") or 0}


def spec_tool_calls(servers: dict[str, Any], requests: Sequence[str], *, repeats: int = 3,
                    max_tokens: int = 32, n_tools: int = 5) -> dict[str, Any]:
    """Each arm's server answers the same tool-call requests once per block, interleaved
    (shuffled in each block) with an A/A rerun of the first arm; a trial's value is its decode
    speed over all the requests (generated tokens / the server's decode time).

    Returns {"speeds": `Interleaved` {arm: [tok/s per block]}, "calls": one row per (arm,
    block, request) with the token ids, the call, the draft counters}.

    Args:
        servers: `spec_servers()`; the first arm is the reference (no drafter).
        requests: user messages that each want one tool call (e.g. `agent_failures.TOOL_REQUESTS`).
        repeats: blocks (3 at least for a verdict against the A/A rerun).
        max_tokens: cap on each answer.
        n_tools: tools offered (the course's first n: the requests' own among them).
    """
    tools, rows = synthetic_tools(n_tools), []
    ref = next(iter(servers))

    def trial(arm: str, server) -> Any:
        def run() -> float:
            got = [_spec_call(server.url, q, tools, max_tokens) for q in requests]
            block = sum(1 for r in rows if r["arm"] == arm and r["request"] == 0)
            rows.extend({"arm": arm, "block": block, "request": i, **g} for i, g in enumerate(got))
            return sum(g["predicted_n"] for g in got) / (sum(g["predicted_ms"] for g in got) / 1e3)
        return run

    arms = {arm: trial(arm, s) for arm, s in servers.items()}
    arms[f"{ref} (A/A)"] = trial(f"{ref} (A/A)", servers[ref])
    speeds = noise.run_interleaved(arms, repeats, warmup=1)
    calls = pd.DataFrame(rows)
    return {"speeds": speeds, "calls": calls[calls["block"] > 0].assign(block=lambda d: d["block"] - 1)}


def spec_table(result: dict[str, Any]) -> pd.DataFrame:
    """Per arm against the reference (the first arm): requests whose token ids differ from the
    reference's on any block, the first differing position, whether the call itself (name,
    arguments) differs, the draft acceptance, the median decode speed and the verdict against
    the A/A rerun."""
    speeds, calls = result["speeds"], result["calls"]
    ref = next(iter(speeds))
    floor = noise.noise_floor(speeds[ref], speeds[f"{ref} (A/A)"])
    base = calls[(calls["arm"] == ref) & (calls["block"] == 0)].set_index("request")
    out = []
    for arm in speeds:
        mine = calls[calls["arm"] == arm]
        diff = [(r.request, next((i for i, (a, b) in enumerate(zip(r.ids, base.loc[r.request, "ids"])) if a != b),
                                 None if len(r.ids) == len(base.loc[r.request, "ids"]) else min(len(r.ids), len(
                                     base.loc[r.request, "ids"]))), r.call != base.loc[r.request, "call"])
                for r in mine.itertuples()]
        changed = [d for d in diff if d[1] is not None]
        drafted = int(mine["draft_n"].sum())
        c = None if arm == ref else noise.compare(speeds[ref], speeds[arm], floor, higher_is_better=True,
                                                  labels=(ref, arm))
        out.append({"arm": arm, "answers": len(mine), "tokens_differ": len(changed),
                    "first_diff_at": min((d[1] for d in changed), default=None),
                    "call_differs": sum(d[2] for d in diff), "acceptance": mine["draft_accepted"].sum() / drafted
                    if drafted else None, "decode_tok_s": float(np.median(speeds[arm])),
                    "speed_up": float(np.median(speeds[arm]) / np.median(speeds[ref])),
                    "verdict": "reference" if c is None else c.said, "comparison": c})
    return pd.DataFrame(out).set_index("arm").assign(floor=floor.floor)


def spec_row(server=None, *, threads: int | None = 1, requests: Sequence[str] = (
        "Read the file textstats/cli.py.", "Search the code for top_words.")):
    """Notebook 18's "tool calls change with speculative decoding" row: the plain F16 server and
    the one with a Q4_1 draft answer the same tool-call requests (greedy), as (layer or None,
    evidence, values): "runtime" (the target's kernels score a verified batch, not one token)
    when any generated token differs."""
    servers = spec_servers(("plain", "draft Q4_1"), threads=threads)
    try:
        got = {arm: [_spec_call(s.url, q, synthetic_tools(5), 32) for q in requests] for arm, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    differ = [i for i, (a, b) in enumerate(zip(got["plain"], got["draft Q4_1"])) if a["ids"] != b["ids"]]
    drafted = sum(g["draft_n"] for g in got["draft Q4_1"])
    accepted = sum(g["draft_accepted"] for g in got["draft Q4_1"])
    evidence = (f"{len(differ)} of {len(requests)} greedy tool calls came out with different tokens with the draft "
                f"({accepted} of {drafted} drafted tokens accepted)")
    return ("runtime" if differ else None), evidence, {"differ": differ}
