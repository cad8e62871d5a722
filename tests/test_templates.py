"""The template comparison of notebook 16 (lessons.templates, lessons.families).

Pure tests render the request with Python's jinja2 (the course's two template files, and a
ChatML that writes any role, as llama-server's fallback does) and count tokens with a toy
tokenizer: what each part became, and the sentences, flipped with whole-word checks. The
slow test runs the router with both families' presets and skips, with the reason, where
Gemma 3 is absent.
"""
from __future__ import annotations

import re

import jinja2
import pandas as pd
import pytest

from infercourse.lessons import families as fam
from infercourse.lessons import templates as tpl
from infercourse.measure.workloads import DATA_DIR
from infercourse.models import gemma3

GEMMA_OK, GEMMA_WHY = gemma3.available()
needs_gemma = pytest.mark.skipif(not GEMMA_OK, reason=f"Gemma 3 not here: {GEMMA_WHY}")

# llama-server's fallback (and SmolLM2's own template, less its default system prompt): any role, no tools
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_TOKENS = re.compile(r"<\|im_start\|>|<\|im_end\|>|<start_of_turn>|<end_of_turn>|\w+|[^\w\s]")
_GEMMA_TOKENS = re.compile(r"<start_of_turn>|<end_of_turn>|\w+|[^\w\s]")   # ChatML's markers are not in its vocabulary


def _env() -> jinja2.Environment:
    env = jinja2.Environment()
    env.filters["tojson"] = lambda v: __import__("json").dumps(v)   # llama.cpp's tojson: plain JSON
    return env


def _render(source: str):
    t = _env().from_string(source)
    return lambda body: t.render(messages=body["messages"], tools=body.get("tools"), add_generation_prompt=True)


def _count(text: str) -> int:
    return len(_TOKENS.findall(text))


def _count_gemma(text: str) -> int:
    return len(_GEMMA_TOKENS.findall(text))


def _parts(source: str) -> pd.DataFrame:
    return tpl.rendered_parts(_render(source), _count).set_index("part")


def test_span_finds_the_removed_turn_and_prefers_it_to_open_at_a_header():
    full = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    without = "<|im_start|>system\nS<|im_end|>\n<|im_start|>assistant\n"
    start, seg = tpl.span(full, without)
    assert seg == "<|im_start|>user\nU<|im_end|>\n" and full[start:].startswith(seg)
    assert tpl.span("abc", "abc") == (3, "")


def test_chatml_tools_renders_the_call_the_result_and_a_middle_system_message():
    """Issue 33 §1: Claude Code's environment arrives as a second system message; a template with
    no branch for it dropped it silently (the server counted ~19 % fewer tokens than were sent)."""
    t = _parts((DATA_DIR / "chatml_tools.jinja").read_text())
    assert t.loc["tool schemas", "rendered"].startswith("inside the `system` turn, in `<tools>`")
    assert t.loc["assistant tool call", "rendered"] == "inside the `assistant` turn, in `<tool_call>`"
    assert t.loc["tool result", "rendered"] == "as its own `user` turn, in `<tool_response>`"
    assert t.loc["system (middle)", "rendered"] == "as its own `system` turn" and t.loc["system (middle)", "appears"]
    assert t.loc["user (last)", "markup_tokens"] == t.loc["user (last)", "tokens"] - t.loc["user (last)", "content_tokens"]


def test_our_gemma_template_uses_two_roles_and_keeps_everything():
    t = _parts((DATA_DIR / "gemma3_tools.jinja").read_text())
    full = t.loc["whole prompt", "text"]
    assert "<|im_start|>" not in full and full.endswith("<start_of_turn>model\n") and set(
        re.findall(r"<start_of_turn>(\w+)", full)) == {"user", "model"}
    assert t.loc["system (first)", "rendered"] == "inside the `user` turn"        # no system role: the first user turn
    assert t.loc["system (middle)", "rendered"] == "as its own `user` turn"       # a later one speaks as the user
    assert t.loc["tool result", "rendered"] == "as its own `user` turn, in `<tool_response>`"
    assert t.loc["assistant tool call", "rendered"] == "inside the `model` turn, in `<tool_call>`"
    assert t.loc["user", "rendered"].startswith("in the `user` turn (leaving it out moves other text)")
    assert t["appears"].all()


