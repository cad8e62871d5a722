"""Notebook 19's "Four failures, live" (issue 32 §4): the tool-call checks, the reasoning
template and its fix, the tables and every computed sentence (synthetic numbers, flipped
both ways, whole words), notebook 18's rows; the live experiments at their smallest (slow)."""
import json
import math
import re

import numpy as np
import pandas as pd
import pytest

from infercourse.lessons import agent_failures as af
from infercourse.lessons import agent_failures_claims as afc
from infercourse.lessons import agent_failures_numerics as afn
from infercourse.lessons import agent_failures_tools as aft
from infercourse.lessons import symptoms
from infercourse.measure import noise
from infercourse.measure import tool_calls as tc


def has(word: str, text: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text) is not None


# ---- measure.tool_calls ---------------------------------------------------------------------
def test_call_validity_checks_in_order_and_says_which_failed():
    tools = tc.synthetic_tools(15)
    ok = tc.call_validity('<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>', tools)
    assert ok == {"parses": True, "offered": True, "args_valid": True, "name": "read_file", "why": None}
    assert tc.call_validity('{"name": "read_file", "arguments": {"pa', tools)["why"].startswith("not JSON")
    invented = tc.call_validity('{"name": "read_files", "arguments": {}}', tools)
    assert invented["parses"] and not invented["offered"] and "not offered" in invented["why"]
    bad = tc.call_validity('{"name": "read_file", "arguments": {"path": 3}}', tools)
    assert bad["offered"] and not bad["args_valid"] and "path" in bad["why"]
    missing = tc.call_validity({"name": "read_file", "arguments": "{}"}, tools)   # a server's string arguments
    assert missing["offered"] and not missing["args_valid"] and "path" in missing["why"]
    assert tc.call_validity(None, tools)["why"] == "no call"
    assert tc.parse_call("```python\nprint(1)")[0] is None
    copied = tc.call_validity('<tool_call>\n{"name": <function name>, "arguments": <arguments object>}', tools)
    assert not copied["parses"] and "copied the template's <function name>" in copied["why"]


@pytest.mark.parametrize("args,ok", [({"path": "a"}, True), ({}, False), ({"path": 1}, False),
                                     ({"path": "a", "offset": True}, False), ({"path": "a", "limit": 3}, True)])
def test_the_small_checker_agrees_with_jsonschema(args, ok):
    schema = tc.synthetic_tools(2)[1]["function"]["parameters"]   # read_file: path (str), offset, limit (int)
    assert (tc._check(args, schema) is None) == ok
    assert (tc.check_arguments(args, schema) is None) == ok


def test_synthetic_tools_are_seeded_distinct_and_a_prefix_of_more():
    a, b = tc.synthetic_tools(40), tc.synthetic_tools(100)
    assert a == b[:40] == tc.synthetic_tools(40)
    names = [tc.tool_name(t) for t in b]
    assert len(set(names)) == 100 and names[:2] == ["list_files", "read_file"]
    with pytest.raises(ValueError):
        tc.synthetic_tools(0)


def test_offered_holds_the_target_and_is_shared_where_it_can_be():
    for n in (1, 3, 10):
        for target in ("read_file", "run_tests", "grep"):
            tools = aft.offered(n, target)
            assert len(tools) == n and target in [tc.tool_name(t) for t in tools]
    assert aft.offered(10, "read_file") == aft.offered(10, "run_tests")   # one cached prefix for every request


# ---- the reasoning template, and the fix ------------------------------------------------------
def _render(messages, mode):
    import jinja2
    env = jinja2.Environment(keep_trailing_newline=True)
    env.filters["tojson"] = json.dumps
    tmpl = env.from_string(af.THINK_TEMPLATE.read_text())
    return tmpl.render(messages=messages, tools=None, add_generation_prompt=True, reasoning_history=mode)


def _prefixes(mode):
    calls = af.thinking_session(2, 1)["calls"]
    texts = [_render(c["messages"], mode) for c in calls]
    # the next prompt extends this one (minus its generation prompt) when nothing earlier was re-rendered
    return [b.startswith(a[: -len("<|im_start|>assistant\n")]) for a, b in zip(texts, texts[1:])]


