"""A recorder in front of your own server: your agent, your model, a working session, measured.

The lab (`ops.agent_lab`) runs an agent sealed against the course's server. A learner's own
agent, on their own machine, talks to their own server; to see what it sends, put the
recording proxy between the two for a working session:

    infercourse agent proxy --upstream http://127.0.0.1:8080 --port 8788
        # point the agent at http://127.0.0.1:8788 (its base URL setting), work as usual, Ctrl-C
    infercourse agent report build/results/agent-session/<stamp>

`SessionRecorder` is the proxy (`ops.agent_capture.RecordingProxy`) with a results folder:
the manifest first (upstream, port, that the agent ran unsealed on this machine), a line per
call, the request bodies in `bodies/` (they hold the agent's prompt text: they stay in that
folder), and at the end the anatomy of every call (`agent_anatomy.write_anatomy`, counted
with the upstream's own tokenizer where it has `/tokenize`, else the embedded model's).
It listens on 127.0.0.1 only, and forwards to a loopback upstream unless the learner passes
`allow_remote`. It does not read `/metrics` around calls (that would add a round trip to
every TTFT and go wrong when calls overlap): evaluated tokens and prefill time come from the
server's own per-request timings (llama-server's `timings.prompt_n` / `prompt_ms`), else
from the usage block (prompt less cached tokens).

`session_totals` sums a session (a lab run too): prompt tokens evaluated against cached,
time in prefill, and the side calls (calls with another system prompt than the agent's main
one) with the main-prompt tokens evaluated again after them; `totals_sentence` words it.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from infercourse.core.loopback import is_loopback
from infercourse.ops.agent_capture import RecordingProxy

__all__ = ["SessionRecorder", "session_totals", "totals_sentence", "anatomy_counter"]


def anatomy_counter(upstream: str) -> tuple[Any, str]:
    """A token counter for the anatomy, and its name: the upstream's `/tokenize` (the served
    model's tokenizer) where it answers, else the embedded model's (an approximation)."""
    from infercourse.ops.agent_anatomy import embedded_counter, tokenizer_of
    try:
        r = httpx.post(upstream.rstrip("/") + "/tokenize", json={"content": "hello"}, timeout=10)
        if r.status_code == 200 and "tokens" in r.json():
            return tokenizer_of(upstream), f"the upstream's /tokenize ({upstream})"
    except (httpx.HTTPError, ValueError):
        pass
    return embedded_counter(), "the embedded model's tokenizer (the upstream has no /tokenize): an approximation"


class SessionRecorder:
    """The recording proxy with a results folder, for a learner's own agent and server.

    Args:
        upstream: the learner's server root ("http://127.0.0.1:8080"); loopback unless `allow_remote`.
        out: a new results folder.
        port: where the proxy listens on 127.0.0.1 (0: any free port; `url` says which).
        allow_remote: forward to a server on another host (the learner's explicit choice).
    """

    def __init__(self, upstream: str, out: str | Path, *, port: int = 0, allow_remote: bool = False):
        self.upstream, self.out = upstream.rstrip("/"), Path(out)
        self.proxy = RecordingProxy(self.upstream, bodies_dir=self.out / "bodies", read_metrics=False, port=port,
                                    allow_remote=allow_remote)
        self.writer = None

    @property
    def url(self) -> str:
        return self.proxy.url

    def start(self) -> "SessionRecorder":
        from infercourse.measure.results import MANIFEST, RunWriter
        if (self.out / MANIFEST).exists():   # before listening: an agent must not reach a recorder that fails
            raise FileExistsError(f"{self.out} already holds a run; results are append-only, pick a new folder")
        # an agent may call the moment the port listens, while the run's folder is still being written
        # (its manifest reads the machine: seconds): the proxy's one recording thread waits for it, so
        # those calls are written first, in order
        ready = threading.Event()

        def on_call(tr: Any) -> None:
            ready.wait()
            if self.writer is not None:
                self.writer.submit(tr)
        self.proxy.on_call = on_call
        self.proxy.start()
        host = httpx.URL(self.upstream).host
        manifest = {"label": self.out.name, "engine": {"server": "the learner's own (upstream)", "url": self.upstream},
                    "model": {"served": "as the agent names it (each call's body)"},
                    "sampling": "set by the agent: each call's body (bodies/) holds it",
                    "load": {"pattern": "a working session: the agent's own calls, as it sends them"},
                    "workload": {"session": "the learner's own tasks"},
                    "recorder": {"listen": self.url, "read_metrics": False, "upstream_loopback": is_loopback(host)},
                    "network": {"namespace": "host: the learner's own agent, not sealed (the recorder listens on "
                                             "127.0.0.1 only)", "interfaces": []}}
        try:
            self.writer = RunWriter(self.out, manifest)
        except BaseException:
            ready.set()                # (nothing to write them to: the recording thread lets them go)
            self.proxy.stop()          # a folder that already holds a run: nothing may listen
            raise
        self.writer.start_thread()             # calls end on the proxy's threads: one writer thread appends them
        ready.set()
        return self

    def stop(self) -> Path:
        """Stop listening, close the run, write the anatomy; returns the folder."""
        self.proxy.stop()
        if self.writer is not None:
            count, name = anatomy_counter(self.upstream)
            self.writer.manifest["anatomy_tokenizer"] = name
            self.writer.close()
            if (self.out / "requests.jsonl").stat().st_size:
                from infercourse.ops.agent_anatomy import write_anatomy
                write_anatomy(self.out, count)
            self.writer = None
        return self.out

    def __enter__(self) -> "SessionRecorder":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def wait(self, duration_s: float | None = None) -> None:
        """Block until Ctrl-C, or `duration_s` seconds."""
        t_end = None if duration_s is None else time.monotonic() + duration_s
        try:
            while t_end is None or time.monotonic() < t_end:
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass


def session_totals(out: str | Path) -> dict[str, Any]:
    """A session's (or lab run's) totals over the calls that generate: calls, failed calls,
    prompt / cached / evaluated tokens, prefill seconds (the server's own timings; where it
    gave none, the calls' TTFT as an upper bound, and `prefill_from` says so), end-to-end
    seconds, side calls (another system prompt than the main one: per API, the one whose calls
    carried the most bytes), and the main-prompt tokens evaluated in the main calls that came
    right after a side call, with a main call before it whose prefix they could have reused."""
    from infercourse.ops.agent_lab import calls_table
    from infercourse.ops.agent_stream import GENERATING_APIS
    c = calls_table(out)
    c = c[c["api"].isin(GENERATING_APIS)] if "api" in c else c.iloc[0:0]
    prompt, cached = c.get("prompt_tokens"), c.get("cached_tokens")
    evaluated = c["evaluated_tokens"] if "evaluated_tokens" in c else prompt - cached
    evaluated = evaluated.fillna(prompt - cached.fillna(0)) if prompt is not None else evaluated
    timed = "prefill_ms" in c and c["prefill_ms"].notna().all() and len(c)
    prefill = (c["prefill_ms"].sum() / 1e3) if timed else c["ttft_s"].sum() if "ttft_s" in c else float("nan")
    side, after_side, after_prompt = 0, 0.0, 0.0
    if "system" in c and c["system"].notna().any():
        # the main prompt: per API, the system prompt whose calls carried the most bytes
        size = c.groupby(["api", "system"])["body_bytes"].sum().reset_index()
        main = size.sort_values("body_bytes").groupby("api")["system"].last()
        is_side = c["system"] != c["api"].map(main)
        side = int(is_side.sum())
        # a main call right after a side call, once a main call was there before (the first is cold anyway)
        seen = (~is_side).cumsum().shift(1, fill_value=0) > 0
        follows = is_side.shift(1, fill_value=False) & ~is_side & seen
        after_side, after_prompt = float(evaluated[follows].sum()), float(prompt[follows].sum())
    return {"calls": int(len(c)), "failed": int((c["status"] != "ok").sum()) if len(c) else 0,
            "prompt_tokens": float(prompt.sum()) if prompt is not None else float("nan"),
            "cached_tokens": float(cached.sum()) if cached is not None else float("nan"),
            "evaluated_tokens": float(evaluated.sum()) if len(c) else 0.0,
            "prefill_s": float(prefill), "prefill_from": "the server's own timings" if timed else "summed TTFT, an upper bound",
            "e2e_s": float(c["e2e_s"].sum()) if "e2e_s" in c else float("nan"),
            "side_calls": side, "evaluated_after_side": after_side, "prompt_after_side": after_prompt}


def totals_sentence(t: dict[str, Any]) -> str:
    """One sentence from `session_totals`: what the session's prompts cost and where it went."""
    if not t["calls"]:
        return "No call that generates was recorded: point the agent's base URL at the recorder."
    share = t["cached_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else float("nan")
    head = (f"{t['calls']} calls ({t['failed']} failed): {t['prompt_tokens']:,.0f} prompt tokens, "
            f"{t['cached_tokens']:,.0f} from the cache ({share:.0%}) and {t['evaluated_tokens']:,.0f} evaluated; "
            f"prefill took {t['prefill_s']:.1f} s of {t['e2e_s']:.1f} s end to end ({t['prefill_from']}).")
    if not t["side_calls"]:
        return head + " Every call had the agent's main system prompt: no side call."
    return head + (f" {t['side_calls']} side call(s) had another system prompt; the main calls right after them "
                   f"made the server evaluate {t['evaluated_after_side']:,.0f} of their "
                   f"{t['prompt_after_side']:,.0f} prompt tokens.")
