"""`--dataset FILE.jsonl`: the format, its validation (every bad line by number), and a run
of a dataset through the command line against the loopback stand-in server."""
import json

import pytest

from infercourse.measure import datasets as ds


def _write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_requests_with_offsets(tmp_path):
    p = _write(tmp_path, [{"prompt": "Why is the sky blue?", "max_tokens": 8, "offset_s": 0},
                          "",
                          {"messages": [{"role": "user", "content": "hi"}], "offset_s": 0.5}])
    wl = ds.dataset_workload(p)
    assert len(wl.requests) == 2 and wl.offsets_s == (0.0, 0.5)
    assert wl.requests[0].max_tokens == 8 and wl.requests[1].max_tokens == ds.DEFAULT_MAX_TOKENS
    assert wl.requests[1].messages == [{"role": "user", "content": "hi"}]
    assert ds.dataset_workload(_write(tmp_path, [{"prompt": "x"}], "n.jsonl")).offsets_s is None


def test_every_bad_line_is_reported_by_number(tmp_path):
    p = _write(tmp_path, [{"prompt": "ok"},
                          {"prompt": "", "max_tokens": 0},
                          "{not json",
                          {"messages": [{"role": "bot", "content": "x"}], "colour": 1},
                          {"prompt": "a", "messages": []},
                          {"prompt": "b", "reply": "r"},
                          [1, 2]])
    with pytest.raises(ds.DatasetError) as e:
        ds.load_dataset(p)
    msg = str(e.value)
    for n, what in ((2, "'prompt' must be"), (2, "'max_tokens'"), (3, "not valid JSON"), (4, "unknown field 'colour'"),
                    (4, "messages[0]"), (5, "give exactly one of"), (6, "'reply' only applies to a session line"),
                    (7, "expected a JSON object")):
        assert f"line {n}: {what}" in msg, (n, what, msg)
    assert "line 1" not in msg
    assert e.value.layer == "workload"


def test_file_level_problems(tmp_path):
    with pytest.raises(ds.DatasetError, match="line 2: mixes session and request"):
        ds.load_dataset(_write(tmp_path, [{"prompt": "a"}, {"session": "s", "prompt": "b"}]))
    with pytest.raises(ds.DatasetError, match="line 2: no 'offset_s'"):
        ds.load_dataset(_write(tmp_path, [{"prompt": "a", "offset_s": 1}, {"prompt": "b"}], "o.jsonl"))
    with pytest.raises(ds.DatasetError, match="no requests"):
        ds.load_dataset(_write(tmp_path, [""], "e.jsonl"))
    with pytest.raises(ds.DatasetError, match="not found"):
        ds.load_dataset(tmp_path / "missing.jsonl")


def test_many_bad_lines_are_capped(tmp_path):
    p = _write(tmp_path, ["nope"] * 30)
    with pytest.raises(ds.DatasetError, match=r"30 problem\(s\)[\s\S]*and 10 more"):
        ds.load_dataset(p)


def test_sessions(tmp_path):
    p = _write(tmp_path, [
        {"session": "a", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "T"}],
         "reply": "R0", "think_s": 0.1, "max_tokens": 5},
        {"session": "b", "prompt": "other task"},
        {"session": "a", "messages": [{"role": "user", "content": "tool out"}]},
    ])
    scripts = ds.dataset_sessions(p)
    assert [s.name for s in scripts] == ["dataset-d-a", "dataset-d-b"]
    a = scripts[0]
    assert len(a.turns) == 2 and a.turns[0].reply == {"role": "assistant", "content": "R0"}
    assert a.turns[0].think_s == 0.1 and a.turns[0].max_tokens == 5 and a.turns[1].reply is None
    assert scripts[1].turns[0].added == ({"role": "user", "content": "other task"},)
    with pytest.raises(ds.DatasetError, match="holds sessions"):
        ds.dataset_workload(p)
    with pytest.raises(ds.DatasetError, match="holds requests"):
        ds.dataset_sessions(_write(tmp_path, [{"prompt": "x"}], "r.jsonl"))