def test_the_qwen3_style_template_rewrites_history_at_a_user_message_and_the_fix_does_not():
    """The failure and its fix, on the template itself: with reasoning kept in every turn each
    prompt extends the last; the Qwen3 shape rewrites it where a new user message arrives."""
    assert all(_prefixes("all")) and all(_prefixes("none"))
    qwen = _prefixes("after_last_user")
    after = [c["after"] for c in af.thinking_session(2, 1)["calls"]][1:]
    assert qwen == [a != "user message" for a in after] and not all(qwen)


def test_the_template_shows_reasoning_only_where_its_mode_says():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x", "reasoning_content": "R1"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "y", "reasoning_content": "R2"},
            {"role": "tool", "content": "out"}]
    assert [("R1" in _render(msgs, m), "R2" in _render(msgs, m)) for m in ("after_last_user", "all", "none")] == \
        [(False, True), (True, True), (False, False)]


def test_thinking_session_shape():
    s = af.thinking_session(3, 2)
    assert len(s["calls"]) == 9 and [c["after"] for c in s["calls"][:4]] == \
        ["user message", "tool result", "tool result", "user message"]
    assert all(c["answer"]["reasoning_content"] for c in s["calls"])
    with pytest.raises(ValueError):
        af.thinking_session(100, 5)


# ---- tables and sentences (synthetic numbers, both ways) --------------------------------------
def _replay(lost_user, lost_tool, agrees=True):
    rows = []
    for i, after in enumerate(["user message", "tool result", "user message", "tool result"]):
        lost = None if i == 0 else lost_user if after == "user message" else lost_tool
        first = None if i == 0 else 100 * i - (lost or 0)
        rows.append({"call": i, "after": after, "cache_lost": lost, "first_changed": first,
                     "cache_n": first if agrees or i != 2 else (first or 0) + 5, "prompt_n": 50 + (lost or 0),
                     "prompt_ms": 10.0, "changed_in": "message 2 (assistant)" if lost else None,
                     "held_text": "<think>\nI" if lost else None, "new_text": "<tool_call>" if lost else None})
    return pd.DataFrame(rows)


def test_reasoning_sentence_flips_with_the_cache_lost():
    names = list(af.HISTORY)
    runs = {names[0]: _replay(400, 0), names[1]: _replay(0, 0), names[2]: _replay(60, 90)}
    t = af.reasoning_table(runs)
    assert t.loc[names[0], "lost_per_user_message"] == 400 and t.loc[names[1], "cache_lost_total"] == 0
    text = afc.reasoning_sentence(t, runs)
    assert has("400", text) and "message 2 (assistant)" in text and has("lost nothing", text) and has("agrees", text)
    quiet = {names[0]: _replay(0, 0), names[1]: _replay(0, 0), names[2]: _replay(0, 0, agrees=False)}
    q = afc.reasoning_sentence(af.reasoning_table(quiet), quiet)
    assert has("did not show the failure", q) and not has("400", q) and has("not", q.split("cache_n")[1])


def _tools(right_lo, right_hi, fits_last=True):
    rows = pd.DataFrame([
        {"model": "m", "tools": 1, "prompt_tokens": 200, "fits": True, "ttft_s": 0.2, "auto_called": 0.0,
         "free_valid": 0.5, "required_valid": 1.0, "required_right": right_lo, "refused": None},
        {"model": "m", "tools": 30, "prompt_tokens": 2900, "fits": True, "ttft_s": 3.0, "auto_called": 0.0,
         "free_valid": 0.0, "required_valid": 1.0, "required_right": right_hi, "refused": None},
        {"model": "m", "tools": 100, "prompt_tokens": 8400, "fits": fits_last, "ttft_s": None, "auto_called": None,
         "free_valid": None, "required_valid": None, "required_right": None,
         "refused": None if fits_last else "HTTP 400: exceeds the available context size"}])
    return rows.set_index("tools")


def test_tools_sentence_follows_the_shares_and_the_window():
    fell = afc.tools_sentence(_tools(1.0, 0.33, fits_last=False), 0.1)
    assert has("fell from", fell) and "100%" in fell and "33%" in fell and has("rising", fell)
    assert "**100 tools**" in fell and "exceeds the available context size" in fell and has("held at", fell)
    rose = afc.tools_sentence(_tools(0.33, 1.0, fits_last=False), None)
    assert has("rose from", rose) and not has("fell from", rose.split("required`")[-1]) and has("not judged", rose)
    per = (2900 - 200) / 29
    assert f"**{per:.0f}**" in fell


