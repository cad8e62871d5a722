"""The command line: `infercourse COMMAND ...` (and `python -m infercourse COMMAND ...`).

`main` reads the command and hands the rest of the line to the module that owns it; each
command parses its own options (`--help`). The commands that measure are here, one module
each; the rest live with what they drive (`ops.*`, `course`):

    cli.bench      bench: one load pattern against an engine, a results folder, a summary
    cli.report     report DIR...: finished runs side by side, and the conditions that differ
    cli.workload   how bench builds its workload (prompts counted by the answering model)
    cli.load       bench's session, dataset and rate-sweep modes
    cli.agent      agent install|status|run|report: a real coding agent, sealed and captured

The console script `infercourse` and `python -m infercourse` both call `main`.
"""
from __future__ import annotations

import sys

from infercourse.cli.bench import bench_main, bench_parser, parse_slos
from infercourse.cli.report import report_main

__all__ = ["main", "USAGE", "bench_main", "bench_parser", "parse_slos", "report_main"]

USAGE = """usage: infercourse COMMAND [ARGS]

commands:
  doctor env        the environment report: hardware, versions, usable engines
  doctor course     predict the course's run time here (a short probe vs the reference machine)
  doctor layers URL walk API -> server -> ... -> hardware; name the first failing layer
  doctor agent URL  is this server ready for a real coding agent (--agent claude-code|codex)?
  agent install|status|run|report  real coding agents against the course's server, captured
  faults list|run   real faults on a local server (loopback, bounded, undone), diagnosed
  bench ...         run a load pattern against an engine, save a results folder
  report DIR...     compare saved runs side by side
  course [--out D]  execute every notebook headless, write executed copies + HTML to D
  formats           derive the embedded model's formats (HF, F16, quant ladder, MLX)
  serve llama|mlx|vllm  one server in the foreground on 127.0.0.1 (a room's: --host, $INFERCOURSE_API_KEY or --api-key-file)
  soak ...          load a server for a bounded time; sample memory, queue, crashes

`infercourse COMMAND --help` documents each command's options."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "doctor" and rest[:1] == ["layers"]:
        from infercourse.ops.faultlab import layers_main
        return layers_main(rest[1:])
    if cmd == "doctor" and rest[:1] == ["course"]:
        from infercourse.ops.pace import pace_main
        return pace_main(rest[1:])
    if cmd == "doctor" and rest[:1] == ["agent"]:
        from infercourse.ops.agent_doctor_cli import doctor_agent_main
        return doctor_agent_main(rest[1:])
    if cmd == "agent":
        from infercourse.cli.agent import agent_main
        return agent_main(rest)
    if cmd == "faults":
        from infercourse.ops.faultlab import faults_main
        return faults_main(rest)
    if cmd == "doctor":
        if rest not in ([], ["env"]):
            print("usage: infercourse doctor env | doctor layers URL | doctor agent URL | doctor course", file=sys.stderr)
            return 2
        from infercourse.ops.doctor import print_report
        print_report()
        return 0
    if cmd == "bench":
        return bench_main(rest)
    if cmd == "report":
        return report_main(rest)
    if cmd == "course":
        from infercourse.course import course_main
        return course_main(rest)
    if cmd == "serve":
        from infercourse.ops.serve import serve_main
        return serve_main(rest)
    if cmd == "soak":
        from infercourse.ops.soak import soak_main
        return soak_main(rest)
    if cmd == "formats":
        from infercourse.models.formats import main as formats_main
        return formats_main(rest) or 0
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2
