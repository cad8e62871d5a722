"""The two descriptions of the environment, and the two commands, stay in step."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _norm(req: str) -> str:
    return re.sub(r"\s+", "", req).replace('"', "'").lower()


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = set(map(_norm, project["dependencies"]))
    for extra, reqs in project["optional-dependencies"].items():
        if extra != "all":
            declared |= set(map(_norm, reqs))
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    # what conda-forge provides prebuilt (no compile), at the same pinned version
    conda = {d.split("=")[0]: d for d in env["dependencies"] if isinstance(d, str)}
    prebuilt = {r for r in declared if r.split("==")[0] in conda}
    for r in prebuilt:
        name, ver = r.split("==")
        assert conda[name] == f"{name}={ver}", f"conda pins {conda[name]}, pyproject {r}"
    assert any(r.startswith("llama-cpp-python==") for r in prebuilt) and "llama.cpp" in conda
    assert set(map(_norm, pip_section)) == declared - prebuilt
    py = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    major_minor = tuple(int(x) for x in py.split("=")[1].split(".")[:2])
    assert major_minor >= tuple(int(x) for x in project["requires-python"].lstrip(">=").split("."))


def test_ci_calls_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make course" in readme
    assert re.search(r"^make test$", ci, re.M)


def test_the_all_extra_names_every_other_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = re.search(r"\[(.*)\]", extras["all"][0]).group(1).split(",")
    assert set(names) == set(extras) - {"all"}
