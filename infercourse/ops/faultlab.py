"""`infercourse doctor layers ...` and `infercourse faults ...`: the troubleshooting lab
from a shell. Both are thin: the walk is `ops.layers`, the faults are `ops.faults`."""
from __future__ import annotations

import argparse
import json
import sys

__all__ = ["layers_main", "faults_main"]


def layers_main(argv: list[str] | None = None) -> int:
    """`infercourse doctor layers`: 0 when no layer fails, 1 when one does, 2 on bad usage."""
    p = argparse.ArgumentParser(prog="infercourse doctor layers", description=(
        "Walk API -> server -> engine -> runtime -> model -> context -> KV cache -> memory -> hardware; "
        "print ok/warn/fail per layer with its evidence, stop at the first failing layer, say what to check next."))
    p.add_argument("url", nargs="?", help="server root, e.g. http://127.0.0.1:8080 (omit with --engine)")
    p.add_argument("--engine", choices=["llamacpp"], help="check an in-process engine instead of a URL")
    p.add_argument("--model", help="with a URL: the model name to ask for (a router serves several: its name or "
                                   "alias); with --engine: a .gguf path (default: the embedded model)")
    p.add_argument("--pid", type=int, help="the server's process id (default: whoever listens on the port)")
    p.add_argument("--log", help="the server's log file (its tail names the cause when it died)")
    p.add_argument("--prompt", help="a prompt to check against the context window (text, or @file)")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens that prompt asks for (default 0)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds each probe may wait (default 5)")
    p.add_argument("--api", choices=["openai", "anthropic"], default="openai",
                   help="anthropic: also check the route coding agents take (POST /v1/messages streams "
                        "every event type, count_tokens, a tool call parses)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    if bool(a.url) == bool(a.engine):
        p.error("give a URL or --engine llamacpp (one of them)")
    prompt = a.prompt
    if prompt and prompt.startswith("@"):
        with open(prompt[1:], encoding="utf-8") as fh:
            prompt = fh.read()
    from infercourse.ops.layers import doctor_engine, doctor_layers
    if a.engine:
        from infercourse.engines.llamacpp import LlamaCppEngine
        report = doctor_engine(LlamaCppEngine(a.model, n_threads=1), prompt=prompt, max_tokens=a.max_tokens)
    else:
        report = doctor_layers(a.url, pid=a.pid, log_path=a.log, prompt=prompt, max_tokens=a.max_tokens,
                               timeout_s=a.timeout, model=a.model)
        if a.api == "anthropic":   # ops.anthropic_probe: the coding-agent route
            from infercourse.ops.anthropic_probe import with_anthropic
            report = with_anthropic(report, a.url, timeout_s=max(a.timeout, 30.0))
    print(report.to_json() if a.json else report)
    return 1 if report.failed else 0


def faults_main(argv: list[str] | None = None) -> int:
    """`infercourse faults list | run NAME...|all`: 0 when the doctor named every fault's layer."""
    from infercourse.ops.faults import FAULTS
    p = argparse.ArgumentParser(prog="infercourse faults", description=(
        "Real faults on a local llama-server (127.0.0.1 only), bounded in time and always undone; "
        "`run` injects each, shows what a client saw and which layer `doctor layers` names."))
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="the fault catalogue: symptom, layer, what is done")
    ls.add_argument("--json", action="store_true")
    run = sub.add_parser("run", help="inject faults one after another and diagnose each")
    run.add_argument("names", nargs="+", metavar="NAME", help=f"'all' or any of: {', '.join(FAULTS)}")
    run.add_argument("--seconds", type=float, default=20.0, help="longest a fault may last (default 20)")
    run.add_argument("--json", action="store_true", help="one JSON object per fault")
    a = p.parse_args(argv)
    if a.cmd == "list":
        rows = [{"fault": f.name, "symptom": f.symptom, "layer": f.layer, "how": f.how} for f in FAULTS.values()]
        for r in rows:
            print(json.dumps(r) if a.json else f"{r['fault']:<22} {r['layer']:<8} {r['symptom']}  [{r['how']}]")
        return 0
    names = list(FAULTS) if a.names == ["all"] else a.names
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        p.error(f"unknown fault(s) {unknown}; see `infercourse faults list`")
    from infercourse.core.errors import InferCourseError
    from infercourse.ops.faults import run_fault, small_server
    wrong = 0
    with small_server() as srv:   # one healthy server lent to every fault that can use it
        for name in names:
            try:
                r = run_fault(name, srv, seconds=a.seconds)
            except InferCourseError as e:   # a fault this machine cannot produce: say why
                print(json.dumps({"fault": name, "skipped": str(e)}) if a.json else f"{name:<22} skipped: {e}")
                continue
            wrong += not r.correct
            if a.json:
                print(json.dumps(r.row()))
            else:
                print(f"{name:<22} expected {r.expected:<8} doctor named {str(r.named):<8} "
                      f"{'ok' if r.correct else 'MISMATCH'} in {r.doctor_s:.1f} s (inject+undo {r.total_s:.1f} s)"
                      f"\n{'':<22} client saw: {r.client_error or '(no error: slow, not broken)'}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(faults_main())
