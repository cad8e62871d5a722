"""One tool call through each family's chat template (notebook 16, section 12).

A chat template turns the API's messages into the one string a model reads. A tool call
makes that harder: the tool schemas, an assistant turn that *called* a tool (its
`tool_calls`, often with no text at all), the tool's *result* (`role: "tool"`) and a
`system` message in the middle of the history all need a place in that string, and each
family's turn format has its own, or none. ChatML writes any role as `<|im_start|>ROLE`;
Gemma's format has two roles, `user` and `model`, so a template must decide where a system
message and a tool result go (ours, `data/gemma3_tools.jinja`, says what it decides). A
template may also drop a part silently: the model then never sees it, and an agent that
sent it does not know.

Measured with one request (`MESSAGES`, `TOOLS`) on every preset, from the server itself:

- `rendered_parts`: the prompt rendered (`/apply-template`) with and without each part; the
  span that differs is what the template made of it: nothing (dropped), a turn of its own
  (its role read from the turn's header) or text inside another turn. The span is counted
  alone by the server's tokenizer (`/tokenize`), and so is the part's raw text, as
  `ops.agent_anatomy` counts parts: the difference is the template's markup.
- `answers`: the same request with `tool_choice` "required" and "auto"; `classify` says
  whether the answer came back as a tool call (structured, a tool offered, JSON arguments),
  a call written as text the server did not parse, or no call.

`compare_presets` runs both on one router that holds every preset at once, and reads the memory
each child holds and the loads its log timed. `table` and `text` turn that into the
notebook's table and sentences.
"""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import httpx
import pandas as pd

from infercourse.engines.tools import parse_arguments, text_tool_call, tool_names
from infercourse.servers.llama_router import course_router, load_times

__all__ = ["TOOLS", "MESSAGES", "PARTS", "CHOICES", "reduced", "span", "where", "rendered_parts", "classify",
           "answers", "compare_presets", "table", "text"]

