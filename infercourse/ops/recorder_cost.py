"""What the recorder itself costs: TTFT and inter-token gaps through it, against direct.

A recorder in front of a server (`ops.agent_capture.RecordingProxy`, the `agent proxy`
command) must not change what it records. Two things could: a delay on every call (it reads
the request, opens a connection upstream, and copies every chunk) and chunks held back (a
buffer that sends several events at once would make the agent's tokens arrive in bursts, and
the recorded inter-token gaps would be the recorder's, not the server's).

`measure` sends the same streamed request (greedy, `ignore_eos`, a fixed length) through three
arms on one server: **direct**, **recorder** (`infercourse agent proxy` in its own process, as a
learner runs it: bodies written, no `/metrics` reads; in the measuring process it would share
its interpreter lock with the client and be charged for the client's work), and **direct
again**, the A/A rerun that measures the noise. The arms are
interleaved in shuffled, seeded blocks (`noise.run_interleaved`); each trial's value is the
median TTFT of its requests (`core.metrics.ttft_s`, from the client's send), and its median
inter-chunk gap (`itl_s`, per chunk) is kept beside it, with each request's chunk count and
text. `compare` judges recorder against direct with the A/A rerun in every block
(`noise.compare`); `recorder_sentence` words it, against the goal of under 1 ms added per
call at p50 (judged on the interval of the ms added in each block, not on the test: that the
recorder adds something says nothing of how much), and says whether every trial got the same
chunks and text through both.
"""
from __future__ import annotations

import contextlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from infercourse.core.errors import InferCourseError

__all__ = ["GOAL_MS", "RecorderCost", "recorder_process", "measure", "measure_on_llama", "compare", "recorder_sentence",
           "cost_table"]

GOAL_MS = 1.0   # added per call at p50
ARMS = ("direct", "recorder", "direct again")


@dataclass
class RecorderCost:
    """Per arm and trial (block order): median TTFT (s), median inter-chunk gap (s), each
    request's chunk count and text; the run's schedule."""
    ttft_s: dict[str, list[float]]
    itl_s: dict[str, list[float]]
    chunks: dict[str, list[list[int]]]
    texts: dict[str, list[list[str]]]
    order: list[tuple[int, str]] = field(default_factory=list)


@contextlib.contextmanager
def recorder_process(url: str, out: str | Path) -> Iterator[str]:
    """`infercourse agent proxy --upstream URL` in its own process, recording into `out`;
    yields its URL once it listens, and ends it with Ctrl-C (SIGINT) as a learner would."""
    from infercourse.servers import free_port
    port, out = free_port(), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "recorder.log", "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "infercourse", "agent", "proxy", "--upstream", url, "--port",
                              str(port), "--out", str(out / "session")], stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
        try:
            t_end = time.monotonic() + 120
            while p.poll() is None and time.monotonic() < t_end:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                time.sleep(0.05)
            if p.poll() is not None or time.monotonic() >= t_end:
                raise RuntimeError(f"the recorder did not start; its output is in {out / 'recorder.log'}")
            yield f"http://127.0.0.1:{port}"
        finally:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def measure(url: str, *, repeats: int = 8, requests: int = 3, max_tokens: int = 24, seed: int = 0,
            prompt: str = "Count from one to fifty in words.", model: str | None = None,
            out: str | Path | None = None) -> RecorderCost:
    """Interleave direct / recorder / direct-again trials against the server at `url`.

    Args:
        url: a loopback server root (the recorder refuses others).
        repeats: trials per arm (blocks); requests: requests per trial (its value is their median).
        max_tokens: the answer's fixed length (`ignore_eos`); seed: the schedule's shuffle.
        prompt, model: what is asked, of which model (None: the server's one).
        out: where the recorder's session goes (None: a temporary folder).
    """
    from infercourse.core.metrics import itl_s, ttft_s
    from infercourse.core.trace import record
    from infercourse.core.types import Request
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    from infercourse.measure import noise
    req = Request(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, ignore_eos=True)
    seen: dict[str, list[tuple[float, list[int], list[str]]]] = {a: [] for a in ARMS}
    with recorder_process(url, out or tempfile.mkdtemp(prefix="recorder-cost-")) as proxy_url:
        engines = {"direct": OpenAIHTTPEngine(url, model), "recorder": OpenAIHTTPEngine(proxy_url, model)}
        engines["direct again"] = engines["direct"]

        def trial(arm: str):
            def run() -> float:
                trs = [record(engines[arm], req) for _ in range(requests)]
                bad = next((tr for tr in trs if ttft_s(tr) is None), None)
                if bad is not None:   # a failed call has no TTFT: say where it failed, never a median of None
                    raise InferCourseError(f"a request {'through the recorder' if arm == 'recorder' else 'direct'} "
                                           f"to {url} failed: {bad.error or bad.status} (API layer)")
                gaps = [g for tr in trs for g in itl_s(tr)]
                seen[arm].append((statistics.median(gaps) if gaps else float("nan"),
                                  [len(tr.chunk_t) for tr in trs], [tr.text for tr in trs]))
                return statistics.median(ttft_s(tr) for tr in trs)
            return run
        res = noise.run_interleaved({a: trial(a) for a in ARMS}, repeats, seed=seed, warmup=1)
    # the k-th call of an arm after its warm-up ran in block k (run_interleaved walks the blocks in order)
    per = {a: seen[a][1:] for a in ARMS}
    return RecorderCost(ttft_s={a: list(res[a]) for a in ARMS}, itl_s={a: [x[0] for x in per[a]] for a in ARMS},
                        chunks={a: [x[1] for x in per[a]] for a in ARMS}, texts={a: [x[2] for x in per[a]] for a in ARMS},
                        order=list(getattr(res, "order", [])))


