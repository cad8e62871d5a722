"""`infercourse bench`'s load modes beyond one pattern: `--sessions N`, `--dataset FILE`, and
`--pattern rate-sweep`. The arguments and the printing live here; every number comes from
`measure.sessions`, `measure.datasets` and `measure.ratesweep`.

    infercourse bench --engine http --url URL --sessions 4 --turns 6
    infercourse bench --engine http --url URL --sessions 4 --dataset my_sessions.jsonl
    infercourse bench --engine http --url URL --pattern rate-sweep --rate-list 0.5,1,2,4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_load_args", "check_load_args", "dataset_workload", "run_load_mode", "DATASET_HELP"]

DATASET_HELP = (
    "your own requests: a JSONL file, one JSON object per line: exactly one of \"prompt\" (string) "
    "or \"messages\" ([{\"role\": system|user|assistant|tool, \"content\": ...}]); optional "
    "\"max_tokens\" (int >= 1, default 64), \"offset_s\" (send time, on every line or none; "
    "--pattern replay uses it). Lines with a \"session\" (string) are the turns of one "
    "conversation in file order (their messages are the ones added at that turn; optional "
    "\"reply\" for --exact-replay and \"think_s\"); run them with --sessions N. Bad lines are "
    "reported by line number before anything is sent")


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be numbers > 0, got {text!r}")
    return values


def add_load_args(p: argparse.ArgumentParser, positive_int) -> None:
    """The session, dataset and rate-sweep arguments, in their own group."""
    g = p.add_argument_group("sessions, datasets, rate sweep")
    g.add_argument("--sessions", type=positive_int, metavar="N",
                   help="N concurrent live agent sessions (each salted apart: prefixes shared within a "
                        "session, never between two), think time from the recorded tool latencies; prints "
                        "the cache hit rate and TTFT by turn and per session. Default session: the "
                        "recorded coding session (--session-kind), or --dataset's sessions")
    g.add_argument("--session-kind", choices=["agentic", "coding-agent"], default="agentic",
                   help="agentic: data/agentic_session.json (tool calls as text, any server); coding-agent: "
                        "the coding-agent workload with tool schemas (llama-server needs --jinja)")
    g.add_argument("--turns", type=positive_int, help="turns per session (default: all)")
    g.add_argument("--exact-replay", action="store_true",
                   help="carry the recorded replies forward instead of the model's own (same tokens every run)")
    g.add_argument("--think-scale", type=float, default=1.0,
                   help="multiply the recorded think (tool) times (0: none; default 1)")
    g.add_argument("--session-counts", type=lambda t: [int(float(v)) for v in _floats(t)],
                   help="sweep the session count, e.g. 1,2,4,8 (instead of --sessions)")
    g.add_argument("--dataset", type=Path, metavar="FILE.jsonl", help=DATASET_HELP)
    g.add_argument("--rate-list", type=_floats, default=[0.5, 1, 2, 4, 8],
                   help="offered requests/s for --pattern rate-sweep, low to high (default 0.5,1,2,4,8); "
                        "the sweep stops at the first saturated level")


def check_load_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if (a.sessions or a.session_counts or a.pattern == "rate-sweep") and a.engine != "http":
        p.error("--sessions and --pattern rate-sweep need a server (--engine http)")
    if a.dataset is not None and not a.dataset.is_file():
        p.error(f"--dataset {a.dataset}: no such file")
    if a.dataset is not None:   # every bad line, by number, before anything is sent
        from infercourse.measure.datasets import DatasetError, load_dataset
        try:
            rows = load_dataset(a.dataset)
        except DatasetError as e:
            p.error(f"--dataset {e.message}")
        if a.pattern == "replay" and "offset_s" not in rows[0]:
            p.error(f"--pattern replay: {a.dataset} has no offset_s on its lines (nothing to replay)")
    if a.think_scale < 0:
        p.error(f"--think-scale must be >= 0, got {a.think_scale}")


def dataset_workload(a: argparse.Namespace):
    """The request dataset of --dataset (None without one)."""
    if a.dataset is None or a.sessions or a.session_counts:
        return None
    from infercourse.measure.datasets import dataset_workload as load
    return load(a.dataset)


def run_load_mode(a: argparse.Namespace, engine, work, kw: dict) -> int | None:
    """Run --sessions / --session-counts / --pattern rate-sweep and print; None: not one of them."""
    import pandas as pd
    out = sys.stdout
    fmt = dict(float_format=lambda v: f"{v:.4g}")
    if a.pattern == "rate-sweep":
        from infercourse.measure.ratesweep import rate_sweep
        table, _ = rate_sweep(engine, work, a.rate_list, requests_per_level=a.requests, **kw)
        print(table.to_string(**fmt), file=out)
        return 0
    if not (a.sessions or a.session_counts):
        return None
    from infercourse.measure import sessions as ss
    if a.dataset is not None:
        from infercourse.measure.datasets import dataset_sessions
        script = dataset_sessions(a.dataset)
    else:
        script = ss.agentic_script(a.session_kind, a.turns)
    skw = dict(n_turns=a.turns, replay="exact" if a.exact_replay else "live", think_scale=a.think_scale,
               seed=a.seed, warmup=a.warmup, max_duration_s=a.duration, label=a.label,
               progress=not a.no_progress, allow_remote=a.allow_remote)
    with pd.option_context("display.width", 160):
        if a.session_counts:
            table, _ = ss.sweep_sessions(engine, script, a.session_counts, slos=a.slo, out_dir=a.out, **skw)
            print(table.to_string(**fmt), file=out)
            return 0
        r = ss.run_sessions(engine, script, a.sessions, out_dir=a.out, **skw)
        print("by turn:\n" + ss.by_turn(r.df).to_string(**fmt), file=out)
        print("\nby session:\n" + ss.by_session(r.df).to_string(**fmt), file=out)
        s = ss.sessions_summary(r.df, a.slo)
        print("\n" + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()),
              file=out)
        for w in r.warnings:
            print(f"WARNING: {w}", file=out)
        print(f"results: {r.dir}", file=out)
    return 130 if r.manifest.get("stopped") == "interrupted" else 0
