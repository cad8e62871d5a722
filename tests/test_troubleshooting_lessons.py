"""Notebooks 17, 18 and 21's lessons, mostly the parts that need no server: evidence shown without
the answer (a failed start with its log's error lines), the guide's suspects beside the layer
found, and a route named only beyond noise."""
import re

import numpy as np
import pandas as pd
import pytest

from infercourse.core.errors import LAYERS
from infercourse.lessons import capstone, capstone_incident, symptoms, troubleshooting
from infercourse.ops.faults import FAULTS


def test_client_errors_lose_their_layer_tags_before_the_guess():
    err = "server at 127.0.0.1:5 answered HTTP 400: request exceeds the context (context layer)"
    assert troubleshooting.untagged(err) == "server at 127.0.0.1:5 answered HTTP 400: request exceeds the context"
    assert troubleshooting.untagged("stream cut (API layer). the server may have crashed").endswith("crashed")
    assert troubleshooting.untagged(None) is None


# the tail of a real failed start (model truncated to 4 MiB), as llama-server logs it
FAILED_START = """$ llama-server -m /tmp/x/model.gguf -np 2 -c 1024 --metrics --host 127.0.0.1 --port 43003 -t 1
[watchdog 13162] started server pid 13163 for parent 13106
0.00.004.136 I srv  llama_server: initializing ...
0.00.005.591 W srv  llama_server: security: no API key is set and CORS allows all origins
0.00.028.442 E llama_model_load: error loading model: tensor 'token_embd.weight' data is not within the file bounds
0.00.028.487 E llama_model_load_from_file_impl: failed to load model
0.00.101.465 E llama_model_load: error loading model: tensor 'token_embd.weight' data is not within the file bounds
0.00.103.362 E srv    load_model: failed to load model, '/tmp/x/model.gguf'
0.00.103.366 I srv    operator(): operator(): cleaning up before exit...
[watchdog] server exited by itself with code 1
"""
MESSAGE = "llama-server exited (code 1) before it became healthy. Last lines of /c/logs/s.log:"   # saw()'s one line


def test_log_evidence_keeps_each_error_line_once_in_order():
    from infercourse.ops.startfaults import log_evidence
    lines = log_evidence(FAILED_START)
    assert len(lines) == 3 and "not within the file bounds" in lines[0] and lines[0].startswith("0.00.028.442 E")
    assert lines[1].endswith("failed to load model") and "load_model: failed" in lines[2]
    assert not any(" I " in x or " W " in x or "watchdog" in x for x in lines)
    assert log_evidence(FAILED_START, n=1) == lines[:1]
    assert log_evidence("plain text\nERROR: cannot open the file\nfine") == ["ERROR: cannot open the file"]
    assert log_evidence(None) == [] and log_evidence("0.00.001.000 I all good") == []


def test_a_failed_start_shows_its_log_lines_before_the_guess(capsys):
    from infercourse.ops.startfaults import log_evidence
    d = troubleshooting.Drill("model_corrupt", "a new model will not run", MESSAGE, "model",
                              log_lines=log_evidence(FAILED_START), log_path="/c/logs/s.log")
    d.show_symptom()
    out = capsys.readouterr().out
    assert "A client saw: llama-server exited (code 1) before it became healthy.\n" in out   # no dangling "Last lines"
    assert "Error lines of its log (/c/logs/s.log):" in out and "not within the file bounds" in out
    troubleshooting.Drill("model_corrupt", "s", MESSAGE, "model").show_symptom()
    assert "Its log (/c/logs/s.log) holds no error line." in capsys.readouterr().out   # said, never left blank


@pytest.mark.slow
@pytest.mark.parametrize("fault,evidence", [("model_corrupt", "not within the file bounds"),
                                            ("memory_limited", "failed to allocate")])
