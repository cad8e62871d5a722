"""The course's pace on a machine: the reference's figures scaled by a probe's ratio."""
import json

from infercourse.ops import pace


def test_predict_scales_every_size_by_the_probe_ratio():
    ref = {"probe_s": 0.5, "course_full_s": 1200.0, "course_ci_s": 600.0}
    p = pace.predict(1.5, ref)        # this machine takes 3x the reference's probe time
    assert p["ratio"] == 3.0
    assert (p["course_full_s"], p["course_ci_s"]) == (3600.0, 1800.0)
    assert "course_ci_s" not in pace.predict(0.25, {"probe_s": 0.5, "course_full_s": 100.0})


def test_save_reference_keeps_the_other_size(tmp_path):
    path = tmp_path / "ref.json"
    for size, total in (("full", 1500.0), ("ci", 700.0)):
        times = tmp_path / f"{size}.json"
        times.write_text(json.dumps({"size": size, "seconds": {"00_setup": 12.0}, "total_s": total, "load_1m": 0.3}))
        pace.save_reference(times, 0.42, path=path)
    ref = json.loads(path.read_text())
    assert (ref["course_full_s"], ref["course_ci_s"], ref["probe_s"]) == (1500.0, 700.0, 0.42)
    assert ref["notebooks_ci_s"] == {"00_setup": 12.0} and "cores" in ref["machine"]


def test_the_committed_reference_names_its_machine_and_load():
    """`make doctor` predicts from data/reference_machine.json: it must exist and say where,
    how loaded, and what the probe took there (a figure without its machine is no reference)."""
    ref = json.loads(pace.REFERENCE.read_text())
    assert ref["probe_s"] > 0 and ref["course_full_s"] > 0
    assert ref["machine"] and "load_1m_full" in ref
    assert set(ref["notebooks_full_s"]) >= {"00_setup", "16_capacity_routing"}


def test_each_notebook_is_scaled_by_its_own_probe():
    """A machine with a slow single thread and a fast prefill on all its cores (the Intel VM the
    one-number forecast put at 132 min ran the course in 81): agent notebooks scale with the
    prefill probe, the rest with the one-thread probe."""
    ref = {"probe_s": 1.0, "prefill_probe_s": 10.0,
           "notebooks_full_s": {"00_setup": 100.0, "20_real_coding_agent": 1000.0}}
    p = pace.predict({"probe_s": 1.2, "prefill_probe_s": 5.0}, ref)
    assert p["notebooks_full_s"] == {"00_setup": 120.0, "20_real_coding_agent": 500.0}
    assert p["course_full_s"] == 620.0 and p["basis_full"]["20_real_coding_agent"] == "prefill"
    t = pace.forecast_table(p, {"00_setup": 110.0, "20_real_coding_agent": 800.0})
    assert bool(t.loc["00_setup", "within"]) and not bool(t.loc["20_real_coding_agent", "within"])
    one = pace.predict(1.2, ref)        # an old reference without the prefill probe: one ratio for all
    assert one["notebooks_full_s"]["20_real_coding_agent"] == 1200.0


def test_a_set_wall_clock_duration_is_not_scaled():
    """15's soak lasts SOAK_S seconds on any machine: a machine 1.4x slower by the probe ran 15
    in 1.07x its reference time (2026-12-05, Intel Xeon VM). Only the rest of its time scales."""
    soak = pace.fixed_s()["15_stability"]
    ref = {"probe_s": 1.0, "notebooks_full_s": {"15_stability": soak + 10.0, "00_setup": 40.0}}
    p = pace.predict(2.0, ref)
    assert p["notebooks_full_s"] == {"15_stability": soak + 20.0, "00_setup": 80.0}
    assert pace.fixed_s("ci")["15_stability"] < soak          # the CI size's own, shorter soak
    short = pace.predict(2.0, {"probe_s": 1.0, "notebooks_full_s": {"15_stability": soak / 2}})
    assert short["notebooks_full_s"]["15_stability"] == soak / 2   # never more fixed time than it took


def test_the_ci_size_is_read_in_one_place(tmp_path, monkeypatch):
    """`make test`'s injected parameters and the forecast's CI-size soak come from one reader
    (ops.ci_size): a changed ci_params.json reaches both, where each used to read it itself."""
    from infercourse import course
    from infercourse.ops import ci_size
    table = {"_about": "x", "15_stability": {"SOAK_S": 7.5, "N": 2}}
    (tmp_path / "ci_params.json").write_text(json.dumps(table))
    monkeypatch.setattr(ci_size, "CI_PARAMS", tmp_path / "ci_params.json")
    assert course.ci_params("notebooks/15_stability.ipynb") == {"SOAK_S": 7.5, "N": 2}
    assert course.ci_params("notebooks/00_setup.ipynb") == {}
    assert pace.fixed_s("ci") == {"15_stability": 7.5}


