"""`infercourse bench ...`: the measurement core from a shell.

`bench` runs one load pattern (or a concurrency sweep) against an engine, writes a results
folder and prints a summary with its warnings (`cli.report` puts finished runs side by side).
It is thin: every number comes from `bench`, `metrics` and `results`, exactly as in the
notebooks; its workload is built by `cli.workload`, its session and rate-sweep modes by
`cli.load`.

A server that checks a key (a room's, started by `infercourse serve --host ...`) gets it from
`--api-key-file FILE`, else `$INFERCOURSE_API_KEY`, else the API's own variable
(`$OPENAI_API_KEY`, `$ANTHROPIC_API_KEY`): never from bench's command line, which `ps` shows
to every user of the machine. It is sent as a header and never written to the results.

Exit codes: 0 done, 1 the run failed for a reason infercourse names (any
`InferCourseError`: one line on stderr, no traceback), 2 bad usage, 130 interrupted
(the summary of what finished is printed first). Anything else is a bug in infercourse
and keeps its traceback.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path

__all__ = ["bench_main", "bench_parser", "parse_slos", "clean_errors", "api_key"]

WORKLOADS = ("fixed", "shared-prefix", "shared-prefix-timestamp", "shared-prefix-reordered", "agentic",
             "coding-agent")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be integers >= 1, got {text!r}")
    return values


def parse_slos(text: str) -> dict[str, float]:
    """`ttft=0.5,tpot=0.05` -> {"ttft_s": 0.5, "tpot_s": 0.05}: names are `summary.SLO_METRICS`
    columns, the `_s` of a latency may be left off; targets are positive numbers."""
    from infercourse.core.summary import SLO_METRICS
    out: dict[str, float] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, eq, value = item.partition("=")
        name = name.strip()
        key = name if name in SLO_METRICS else f"{name}_s"
        if not eq or key not in SLO_METRICS:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected NAME=VALUE with NAME one of {', '.join(sorted(SLO_METRICS))}")
        try:
            target = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: {value!r} is not a number") from None
        if not math.isfinite(target) or target <= 0:
            raise argparse.ArgumentTypeError(f"{item!r}: the target must be a positive number")
        out[key] = target
    if not out:
        raise argparse.ArgumentTypeError("give at least one SLO, e.g. ttft=0.5,tpot=0.05")
    return out


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infercourse bench", description=(
        "Run a load pattern against an engine, record every request (latency measured from "
        "its scheduled send time) into a results folder, and print a summary."))
    g = p.add_argument_group("engine")
    g.add_argument("--engine", choices=["llamacpp", "http"], default="llamacpp",
                   help="llamacpp: in process, one request at a time; http: any OpenAI-compatible server")
    g.add_argument("--url", help="server root for --engine http, e.g. http://127.0.0.1:8080")
    g.add_argument("--model", help="llamacpp: a .gguf path (default: the embedded SmolLM2-135M); "
                                   "http: the served model name (default: the server's only model)")
    g.add_argument("--api", choices=["chat", "completions", "openai", "anthropic"], default="chat",
                   help="HTTP API (default chat; openai = chat): anthropic sends POST /v1/messages, the "
                        "Anthropic Messages API coding agents speak (llama-server, vLLM, Ollama)")
    g.add_argument("--threads", type=_positive(int), help="llamacpp CPU threads (default: physical cores)")
    g.add_argument("--n-ctx", type=_positive(int), default=8192, help="llamacpp context window (default 8192)")
    g.add_argument("--allow-remote", action="store_true", help="permit a server that is not on loopback")
    from infercourse.ops.serve import KeyFile
    g.add_argument("--api-key-file", metavar="FILE", action=KeyFile, dest="api_key_file_key",
                   help="file holding the key for --engine http (default: $INFERCOURSE_API_KEY, else "
                        "$OPENAI_API_KEY / $ANTHROPIC_API_KEY); sent as a header, never written to the results")
    # Kept only to refuse it (a key on argv is in `ps`); without it argparse would read
    # `--api-key K` as an abbreviation of --api-key-file and open a file named K.
    g.add_argument("--api-key", dest="api_key_on_argv", metavar="KEY",
                   help="refused: a key on the command line is visible in `ps`; use --api-key-file or "
                        "$INFERCOURSE_API_KEY")
    g.add_argument("--logprobs", action="store_true",
                   help="ask the server for logprobs (exact tokens per chunk even when a chunk holds "
                        "several; costs server time per token)")
    g = p.add_argument_group("load")
    g.add_argument("--pattern", choices=["sequential", "concurrency", "rate", "poisson", "sweep", "replay",
                                         "rate-sweep"],
                   default="sequential", help="closed loop (sequential, concurrency, sweep) or open loop "
                                              "(rate, poisson, replay of the agentic trace's timing)")
    g.add_argument("--concurrency", type=_positive(int), default=1, help="workers for --pattern concurrency")
    g.add_argument("--concurrency-list", type=_int_list, default=[1, 2, 4, 8],
                   help="levels for --pattern sweep, comma-separated (default 1,2,4,8)")
    g.add_argument("--rate", type=_positive(float), help="requests/s for --pattern rate and poisson")
    g.add_argument("--seed", type=int, default=0, help="seed for the Poisson schedule, prompts, sampling")
    g.add_argument("--requests", type=_positive(int), help="requests to send (per level for sweep; "
                                                           "default: the workload's size)")
    g.add_argument("--duration", type=_positive(float), help="stop sending after this many seconds")
    g.add_argument("--warmup", type=int, default=1, help="warm-up requests, excluded (default 1)")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="fixed",
                   help="fixed: prompts of exactly --prompt-tokens tokens; shared-prefix[-variant]: "
                        "one long system prompt, many tasks; agentic: the recorded coding session; "
                        "coding-agent: that session as a coding agent sends it (system blocks, 15 "
                        "tools, tool_use/tool_result turns) in the shape of --api")
    g.add_argument("--prompt-tokens", type=_positive(int), default=64,
                   help="prompt length for --workload fixed (default 64), counted by the model's own "
                        "tokenizer: in process, the engine's; over HTTP, the server's /tokenize "
                        "(llama-server, vLLM) or --tokenizer")
    g.add_argument("--tokenizer", type=Path, help="tokenizer of the served model for --prompt-tokens: "
                                                  "a .gguf file, or an HF folder / tokenizer.json")
    g.add_argument("--no-salt", action="store_true",
                   help="send prompts as given; by default a per-run salt starts each prompt so a "
                        "server's prompt cache cannot serve this run from an earlier one")
    g.add_argument("--max-tokens", type=_positive(int), default=32,
                   help="output tokens per request (default 32; agentic uses the recorded lengths)")
    g.add_argument("--ignore-eos", action="store_true", help="force exactly --max-tokens output tokens")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, help="results folder (default: under the infercourse cache)")
    g.add_argument("--label", help="name of this run in reports")
    g.add_argument("--slo", type=parse_slos, metavar="NAME=VALUE,...",
                   help="service-level objectives, e.g. ttft=0.5,tpot=0.05 (seconds; *_tok_per_s are "
                        "lower bounds): prints goodput, the share of requests meeting all of them")
    g.add_argument("--roofline", action="store_true",
                   help="probe this machine (~5 s) and print the decode ceiling and bandwidth utilisation")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    from infercourse.cli.load import add_load_args
    add_load_args(p, _positive(int))
    return p


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse misuse while parsing (argparse's usage error, exit 2), before anything is built:
    building a fixed workload already asks the server's /tokenize, so a remote --url must be
    refused here, not by the run."""
    from infercourse.core.loopback import refuse_remote
    remote = refuse_remote(a.url, what="bench", allow_remote=a.allow_remote) if a.url else None
    wrong = [message for bad, message in (
        (a.engine == "http" and not a.url, "--engine http needs --url, e.g. --url http://127.0.0.1:8080"),
        (a.engine != "http" and a.url, "--url only applies to --engine http"),
        (remote is not None, remote),
        (a.pattern in ("rate", "poisson") and not a.rate, f"--pattern {a.pattern} needs --rate REQUESTS_PER_S"),
        (a.pattern == "replay" and a.workload != "agentic" and a.dataset is None,
         "--pattern replay replays the timing of --workload agentic (or of a --dataset with offset_s)"),
        (a.pattern == "sweep" and a.engine != "http",
         "--pattern sweep needs a server (--engine http): an in-process engine runs one request at a time"),
        (a.roofline and a.engine != "llamacpp",
         "--roofline needs --engine llamacpp: the ceiling is computed from the local model file"),
        (a.warmup < 0, f"--warmup must be >= 0, got {a.warmup}"),
        (a.engine != "http" and (a.api_key_file_key or a.logprobs),
         "--api-key-file and --logprobs only apply to --engine http"),
        (a.tokenizer is not None and not a.tokenizer.exists(), f"--tokenizer {a.tokenizer}: no such file or folder"),
    ) if bad]
    if wrong:
        p.error(wrong[0])
    if a.api_key_on_argv:
        p.error("--api-key KEY puts the key on bench's command line, visible to every user of this machine "
                "(`ps`): give --api-key-file FILE or set INFERCOURSE_API_KEY")