def test_chatml_fallback_drops_tools_and_the_call_and_writes_a_tool_role():
    t = _parts(CHATML)
    assert t.loc["tool schemas", "rendered"] == "dropped" and t.loc["assistant tool call", "rendered"] == "dropped"
    assert t.loc["tool result", "rendered"] == "as its own `tool` turn" and t.loc["tool result", "appears"]
    assert t.loc["system (middle)", "rendered"] == "as its own `system` turn"
    assert t.loc["tool schemas", "tokens"] == 0


def test_a_template_that_writes_its_own_default_in_place_of_a_missing_part():
    default = ("{% if messages[0].role != 'system' %}{{ '<|im_start|>system\\nI am the default.<|im_end|>\\n' }}"
               "{% endif %}" + CHATML)
    t = _parts(default)
    assert t.loc["system (first)", "rendered"] == \
        "in the `system` turn (left out, the template writes its own text there)"
    assert t.loc["system (first)", "appears"] and t.loc["system (first)", "tokens"] == _count(
        "<|im_start|>system\n" + tpl.MESSAGES[0]["content"] + "<|im_end|>\n")   # its whole turn, counted alone


def _answer(calls=None, content="", finish="stop"):
    msg = {"role": "assistant", "content": content}
    if calls is not None:
        msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return {"choices": [{"message": msg, "finish_reason": finish}]}


@pytest.mark.parametrize("body, outcome, valid", [
    (_answer([("list_files", '{"path": "tests"}')]), "tool call", 1),
    (_answer([("list_files", '{"path": "src"}'), ("list_files", '{"')], finish="length"), "tool call", 1),
    (_answer([("list_files", '{"pa')], finish="length"), "tool call, bad arguments", 0),
    (_answer([("rm_rf", '{}')]), "tool call, bad arguments", 0),
    (_answer(content='<tool_call>\n{"name": "list_files", "arguments": {}}'), "call as text", 0),
    (_answer(content="tests/a.py"), "no call", 0),
])
def test_classify_says_whether_an_answer_parses_as_a_tool_call(body, outcome, valid):
    got = tpl.classify(body, names=["list_files"])
    assert got["outcome"] == outcome and got["valid_calls"] == valid
    assert tpl.classify(None, "HTTP 400: bad", ["list_files"])["outcome"] == "refused"


def _result(count=_count_gemma, **answers) -> dict:
    """Synthetic `compare_presets` output: our Gemma template and the ChatML fallback, rendered by
    jinja2 and counted by `count`; `answers` maps a preset to its (required, auto) outcomes."""
    parts = {"gemma3": tpl.rendered_parts(_render((DATA_DIR / "gemma3_tools.jinja").read_text()), count),
             "gemma3-chatml": tpl.rendered_parts(_render(CHATML), count)}
    rows = []
    for name, outs in answers.items():
        for choice, got in zip(tpl.CHOICES, outs):
            body = _answer([("list_files", '{"path": "tests"}')]) if got else _answer(content="ok", finish="length")
            rows.append({"model": name, "tool_choice": choice, **tpl.classify(body, names=["list_files"])})
    return {"parts": parts, "answers": pd.DataFrame(rows)}


def test_text_flips_with_what_each_template_did_and_what_each_answer_was():
    said = tpl.text(_result(**{"gemma3": (True, False), "gemma3-chatml": (False, True)}))
    gem, fallback = (line for line in said.splitlines() if line.startswith("- **gemma3"))
    assert re.search(r"\brenders the tool call\b", gem) and re.search(r"\bdrops the tool call\b", fallback)
    assert not re.search(r"\bdrops the tool call\b", gem) and not re.search(r"\brenders the tool call\b", fallback)
    assert re.search(r"`required` the answer parsed as a tool call\b", gem)
    assert re.search(r"`auto` the answer did not parse as a tool call\b", gem)
    assert re.search(r"`required` the answer did not parse\b", fallback)
    assert re.search(r"`auto` the answer parsed as a tool call\b", fallback)
    assert re.search(r"\bsurvives\b", gem) and "**dropped**" not in gem
    assert re.search(r"\bgemma3-chatml spends \d+ more than gemma3\b", said)   # <|im_start|> in pieces
    assert "gemma3-chatml: `<|im_start|>` 5" in said
    same = tpl.text(_result(_count, **{"gemma3": (True, True)}))          # every marker one token: no gap
    assert re.search(r"\bthe same in every one\b", same) and not re.search(r"\bspends\b", same)
    table = tpl.table(_result(**{"gemma3": (True, True)}))
    assert table.loc["answer, tool_choice auto", "gemma3"].startswith("tool call (list_files")