def test_a_run_is_read_at_its_own_pace_the_median_of_its_readings():
    """A shared VM slowed down mid-course (2026-12-06: notebooks 13-22 % slower than an hour
    before, the probes read after the run saw nothing). A run that read the pace before each
    notebook is forecast, and scaled to the reference, at the median of its readings against the
    reference run's: one spiky reading (01's 1.75 s on a 0.98 s run) moves no notebook."""
    soak = pace.fixed_s()["15_stability"]
    ref = {"probe_s": 0.9, "prefill_probe_s": 1.9, "readings": {"probe_s": 1.0, "prefill_probe_s": 2.0},
           "notebooks_full_s": {"00_setup": 100.0, "01_x": 10.0, "15_stability": soak + 10.0,
                                "20_real_coding_agent": 1000.0}}
    run = {"size": "full", "seconds": {"00_setup": 125.0, "01_x": 12.5, "15_stability": soak + 12.5,
                                       "20_real_coding_agent": 1200.0, "21_capstone": 50.0},
           "pace": {"00_setup": {"probe_s": 1.25}, "01_x": {"probe_s": 9.0}, "15_stability": {"probe_s": 1.25},
                    "20_real_coding_agent": {"probe_s": 1.0, "prefill_probe_s": 2.4}}}
    assert pace.readings_median(run) == {"probe_s": 1.25, "prefill_probe_s": 2.4}
    got = pace.run_pace(run, ref)
    assert set(got) == {"00_setup", "01_x", "15_stability", "20_real_coding_agent"}   # 21: no reference time
    assert got["00_setup"] == {"read": 1.25, "ratio": 1.25, "forecast_s": 125.0, "measured_s": 125.0,
                               "at_reference_s": 100.0}
    assert got["01_x"]["ratio"] == 1.25 and got["01_x"]["at_reference_s"] == 10.0     # its 9.0 s reading ignored
    assert got["20_real_coding_agent"]["ratio"] == 1.2                                  # the prefill readings
    assert got["15_stability"]["at_reference_s"] == soak + 10.0                         # the soak is not scaled
    t = pace.run_pace_table(run, ref)
    assert bool(t["within"].all()) and t["at_reference_s"].sum() == 1110.0 + soak + 10.0
    assert pace.run_pace({**run, "pace": {}}, ref) == {}             # a run without readings: nothing
    old = {k: v for k, v in ref.items() if k != "readings"}       # a reference without readings: its probes
    assert round(pace.run_pace(run, old)["00_setup"]["ratio"], 4) == round(1.25 / 0.9, 4)


def test_the_course_reads_the_pace_before_each_notebook_at_full_size(tmp_path, monkeypatch):
    from infercourse import course
    from infercourse.ops import pace as pace_mod
    nbs = [tmp_path / "00_a.ipynb", tmp_path / "20_real_coding_agent.ipynb"]
    monkeypatch.setattr(course, "notebooks", lambda: nbs)
    monkeypatch.setattr(course, "notebook_parameters", lambda p: {})
    monkeypatch.setattr(course, "run_notebook", lambda p, out, **kw: {"seconds": 1.0})
    monkeypatch.setattr(course, "write_claims", lambda out: tmp_path / "claims.md")
    asked = []
    monkeypatch.setattr(pace_mod, "reading", lambda prefill=False: asked.append(prefill) or {"probe_s": 1.0})
    assert course.course_main(["--out", str(tmp_path)]) == 0
    assert asked == [False, True]            # the prefill probe only before a prefill-bound notebook
    saved = json.loads((tmp_path / "course_times.json").read_text())
    assert set(saved["pace"]) == {"00_a", "20_real_coding_agent"} and "pace_reading_s" in saved
    asked.clear()
    assert course.course_main(["--out", str(tmp_path), "--size", "ci"]) == 0
    assert asked == [] and "pace" not in json.loads((tmp_path / "course_times.json").read_text())


def test_a_reference_keeps_the_pace_its_run_was_measured_at(tmp_path):
    """The probes read after a run can miss the pace it ran at (2026-12-06: the same, while the
    notebooks had run 13-22 % slower): a reference saved from a run that read the pace keeps the
    medians of its readings beside the probes read afterwards (each compared with its own kind)."""
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"size": "full", "seconds": {"00_setup": 12.0}, "total_s": 30.0, "load_1m": 0.3,
                                 "pace": {"00_setup": {"probe_s": 1.1}, "01_x": {"probe_s": 1.3},
                                          "20_y": {"probe_s": 1.2, "prefill_probe_s": 2.0}}}))
    ref = pace.save_reference(times, {"probe_s": 0.9, "prefill_probe_s": 1.5}, path=tmp_path / "ref.json")
    assert (ref["probe_s"], ref["prefill_probe_s"]) == (0.9, 1.5)
    assert ref["readings"] == {"probe_s": 1.2, "prefill_probe_s": 2.0}
    times.write_text(json.dumps({"size": "full", "seconds": {"00_setup": 12.0}, "total_s": 30.0, "load_1m": 0.3}))
    assert "readings" not in pace.save_reference(times, 0.9, path=tmp_path / "ref2.json")