def compare(cost: RecorderCost) -> dict[str, Any]:
    """Recorder against direct, with direct's A/A rerun in every block: the verdicts on TTFT
    and on the inter-chunk gap, the median added ms per call (recorder less direct in each block:
    the pairs the TTFT verdict ranks, so the two intervals agree in sign) and the A/A's own
    (direct again less direct), and whether every trial got the same chunk counts and texts
    through the recorder as direct."""
    from infercourse.measure import noise
    out: dict[str, Any] = {}
    for metric in ("ttft_s", "itl_s"):
        v = getattr(cost, metric)
        floor = noise.noise_floor(v["direct"], v["direct again"])
        out[metric] = noise.compare(v["direct"], v["recorder"], floor, labels=("direct", "recorder"))
    d, r, d2 = (np.asarray(cost.ttft_s[a], float) for a in ARMS)
    out["added_per_block_ms"] = [float(x) * 1e3 for x in r - d]
    out["added_ms"] = float(np.median(out["added_per_block_ms"]))
    out["aa_ms"] = float(np.median(np.abs(d2 - d)) * 1e3)
    same = [cost.chunks["recorder"][i] == cost.chunks["direct"][i] and cost.texts["recorder"][i] == cost.texts["direct"][i]
            for i in range(min(len(cost.chunks["recorder"]), len(cost.chunks["direct"])))]
    out["trials"], out["same_chunks"] = len(same), sum(same)
    out["chunks_per_request"] = sorted({n for t in cost.chunks["direct"] for n in t})
    return out


def cost_table(cost: RecorderCost) -> "Any":
    """One row per arm: median TTFT and inter-chunk gap over its trials (ms), trials."""
    import pandas as pd
    return pd.DataFrame({"ttft_p50_ms": {a: np.median(cost.ttft_s[a]) * 1e3 for a in ARMS},
                         "itl_p50_ms": {a: np.median(cost.itl_s[a]) * 1e3 for a in ARMS},
                         "trials": {a: len(cost.ttft_s[a]) for a in ARMS}})


def _goal(c: Any, added: list[float], aa: float) -> str:
    """The goal judged on the added ms per call (`added`: one per block, recorder less direct, the
    pairs the TTFT verdict ranks): its median's 95% order-statistic interval, and the A/A noise.
    Missed only when the whole interval lies above the goal; met only when it and the noise lie under
    it; a median just past the goal inside a wider noise is neither (the test above may still find the
    recorder slower: that it adds something says nothing of how much)."""
    from infercourse.core.summary import median_interval
    interval = median_interval(added)
    if c.too_few or interval is None:
        return "cannot be judged: too few pairs" + ("" if c.too_few else f" ({len(added)}) for an interval of the added ms")
    (lo, hi), med = interval, float(np.median(added))
    adds = f"{med:.2f} ms per call (95% interval [{lo:.2f}, {hi:.2f}] ms)"
    if lo > GOAL_MS:
        return f"missed: the recorder adds {adds}, all of it above {GOAL_MS:g} ms"
    if hi < GOAL_MS and aa < GOAL_MS:
        return (f"met: the recorder adds {adds}, under {GOAL_MS:g} ms" if c.decided else
                f"met: no difference beyond the noise; the recorder adds {adds}, under {GOAL_MS:g} ms") + \
            f", as is the A/A noise ({aa:.2f} ms)"
    return (f"cannot be judged here: the recorder adds {adds}, and the A/A noise is {aa:.2f} ms: "
            f"this run shows it neither under nor over {GOAL_MS:g} ms")


def recorder_sentence(c: dict[str, Any]) -> str:
    """What `compare` found, in words: TTFT and gaps, the goal, the chunks."""
    from infercourse.measure.claims import verdict_sentence
    t = c["ttft_s"]
    chunks = (f"Every one of the {c['trials']} trials got the same chunks and text through the recorder as direct: "
              "none held back or merged." if c["same_chunks"] == c["trials"] else
              f"{c['trials'] - c['same_chunks']} of {c['trials']} trials got other chunks or text through the "
              "recorder than direct: it changed what the client received.")
    return (f"Through the recorder the first token came {c['added_ms']:+.2f} ms later per call at p50 (direct against "
            f"its A/A rerun: {c['aa_ms']:.2f} ms apart). {verdict_sentence(t, 'TTFT')} The goal, under "
            f"{GOAL_MS:g} ms added per call: {_goal(t, c['added_per_block_ms'], c['aa_ms'])}. "
            f"{verdict_sentence(c['itl_s'], 'inter-chunk gap')} {chunks}")


def measure_on_llama(*, ctx: int = 2048, threads: int | None = 1, model: str | None = None, **kw: Any) -> RecorderCost:
    """`measure` against a fresh llama-server (one slot, `ctx` tokens) of `model` (None: the
    embedded one); `kw` goes to `measure` (repeats, requests, max_tokens, seed, out)."""
    from infercourse.servers import LlamaServer
    with LlamaServer(model, n_parallel=1, ctx_size=ctx, threads=threads) as srv:
        return measure(srv.url, **kw)