TOOLS = [{"type": "function", "function": {
    "name": "list_files", "description": "List the files in a folder.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
MESSAGES = [
    {"role": "system", "content": "You are a coding assistant. Use the tools."},
    {"role": "user", "content": "List the files in src."},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "list_files", "arguments": "{\"path\": \"src\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "src/main.py\nsrc/util.py"},
    {"role": "system", "content": "Reminder: the user may ask for more folders."},
    {"role": "user", "content": "Now list the files in tests."},
]
# part -> (index of the message it is, None: the tool schemas; text that shows it survived)
PARTS = {"tool schemas": (None, "List the files in a folder."), "system (first)": (0, MESSAGES[0]["content"]),
         "user": (1, MESSAGES[1]["content"]), "assistant tool call": (2, "list_files"),
         "tool result": (3, "src/main.py"), "system (middle)": (4, MESSAGES[4]["content"]),
         "user (last)": (5, MESSAGES[5]["content"])}
CHOICES = ("required", "auto")
_MARKERS = ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>")   # ChatML's, Gemma's
_TAGS = ("<tools>", "<tool_call>", "<tool_response>")
_HEADER = re.compile(r"(?:<\|im_start\|>|<start_of_turn>)(\w+)")


def _raw(part: str) -> str:
    """The part's own text, as an agent sends it (no template markup)."""
    i = PARTS[part][0]
    if i is None:
        return json.dumps(TOOLS, separators=(",", ":"))
    if part == "assistant tool call":
        f = MESSAGES[i]["tool_calls"][0]["function"]
        return json.dumps({"name": f["name"], "arguments": json.loads(f["arguments"])})
    return MESSAGES[i]["content"]


def reduced(part: str) -> dict[str, Any]:
    """The request without `part`: no tools, a message left out, or the assistant's message
    kept with its tool call taken away (so only the call itself differs)."""
    i = PARTS[part][0]
    if i is None:
        return {"messages": MESSAGES}
    if part == "assistant tool call":
        return {"messages": [*MESSAGES[:i], {"role": "assistant", "content": ""}, *MESSAGES[i + 1:]], "tools": TOOLS}
    return {"messages": [m for k, m in enumerate(MESSAGES) if k != i], "tools": TOOLS}


def span(full: str, without: str) -> tuple[int, str]:
    """Where `full` differs from `without` (the prompt rendered without one part): the start
    and the text of the span between their common prefix and common suffix ("" when equal)."""
    n = min(len(full), len(without))
    p = 0
    while p < n and full[p] == without[p]:
        p += 1
    s = 0
    while s < n - p and full[-1 - s] == without[-1 - s]:
        s += 1
    seg = full[p:len(full) - s]
    # the same removal can sit a few characters earlier ("user…<|im_start|>" or "<|im_start|>user…"):
    # prefer the position where it opens a turn, else where it opens a tag, so it reads as what it is
    k, best = 0, {}
    while seg and k < p and full[p - 1 - k] == full[p + len(seg) - 1 - k]:
        k += 1
        for kind, marks in (("turn", _MARKERS[::2]), ("tag", _TAGS)):
            if kind not in best and full.startswith(marks, p - k):
                best[kind] = k
    k = best.get("turn", best.get("tag", 0))
    return p - k, full[p - k:p - k + len(seg)]


def _turn(full: str, pos: int) -> str:
    """The whole turn around `pos`: from its header's marker to its end marker (and newline)."""
    start = max(full.rfind(m, 0, pos + 1) for m in _MARKERS[::2])
    ends = [(e, m) for m in _MARKERS[1::2] if (e := full.find(m, pos)) >= 0]
    if start < 0 or not ends:
        return full
    e, m = min(ends)
    return full[start:e + len(m) + (full[e + len(m):e + len(m) + 1] == "\n")]


def where(full: str, start: int, seg: str, key: str, others: Sequence[str] = ()) -> tuple[str, str | None]:
    """How a part appears in the rendered prompt, and the text that is it.

    Args:
        full: the prompt; start, seg: where it differs from the prompt without the part (`span`).
        key: text that shows the part survived; others: the other parts' keys.

    Returns (description, text): "dropped" (text ""), "as its own `ROLE` turn" (a header in
    its span) or "inside the `ROLE` turn" (the last header before it), with the tags around
    it (text: the span). Where leaving it out changed other text too, "in the `ROLE` turn"
    and why: the template writes its own text in its place (text: the part's whole turn),
    or other text moved (text None: the span is not the part alone).
    """
    if not seg:
        return "dropped", ""
    if key in seg and not any(o in seg for o in others):
        own = _HEADER.findall(seg)
        before = _HEADER.findall(full[:start])
        out = f"as its own `{own[0]}` turn" if own else f"inside the `{before[-1]}` turn" if before else "before any turn"
        tags = sorted((t for t in _TAGS if t in seg), key=seg.index)
        return out + (", in " + " ".join(f"`{t}`" for t in tags) if tags else ""), seg
    if key in seg:   # leaving it out moved other text (e.g. a preamble into the next turn)
        pos, why, text = start + seg.index(key), "leaving it out moves other text", None
    else:            # its text sits next to the span: the template writes something else in its place
        near = [m.start() for m in re.finditer(re.escape(key), full)
                if m.start() <= start + len(seg) and m.end() >= start]
        if not near:
            return "dropped (the template changed other text)", ""
        pos, why = near[0], "left out, the template writes its own text there"
        text = _turn(full, pos)
    before = _HEADER.findall(full[:pos])
    return (f"in the `{before[-1]}` turn ({why})" if before else f"before any turn ({why})"), text


def rendered_parts(render: Callable[[dict], str], count: Callable[[str], int]) -> pd.DataFrame:
    """One row per part of the request: how the template renders it and what it costs.

    Args:
        render: request body -> the prompt text (a server's `/apply-template`).
        count: text -> its tokens, counted alone (a server's `/tokenize`, no BOS).

    Returns columns part, rendered (`where`), appears, tokens (the part as rendered, counted
    alone; where leaving it out moves other text, the prompt's tokens with it less without
    it), content_tokens (the part's own text, alone), markup_tokens (the difference), text
    (the span); a last row "whole prompt" carries the prompt's tokens.
    """
    full = render({"messages": MESSAGES, "tools": TOOLS})
    n_full = count(full)
    keys = {p: k for p, (i, k) in PARTS.items() if i is not None and p != "assistant tool call"}   # message texts
    rows = []
    for part, (_, key) in PARTS.items():
        without = render(reduced(part))
        start, seg = span(full, without)
        shown, text = where(full, start, seg, key, [k for p, k in keys.items() if p != part])
        tok = (count(text) if text else 0) if text is not None else n_full - count(without)
        raw = count(_raw(part))
        ok = not shown.startswith("dropped")
        rows.append({"part": part, "rendered": shown, "appears": ok, "tokens": tok, "content_tokens": raw,
                     "markup_tokens": tok - raw if ok and text is not None else None, "text": seg})
    rows.append({"part": "whole prompt", "rendered": "", "appears": True, "tokens": n_full,
                 "content_tokens": None, "markup_tokens": None, "text": full})
    df = pd.DataFrame(rows)
    df.attrs["markers"] = {m: count(m) for m in _MARKERS if m in full}   # each turn marker, in tokens
    return df


def classify(body: Mapping[str, Any] | None, error: str | None = None, names: Sequence[str] = ()) -> dict[str, Any]:
    """What an answer to the tool request was.

    Args:
        body: the chat completion's JSON (None when the request failed).
        error: the failure, when it did.
        names: the tools offered.

    Returns outcome ("tool call": structured, the first call names an offered tool with JSON
    object arguments; "tool call, bad arguments"; "call as text": a call the server left in
    the text; "no call"; "refused"), the calls parsed, how many were valid, the first call
    and the finish reason.
    """
    if body is None:
        return {"outcome": "refused", "calls": 0, "valid_calls": 0, "first_call": None, "finish": None,
                "content": (error or "")[:120]}
    choice = (body.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    calls = msg.get("tool_calls") or []
    valid = []
    for c in calls:
        f = c.get("function") or {}
        args, bad = parse_arguments(f.get("arguments") or "")
        valid.append(f.get("name") in names and bad is None and isinstance(args, dict))
    first = calls[0]["function"] if calls else None
    if calls:
        outcome = "tool call" if valid[0] else "tool call, bad arguments"
    else:
        outcome = "call as text" if text_tool_call(msg.get("content") or "", list(names)) else "no call"
    return {"outcome": outcome, "calls": len(calls), "valid_calls": sum(valid),
            "first_call": f"{first.get('name')} {first.get('arguments')}" if first else None,
            "finish": choice.get("finish_reason"), "content": (msg.get("content") or "")[:120]}


def answers(url: str, model: str, *, max_tokens: int = 40, choices: Sequence[str] = CHOICES) -> list[dict[str, Any]]:
    """The tool request to `model` through the router at `url`, once per `tool_choice`
    (greedy, `max_tokens` at most), classified (`classify`)."""
    rows = []
    for choice in choices:
        body = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
                "max_tokens": max_tokens, "temperature": 0}
        t0 = time.perf_counter()
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
            ok = r.status_code < 400
            got = classify(r.json() if ok else None, None if ok else f"HTTP {r.status_code}: {r.text}",
                           tool_names(TOOLS))
            usage = (r.json().get("usage") or {}) if ok else {}
        except httpx.HTTPError as e:
            got, usage = classify(None, type(e).__name__), {}
        rows.append({"model": model, "tool_choice": choice, **got, "prompt_tokens": usage.get("prompt_tokens"),
                     "completion_tokens": usage.get("completion_tokens"), "seconds": time.perf_counter() - t0})
    return rows


def _server_calls(url: str, model: str) -> tuple[Callable[[dict], str], Callable[[str], int]]:
    def render(body: dict) -> str:
        r = httpx.post(url + "/apply-template", json={"model": model, **body}, timeout=120)
        r.raise_for_status()
        return r.json()["prompt"]

    def count(text: str) -> int:
        r = httpx.post(url + "/tokenize", json={"model": model, "content": text, "add_special": False}, timeout=120)
        r.raise_for_status()
        return len(r.json()["tokens"])
    return render, count


def compare_presets(presets: Sequence[Any], *, max_tokens: int = 40, workers: int = 2,
                    **router_kw: Any) -> dict[str, Any]:
    """Every preset on one router at once (models_max = their count): each one's rendered
    parts and its answers to the tool request, the memory each child then holds, and each
    load the router's log timed.

    Args:
        presets: `servers.llama_router.Preset`s (a template file rides in their flags).
        max_tokens: the answers' cap; workers: presets answered at once (one thread each).
        router_kw: to `course_router` (threads, ctx_size...).

    Returns {"parts": {name: `rendered_parts`}, "answers": one row per (model, tool_choice),
    "memory": `LlamaRouter.memory()`, "loads": `load_times` of the router's log}.
    """
    names = [p.name for p in presets]
    with course_router(len(presets), presets, **router_kw) as r:
        with ThreadPoolExecutor(max_workers=len(names)) as pool:   # every child up at once, before anything runs
            list(pool.map(r.load, names))
        parts = {n: rendered_parts(*_server_calls(r.url, n)) for n in names}
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            rows = [row for got in pool.map(lambda n: answers(r.url, n, max_tokens=max_tokens), names) for row in got]
        memory = r.memory()
        loads = load_times(r.log_path.read_text(errors="replace"))
    return {"parts": parts, "answers": pd.DataFrame(rows), "memory": memory, "loads": loads}


def table(result: Mapping[str, Any]) -> pd.DataFrame:
    """Parts (rows) by preset (columns): how each part was rendered and its tokens, the whole
    prompt's tokens, and what each `tool_choice` answer was."""
    cols = {}
    for name, df in result["parts"].items():
        cells = {r["part"]: (f"{r['tokens']} tok" if r["part"] == "whole prompt" else
                             f"{r['rendered']} · {r['tokens']} tok" if r["appears"] else r["rendered"])
                 for _, r in df.iterrows()}
        ans = result["answers"][result["answers"]["model"] == name]
        for _, a in ans.iterrows():
            said = a["first_call"] if isinstance(a["first_call"], str) else f"finish {a['finish']}"
            cells[f"answer, tool_choice {a['tool_choice']}"] = f"{a['outcome']} ({said})"
        cols[name] = cells
    return pd.DataFrame(cols)


def _row(df: pd.DataFrame, part: str) -> pd.Series:
    return df[df["part"] == part].iloc[0]


def _says(r: pd.Series, what: str) -> str:
    return (f"renders the {what} {r['rendered']} ({r['tokens']} tokens)" if r["appears"]
            else f"drops the {what}" + ("" if r["rendered"] == "dropped" else f" ({r['rendered']})"))


def _answer(a: Mapping[str, Any]) -> str:
    if a["outcome"] == "tool call":
        more = (f"; {a['calls'] - 1} more call(s), {a['valid_calls']} of {a['calls']} valid" if a["calls"] > 1 else "")
        return f"with `{a['tool_choice']}` the answer parsed as a tool call ({a['first_call']}{more})"
    finish = f", finish {a['finish']}" if a["finish"] else ""
    return f"with `{a['tool_choice']}` the answer did not parse as a tool call ({a['outcome']}{finish})"


def text(result: Mapping[str, Any]) -> str:
    """What each template did with the same request, and what each answer was, from
    `compare_presets`' result: one line per preset, then the markup a turn costs in each."""
    lines = []
    for name, df in result["parts"].items():
        mid = _row(df, "system (middle)")
        sys_line = (f"the middle system message survives, {mid['rendered']}" if mid["appears"]
                    else "the middle system message is **dropped**")
        ans = result["answers"][result["answers"]["model"] == name]
        lines.append(f"- **{name}** {_says(_row(df, 'tool schemas'), 'tool schemas')}, "
                     f"{_says(_row(df, 'assistant tool call'), 'tool call')} and "
                     f"{_says(_row(df, 'tool result'), 'tool result')}; {sys_line}; the whole prompt is "
                     f"{_row(df, 'whole prompt')['tokens']} tokens; "
                     + ", ".join(_answer(a) for _, a in ans.iterrows()) + ".")
    last = {n: _row(df, "user (last)") for n, df in result["parts"].items()}
    shown = {n: int(r["markup_tokens"]) for n, r in last.items() if r["appears"] and pd.notna(r["markup_tokens"])}
    if shown:
        lo, hi = min(shown, key=shown.get), max(shown, key=shown.get)
        marks = {n: ", ".join(f"`{m}` {k}" for m, k in df.attrs.get("markers", {}).items())
                 for n, df in result["parts"].items()}
        lines.append("- One user turn's markup (the last user message rendered, less its own text): " + ", ".join(
            f"{n} {k} tokens" for n, k in shown.items()) + (
            f": {hi} spends {shown[hi] - shown[lo]} more than {lo} on the same turn" if shown[hi] > shown[lo]
            else ": the same in every one") + ". Each turn marker, counted alone by its model's tokenizer: "
            + "; ".join(f"{n}: {m or 'none found'}" for n, m in marks.items()) + ".")
    return "\n".join(lines)