def test_drills_that_never_start_show_the_servers_own_words(fault, evidence, capsys):
    """Drills 4 and 6 printed "Last lines of ...log:" and nothing under it: `Injected.saw` keeps
    the first line of the error only. The log's error lines now travel with the drill."""
    d = troubleshooting.run_drill(fault, None, seconds=10, timeout_s=3)
    if d.skipped:
        pytest.skip(d.skipped)
    assert any(evidence in x for x in d.log_lines), d.log_lines
    d.show_symptom()
    out = capsys.readouterr().out
    assert evidence in out and "Last lines of" not in out


def test_doctor_time_story_splits_at_one_probe_deadline():
    table = pd.DataFrame({"doctor s": [5.2, 0.1, None]}, index=pd.Index(["frozen", "model_corrupt", "x"], name="fault"))
    line = troubleshooting.doctor_time_story(table, 5.0)
    assert "at least one probe deadline (5 s): `frozen` (5.2 s)" in line
    assert "Under one deadline: `model_corrupt` (0.1 s)" in line
    flipped = troubleshooting.doctor_time_story(table.assign(**{"doctor s": [0.2, 6.0, None]}), 5.0)
    assert "(5 s): `model_corrupt` (6.0 s)" in flipped and "Under one deadline: `frozen` (0.2 s)" in flipped
    assert "Under one deadline: none" in troubleshooting.doctor_time_story(table.iloc[:1], 5.0)
    assert "No drill was diagnosed" in troubleshooting.doctor_time_story(table.iloc[2:], 5.0)


class _Report:
    failed = None

    def __str__(self):
        return "THE REPORT"


def test_reveal_hides_the_report_until_a_layer_is_named(capsys):
    d = troubleshooting.Drill("frozen", "hangs", None, "server", report=_Report())
    graded = []
    assert troubleshooting.reveal(d, None, lambda *a, **k: graded.append(a)) is None
    assert "THE REPORT" not in capsys.readouterr().out and not graded
    troubleshooting.reveal(d, "b", lambda *a, **k: graded.append(a) or True)
    assert "THE REPORT" in capsys.readouterr().out and graded[0][2] == troubleshooting.key_of("server")
    troubleshooting.reveal(d, "?", lambda *a, **k: graded.append(a))
    assert "THE REPORT" in capsys.readouterr().out and len(graded) == 1          # "?" shows without grading


def test_every_symptom_row_is_reproduced_by_something(monkeypatch):
    """Each row's `how` is a fault of the lab or one of the live measurements: `reproduce`
    reaches it (stand-ins record the call) and the row takes the layer it names. A row whose
    `how` names nothing would raise here, not in the middle of notebook 16."""
    from types import SimpleNamespace
    called = []
    monkeypatch.setattr(symptoms, "run_fault", lambda how, server, **kw: called.append(how) or SimpleNamespace(
        report=SimpleNamespace(failed=None, checks=[]), named=FAULTS[how].layer, doctor_s=0.0,
        client_error="stand-in", notes={}))
    live = lambda how: (lambda *a, **k: called.append(how) or ("context", f"stand-in {how}", {}))  # noqa: E731
    for how in ("context_growth", "cpu_contention"):
        monkeypatch.setattr(symptoms, how, live(how))
    monkeypatch.setattr(symptoms, "cache_buster_check", live("cache_buster"))
    monkeypatch.setattr(symptoms, "tool_check", live("anthropic_tools"))
    # the agent failures' reproducers live in other lessons; notebook 18 passes them in
    agent = {how: live(how) for how in ("reasoning_dropped", "many_tools", "quantized_kv", "spec_tool_calls")}
    for name, (suspects, how) in symptoms.SYMPTOMS.items():
        row = symptoms.reproduce(name, SimpleNamespace(url="http://stand-in"), reproducers=agent)
        assert called[-1] == how and row.skipped is None and row.layer in LAYERS, (name, row)
    assert len(called) == len(symptoms.SYMPTOMS)


def test_an_agent_row_without_its_reproducer_is_skipped_with_the_reason():
    """Lessons never import each other: without `reproducers` an agent row says where its
    measurement lives, and is skipped rather than faked."""
    from types import SimpleNamespace
    row = symptoms.reproduce("thinking model slow on every new message", SimpleNamespace(url="http://stand-in"))
    assert row.layer is None and "agent_failures" in row.skipped and "reproducers=" in row.skipped


