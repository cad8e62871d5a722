"""What a real-agent run showed, in words computed from its own numbers (notebook 20).

Notebook 20's markdown explains mechanisms (the prefix cache, the billing header, the
window the agent assumes, a client timeout); whether the warm call was faster, whether the
header cost a new task its prefix, whether the agent compacted and whether a short timeout
made the server pay twice can only come from the run. Each function here takes the tables
`lessons.real_agent` and `lessons.real_agent_session` build from a lab run's folder (or
their plain dicts) and returns a sentence that flips when the numbers flip; where the
numbers cannot decide (a cold/warm ratio inside the spread of two warm runs), it says so.
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from infercourse.ops.agent_lab import refused_size, refused_window

__all__ = ["ends_sentence", "ledger_sentence", "cold_warm_sentence", "header_sentence", "amplification_sentence",
           "plan_sentence", "compaction_sentence", "rewrite_sentence", "clip_sentence", "changed_part_sentence"]


def _fold(ratio: float) -> str:
    """A ratio and its inverse read the same way: 0.5 is "2.0x", 25 is "25x"."""
    r = ratio if ratio >= 1 else 1 / ratio
    return f"{r:.0f}x" if r >= 10 else f"{r:.1f}x"


_CAPPED = "output token maximum"   # Claude Code's error for an answer cut at CLAUDE_CODE_MAX_OUTPUT_TOKENS


def ends_sentence(tab: pd.DataFrame) -> str:
    """How the tasks ended in the agent's own words (`agent_said`, from its own result), counted
    by kind, and how many of those ends the answer cap made: Claude Code reports an answer cut at
    its output cap as an API error (after asking to continue it), so a capped task is not a
    refused one.

    Args:
        tab: `real_agent.evaluated_by_task` (its agent_said column).
    """
    said = tab["agent_said"].fillna("not recorded").astype(str)
    counts = said.map(_kind).value_counts()
    line = (f"In the agent's own words, the {len(tab)} tasks ended: "
            + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + ".")
    capped = int(said.str.contains(_CAPPED).sum())
    if capped:
        line += (f" {capped} of them ended in the API error the answer cap makes (an answer cut at "
                 "CLAUDE_CODE_MAX_OUTPUT_TOKENS, which the agent tries to continue, then reports as an error); "
                 "a first call is sent before any answer, so its prompt side does not depend on how its task ended.")
    cut = int((tab.get("cut_by_server", pd.Series(False, index=tab.index)).fillna(False).astype(bool)
               & said.eq("completed")).sum())
    if cut:
        line += (f" {cut} task(s) the agent reports completed ended on an answer the server cut at its own output "
                 "cap (`-n`: the agent named no max_tokens): the agent did not see the cut.")
    return line


def cold_warm_sentence(tab: pd.DataFrame, cold: str, warm: str, again: str) -> str:
    """What the cold and the two warm runs of one task showed, with the warm pair as the A/A
    spread (one pair: a range, not an interval): the warm call faster or slower, by the fold
    (a slower warm call's ratio is inverted, so "2.0x slower", never "0x"), only beyond it.

    Args:
        tab: `real_agent.evaluated_by_task` (ttft_s, evaluated_tokens per task).
        cold, warm, again: the three tasks' labels (the same task three times).
    """
    c, w, a = (tab.loc[k] for k in (cold, warm, again))
    aa = max(w["ttft_s"], a["ttft_s"]) / min(w["ttft_s"], a["ttft_s"]) - 1
    ratio = c["ttft_s"] / w["ttft_s"]
    beyond = ratio > 1 + aa or ratio < 1 / (1 + aa)
    how = (f"a cold/warm ratio of {ratio:.2f}" if not beyond else
           f"{_fold(ratio)} faster warm" if ratio > 1 else f"{_fold(ratio)} slower warm")
    return (f"The cold call evaluated {c['evaluated_tokens']:,.0f} prompt tokens and waited {c['ttft_s']:.2f} s "
            f"for its first token; the same task again evaluated {w['evaluated_tokens']:,.0f} and waited "
            f"{w['ttft_s']:.2f} s ({how}). The two warm runs differ by {aa:.0%} (one A/A pair: a range, not an "
            "interval); the cold/warm ratio is "
            + ("beyond it." if beyond else "within it: this run cannot tell them apart."))


def header_sentence(tab: pd.DataFrame, on: str, off: str, cold: str | None = None) -> str:
    """A new task's re-prefill with the header on against off (first calls), as shares of each one's prompt
    (the two may run at different sizes); where the header made a smaller request evaluate all of itself
    again, its cost at the full size is `cold`'s first call (the full request, cold)."""
    a, b = tab.loc[on], tab.loc[off]
    sa, sb = (float(r["evaluated_tokens"]) / float(r["prompt_tokens"] or "nan") for r in (a, b))
    of = lambda r, sh: (f"{r['evaluated_tokens']:,.0f} prompt tokens (the server's usage gave no prompt size)" if pd.isna(sh)
                        else f"{r['evaluated_tokens']:,.0f} of its {r['prompt_tokens']:,.0f} prompt tokens ({sh:.0%})")
    verdict = ("Without both prompt sizes this run cannot compare the shares." if pd.isna(sa) or pd.isna(sb) else
               "A larger share of its prompt with the header on." if sa > sb + 0.005 else
               "A smaller share of its prompt with the header on." if sa < sb - 0.005 else
               "The same share with the header on as off: here the header cost nothing.")
    out = (f"A new task with the header on evaluated {of(a, sa)}; first difference: {a['first_diff']}. With "
           f"CLAUDE_CODE_ATTRIBUTION_HEADER=0 a new task evaluated {of(b, sb)}; first difference: {b['first_diff']}. {verdict}")
    if (c := tab.loc[cold] if cold is not None else None) is not None and sa >= 0.99 and float(c["prompt_tokens"]) > float(a["prompt_tokens"]):
        out += (f" With the header on a new task evaluates its whole prompt again: at the full size ({cold}'s {c['prompt_tokens']:,.0f} "
                f"tokens) that is {cold}'s cold prefill, {c['ttft_s']:.1f} s to the first token on this server, for every new task.")
    return out


_SIZE_FROM = {"server usage": "", "server refusal": " (the size the server's refusal named: no copy was answered)",
              "request body": " (its parts counted from the captured body: no copy was answered)"}


def amplification_sentence(tab: pd.DataFrame, short: str, fixed: str) -> str:
    """What the short and the long client timeout cost the server, computed from
    `real_agent.amplification` (where no copy was answered, the sentence says where the
    request's size came from; where none did, that no ratio was computed)."""
    def one(r) -> str:
        retried = f"{r['copies']:.0f} copies of its first request" if r["copies"] > 1 else "its first request once (no retry)"
        said = (f"sent {retried}, {r['answered']:.0f} answered; the server evaluated {r['server_evaluated']:,.0f} "
                "prompt tokens")
        if pd.isna(r["amplification"]):
            return said + " (no request size or no evaluated count: no amplification computed)"
        return (f"{said} for a request of {r['request_tokens']:,.0f}{_SIZE_FROM.get(r.get('size_from'), '')} "
                f"({r['amplification']:.1f}x)")
    return f"With the short timeout the agent {one(tab.loc[short])}. With the long one it {one(tab.loc[fixed])}."


def clip_sentence(view: pd.DataFrame, said: str) -> str:
    """What the agent did once the server clipped its answer, read from `real_agent.clip_view`:
    where the first answer stopped against the room the window left, then each later call as the
    table shows it (max_tokens raised, refused for size, the same prompt sent again (its max_tokens
    may differ: the prompt is what the capture compares), another system prompt), and the task's
    end in the agent's own words (`said`, its `agent_said`)."""
    first, rest = view.iloc[0], view.iloc[1:]
    windows = view["error"].map(refused_window).dropna()
    window = int(windows.iloc[0]) if len(windows) else None
    if first["status"] != "ok":
        line = f"The first call was refused ({str(first['error'])[:120]})"
    else:
        room = (f", all the room its {window:,}-token window left after the {int(first['prompt_tokens']):,}-token prompt"
                if window and int(first["prompt_tokens"]) + int(first["output_tokens"]) >= window else "")
        line = (f"The first call asked for max_tokens {int(first['max_tokens']):,}; the server stopped its answer at "
                f"{int(first['output_tokens']):,} tokens (stop_reason {first['stop_reason']}{room})")
        if first["stop_reason"] != "max_tokens":
            line += ": the answer ended before the window did, so this run did not clip it"
    if len(rest):
        sizes = rest["error"].map(refused_size).dropna()
        raised = rest.loc[rest["max_tokens"] > first["max_tokens"], "max_tokens"]
        counted = [(len(raised), f"with max_tokens raised to {raised.max():,.0f}"),
                   (len(sizes) if window else 0, f"refused by the server for size (requests of {sizes.min():,.0f} to "
                                                 f"{sizes.max():,.0f} tokens against its {window or 0:,}-token window)"),
                   (int((rest["status"] == "ok").sum()), "answered"),
                   (int((rest["first_diff"] == "identical").sum()),
                    "sent again with the same prompt right after the one before"),
                   (int((rest["first_diff"] == "system 0").sum()),
                    "starting from another system prompt (first difference at system 0)")]
        line += f". Then {len(rest)} more call(s): " + "; ".join(f"{n} {what}" for n, what in counted if n)
    return line + f". The task ended, in the agent's words: {_end(str(said))}."


def plan_sentence(plan: dict[str, int]) -> str:
    """The window the session gets and where the told agent's limits fall, from `real_agent.compaction_plan`."""
    w, t, b, f = plan["window"], plan["compacts_above"], plan["refuses_above"], plan["first_turn"]
    told = ("below the first turn: told, it refuses to send at all" if b < f else
            "below the first turn: told, it compacts at every call" if t < f else
            f"{t - f:,} tokens above the first turn: told, it compacts once the session has grown that much"
            + _in_pastes(t - f, plan["paste_tokens"]))
    as_is = ("beyond the window: as is, the session outgrows the server in its last turn"
             if plan["last_turn"] > w else "within the window: as is, the session does not outgrow this server")
    last = plan.get("last_paste_tokens")
    pastes = (f"each turn but the last pastes up to {plan['paste_tokens']:,}, the last {last:,} at once (a long file),"
              if last else f"each turn pastes up to {plan['paste_tokens']:,},")
    return (f"The session's first turn is about {f:,} tokens; {pastes} and "
            f"the last turn holds at least {plan['last_turn']:,}, {as_is}. The server's window: {w:,} tokens. Told "
            f"it, with answers capped at {plan['max_output']:,}, this agent version refuses to send a prompt it counts "
            f"over {b:,} tokens (its own count, which need not match the server's), and its compaction threshold is "
            f"{t:,}, {told}." + (_told_last(plan["told_last"], b) if last else ""))


def _told_last(told_last: int, refuses: int) -> str:
    """Whether the last turn fits the told agent after a compaction: first request and last paste
    (the summary not counted) against its refuse line."""
    fits = (f"{refuses - told_last:,} under its refuse line: told, it can send that turn after a compaction"
            if told_last < refuses else "over its refuse line: told, it cannot send that turn either")
    return f" After a compaction that last turn holds about {told_last:,} tokens and a summary, {fits}."


def _in_pastes(room: int, paste: int) -> str:
    """The compaction line's height above the first turn, in this session's pastes. How often the
    told agent compacts is not derived from it: its own count of an unsent prompt runs above the
    server's, so that is measured (`compaction_sentence` names the turns)."""
    return f" (about {room / paste:.1f} pastes)"


def _listed(items: list[str]) -> str:
    """"turn 2", "turn 2 and turn 4", "turn 2, turn 4 and turn 6"."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def _session_read(v: pd.DataFrame) -> dict[str, Any]:
    """What one growing session showed, from `real_agent_session.session_view`."""
    sent = v[v["status"] != "not sent"].reset_index(drop=True)
    by_server = sent[sent["refused_by"] == "server"]
    rewrites = sent.index[sent["rewrote_history"].fillna(False).astype(bool)]
    first = rewrites[0] if len(rewrites) else None
    before = sent["prompt_tokens"].iloc[:first].dropna() if first is not None else pd.Series(dtype=float)
    turns = v.drop_duplicates("turn")
    return {"calls": len(sent), "largest": sent["prompt_tokens"].max(), "server_refused": len(by_server),
            "first_refused": by_server["turn"].iloc[0] if len(by_server) else None,
            "not_sent": int((v["refused_by"] == "agent").sum()), "timeouts": int((turns["ended"] == "timeout").sum()),
            "rewrites": len(rewrites), "rewrite_turns": list(dict.fromkeys(sent["turn"].iloc[rewrites])),
            "rewrote_after_refusal": first is not None and len(by_server) > 0 and first > by_server.index[0],
            "before": before.iloc[-1] if len(before) else float("nan"),
            "after": sent["prompt_tokens"].iloc[first] if first is not None else float("nan"),
            "window": v["agent_window"].max(), "compact_logged": list(turns.loc[turns["compact_logged"], "turn"]),
            "said": [f"{r.turn} {_end(r.agent_said)}" for r in turns.itertuples()
                     if isinstance(getattr(r, "agent_said", None), str)]}


def _end(said: str) -> str:
    """A turn's end in the agent's words, by kind ("api_error", not the message cut at 100
    characters), naming the answer cap where it made the error."""
    return _kind(said) + (" (the answer cap)" if _CAPPED in said else "")


def _kind(said: str) -> str:
    """The kind of an end in the agent's words: what precedes its message ("api_error")."""
    return said.split(":")[0]


def _session_clause(name: str, r: dict[str, Any]) -> str:
    said = (f"the agent reported a window of {r['window']:,.0f} tokens" if r["window"] == r["window"]
            else "the agent reported no window")
    refused = (f"the server refused {r['server_refused']} of its {r['calls']} calls, the first in {r['first_refused']}"
               if r["server_refused"] else f"the server refused none of its {r['calls']} calls")
    if r["not_sent"]:
        refused += f"; the agent refused to send {r['not_sent']} turn(s) itself"
    if r["rewrites"]:
        move = "dropped" if r["after"] < r["before"] else "did not drop"
        hist = (f"it rewrote its history {r['rewrites']} time(s), in {_listed(r['rewrite_turns'])}, and the prompt "
                f"{move}: {r['before']:,.0f} tokens on the call before the first, {r['after']:,.0f} on the rewritten call")
    elif r["compact_logged"]:
        hist = (f"it logged a compaction query in {', '.join(r['compact_logged'])}, but no call started from a "
                f"summary: its history was never rewritten")
    else:
        hist = "its history was never rewritten"
    bound = f"; {r['timeouts']} turn(s) hit the task's time bound" if r["timeouts"] else ""
    ends = f"; how each turn ended, in the agent's words: {', '.join(r['said'])}" if r.get("said") else ""
    return f"{name}, {said}: {refused}; {hist}; its largest prompt was {r['largest']:,.0f} tokens{bound}{ends}"


def compaction_sentence(as_is: pd.DataFrame, told: pd.DataFrame, window: int) -> str:
    """What the two growing sessions (`session_view`s) showed on a `window`-token server: the
    window each agent reported, the refusals (the server's, and the agent's own), whether and
    where the history was rewritten and the prompt size around it, the turns cut by the time
    bound, and what, from these, the run shows about compaction."""
    a, t = _session_read(as_is), _session_read(told)
    failed = [x for x in t.get("said", []) if not x.endswith(" completed")]
    if t["rewrites"] and t["after"] < t["before"]:
        verdict = "Told the window, the agent compacted" + (f" (yet {len(failed)} of its turns did not complete)"
                                                            if failed else "") + (
            f", and still the server refused {t['server_refused']} of its calls" if t["server_refused"]
            else " and the server refused none of its calls") + (
            f"; as is, the session outgrew the server (refused for size in {a['first_refused']})" + (
                ", and the agent compacted only after that refusal." if a["rewrote_after_refusal"] else ".")
            if a["server_refused"] else
            "; as is, the session never outgrew this server, so this run does not show a refusal that compaction prevented.")
    elif t["compact_logged"]:
        verdict = ("Told the window, the agent started compacting but did not finish a compaction in this run: "
                   "no prompt drop to show.")
    else:
        verdict = ("Told the window, the agent did not compact in this run"
                   + (" (it refused to send instead)" if t["not_sent"] else "") + ": no prompt drop to show.")
    return f"On a {window:,}-token server. {_session_clause('As is', a)}. {_session_clause('Told the window', t)}. {verdict}"


def rewrite_sentence(table: pd.DataFrame, nothing: float = 0.02) -> str:
    """What each replay of the session reused and evaluated at each call that rewrote the history
    (`real_agent_session.rewrite_table`; exact counts, no noise floor), and, per rewrite, which
    replays lost what the first (the reference) kept: a share reused under half the reference's.
    Where the reference reused under `nothing` of its prompt, the change sat at the top and no
    family had a prefix to keep. Shares, not tokens, are compared: the families' tokenizers differ."""
    labels = list(dict.fromkeys(table.index.get_level_values("replay")))
    ref, out = labels[0], []
    for label in labels:
        if 0 in table.loc[label].index:
            out.append(f"**{label}**: no call of the {int(table.loc[(label, 0), 'calls'])} replayed rewrote the history.")
    for k in sorted(k for k in set(table.index.get_level_values("rewrite")) if k > 0):
        rows = table.xs(k, level="rewrite")
        each = "; ".join(f"{label} reused {r['reused']:,.0f} of {r['prompt_tokens']:,.0f} prompt tokens "
                         f"({r['reused_share']:.0%}) and evaluated {r['evaluated']:,.0f}" for label, r in rows.iterrows())
        head = f"**Rewrite {k}** ({rows['turn'].iloc[0]}): {each}."
        if ref not in rows.index:
            out.append(head)
            continue
        base = rows.loc[ref, "reused_share"]
        if base < nothing:
            more = [lb for lb in rows.index if rows.loc[lb, "reused_share"] >= nothing]
            out.append(f"{head} {ref} reused almost nothing: the change sat at the top of the prompt, and "
                       + (f"every family evaluated it whole." if not more else f"{' and '.join(more)} kept more."))
            continue
        lost = [lb for lb in rows.index if lb != ref and rows.loc[lb, "reused_share"] < base / 2]
        kept = [lb for lb in rows.index if lb != ref and lb not in lost]
        verdict = (f" {' and '.join(lost)} lost the prefix {ref} kept and evaluated the prompt again from the top"
                   if lost else f" No replay lost the prefix {ref} kept")
        out.append(head + verdict + (f"; {' and '.join(kept)} kept it." if lost and kept else "."))
    return " ".join(out)


def ledger_sentence(led: pd.DataFrame) -> str:
    """What the notebook's lab runs paid, from `real_agent_session.prefill_ledger`: model calls,
    the calls that evaluated a thousand tokens or more, and the run that held most of them."""
    if not len(led):
        return "No lab run was captured here (every measuring cell skipped)."
    top = led["big_prefills"].idxmax()
    return (f"The {len(led)} lab runs sent {led['model_calls'].sum():,} model calls; {led['big_prefills'].sum():,} of "
            f"them made the server evaluate 1,000 prompt tokens or more, and their tasks took "
            f"{led['wall_s'].sum():,.0f} s. The run with most such calls: {top} "
            f"({led.loc[top, 'big_prefills']:,} of {led.loc[top, 'model_calls']:,} calls, {led.loc[top, 'wall_s']:,.0f} s).")


def changed_part_sentence(records: list[dict[str, Any]], calls: pd.DataFrame, most: int = 3) -> str:
    """Calls whose first difference from the last call with the same system prompt lies in a part
    both carry (a system block or a tool schema the agent sent changed: the prefix cache loses
    everything from it on): that part's tokens in each call, and what the server evaluated. Where
    no first difference lies in such a part, that the system text and the tools stayed the same.

    Args:
        records: the capture's anatomy (`ops.agent_lab.anatomy`: parts and first differences).
        calls: its calls table (`real_agent.calls_table`: prompt and evaluated tokens per request).
    """
    last: dict[str, dict[str, Any]] = {}
    found, compared = [], 0
    for r in records:
        prev, d = last.get(r.get("system_key")), r.get("first_difference_same_system") or {}
        if prev is not None:
            compared += 1
            before, now = ({p["part"]: p["tokens"] for p in x["parts"]} for x in (prev, r))
            if d.get("kind") in ("system", "tool") and d.get("part") in before and d.get("part") in now:
                found.append((r, prev, d["part"], before[d["part"]], now[d["part"]]))
        last[r.get("system_key")] = r
    if not found:
        if not compared:
            return "No two calls shared a system prompt."
        who, did, each = (("The one call", "did not first differ", "its") if compared == 1 else
                          (f"None of the {compared} calls", "first differed", "each"))
        return (f"{who} compared with an earlier one of the same system prompt {did} inside a system block or a "
                f"tool schema: the system text and the tools stayed the same, and {each} first difference lay in the messages.")
    by_id = calls.set_index("request_id") if "request_id" in calls else pd.DataFrame()
    out = []
    for r, prev, part, a, b in found[:most]:
        c = by_id.loc[r["request_id"]] if r["request_id"] in by_id.index else pd.Series(dtype=object)
        ev = (f"; the server evaluated {c['evaluated_tokens']:,.0f} of its {c['prompt_tokens']:,.0f} prompt tokens"
              if pd.notna(c.get("evaluated_tokens")) and pd.notna(c.get("prompt_tokens")) else "")
        size = f"{a:,} tokens there, {b:,} here" if a != b else f"{a:,} tokens in both, other text"
        out.append(f"Call {r['request_id']} ({r.get('task')}) first differed from call {prev['request_id']} "
                   f"({prev.get('task')}) inside {part}, a part both carry: {size}{ev}.")
    more = f" {len(found) - most} more call(s) did the same." if len(found) > most else ""
    return " ".join(out) + more + " The agent sent that part changed: the prefix cache reuses nothing after it."