def api_key(a: argparse.Namespace, api: str) -> str | None:
    """The key bench sends: --api-key-file's, else $INFERCOURSE_API_KEY (a room's key, as
    `serve` reads it), else the API's own variable; None: no Authorization header.

    Args:
        a: the parsed arguments.
        api: "anthropic" or an OpenAI API ("chat", "completions", "openai").
    """
    own = "ANTHROPIC_API_KEY" if api == "anthropic" else "OPENAI_API_KEY"
    return a.api_key_file_key or os.environ.get("INFERCOURSE_API_KEY") or os.environ.get(own) or None


def _print_summary(r, slos=None) -> None:
    from infercourse.core import summary
    from infercourse.measure.results import report_lines
    out = sys.stdout  # looked up at call time: notebooks and tests swap it
    if len(r.summary):
        cols = [c for c in ("count", "p50", "p95", "p99", "max") if c in r.summary]
        t = r.summary[cols].astype(object)
        for m in t.index:          # a percentile its sample cannot support is printed as "n<N"
            for c in ("p95", "p99"):
                if c in t:
                    t.loc[m, c] = summary.shown(t.loc[m, c], c, r.summary.loc[m].get("n_too_small"))
        print(t.to_string(float_format=lambda v: f"{v:.4g}"), file=out)
        if any("n<" in str(v) for v in t.to_numpy().ravel()):
            print("(n<N: fewer samples than that percentile's 95% interval needs; not printed)", file=out)
    t = summary.throughput(r.df) if len(r.df) else {"completed": 0, "requests": 0, "requests_per_s": math.nan,
                                                    "output_tok_per_s": math.nan, "wall_s": math.nan}
    print(f"\n{t['completed']}/{t['requests']} ok, {t['requests_per_s']:.3g} req/s, "
          f"{t['output_tok_per_s']:.4g} output tok/s over {t['wall_s']:.3g} s", file=out)
    for line in report_lines(r.df, slos) if len(r.df) else []:
        print(line, file=out)
    for w in r.warnings:
        print(f"WARNING: {w}", file=out)
    print(f"results: {r.dir}", file=out)


