"""A tool call and its result through the server, with a real agent (notebook 20).

The embedded model calls no tool on its own, so notebook 20's other runs are one turn each:
no tool call and no tool result ever reaches the server, yet the chat template and the
tool-call parser are where a local agent fails most. The lab's `force_first_tool` option
(`ops.lab_options.first_tool_forcer`, stated on the call it changes: its `forced` column)
makes the task's first call ask for one tool alone, with llama-server's grammar and the
call's opening prefilled, greedy: the answer is one valid call, and the agent runs the tool and sends
its result back, as it does with a model that calls tools.

`tool_round_trip(out)` reads each call's structure from its captured body, never its text:
the tools offered, the tool calls and results it carries (and how many results the agent
marked as errors), how the server's answer stopped, the server's prompt and evaluated tokens.
`tool_result_rendered(out)` asks a fresh server with the same template what it makes of the
first tool result: that call's body counted twice (`/v1/messages/count_tokens`: no prefill),
as captured and with the results' text emptied. The difference is what the template rendered
of the results; none means it dropped them, and the model never saw what its tool returned.
`template_line(out)` names the template a lab's server ran and sets its count of the first
call against that call's parts tokenised one by one (a part the template drops shows as a
server count below the parts' sum).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from infercourse.ops.agent_lab import anatomy, calls_table
from infercourse.ops.agent_stream import GENERATING_APIS
from infercourse.ops.anthropic_probe import post_messages

__all__ = ["tool_round_trip", "tool_result_rendered", "tool_sentence", "template_line"]


def _blocks(message: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    content = message.get("content")
    return [b for b in content if isinstance(b, dict) and b.get("type") == kind] if isinstance(content, list) else []


def _body(out: str | Path, request_id: int) -> dict[str, Any]:
    path = Path(out) / "bodies" / f"{request_id:03d}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def tool_round_trip(out: str | Path) -> pd.DataFrame:
    """One row per model call of a lab run: whether the lab forced it, the tools it offered,
    the tool calls and tool results its messages carry (`results_marked_error`: results the
    agent flagged as its tool's error), how the answer stopped, the server's prompt and
    evaluated tokens, and the first part that differs from the call before."""
    calls = calls_table(out)
    rows = []
    for r in calls[calls["api"].isin(GENERATING_APIS)].to_dict("records"):
        doc = _body(out, int(r["request_id"]))
        msgs = [m for m in doc.get("messages") or [] if isinstance(m, dict)]
        results = [b for m in msgs for b in _blocks(m, "tool_result")]
        forced = r.get("forced")
        rows.append({"request_id": r["request_id"], "task": r["task"],
                     "forced": forced if isinstance(forced, str) else None,
                     "tools_offered": len(doc.get("tools") or []),
                     "tool_calls_sent": sum(len(_blocks(m, "tool_use")) for m in msgs),
                     "tool_results_sent": len(results), "results_marked_error": sum(bool(b.get("is_error")) for b in results),
                     "stop_reason": r.get("stop_reason"), "prompt_tokens": r.get("prompt_tokens"),
                     "evaluated_tokens": r.get("evaluated_tokens"), "first_diff": r.get("first_diff")})
    return pd.DataFrame(rows)


def _count(url: str, doc: dict[str, Any]) -> int | None:
    status, answer = post_messages(url, {k: doc[k] for k in ("model", "system", "tools", "messages") if k in doc},
                                   120, route="/v1/messages/count_tokens")
    return answer.get("input_tokens") if status == 200 else None


def tool_result_rendered(out: str | Path, *, model: str | Path | None = None, template: str | Path | None = None,
                         ctx: int = 8192, server_args: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """What the server's template makes of the first call that carries tool results: its
    prompt tokens as captured and with every result's text emptied (the server's own count,
    no prefill), the difference (`rendered_tokens`: 0, the template dropped them) and the
    results' characters. Empty where no call carried a result.

    Args:
        out: a lab run's folder. model, ctx, server_args: as the lab served it.
        template: the chat template file (None: the course's tools template, the lab's).
    """
    from infercourse.measure.workloads import DATA_DIR
    from infercourse.servers import LlamaServer
    trip = tool_round_trip(out)
    carrying = trip[trip["tool_results_sent"] > 0]
    if not len(carrying):
        return {}
    rid = int(carrying["request_id"].iloc[0])
    doc = _body(out, rid)
    texts, blank = [], json.loads(json.dumps(doc))
    for m in blank.get("messages") or []:
        for b in _blocks(m, "tool_result"):
            c = b.get("content")
            texts.append(c if isinstance(c, str) else " ".join(x.get("text", "") for x in c or [] if isinstance(x, dict)))
            b["content"] = ""
    extra = ["--chat-template-file", str(template or DATA_DIR / "chatml_tools.jinja"), *server_args]
    with LlamaServer(model, n_parallel=1, ctx_size=ctx, threads=1, jinja=True, extra_args=extra) as srv:
        full, empty = _count(srv.url, doc), _count(srv.url, blank)
    return {"request_id": rid, "results": len(texts), "result_chars": sum(len(t) for t in texts),
            "prompt_tokens": full, "results_emptied": empty,
            "rendered_tokens": full - empty if None not in (full, empty) else None}


def tool_sentence(trip: pd.DataFrame, rendered: dict[str, Any]) -> str:
    """What the forced round trip showed, from `tool_round_trip` and `tool_result_rendered`."""
    forced = trip[trip["forced"].notna()]
    if not len(forced):
        return "No call was forced here: the run holds no tool round trip."
    first = forced.iloc[0]
    after = trip[(trip["request_id"] > first["request_id"]) & (trip["tool_results_sent"] > 0)]
    line = f"The forced call ({first['forced']}) came back with stop reason {first['stop_reason']}; "
    if not len(after):
        return line + "the agent sent no tool result after it: the round trip did not close."
    nxt = after.iloc[0]
    line += (f"the agent ran the tool and its next call carried {nxt['tool_results_sent']:.0f} tool result(s) "
             f"({nxt['results_marked_error']:.0f} marked as the tool's error), answered with stop reason "
             f"{nxt['stop_reason']}. ")
    n = rendered.get("rendered_tokens")
    if n is None:
        return line + "The server did not count the call, so what its template rendered is not known."
    if n <= 0:
        return line + (f"Emptying the results' {rendered['result_chars']:,} characters left the server's count as it "
                       "was: the template dropped them, and the model never saw what its tool returned.")
    return line + (f"The template rendered {n:,} tokens of the results' {rendered['result_chars']:,} characters "
                   f"(the server counted {rendered['prompt_tokens']:,} tokens with them, {rendered['results_emptied']:,} "
                   "with their text emptied): the model reads what its tool returned.")


def template_line(out: str | Path) -> str:
    """The chat template a lab run's server ran (its argv in the manifest) and the server's
    prompt tokens for the first model call against the sum of that call's parts tokenised one
    by one (the anatomy): the template's markup adds a few tokens per part, and a count below
    the sum means the template dropped something the agent sent."""
    argv = json.loads((Path(out) / "manifest.json").read_text()).get("engine", {}).get("argv") or []
    tpl = (Path(argv[argv.index("--chat-template-file") + 1]).name if "--chat-template-file" in argv
           else "the model's own (from its file)")
    calls = calls_table(out)
    gen = calls[calls["api"].isin(GENERATING_APIS) & calls["prompt_tokens"].notna()]
    anat = {a["request_id"]: a for a in anatomy(out)}
    if not len(gen) or int(gen["request_id"].iloc[0]) not in anat:
        return f"The server ran the chat template {tpl}; no answered call to count against its parts."
    first = gen.iloc[0]
    parts = sum(p.get("tokens") or 0 for p in anat[int(first["request_id"])]["parts"])
    server = int(first["prompt_tokens"])
    how = (f"{server - parts:,} more: the template's markup around the parts" if server >= parts else
           f"{parts - server:,} fewer: the template dropped part of what the agent sent")
    return (f"The server ran the chat template {tpl}. For the first answered call it counted {server:,} prompt "
            f"tokens; the call's parts tokenised one by one add up to {parts:,} ({how}).")
