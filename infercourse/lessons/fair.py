"""A fair benchmark: one rule, every route on this machine, and a table that says what differed.

"Engine A is faster than engine B" is only true under stated conditions. The rule here:
the same weights, quantization, context, prompts (an agent workload), sampling, hardware,
load pattern and request count on every route, and every number (TTFT, prefill, decode,
memory, prefix-cache hits, error rate) computed the same way, by `bench` and
`core.metrics`, from the client's own clock. Where a condition *cannot* be made equal
(transformers has no Q4_1 kernels, so it runs the same weights in float32; MLX on a CPU
picks its own threads), the comparison must not hide it: `results.differing_conditions`
refuses the comparison unless that condition is explicitly allowed, and the table then
labels it beside the numbers.

A route (`ops.routes`) is an engine plus whatever stands in front of it: llama.cpp in
process, llama-server, transformers, MLX in process, mlx_lm.server, vLLM's CPU build,
Ollama. Each route is built, warmed up with the same short request, measured and torn down in
turn (loaded once). Every route that can run here runs (MLX's CPU build and vLLM's CPU build
too: slow, and measured as such); one that cannot still gets a row, saying why, computed by
`ops.doctor.engine_status` on this machine (`plan`).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from infercourse.core import summary
from infercourse.core.trace import record
from infercourse.core.types import Request
from infercourse.measure import bench
from infercourse.measure.importers import load_vllm_bench
from infercourse.measure.results import Run, compare, differing_conditions, load_run, new_run_dir
from infercourse.measure.workloads import DATA_DIR, Workload, agentic_workload
# Routes (how each is opened, which run here) are shared with notebook 21: ops.routes.
from infercourse.ops.routes import ROUTES, open_route, route_status

__all__ = ["FAIR_KEYS", "LABELLED", "ROUTES", "PEER_FIXTURE", "WARMUP", "agent_calls", "route_status", "plan",
           "open_route", "measure_routes", "fair_table", "engine_table", "plot_routes",
           "server_vs_in_process", "thread_scaling", "peer_run", "peer_beside_ours"]

# Manifest keys that must match for two runs' numbers to be compared (dotted, as
# `differing_conditions` flattens them). `fair.*` is what each route records below.
FAIR_KEYS = ("fair.weights", "fair.quantization", "fair.context_tokens", "fair.threads",
             "workload.sha256", "sampling", "load.pattern", "load.concurrency", "load.max_requests",
             "load.max_duration_s", "hardware")
# Conditions some runtimes cannot share: allowed to differ, but always shown.
LABELLED = ("fair.quantization", "fair.threads", "fair.context_tokens")

PEER_FIXTURE = DATA_DIR.parent / "tests" / "data" / "vllm_bench_serve_detailed.json"
# The same short, unrelated request warms every route up: pages weights in, builds kernels,
# and leaves no useful prefix in any cache for the measured calls.
WARMUP = Request(messages=[{"role": "user", "content": "Say hello."}], max_tokens=4)


def agent_calls(n_calls: int, max_tokens: int) -> Workload:
    """The first `n_calls` model calls of the recorded coding-agent session (each prompt
    extends the previous one, as an agent's does), every answer forced to `max_tokens`.

    Args:
        n_calls: calls replayed, back to back (no tool think-time: that is notebook 15's).
        max_tokens: forced output length, so decode is timed over the same token count.
    """
    wl = agentic_workload()
    reqs = tuple(Request(messages=r.messages, max_tokens=max_tokens, ignore_eos=True)
                 for r in wl.requests[:n_calls])
    return Workload(f"{wl.name}-first{n_calls}-max{max_tokens}", reqs, cache_workload=True)


def plan(names: list[str], status: dict | None = None, skip: dict[str, str] | None = None) -> pd.DataFrame:
    """Which routes will run, and why each other one will not: one row per route (`run`, `why`).

    A route runs if this machine can run it (`ops.doctor.engine_status`), however slowly, unless
    `skip` names it; `why` is the doctor's reason (e.g. what does not import, or the vLLM
    environment's path and the command that builds it) or "skipped by you: <reason>".

    Args:
        names: routes from `ROUTES`.
        status: `doctor.engine_status()` (None: asked now).
        skip: {route: reason} not to run although it could.
    """
    here, skip = route_status(names, status), skip or {}
    unknown = set(skip) - set(names)
    if unknown:
        raise ValueError(f"skip names route(s) not in the list: {sorted(unknown)}")
    run = here["here"] & ~here.index.isin(list(skip))
    why = [here.loc[n, "why"] if not here.loc[n, "here"] else f"skipped by you: {skip[n]}" if n in skip
           else f"runs: {here.loc[n, 'why']}" for n in names]
    return pd.DataFrame({"run": run, "why": why}, index=here.index)


def _cold_warm(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(call 1, the later calls) among a run's completed requests, in the order they were sent."""
    ok = df.sort_values("request_id")
    ok = ok[ok["status"] == "ok"]
    return ok.iloc[:1], ok.iloc[1:]


def _row(name: str, run: Run, mem_bytes: float) -> dict[str, Any]:
    """One route's numbers. Call 1 (cold: nothing of it cached after the unrelated warm-up) is
    kept apart from the later calls (warm: each extends the last, so a prefix cache can serve
    most of it): a p50 over both mixes the two (with 2 calls it is their mean), so TTFT and E2E
    are call 1's or the later calls'; decode does not depend on a cache, so its p50 is over all."""
    df = run.df.sort_values("request_id")
    ok = df[df["status"] == "ok"]
    first, later = _cold_warm(df)
    s = summary.summarize(df, ("decode_tok_per_s",))
    p50 = lambda m: float(s.loc[m, "p50"]) if m in s.index and "p50" in s else float("nan")  # noqa: E731
    one = lambda part, m: float(part[m].iloc[0]) if len(part) and pd.notna(part[m].iloc[0]) \
        else float("nan")  # noqa: E731

    def hit(part: pd.DataFrame) -> float:    # NaN, not 0, when the route reports no cached count (vLLM)
        prompt = float(part["prompt_tokens"].sum())
        return float(part["cached_tokens"].sum()) / prompt if prompt and part["cached_tokens"].notna().any() \
            else float("nan")
    fair = run.manifest.get("fair", {})
    return {"route": name, "ran": True, "why": "", "quantization": fair.get("quantization"),
            "threads": fair.get("threads"), "context": fair.get("context_tokens"),
            "calls": len(df), "prompt_tokens": float(ok["prompt_tokens"].sum()),
            "ttft_first_s": one(first, "ttft_s"),
            "ttft_later_p50_s": float(later["ttft_s"].median()) if len(later) else float("nan"),
            "prefill_first_tok_per_s": one(first, "prefill_tok_per_s"), "decode_tok_per_s": p50("decode_tok_per_s"),
            "e2e_first_s": one(first, "e2e_s"), "memory_mb": mem_bytes / 1e6,
            "cache_hit": hit(ok), "cache_hit_first": hit(first), "cache_hit_later": hit(later),
            "error_rate": summary.error_rate(df)}


def measure_routes(names: list[str], workload: Workload, *, threads: int, ctx_size: int,
                   results_root: str | Path | None = None, status: dict | None = None,
                   skip: dict[str, str] | None = None) -> tuple[pd.DataFrame, dict[str, Run]]:
    """Every route in turn under the same conditions: warm-up, then the workload once,
    sequentially (in-process engines serve one request at a time, so servers do too).

    Returns (one row per route: conditions and measured numbers, or why it did not run;
    {route: Run} of those that ran, read back from disk with their manifests).

    Args:
        names: routes from `ROUTES`, in the order to run them.
        workload: the same requests for every route (e.g. `agent_calls(4, 16)`).
        threads, ctx_size: as `open_route`.
        results_root: parent folder for one run folder per route (None: bench's default).
        status: `doctor.engine_status()` (None: asked now).
        skip: {route: reason} not to run although it could (`plan`).
    """
    todo = plan(names, status, skip)
    rows, runs = [], {}
    for name in names:
        if not todo.loc[name, "run"]:
            rows.append({"route": name, "ran": False, "why": todo.loc[name, "why"]})
            continue
        try:
            with open_route(name, threads=threads, ctx_size=ctx_size) as (engine, fair, mem):
                record(engine, WARMUP, raise_errors=True)
                res = bench.run(engine, workload, pattern="sequential", warmup=0, label=name,
                                out_dir=new_run_dir(results_root, name.replace(" ", "_").replace("/", "_")),
                                progress=False, conditions={"fair": fair}, salt=False)  # same prompts everywhere
                mem_bytes = mem()
            runs[name] = load_run(res.dir)
            rows.append(_row(name, runs[name], mem_bytes))
        except Exception as e:  # noqa: BLE001 - the row records why; the next route still runs
            rows.append({"route": name, "ran": False, "why": f"{type(e).__name__}: {e}"[:300]})
    return pd.DataFrame(rows).set_index("route"), runs


def fair_table(runs: dict[str, Run], *, must_match=FAIR_KEYS, allow=LABELLED) -> pd.DataFrame:
    """`results.compare` of the runs, refused (UnfairComparisonError) if a `must_match`
    condition outside `allow` differs; each row labels how its conditions differ from
    the first run's (the reference). TTFT is call 1's (`ttft_first_s`, cold) beside the
    later calls' p50 (`ttft_later_p50_s`, warm), never a p50 over both: over a cold and a
    warm call it is their mean, which describes neither (so no TTFT or E2E p50 columns).

    Args:
        runs: {label: Run}, the reference first.
        must_match, allow: as `results.differing_conditions`.
    """
    diff = differing_conditions(runs.values(), must_match=must_match, allow=allow)
    ref = next(iter(runs))
    table = compare(runs.values(), ("tpot_s", "decode_tok_per_s"))
    labels = []
    for lab in table.index:
        d = [f"{k.split('.')[-1]}={diff.loc[k, lab]}" for k in diff.index
             if any(k == a or k.startswith(a + ".") for a in allow) and diff.loc[k, lab] != diff.loc[k, ref]]
        labels.append("; ".join(d) if d else "reference" if lab == ref else "same conditions")
    table.insert(0, f"differs from {ref}", labels)
    calls = {r.label: _cold_warm(r.df) for r in runs.values()}
    nan = float("nan")
    table.insert(1, "ttft_first_s", [float(calls[x][0]["ttft_s"].iloc[0]) if x in calls and len(calls[x][0]) else nan
                                     for x in table.index])
    table.insert(2, "ttft_later_p50_s", [float(calls[x][1]["ttft_s"].median()) if x in calls and len(calls[x][1])
                                         else nan for x in table.index])
    return table


def engine_table(measured: pd.DataFrame) -> pd.DataFrame:
    """The engine comparison table: positioning, API and deployment limits (from each
    project's documentation) beside what was measured here (or why it was not)."""
    static = pd.DataFrame.from_dict(ROUTES, orient="index").drop(columns="check")
    cols = ["quantization", "ttft_first_s", "ttft_later_p50_s", "prefill_first_tok_per_s", "decode_tok_per_s",
            "memory_mb", "cache_hit", "error_rate", "why"]
    return static.join(measured.reindex(columns=cols), how="right")


def plot_routes(rows: pd.DataFrame, ceilings: dict[str, float], axes):
    """Left: TTFT per route (s), call 1 (cold) beside the later calls' p50 (warm). Right:
    decode tok/s per route, with the bandwidth ceiling of each weight format (a dashed line
    per quantization) as the reference.

    Args:
        rows: `measure_routes` rows.
        ceilings: {quantization: decode ceiling tok/s}.
        axes: two matplotlib Axes.
    """
    ran = rows[rows["ran"]]
    y = list(range(len(ran)))
    axes[0].barh([i + 0.2 for i in y], ran["ttft_first_s"], height=0.4, color="tab:orange", label="call 1 (cold)")
    if ran["ttft_later_p50_s"].notna().any():
        axes[0].barh([i - 0.2 for i in y], ran["ttft_later_p50_s"], height=0.4, color="tab:green",
                     label="later calls, p50 (warm)")
    axes[0].set_yticks(y, list(ran.index))
    axes[0].set(xlabel="TTFT (s)", title="Time to first token (agent calls)")
    axes[0].legend(loc="lower right", fontsize=8)
    axes[1].barh(list(ran.index), ran["decode_tok_per_s"], color="tab:blue")
    for (quant, c), style in zip(ceilings.items(), ("--", ":", "-.")):
        axes[1].axvline(c, ls=style, color="tab:red", label=f"ceiling, {quant} weights: {c:.0f} tok/s")
    axes[1].set(xlabel="decode speed p50 (tok/s, log)", xscale="log", title="Decode speed vs bandwidth ceiling")
    axes[1].legend(loc="lower right", fontsize=8)
    return axes


def server_vs_in_process(request: Request, *, threads: int, ctx_size: int, repeats: int = 6) -> dict[str, Any]:
    """Does llama-server cost TTFT against the same runtime in process? Interleaved A/A/B.

    Both routes are open at once; each trial sends `WARMUP` (so no trial starts with the
    call's prefix cached) and then `request`, and keeps its TTFT. Each block runs in process,
    llama-server and in process again (the A/A floor) in a shuffled order (`noise.schedule`,
    seeded, returned as "order"): with a fixed order (ABBA put the server in the middle of
    every block) whatever a slot costs reads as an effect; shuffled, which run carries which
    label is chance, as the verdict's permutation test against the A/A rerun assumes.
    `fair_claims.order_sentence` looks for an order effect in the A/A pairs.

    Returns {"values": {arm: [TTFT s per block]}, "order": [(block, arm)] as run,
    "floor": NoiseFloor, "comparison": Comparison}.

    Args:
        request: one call (e.g. the first agent call, `agent_calls(1, n).requests[0]`).
        threads, ctx_size: as `open_route`.
        repeats: trials per arm (6 pairs give a 95% interval; fewer, the range, said so).
    """
    from infercourse.core import metrics
    from infercourse.measure import noise
    with open_route("llama.cpp in process", threads=threads, ctx_size=ctx_size) as (a, _, _), \
            open_route("llama-server", threads=threads, ctx_size=ctx_size) as (b, _, _):
        # cache_prompt=False: llama-server's host prompt cache (--cache-ram) would otherwise restore
        # the call's prefix after the warm-up (measured: 0.1 s against 25 s), a cache, not the server
        cold = replace(request, cache_prompt=False)

        def ttft(engine) -> float:
            record(engine, WARMUP, raise_errors=True)
            return metrics.ttft_s(record(engine, cold, raise_errors=True))
        arms = {"in process": lambda: ttft(a), "llama-server": lambda: ttft(b), "in process (A/A)": lambda: ttft(a)}
        vals = noise.run_interleaved(arms, repeats, warmup=1)
    floor = noise.noise_floor(vals["in process"], vals["in process (A/A)"])
    return {"values": vals, "order": vals.order, "floor": floor,
            "comparison": noise.compare(vals["in process"], vals["llama-server"], floor,
                                        labels=("in process", "llama-server"))}


def thread_scaling(request: Request, threads: tuple[int, int], *, ctx_size: int, repeats: int = 2) -> dict[str, Any]:
    """Call `request` on llama.cpp in process at two thread counts, interleaved (shuffled
    blocks, `noise.run_arms`), each call cold (`cache_prompt=False`): how much do TTFT (prefill,
    arithmetic-bound) and decode (bandwidth-bound) gain from more threads?

    Returns {"ttft_speedup": median paired TTFT(fewer) / TTFT(more), "decode_speedup":
    median paired decode(more) / decode(fewer), "pairs": n, "trials": the rows}.

    Args:
        request: one call (e.g. `agent_calls(1, n).requests[0]`).
        threads: (fewer, more), e.g. (1, 2).
        ctx_size: as `open_route`.
        repeats: trials per thread count (made even).
    """
    from infercourse.core import metrics
    from infercourse.measure import noise
    few, many = threads
    cold = replace(request, cache_prompt=False)
    with open_route("llama.cpp in process", threads=few, ctx_size=ctx_size) as (a, _, _), \
            open_route("llama.cpp in process", threads=many, ctx_size=ctx_size) as (b, _, _):
        for engine in (a, b):
            record(engine, WARMUP, raise_errors=True)

        def trial(engine, _label: str) -> tuple[dict, None]:
            tr = record(engine, cold, raise_errors=True)
            return {"ttft_s": metrics.ttft_s(tr), "decode_tok_per_s": metrics.decode_tok_per_s(tr)}, None
        trials, _ = noise.run_arms({"fewer": a, "more": b}, repeats, trial)
    t = trials.pivot(index="rep", columns="arm", values="ttft_s")
    d = trials.pivot(index="rep", columns="arm", values="decode_tok_per_s")
    return {"ttft_speedup": noise.paired_interval(t["more"], t["fewer"]).median,
            "decode_speedup": noise.paired_interval(d["fewer"], d["more"]).median, "pairs": len(t), "trials": trials}


def peer_run(path: str | Path = PEER_FIXTURE) -> Run:
    """A `vllm bench serve --save-detailed` result file as a `Run`: its requests on our
    columns (`importers.load_vllm_bench`) and a manifest built from only what the file
    records, so `differing_conditions` can say what it leaves out (the machine, the
    quantization, the exact prompts)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        head = json.loads(text)
    except json.JSONDecodeError:   # `--append-result`: one document per line; the first names the run
        head = json.loads(text.splitlines()[0])
    df = load_vllm_bench(path)
    manifest = {"label": f"vllm bench serve ({path.name})", "tool": "vllm bench serve",
                "fair": {"weights": head.get("model_id"), "tokenizer": head.get("tokenizer_id")},
                "load": {"pattern": "rate" if head.get("request_rate") not in (None, "inf") else "burst",
                         "concurrency": head.get("max_concurrency"), "max_requests": head.get("num_prompts")},
                "workload": {"input_lens": head.get("input_lens"), "output_lens": head.get("output_lens")}}
    return Run(path, manifest, df, [])


def peer_beside_ours(ours: Run, peer: Run) -> pd.DataFrame:
    """Ours and a peer tool's run on the same axes (one definition of each metric, from
    `core.metrics`), with every condition that differs listed, never silently merged. Ours
    is its call 1 (cold, as the peer's independent prompts are): our calls extend each other,
    and a p50 over a cold call and warm ones describes neither."""
    diff = differing_conditions([ours, peer])
    first = ours.df.sort_values("request_id").iloc[:1]
    cold = Run(ours.path, {**ours.manifest, "label": f"{ours.label}, call 1 (cold)"}, first, [])
    table = compare([cold, peer], ("ttft_s", "ttft_from_send_s", "tpot_s", "e2e_s"))
    table.insert(0, "conditions that differ", len(diff))
    return table