def clean_errors(main):
    """Every InferCourseError is a named failure, not a bug: one line on stderr, exit 1
    (after the summary of whatever finished). Anything else keeps its traceback."""
    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        from infercourse.core.errors import InferCourseError
        try:
            return main(argv)
        except InferCourseError as e:
            if hasattr(e.partial, "df") and hasattr(e.partial, "dir"):
                _print_summary(e.partial)
            lines = str(e.message).strip().splitlines() or [type(e).__name__]
            more = " (more in the log it names)" if len(lines) > 1 else ""
            hint = f" {e.hint}" if e.hint else ""
            print(f"error: {lines[0]}{more} ({e.layer} layer).{hint}", file=sys.stderr)
            return 1
    return wrapper


@clean_errors
def bench_main(argv: list[str] | None = None) -> int:
    """`infercourse bench`: returns the exit code (0 ok, 1 run failed, 2 bad usage, 130 interrupted)."""
    p = bench_parser()
    a = p.parse_args(argv)
    _check(p, a)
    from infercourse.cli.load import check_load_args, run_load_mode
    check_load_args(p, a)
    from infercourse.measure import bench
    if a.api == "anthropic" and (a.ignore_eos or a.logprobs):
        p.error("--api anthropic: the Messages API has no field for --ignore-eos or --logprobs")
    if a.engine == "http" and a.api == "anthropic":
        from infercourse.engines.anthropic_http import AnthropicHTTPEngine
        engine = AnthropicHTTPEngine(a.url, model=a.model, api_key=api_key(a, a.api))
    elif a.engine == "http":
        from infercourse.engines.openai_http import OpenAIHTTPEngine
        engine = OpenAIHTTPEngine(a.url, model=a.model, api="chat" if a.api == "openai" else a.api,
                                  logprobs=a.logprobs, api_key=api_key(a, a.api))
    else:
        from infercourse.engines.llamacpp import LlamaCppEngine
        engine = LlamaCppEngine(a.model, n_ctx=a.n_ctx, n_threads=a.threads, seed=a.seed)
    # A fixed workload's prompts are built with the run's salt in them, so they are exactly
    # --prompt-tokens long. A sweep salts each level afresh (no level may hit the previous
    # one's prompts): its prompts are built with a salt of the same form, so they may be a
    # token or two off where another salt tokenizes differently.
    salt = None if a.no_salt or a.workload != "fixed" else bench.new_salt()
    from infercourse.cli.workload import build_workload
    work = build_workload(a, engine, salt)
    kw = dict(seed=a.seed, warmup=a.warmup, max_duration_s=a.duration, out_dir=a.out, label=a.label,
              ignore_eos=True if a.ignore_eos else None, progress=not a.no_progress,
              allow_remote=a.allow_remote,
              salt=False if a.no_salt else (None if a.pattern == "sweep" else salt))
    done = run_load_mode(a, engine, work, kw)   # --sessions, --pattern rate-sweep
    if done is not None:
        return done
    if a.pattern == "sweep":
        table, runs = bench.sweep(engine, work, a.concurrency_list, requests_per_level=a.requests, **kw)
        if a.slo:
            from infercourse.core.summary import goodput
            table["good_fraction"] = [goodput(r.df, a.slo)["good_fraction"] for r in runs]
        print(table.to_string(float_format=lambda v: f"{v:.4g}"))
        return 0
    r = bench.run(engine, work, pattern=a.pattern, concurrency=a.concurrency, rate_rps=a.rate,
                  max_requests=a.requests, **kw)
    _print_summary(r, a.slo)
    if a.roofline:
        _print_roofline(engine, r)
    return 130 if r.manifest.get("stopped") == "interrupted" else 0


def _print_roofline(engine, r) -> None:
    from infercourse.measure import roofline
    from infercourse.models.modelcard import model_card
    card, machine = model_card(engine.model.path), roofline.probe()
    ctx = float(r.df["prompt_tokens"].median())
    ceiling = roofline.decode_ceiling_tok_per_s(machine["bandwidth_gbs"], card, int(ctx))
    dec = float(r.df["decode_tok_per_s"].median())
    print(f"roofline: {machine['bandwidth_gbs']:.3g} GB/s read -> decode ceiling {ceiling:.4g} tok/s at "
          f"context {ctx:.0f}; measured p50 {dec:.4g} tok/s = {dec / ceiling:.1%} bandwidth utilisation")