def test_cli_runs_a_dataset_and_reports_bad_lines(tmp_path, capsys):
    from infercourse.cli import bench_main
    from infercourse.testing import SSESource
    bad = _write(tmp_path, [{"prompt": "x"}, {"prompt": 3}], "bad.jsonl")
    good = _write(tmp_path, [{"prompt": f"question {i}", "max_tokens": 4} for i in range(3)], "good.jsonl")
    with SSESource(ttft_s=0.0, gap_s=0.001) as src:
        with pytest.raises(SystemExit) as e:    # a usage error, before anything is sent
            bench_main(["--engine", "http", "--url", src.url, "--dataset", str(bad), "--no-progress"])
        assert e.value.code == 2 and "line 2: 'prompt' must be" in capsys.readouterr().err
        code = bench_main(["--engine", "http", "--url", src.url, "--dataset", str(good), "--no-progress",
                           "--warmup", "0", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0 and "3/3 ok" in out, out
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["workload"]["name"] == "dataset-good" and manifest["workload"]["n_requests"] == 3


def test_cli_dataset_usage_errors(tmp_path, capsys):
    from infercourse.cli import bench_main
    with pytest.raises(SystemExit) as e:
        bench_main(["--engine", "http", "--url", "http://127.0.0.1:9", "--dataset", str(tmp_path / "no.jsonl")])
    assert e.value.code == 2 and "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["--sessions", "2"])          # sessions need a server
    assert "need a server" in capsys.readouterr().err


def test_cli_replays_a_datasets_offsets(tmp_path, capsys):
    from infercourse.cli import bench_main
    from infercourse.testing import SSESource
    timed = _write(tmp_path, [{"prompt": f"q{i}", "max_tokens": 3, "offset_s": 0.2 * i} for i in range(3)], "t.jsonl")
    untimed = _write(tmp_path, [{"prompt": "q", "max_tokens": 3}], "u.jsonl")
    with SSESource(ttft_s=0.0, gap_s=0.001) as src:
        base = ["--engine", "http", "--url", src.url, "--pattern", "replay", "--warmup", "0", "--no-progress"]
        with pytest.raises(SystemExit):
            bench_main([*base, "--dataset", str(untimed)])
        assert "no offset_s" in capsys.readouterr().err
        assert bench_main([*base, "--dataset", str(timed), "--out", str(tmp_path / "run")]) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["load"]["pattern"] == "replay" and manifest["workload"]["n_requests"] == 3


def test_model_per_line(tmp_path):
    from infercourse.core.types import Request
    from infercourse.measure.model_mix import ModelRequest
    p = _write(tmp_path, [{"prompt": "a", "model": "main"}, {"prompt": "b"}, {"prompt": "c", "model": "fast"}])
    wl = ds.dataset_workload(p)
    assert [getattr(r, "model", None) for r in wl.requests] == ["main", None, "fast"]
    assert isinstance(wl.requests[0], ModelRequest) and type(wl.requests[1]) is Request
    assert wl.describe()["models"] == {"main": 1, None: 1, "fast": 1}
    plain = ds.dataset_workload(_write(tmp_path, [{"prompt": "a"}, {"prompt": "c"}], "plain.jsonl"))
    other = ds.dataset_workload(_write(tmp_path, [{"prompt": "a", "model": "x"}, {"prompt": "c"}], "o.jsonl"))
    assert "models" not in plain.describe() and plain.sha256 != other.sha256   # the models are part of the workload
    bad = _write(tmp_path, [{"prompt": "a", "model": ""}, {"prompt": "b", "model": 7}], "bad.jsonl")
    with pytest.raises(ds.DatasetError, match=r"(?s)line 1: 'model' must be.*line 2: 'model' must be"):
        ds.load_dataset(bad)
    sess = _write(tmp_path, [{"session": "s", "prompt": "a", "model": "main"}], "s.jsonl")
    with pytest.raises(ds.DatasetError, match="line 1: 'model' applies to request lines only"):
        ds.load_dataset(sess)


def test_cli_dataset_with_models_reports_by_model(tmp_path, capsys):
    from infercourse.cli import bench_main, report_main
    from infercourse.testing import SSESource
    f = _write(tmp_path, [{"prompt": f"q{i}", "max_tokens": 3, "model": "fast" if i == 1 else "main"}
                          for i in range(3)], "mix.jsonl")
    with SSESource(ttft_s=0.0, gap_s=0.001) as src:   # a stand-in: it answers any model name
        code = bench_main(["--engine", "http", "--url", src.url, "--dataset", str(f), "--no-progress",
                           "--warmup", "0", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0 and "model fast: 1 ok of 1" in out and "model main: 2 ok of 2" in out, out
    rows = [json.loads(x) for x in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert sorted(r["tags"]["model"] for r in rows) == ["fast", "main", "main"]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["model"] == ["fast", "main"] and manifest["engine"]["dispatch"] == "per request"
    assert report_main([str(tmp_path / "run")]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "[fast]" in head and "[main]" in head, head
