"""The agent lab's options (ops.lab_options): what each changes in a call, and that it says so."""
import json

from infercourse.measure.tool_calls import CALL_CLOSE
from infercourse.ops.lab_options import answer_stopper, greedy_sampler, lab_rewrite

ANTH = {"model": "m", "system": [{"type": "text", "text": "s"}], "max_tokens": 64,
        "tools": [{"name": "Read", "input_schema": {}}], "messages": [{"role": "user", "content": "hi"}]}


def test_the_stopper_adds_its_sequences_to_the_agents_own_and_tags_the_call():
    tags = {"task": "t", "api": "anthropic"}
    sent = json.loads(answer_stopper(["\n"])(json.dumps({**ANTH, "stop_sequences": ["END"]}).encode(), tags))
    assert sent["stop_sequences"] == ["END", "\n"] and json.loads(tags["answer_stop"]) == ["\n"]
    assert {k: v for k, v in sent.items() if k != "stop_sequences"} == ANTH       # nothing else changed
    tags = {"task": "t", "api": "anthropic"}
    sent = json.loads(answer_stopper(["\n"])(json.dumps(ANTH).encode(), tags))
    assert sent["stop_sequences"] == ["\n"] and "answer_stop" in tags


def test_the_stopper_speaks_each_apis_field_and_leaves_what_it_cannot_stop():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": "END"}
    sent = json.loads(answer_stopper(["\n"])(json.dumps(chat).encode(), {"api": "openai-chat"}))
    assert sent["stop"] == ["END", "\n"] and "stop_sequences" not in sent
    responses, tags = json.dumps({"model": "m", "input": "hi"}).encode(), {"api": "openai-responses"}
    assert answer_stopper(["\n"])(responses, tags) == responses and "answer_stop" not in tags
    assert answer_stopper(["\n"])(b"not json", {"api": "anthropic"}) == b"not json"
    own, tags = json.dumps({**ANTH, "stop_sequences": ["\n"]}).encode(), {"api": "anthropic"}
    assert answer_stopper(["\n"])(own, tags) == own and "answer_stop" not in tags   # the agent's own already
    bare = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}   # no system, no tools
    assert json.loads(answer_stopper(["\n"])(json.dumps(bare).encode(), {"api": "anthropic"}))["stop_sequences"] == ["\n"]


def test_a_forced_call_keeps_its_own_stop_and_later_calls_get_the_lab_stop():
    rw = lab_rewrite("Read", ["\n"])
    first, later = {"task": "t", "api": "anthropic"}, {"task": "t", "api": "anthropic"}
    sent = json.loads(rw(json.dumps(ANTH).encode(), first))
    assert sent["stop_sequences"] == [CALL_CLOSE] and "forced" in first and "answer_stop" not in first
    sent = json.loads(rw(json.dumps(ANTH).encode(), later))
    assert sent["stop_sequences"] == ["\n"] and "forced" not in later and "answer_stop" in later
    assert lab_rewrite(None, None) is None and lab_rewrite(None, []) is None


def test_greedy_sends_temperature_zero_and_says_what_the_agent_had_sent():
    """20's clipped answer ended before the room on 1 of 5 sampled answers: the clip lab runs greedy."""
    tags = {"task": "t", "api": "anthropic"}
    sent = json.loads(greedy_sampler()(json.dumps(ANTH).encode(), tags))
    assert sent == {**ANTH, "temperature": 0} and tags["greedy"] == "temperature 0 (sent: default)"
    tags = {"api": "openai-chat"}
    assert json.loads(greedy_sampler()(json.dumps({"temperature": 0.7}).encode(), tags))["temperature"] == 0
    assert tags["greedy"] == "temperature 0 (sent: 0.7)"
    zero, tags = json.dumps({**ANTH, "temperature": 0}).encode(), {}
    assert greedy_sampler()(zero, tags) == zero and "greedy" not in tags and greedy_sampler()(b"x", {}) == b"x"
    rw, tags = lab_rewrite(None, ["\n"], greedy=True), {"api": "anthropic"}
    sent = json.loads(rw(json.dumps(ANTH).encode(), tags))
    assert sent["temperature"] == 0 and sent["stop_sequences"] == ["\n"] and {"greedy", "answer_stop"} <= set(tags)


def test_the_clip_lab_runs_greedy(monkeypatch, tmp_path):
    from infercourse.lessons import real_agent as ra
    sent = []
    monkeypatch.setattr(ra, "lab", lambda root, name, tasks, **kw: sent.extend(tasks) or tmp_path / name)
    monkeypatch.setattr(ra, "first_request_size", lambda out: 900)
    ra.clip_lab(tmp_path, 100, "ci")
    assert len(sent) == 2 and all(t.greedy for t in sent)   # the sizing call and the clipped one