def test_tools_table_shares_from_rows():
    rows = pd.DataFrame([{"model": "m", "tools": 3, "request": j, "prompt_tokens": 400, "mode": mode, "fits": True,
                          "ttft_s": 0.5 if j == 0 else None, "parses": ok, "args_valid": ok, "right_tool": ok and j == 0,
                          "error": None} for j in range(2) for mode, ok in (("auto", False), ("required", True))])
    t = aft.tools_table(rows).loc[("m", 3)]
    assert (t["auto_called"], t["required_valid"], t["required_right"], t["ttft_s"]) == (0.0, 1.0, 0.5, 0.5)
    assert t["free_valid"] is None and t["fits"]


def _kv(d_short, d_long, same_call=True):
    rows = []
    for kv, d, secs in (("f16", (0.0, 0.0), 20.0), ("q8_0", (0.001, 0.002), 30.0), ("q4_0", (d_short, d_long), 45.0)):
        for target, dd in zip((1024, 7168), d):
            name = "list_files" if (kv == "q4_0" and target == 1024 and not same_call) else "read_file"
            rows.append({"kv_type": kv, "target": target, "context_tokens": target - 50, "ref_tokens": 30,
                         "nll_mean": 0.3 + dd, "name": name, "call": json.dumps({"name": name}),
                         "right_call": target == 7168, "seconds": secs})
    return pd.DataFrame(rows)


def test_kv_sentence_flips_with_the_nll_and_the_call():
    worse = afc.kv_sentence(_kv(0.08, 0.3, same_call=False), tol=0.05)
    q4 = worse.split("**q4_0**")[1]
    assert has("above f16", q4) and has("grows with the context", q4) and "list_files instead of read_file" in q4
    assert f"{math.exp(0.3 * 30):.2f}× less likely" in q4 and has("differed from f16's", q4)
    q8 = worse.split("**q8_0**")[1].split("**q4_0**")[0]
    assert has("no change", q8) and has("does not grow with the context", q8) and has("f16's at every length", q8)
    same = afc.kv_sentence(_kv(0.04, -0.03), tol=0.05).split("**q4_0**")[1]
    assert has("no change", same) and not has("above f16", same) and has("f16's at every length", same)
    assert has("shrinks with the context", afc.kv_sentence(_kv(0.3, 0.05), tol=0.05).split("**q4_0**")[1])
    assert "1 time(s) with f16" in worse and "45 s (q4_0)" in worse and has("not judged", worse)
    one = afc.kv_sentence(_kv(0.3, 0.05)[lambda d: d["target"] == 1024], tol=0.05)
    assert has("measured at one length only", one) and not has("grows", one)


def _spec(ids_draft, speeds_draft):
    speeds = {"plain": [10.0, 10.5, 9.8, 10.2], "n-gram lookup": [10.1, 10.4, 9.9, 10.0],
              "draft Q4_1": speeds_draft, "plain (A/A)": [10.2, 10.3, 9.9, 10.1]}
    rows = []
    for arm in speeds:
        for block in range(4):
            for req in range(2):
                ids = ids_draft[req] if arm == "draft Q4_1" else [1, 2, 3, 4]
                rows.append({"arm": arm, "block": block, "request": req, "ids": ids,
                             "call": {"name": "read_file" if ids == [1, 2, 3, 4] else "grep", "arguments": "{}"},
                             "draft_n": 10 if arm != "plain" else 0, "draft_accepted": 8 if arm != "plain" else 0})
    return afn.spec_table({"speeds": speeds, "calls": pd.DataFrame(rows)})


def test_spec_table_and_sentence_flip_with_tokens_and_speed():
    changed = _spec([[1, 2, 3, 4], [1, 2, 9, 4]], [20.0, 21.0, 19.5, 20.5])
    r = changed.loc["draft Q4_1"]
    assert (r["tokens_differ"], r["first_diff_at"], r["call_differs"]) == (4, 2, 4)
    text = afc.spec_sentence(changed)
    d = text.split("**draft Q4_1**")[1]
    assert has("different tokens", d) and has("draft Q4_1 faster", d) and "80%" in d
    assert has("the same tokens on every request", text.split("**n-gram lookup**")[1].split("**draft")[0])
    same = afc.spec_sentence(_spec([[1, 2, 3, 4], [1, 2, 3, 4]], [10.1, 10.2, 9.9, 10.3])).split("**draft Q4_1**")[1]
    assert has("the same tokens on every request", same) and not has("different tokens", same)
    assert not has("draft Q4_1 faster", same) and has("within noise", same)


