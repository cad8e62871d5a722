"""Workloads: the inputs of every measurement, made by this project, with a content hash.

A benchmark number means nothing without the exact inputs behind it, so every workload
here is generated deterministically (no network, no downloads), carries a name and a
SHA-256 of its content, and that hash is written into each run's manifest.

- `exact_length_prompt`: a prompt of exactly n tokens for a given tokenizer (prefill sweeps).
- `shared_prefix_workload`: one long system prompt + tools + project context, many tasks
  after it; variants that silently break prefix caching (a timestamp on top, reordered tools).
- `agentic_workload`: a recorded coding-agent session (≥ 30 model calls, growing context),
  built by `python -m infercourse.measure.workloads build` from data/synthetic_repo and
  data/agentic_plan.json by actually running the tools (read, grep, edit, run tests).
- `eval_text`: original prose for perplexity, checked against its recorded hash.

Tool results go back to the model as user turns wrapped in <tool_response>, which is what
Qwen/Hermes-style chat templates render a `tool` message into: it keeps the requests plain
`{role, content}` messages that every engine and server accepts.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from infercourse.core.types import Request, generate
from infercourse.core.errors import ContextLayerError, EngineLayerError, InferCourseError
from infercourse.core.hashing import content_hash  # the same hash run manifests use

__all__ = ["DATA_DIR", "Workload", "WorkloadError", "content_hash", "common_prefix_len", "local_tokenizer",
           "exact_length_prompt", "chat_overhead_tokens",
           "shared_prefix_workload", "agentic_workload", "build_agentic_session", "replay_calls",
           "eval_text", "run_tool", "TOOLS"]

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
EVAL_TEXT_SHA256 = "93a73ac4be38996a4cb0a2063138b4b86a971a0fa79ec75a971f2da1aca22c03"
TOOLS = [  # JSON schemas, in the shape OpenAI-style tool calling uses
    {"name": "list_files", "description": "List files under a directory of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "read_file", "description": "Return a file's content with line numbers.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "grep", "description": "Find lines containing a fixed string in all files.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}},
    {"name": "edit_file", "description": "Replace one exact occurrence of `old` with `new` in a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                    "new": {"type": "string"}}, "required": ["path", "old", "new"]}},
    {"name": "run_tests", "description": "Run the test suite and report each test's outcome.",
     "parameters": {"type": "object", "properties": {}}},
]


class WorkloadError(InferCourseError):
    """A workload file is missing, altered, or cannot be built."""

    layer = "workload"


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Number of leading items two token sequences share: what a prefix cache can reuse."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def local_tokenizer(engine) -> Callable[[str], list]:
    """The tokenizer an in-process engine carries (llama.cpp's `tokenize`, transformers'
    `tokenizer`), for building exact-length prompts. A served model has none here: count
    with that server's own tokenizer instead."""
    if hasattr(engine, "tokenize"):                       # llama.cpp
        return engine.tokenize
    if hasattr(engine, "tokenizer"):                      # transformers
        return lambda text: engine.tokenizer(text)["input_ids"]
    raise EngineLayerError(f"engine {getattr(engine, 'name', engine)!r} has no local tokenizer",
                           hint="pass tokenize= (the model's tokenizer) to build exact-length prompts")


@dataclass(frozen=True)
class Workload:
    """A named list of requests, with optional send offsets (seconds from the run start).
    `cache_workload`: its requests are meant to share prefixes (prefix caching is what it
    measures), so bench does not salt its prompts."""

    name: str
    requests: tuple[Request, ...]
    offsets_s: tuple[float, ...] | None = None
    cache_workload: bool = False

    @property
    def sha256(self) -> str:
        return content_hash({"requests": [_req_dict(r) for r in self.requests],
                             "offsets_s": self.offsets_s})

    def describe(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "n_requests": len(self.requests),
                "cache_workload": self.cache_workload}