def test_a_fault_outside_the_guides_suspects_says_why():
    """Where the lab's fault lies in a layer the guide does not suspect for that symptom,
    the row's own explanation (DIFFERS) says why, never the generic line; every explanation
    belongs to a row; every suspect is a layer of the walk or is explained."""
    generic = symptoms.SymptomRow("?", (), "?", layer="server").differs()
    for name, (suspects, how) in symptoms.SYMPTOMS.items():
        for s in suspects:
            assert s in LAYERS or s in symptoms.DIFFERS.get(name, ""), (name, s)
        if how in FAULTS:
            row = symptoms.SymptomRow(name, suspects, how, layer=FAULTS[how].layer)
            assert (row.differs() == "") == (FAULTS[how].layer in suspects), name
            assert row.differs() in ("", symptoms.DIFFERS.get(name)) and row.differs() != generic, name
    assert set(symptoms.DIFFERS) <= set(symptoms.SYMPTOMS)


@pytest.mark.parametrize("layer", LAYERS)
def test_differs_is_empty_exactly_when_the_layer_is_suspected(layer):
    for name, (suspects, how) in symptoms.SYMPTOMS.items():
        row = symptoms.SymptomRow(name, suspects, how, layer=layer)
        assert (row.differs() == "") == (layer in suspects), (name, layer)
        assert row.as_dict()["guide's suspects"].split(" → ") == list(suspects)
    sheet = symptoms.blank_sheet(list(symptoms.SYMPTOMS))
    assert list(sheet.index) == list(symptoms.SYMPTOMS) and (sheet["your layer"] == "").all()


def test_evidence_is_one_clean_line_without_html():
    text = symptoms._clean("answered HTTP 502: <html><body><h1>502 Bad Gateway</h1></body></html>\n more")
    assert text == "answered HTTP 502: 502 Bad Gateway more"
    assert len(symptoms._clean("x" * 500)) == 240


def _replay(route, e2e, status=None):
    n = len(e2e)
    return pd.DataFrame({"route": route, "request_id": range(n), "e2e_s": e2e, "ttft_s": np.array(e2e) / 2,
                         "status": status or ["ok"] * n, "error": [None] * n})


def test_changed_most_needs_a_change_beyond_the_routes_aa_floor():
    base = pd.concat([_replay("C", [1.0, 2.0, 3.0]), _replay("D", [1.0, 1.0, 1.0])])
    again = pd.concat([_replay("C", [1.1, 2.0 / 1.1, 3.3]), _replay("D", [1.6, 0.7, 1.5])])   # D is noisy
    floor = capstone.floors(base, again)
    assert floor["C"].floor == pytest.approx(0.1) and floor["D"].floor == pytest.approx(0.6)
    # D x1.5 by chance, within its floor; C +40%, beyond its floor of 10%: C is named
    inc = pd.concat([_replay("C", [1.4, 2.8, 4.2]), _replay("D", [1.5, 1.5, 1.5])])
    route, why = capstone.changed_most(base, inc, floor)
    assert route == "C" and "x1.4" in why
    quiet = pd.concat([_replay("C", [1.05, 2.0, 3.1]), _replay("D", [1.5, 1.5, 1.5])])
    assert capstone.changed_most(base, quiet, floor)[0] is None
    errs = pd.concat([_replay("C", [1.0, 2.0, 3.0]), _replay("D", [1.0, 1.0, 1.0], ["ok", "error", "ok"])])
    assert capstone.changed_most(base, errs, floor)[0] == "D"


def test_incident_doctor_gives_nothing_away_without_a_suspect():
    inc = capstone_incident.Incident(0, "latency", "C", snapshots={"C": "REPORT C"})
    assert "Name the route" in inc.doctor(None) and inc.doctor("C") == "REPORT C"