def test_summary_lines_one_per_failure_and_they_flip():
    names = list(af.HISTORY)
    runs = {names[0]: _replay(400, 0), names[1]: _replay(0, 0), names[2]: _replay(60, 90)}
    tools = pd.concat({"m": _tools(1.0, 0.33, fits_last=False)}, names=["model"])
    text = afc.summary_lines(af.reasoning_table(runs), tools, _kv(0.08, 0.3), _spec([[1, 2, 3, 4]] * 2, [10.0] * 4),
                             tol=0.05)
    assert "**400**" in text and "100% at 1 tool, 33% at 30" in text and "100 tools did not fit" in text
    assert re.search(r"q4_0 .*\+0\.300 .*\bbeyond\b", text) and re.search(r"q8_0 .*\bwithin\b", text)
    assert "0 of 8 answers with different tokens" in text
    quiet = afc.summary_lines(af.reasoning_table(runs), tools, _kv(0.01, 0.02), _spec([[1, 2, 3, 4]] * 2, [10.0] * 4),
                              tol=0.05)
    assert re.search(r"q4_0 .*\bwithin\b", quiet) and not re.search(r"q4_0 .*\bbeyond\b", quiet)


def test_spec_table_counts_a_shorter_answer_as_different():
    t = _spec([[1, 2, 3], [1, 2, 3, 4]], [10.0, 10.0, 10.0, 10.0])
    assert t.loc["draft Q4_1", "first_diff_at"] == 3 and t.loc["plain", "tokens_differ"] == 0


# ---- notebook 18's rows --------------------------------------------------------------------------
def test_the_agent_rows_are_in_the_symptom_table_and_run_from_reproducers():
    hows = {"reasoning_dropped", "many_tools", "quantized_kv", "spec_tool_calls"}
    assert hows <= {how for _, how in symptoms.SYMPTOMS.values()} and hows <= set(symptoms.MEASURED)
    name = "tool calls break late in a long session"
    skipped = symptoms.reproduce(name, server=None)
    assert skipped.skipped and "reproducers" in skipped.skipped and skipped.layer is None
    row = symptoms.reproduce(name, None, reproducers={"quantized_kv": lambda s: ("KV cache", "NLL +0.1", {"d": 0.1})})
    assert (row.layer, row.evidence, row.values, row.skipped) == ("KV cache", "NLL +0.1", {"d": 0.1}, None)
    quiet = symptoms.reproduce(name, None, reproducers={"quantized_kv": lambda s: (None, "NLL +0.001", {})})
    assert quiet.evidence.startswith("not reproduced here: NLL")


def test_kv_cuts_share_one_prefill():
    import llama_cpp

    from infercourse.models.embedded import embedded_gguf
    llm = llama_cpp.Llama(model_path=str(embedded_gguf()), vocab_only=True, verbose=False)
    cuts = afn._cuts(llm, afn.agent_context(), (1024, 3584))
    assert [len(ids) <= t for t, ids in cuts] == [True, True] and cuts[1][1][:len(cuts[0][1])] == cuts[0][1]
    assert afn.agent_context()["tail"].endswith(tc.CALL_OPEN)


def test_the_agent_rows_can_be_left_to_notebook_19():
    """18's CI size runs without the four rows that each start a server (19 and the live tests
    below run the same experiments); the table's order and a chosen subset are kept."""
    every = symptoms.rows()
    assert every == tuple(symptoms.SYMPTOMS) and len(every) == 17
    without = symptoms.rows(agent_rows=False)
    assert len(without) == 13 and not {symptoms.SYMPTOMS[s][1] for s in without} & set(symptoms.AGENT_FAILURES)
    assert symptoms.rows(("tokens slow", "tool calls break late in a long session"), agent_rows=False) == ("tokens slow",)
    with pytest.raises(ValueError, match="no symptom row"):
        symptoms.rows(("tokens are slow",))