def _swaps(gemma_s, smol_s):
    req = pd.DataFrame([{"step": i, "asked": m, "state": s, "loaded_after": m, "status": "ok", "ttft_s": 1.0}
                        for i, (m, s) in enumerate([("smollm2", "cold"), ("gemma3", "swap"), ("smollm2", "swap")])])
    loads = pd.DataFrame([{"model": "gemma3", "loaded_s": g} for g in gemma_s]
                         + [{"model": "smollm2", "loaded_s": s} for s in smol_s])
    return {"requests": req, "loads": loads, "sizes": {"smollm2": 100 * 2 ** 20, "gemma3": 240 * 2 ** 20}}


def test_swap_text_names_the_slower_family_only_when_every_load_says_so():
    slow_gemma = fam.swap_text(_swaps([2.4, 2.5], [0.5, 0.6]))
    assert re.search(r"\bA switch to gemma3 costs more\b", slow_gemma) and "x2.4" in slow_gemma
    slow_smol = fam.swap_text(_swaps([0.4], [0.9, 1.0]))
    assert re.search(r"\bA switch to smollm2 costs more\b", slow_smol)
    mixed = fam.swap_text(_swaps([0.5, 2.0], [0.6, 0.7]))
    assert re.search(r"\bNo order\b", mixed) and "costs more" not in mixed


def test_memory_text_names_the_bigger_child_and_sums_both_families():
    said = fam.memory_text({"router": 10 * 2 ** 20, "smollm2": 100 * 2 ** 20, "gemma3": 300 * 2 ** 20})
    assert re.search(r"\bgemma3's child holds x3\b", said) and "410 MiB for both" in said
    flipped = fam.memory_text({"router": 10 * 2 ** 20, "smollm2": 300 * 2 ** 20, "gemma3": 100 * 2 ** 20})
    assert re.search(r"\bsmollm2's child holds x3\b", flipped)
    assert "only smollm2" in fam.memory_text({"smollm2": 2 ** 20})


def test_the_presets_name_both_families_and_their_templates():
    assert set(fam.FAMILIES) <= set(fam.PRESETS) and all(
        (DATA_DIR / t).is_file() for _, t in fam.PRESETS.values() if t)


@pytest.mark.slow
@needs_gemma
def test_both_families_behind_one_router_answer_by_name_and_render_the_tool_request():
    presets = fam.family_presets()
    ini_flags = {p.name: p.flags.get("chat-template-file") for p in presets}
    assert ini_flags["gemma3"].endswith("gemma3_tools.jinja") and ini_flags["gemma3-chatml"] is None
    got = tpl.compare_presets(presets, max_tokens=40)
    parts = {n: df.set_index("part") for n, df in got["parts"].items()}
    assert parts["gemma3"].loc["tool result", "rendered"] == "as its own `user` turn, in `<tool_response>`"
    assert parts["gemma3-chatml"].loc["assistant tool call", "rendered"] == "dropped"     # the fallback: ChatML
    assert parts["gemma3-chatml"].attrs["markers"]["<|im_start|>"] > 1 == parts["smollm2"].attrs["markers"]["<|im_start|>"]
    assert set(got["answers"]["model"]) == set(ini_flags) and (got["answers"]["outcome"] != "refused").all()
    assert {"smollm2", "gemma3"} <= set(got["memory"]) and set(got["loads"]["model"]) == set(ini_flags)
    sw = fam.family_swaps(switches=2, max_tokens=4)
    assert list(sw["requests"]["state"]) == ["cold", "swap", "swap"] and (sw["requests"]["status"] == "ok").all()
    assert list(sw["requests"]["loaded_after"]) == ["smollm2", "gemma3", "smollm2"] and len(sw["loads"]) == 3