def test_cpu_contention_hogs_each_run_in_a_session_of_their_own():
    """With Linux's autogroup, busy loops in the notebook's session barely slowed a server in
    its own session: the lab's hogs are each a session, as another program would be."""
    import os
    hogs = symptoms._hogs(2, seconds=5)
    try:
        sids = {os.getsid(h.pid) for h in hogs}
        assert len(sids) == 2 and os.getsid(0) not in sids
        assert all(h.poll() is None for h in hogs)           # spinning
    finally:
        for h in hogs:
            h.terminate()
        assert all(h.wait(5) is not None for h in hogs)


def test_blind_drills_hide_the_fault_behind_a_shuffled_neutral_label():
    """Issue 31 (17): the fault names (`model_corrupt`, `context_overflow`, `memory_limited`) gave
    three layers away before the guesses, and so did an order that follows the walk."""
    m = troubleshooting.blind(seed=0)
    assert list(m) == [f"fault {c}" for c in "ABCDEF"] and sorted(m.values()) == sorted(troubleshooting.DRILL_FAULTS)
    assert troubleshooting.blind(seed=0) == m                                    # seeded: the same order again
    orders = {tuple(troubleshooting.blind(seed=s).values()) for s in range(20)}
    assert len(orders) > 1 and any(o != troubleshooting.DRILL_FAULTS for o in orders)   # shuffled, not the walk's


def _names_or_layers(text):
    words = set(troubleshooting.DRILL_FAULTS) | {f.layer for f in FAULTS.values()} | {"limited", "corrupt"}
    return [w for w in words if re.search(rf"\b{re.escape(w)}\b", text)]


def test_a_labelled_drill_names_neither_fault_nor_layer_before_the_guess(capsys):
    from infercourse.ops.startfaults import log_evidence
    d = troubleshooting.Drill("model_corrupt", "a new model will not run", MESSAGE, "model",
                              report=_Report(), label="fault C", log_lines=log_evidence(FAILED_START)[:1])
    d.show_symptom()
    out = capsys.readouterr().out
    assert out.startswith("[fault C]\n") and "model_corrupt" not in out
    skipped = troubleshooting.Drill("memory_limited", "will not start", None, "memory", label="fault F",
                                    skipped="RLIMIT_AS is only enforced on Linux (memory layer)")
    skipped.show_symptom()
    out = capsys.readouterr().out
    assert "[fault F] could not be made" in out and not _names_or_layers(out), out
    troubleshooting.reveal(skipped, None, None)
    assert "was `memory_limited` (memory layer), skipped here: RLIMIT_AS" in capsys.readouterr().out
    troubleshooting.reveal(d, "?", None)
    assert "[fault C] was `model_corrupt` (model file truncated)." in capsys.readouterr().out
    assert d.why().startswith("fault C was 'model_corrupt'")
    assert troubleshooting.Drill("cut", "s", None, "API", label="fault A").row()["drill"] == "fault A"


def _nb(name):
    import json
    from pathlib import Path
    nb = json.loads((Path(__file__).parents[1] / "notebooks" / name).read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"]]


def test_notebook_17_names_no_fault_before_the_first_reveal_and_checks_the_measured_skips():
    cells = _nb("17_layered_troubleshooting.ipynb")
    first = next(i for i, c in enumerate(cells) if "lesson.reveal(" in c)
    before = "\n".join(cells[:first])
    assert "lesson.run_drills(" in before
    for name in troubleshooting.DRILL_FAULTS:
        assert not re.search(rf"\b{name}\b", before), name
    ex5 = next(c for c in cells if "doctor_engine(" in c and "check(" in c)
    assert "lesson.skipped_layers(inproc)" in ex5 and not re.search(r"check\(answer, \d", ex5)


def test_skipped_layers_counts_what_the_report_skipped():
    from infercourse.ops.layers import LayerCheck, LayerReport
    rep = LayerReport("x", [LayerCheck("API", "skip", "in process"), LayerCheck("server", "skip", "in process"),
                            LayerCheck("engine", "ok", "")])
    assert troubleshooting.skipped_layers(rep) == ["API", "server"]
    rep.checks.append(LayerCheck("runtime", "skip", "not reached"))
    assert len(troubleshooting.skipped_layers(rep)) == 3