# ---- live, at the smallest size: through notebook 18's rows, which notebook 19's cells share -------
@pytest.mark.slow
def test_reasoning_row_live_the_server_agrees_and_only_the_qwen3_shape_loses_cache():
    layer, evidence, values = af.reasoning_row(threads=1)      # a session of 2 user messages, 1 step each
    t = pd.DataFrame(values["table"]).set_index("history")
    names = list(af.HISTORY)[:2]
    assert list(t.index) == names and t["server_agrees"].all()
    assert t.loc[names[0], "lost_per_user_message"] > 0 and t.loc[names[1], "cache_lost_total"] == 0
    assert layer == "model" and "agrees" in evidence


@pytest.mark.slow
def test_tools_row_live_required_calls_are_valid_and_an_oversized_count_is_refused():
    layer, evidence, values = aft.tools_row(threads=1, counts=(1, 30), requests=1, ctx=1024)
    t = pd.DataFrame(values["table"]).set_index("tools")
    assert t.loc[1, "fits"] and t.loc[1, "required_valid"] == 1.0
    assert not t.loc[30, "fits"] and t.loc[30, "refused"].startswith("HTTP 4")
    assert layer == "context" and evidence.startswith(f"30 tools = {t.loc[30, 'prompt_tokens']:,} prompt tokens")


@pytest.mark.slow
def test_kv_row_live_scores_the_reference_in_each_cache():
    layer, evidence, values = afn.kv_row(threads=1, context=1024)
    t = pd.DataFrame(values["table"])
    assert list(t["kv_type"]) == ["f16", "q4_0"] and (t["nll_mean"] > 0).all()
    assert np.isfinite(t["nll_total"]).all() and t["generated"].str.startswith(tc.CALL_OPEN).all()
    worse = values["nll_q4_0"] - values["nll_f16"] > afn.NLL_TOL or t["call"].nunique(dropna=False) > 1
    assert (layer == "KV cache") == worse and f"{values['nll_f16']:.3f}" in evidence


def test_spec_row_names_the_runtime_only_when_a_token_differs(monkeypatch):
    """18's speculative-decoding row on stand-in answers (the live servers are
    test_spec_tool_calls_live's): a differing token id names the runtime, and the evidence
    counts the calls and the drafted tokens accepted."""
    class Stub:
        def __init__(self, arm):
            self.url = arm

        def stop(self):
            pass

    def answers(ids_by_arm):
        def call(url, text, tools, max_tokens):
            return {"ids": ids_by_arm[url][text], "draft_n": 4 if url == "draft Q4_1" else 0,
                    "draft_accepted": 3 if url == "draft Q4_1" else 0}
        return call

    monkeypatch.setattr(afn, "spec_servers", lambda arms, threads=1: {a: Stub(a) for a in arms})
    asks = ("a", "b")
    same = {arm: {"a": [1, 2], "b": [3]} for arm in ("plain", "draft Q4_1")}
    monkeypatch.setattr(afn, "_spec_call", answers(same))
    layer, evidence, values = afn.spec_row(requests=asks)
    assert layer is None and values["differ"] == [] and evidence.startswith("0 of 2 greedy tool calls")
    assert "(6 of 8 drafted tokens accepted)" in evidence
    monkeypatch.setattr(afn, "_spec_call", answers({**same, "draft Q4_1": {"a": [1, 2], "b": [4]}}))
    layer, evidence, values = afn.spec_row(requests=asks)
    assert layer == "runtime" and values["differ"] == [1] and evidence.startswith("1 of 2 greedy tool calls")


@pytest.mark.slow
def test_spec_tool_calls_live_returns_ids_and_a_verdict():
    servers = afn.spec_servers(("plain", "draft Q4_1"), threads=1)
    try:
        res = afn.spec_tool_calls(servers, ["Read the file textstats/cli.py."], repeats=1, max_tokens=24)
    finally:
        for s in servers.values():
            s.stop()
    t = afn.spec_table(res)
    assert t.loc["plain (A/A)", "tokens_differ"] == 0 and len(res["calls"]["ids"].iloc[0]) > 0
    assert isinstance(t.loc["draft Q4_1", "comparison"], noise.Comparison)