def _req_dict(r: Request) -> dict:
    tools = {"tools": r.tools} if r.tools else {}   # only when present: older hashes stay valid
    return {"prompt": r.prompt, "messages": r.messages, **r.sampling(), **tools}


# -- exact-length prompts -------------------------------------------------------------------
def _word_stream(seed: int) -> Iterator[str]:
    # Words of the project's own prose, shuffled per seed: prompts with different seeds
    # differ from the first word, so a prefix cache cannot serve one from another.
    vocab = sorted(set(re.findall(r"[a-z]+", eval_text().lower())))
    rng = random.Random(seed)
    while True:
        yield from rng.sample(vocab, len(vocab))


def exact_length_prompt(n_tokens: int, tokenize: Callable[[str], list], *, seed: int = 0) -> str:
    """Text that `tokenize` turns into exactly `n_tokens` tokens (re-tokenized to check).

    Args:
        n_tokens: the target count, including whatever `tokenize` adds (e.g. BOS).
        tokenize: text -> token ids, e.g. `LlamaCppEngine(...).tokenize`.
        seed: picks the word order; different seeds give prompts with no shared prefix.
    """
    base = len(tokenize(""))
    if n_tokens <= base:
        raise ContextLayerError(f"cannot make a {n_tokens}-token prompt: the tokenizer adds "
                                f"{base} token(s) to any text", hint=f"ask for more than {base}")
    stream, words = _word_stream(seed), []
    while len(tokenize(" ".join(words))) < n_tokens:  # grow in strides, then trim below
        words.extend(next(stream) for _ in range(max(1, (n_tokens - len(tokenize(" ".join(words)))) // 2)))
    lo, hi = 0, len(words)  # largest prefix of words with <= n tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tokenize(" ".join(words[:mid]))) <= n_tokens else (lo, mid - 1)
    text = " ".join(words[:lo])
    for _ in range(4 * n_tokens):  # top up with single-token pieces
        count = len(tokenize(text))
        if count == n_tokens:
            return text
        for piece in (" a", " I", ".", ",", " x", "a"):
            if len(tokenize(text + piece)) == count + 1:
                text += piece
                break
        else:
            break
    raise ContextLayerError(f"could not hit exactly {n_tokens} tokens with this tokenizer "
                            f"(got {len(tokenize(text))})", hint="try another seed")


def chat_overhead_tokens(engine, text: str, n_text_tokens: int) -> int:
    """Tokens the chat template adds around `text` sent as one user message, as counted by
    the engine itself (a 1-token generation; its usage.prompt_tokens minus the text's)."""
    c = generate(engine, Request(messages=[{"role": "user", "content": text}], max_tokens=1))
    if c.usage is None:
        raise ContextLayerError("engine reported no prompt token count; cannot measure overhead")
    return c.usage.prompt_tokens - n_text_tokens


# -- shared-prefix sets ---------------------------------------------------------------------
_TASKS = ["explain what {f} does", "add type hints to {f}", "write a docstring for every function in {f}",
          "list the edge cases {f} does not handle", "suggest a test for {f}", "rename the helpers in {f} for clarity",
          "find any bug in {f}", "summarise {f} in two sentences"]


def _repo_files(root: Path | None = None) -> dict[str, str]:
    root = root or DATA_DIR / "synthetic_repo"
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def system_prompt(tools: list[dict] | None = None, *, header: str = "") -> str:
    """The agent's system prompt: role, tool schemas (one JSON per line), project context."""
    tools = TOOLS if tools is None else tools
    files = _repo_files()
    return (header + "You are a careful coding assistant working in the `textstats` repository. "
            "Call one tool per turn as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; "
            "results come back inside <tool_response>. Never guess a file's content: read it.\n\n"
            "# Tools\n<tools>\n" + "\n".join(json.dumps(t) for t in tools) + "\n</tools>\n\n"
            "# Project files\n" + "\n".join(files) + "\n\n# README.md\n" + files["README.md"])


def shared_prefix_workload(n_tasks: int = 16, *, variant: str = "shared", max_tokens: int = 32,
                           seed: int = 0) -> Workload:
    """Many tasks after one long shared prefix.

    Args:
        variant: "shared" (identical prefix), "timestamp" (a per-request time on the first
            line of the system prompt) or "reordered_tools" (tool list shuffled per request):
            the last two look harmless but make every prefix-cache lookup miss.
    """
    if variant not in ("shared", "timestamp", "reordered_tools"):
        raise ValueError(f"unknown variant {variant!r}: use shared, timestamp or reordered_tools")
    rng, files = random.Random(seed), [f for f in _repo_files() if f.endswith(".py")]
    reqs = []
    for i in range(n_tasks):
        task = _TASKS[i % len(_TASKS)].format(f=files[(i // len(_TASKS) + i) % len(files)])
        header = f"Current time: 2026-11-29T10:{i // 60:02d}:{i % 60:02d}Z\n" if variant == "timestamp" else ""
        tools = rng.sample(TOOLS, len(TOOLS)) if variant == "reordered_tools" else TOOLS
        reqs.append(Request(messages=[{"role": "system", "content": system_prompt(tools, header=header)},
                                      {"role": "user", "content": f"Task {i + 1}: {task}."}],
                            max_tokens=max_tokens, seed=seed))
    return Workload(f"shared-prefix-{variant}-{n_tasks}", tuple(reqs), cache_workload=True)


# -- the agentic coding session ---------------------------------------------------------------
_RUNNER = r"""
import importlib, io, contextlib, sys, traceback, pathlib
sys.path.insert(0, "."); passed = failed = 0
for path in sorted(pathlib.Path("tests").glob("test_*.py")):
    mod = importlib.import_module("tests." + path.stem)
    for name in sorted(n for n in vars(mod) if n.startswith("test_")):
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                getattr(mod, name)()
            passed += 1; print(f"{path.as_posix()}::{name} PASSED")
        except BaseException as e:
            failed += 1; here = pathlib.Path.cwd()  # the deepest frame inside the repo
            fr = [f for f in traceback.extract_tb(e.__traceback__) if pathlib.Path(f.filename).resolve().is_relative_to(here)][-1]
            where = pathlib.Path(fr.filename).resolve().relative_to(here).as_posix()
            print(f"{path.as_posix()}::{name} FAILED  {type(e).__name__}: {e}  at {where}:{fr.lineno}: {fr.line}")
print(f"{passed} passed, {failed} failed"); sys.exit(1 if failed else 0)
"""


def run_tool(root: Path, tool: str, args: dict) -> str:
    """Run one of `TOOLS` against the synthetic repository at `root`; its text result."""
    files = _repo_files(root)
    if tool == "list_files":
        return "\n".join(files)
    if tool == "read_file":
        return "\n".join(f"{i:4d}  {line}" for i, line in enumerate(files[args["path"]].splitlines(), 1))
    if tool == "grep":
        hits = [f"{f}:{i}: {line}" for f, text in files.items()
                for i, line in enumerate(text.splitlines(), 1) if args["pattern"] in line]
        return "\n".join(hits) or "(no matches)"
    if tool == "edit_file":
        text = files[args["path"]]
        if text.count(args["old"]) != 1:
            raise WorkloadError(f"plan edit does not match {args['path']} exactly once")
        (root / args["path"]).write_text(text.replace(args["old"], args["new"]))
        return f"edited {args['path']}"
    if tool == "run_tests":
        out = subprocess.run([sys.executable, "-B", "-c", _RUNNER], cwd=root, capture_output=True,
                             text=True, timeout=60)
        if out.returncode not in (0, 1):
            raise WorkloadError(f"test runner crashed: {out.stderr[-500:]}")
        return out.stdout.strip()
    raise WorkloadError(f"unknown tool {tool!r} in plan")


def build_agentic_session(plan_path: Path | None = None, repo: Path | None = None, *, seed: int = 0,
                          plan: dict | None = None) -> dict:
    """Run the scripted agent of data/agentic_plan.json against a copy of the synthetic repo.

    Each step is one model call: its messages are the session so far, its output the
    scripted assistant turn; tools really run, so results (test failures included) are
    true. Offsets model a reference session: model time = 0.4 s + output chars / 160
    (about 40 tok/s), plus each tool's latency (seeded jitter). `plan`: a plan already
    loaded (and changed), instead of reading `plan_path`.
    """
    if plan is None:
        plan = json.loads((plan_path or DATA_DIR / "agentic_plan.json").read_text())
    rng, latency = random.Random(seed), {"run_tests": 1.5, "grep": 0.08, None: 0.0}
    messages = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": plan["task"]}]
    calls, t = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "repo"
        shutil.copytree(repo or DATA_DIR / "synthetic_repo", root,
                        ignore=shutil.ignore_patterns("__pycache__"))
        for i, (thought, tool, args) in enumerate(plan["steps"]):
            out = thought if tool is None else \
                f"{thought}\n<tool_call>\n{json.dumps({'name': tool, 'arguments': args})}\n</tool_call>"
            tool_s = round(latency.get(tool, 0.04) * rng.uniform(0.8, 1.2), 3)
            calls.append({"index": i, "n_messages": len(messages), "offset_s": round(t, 3),
                          "tool": tool, "tool_latency_s": tool_s, "max_tokens": math.ceil(len(out) / 4) + 8})
            messages.append({"role": "assistant", "content": out})
            if tool is not None:
                result = run_tool(root, tool, args)
                messages.append({"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"})
            t += 0.4 + len(out) / 160 + tool_s
        final = content_hash(_repo_files(root))
    return {"name": "agentic-coding-textstats", "generator": "python -m infercourse.measure.workloads build",
            "seed": seed, "task": plan["task"], "calls": calls, "messages": messages,
            "final_repo_sha256": final}


def replay_calls(session: dict) -> Iterator[tuple[float, Request]]:
    """Each model call of a recorded session, in order: (offset_s, Request). Call i sees the
    first `n_messages` messages; the next message is the output the session used."""
    for c in session["calls"]:
        yield c["offset_s"], Request(messages=session["messages"][:c["n_messages"]], max_tokens=c["max_tokens"])


def agentic_workload(path: Path | None = None) -> Workload:
    """The recorded agentic session of data/agentic_session.json as a timed Workload."""
    path = path or DATA_DIR / "agentic_session.json"
    if not path.is_file():
        raise WorkloadError(f"{path} not found", hint="run `python -m infercourse.measure.workloads build`")
    session = json.loads(path.read_text())
    offsets, reqs = zip(*replay_calls(session))
    return Workload(session["name"], tuple(reqs), tuple(offsets), cache_workload=True)


def eval_text() -> str:
    """The fixed evaluation prose for perplexity, verified against its recorded SHA-256."""
    raw = (DATA_DIR / "eval_prose.txt").read_bytes()
    if hashlib.sha256(raw).hexdigest() != EVAL_TEXT_SHA256:
        raise WorkloadError("data/eval_prose.txt does not match its recorded sha256",
                            hint="restore it from git; perplexities are only comparable on the same text")
    return raw.decode("utf-8")


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m infercourse.measure.workloads",
                                description="build the workload files in data/")
    p.add_argument("command", choices=["build"])
    p.add_argument("--out", type=Path, default=DATA_DIR / "agentic_session.json")
    args = p.parse_args(argv)
    session = build_agentic_session()
    args.out.write_text(json.dumps(session, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}: {len(session['calls'])} calls, sha256 "
          f"{hashlib.sha256(args.out.read_bytes()).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
