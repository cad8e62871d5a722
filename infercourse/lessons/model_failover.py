"""A model instance killed mid-answer behind llama-server's router, and what other routers
do with model names (notebook 16, section 10).

The router is one process and each model's instance (a child llama-server) another, so a
child can die alone: the OOM killer picks the largest process, and that is a model. The
drill here SIGKILLs one child once its answer has started streaming (an event, not a
clock), then reads what each side saw:

- the client: the stream it was reading ends without its final event (bytes already sent
  cannot be taken back, so no router can retry it);
- the router, in its own words: `GET /models` marks the model failed with an exit code,
  and `check()` names the dead instance. What that exit code says is read, not assumed:
  llama.cpp's subprocess layer reports a child killed by a signal as a plain failure
  (exit code 1 in the builds tried), where a supervisor that waits on the child itself (notebook
  18's) sees -9;
- what was kept (the other model's child, untouched) and what the next requests paid (the
  first one loads a fresh child).

`router_versions` and `router_notes` label what the course observed of the two Rust
routers on PyPI (neither routes by model name) with the version it was observed on.
"""
from __future__ import annotations

import importlib.metadata
import signal
from typing import Any, Iterator, Mapping

from infercourse.core import metrics
from infercourse.core.errors import InferCourseError
from infercourse.core.trace import record_stream
from infercourse.core.types import Request
from infercourse.measure.model_mix import ask
from infercourse.servers.llama_router import LlamaRouter, course_presets, course_router

__all__ = ["killed_instance", "killed_text", "exit_code_text", "router_versions", "router_notes", "OBSERVED_ROUTERS"]


def _kill_after_first_chunk(stream: Iterator, router: LlamaRouter, model: str, box: dict) -> Iterator:
    for ev in stream:
        yield ev
        if "pid" not in box:   # an event, not a clock: the instance is mid-stream right now
            box["pid"] = router.kill_instance(model, box["sig"])


def killed_instance(presets=None, *, model: str = "main", n_after: int = 3, sig: int = signal.SIGKILL,
                    **router_kw: Any) -> dict[str, Any]:
    """Send `sig` to `model`'s instance while it streams an answer, with every model loaded
    (models_max = their count): what that request got, what the router reports (its
    `/models` row: failed, exit code; and `check()`), whether it and the other instances
    stayed up, and what the next requests to `model` found.

    Args:
        presets: the models (None: `course_presets()`); model: the one killed.
        n_after: requests to `model` after the kill; sig: the signal sent (SIGKILL).
        router_kw: to `course_router` (threads, ctx_size...).
    """
    presets = presets if presets is not None else course_presets()
    with course_router(len(presets), presets, **router_kw) as r:
        for p in r.presets:
            ask(r, p.name)
        resident = ask(r, model)
        pids = {m["name"]: m["pid"] for m in r.models() if m["pid"]}
        box: dict[str, Any] = {"sig": sig}
        eng = r.engine(model=model, api="anthropic")
        req = Request(messages=[{"role": "user", "content": "Write a long story about the sea."}], max_tokens=256)
        tr = record_stream(_kill_after_first_chunk(eng.stream(req), r, model, box))
        dead = r.wait_status(model, ("unloaded",))   # the router saw its child die: its own row says how
        try:
            r.check()
            said = None
        except InferCourseError as e:
            said = e.message.split(". Last lines")[0]
        now = {m["name"]: m for m in r.models()}
        name = r.model_status(model)["name"]
        kept = [n for n, pid in pids.items() if n != name and now[n]["pid"] == pid]
        found = now[name]["status"]
        after = [ask(r, model) for _ in range(n_after)]
        return {"model": model, "killed_pid": box.get("pid"), "signal": signal.Signals(sig).name, "signal_number": int(sig),
                "router_failed": dead["failed"], "router_exit_code": dead["exit_code"], "in_flight_status": tr.status,
                "in_flight_tokens": metrics.output_tokens(tr), "in_flight_error": (tr.error or "")[:200] or None,
                "router_said": said, "router_up": r.running, "kept": kept, "next_found": found,
                "resident_ttft_s": resident["ttft_s"], "after_ttft_s": [a["ttft_s"] for a in after],
                "after_ok": sum(a["status"] == "ok" for a in after), "status_now": r.model_status(model)["status"]}


def exit_code_text(s: Mapping[str, Any]) -> str:
    """What the drill sent and what the router reported of it, from `killed_instance`'s
    row: the signal, the router's failed flag and exit code, and whether that code names
    the signal (-N, or 128 + N as a shell reports it) or reads like any crash."""
    sent = f"The drill sent {s['signal']} (signal {s['signal_number']}) to {s['model']}'s instance (pid {s['killed_pid']})"
    code, n = s["router_exit_code"], s["signal_number"]
    if not s["router_failed"]:
        return f"{sent}; the router did **not** mark it failed (exit code {code}): it read the death as a stop."
    if code is None:
        return f"{sent}; the router marked it failed, with no exit code."
    if code in (-n, 128 + n):
        return (f"{sent}; the router reported it failed with exit code {code}: the signal's own number, so its "
                "`/models` tells a kill from a crash.")
    return (f"{sent}; the router reported it failed with **exit code {code}**, not the signal: its `/models` shows "
            "a child killed by a signal like any other failure, so from the router alone a kill (the OOM "
            "killer's, or ours) reads as a crash; the kernel log (`dmesg`) or a supervisor that waits on the "
            "child itself (notebook 18's) sees the signal.")


def killed_text(s: Mapping[str, Any]) -> str:
    """What `killed_instance` showed: what was sent and what the router reported of it
    (`exit_code_text`, the first line), the client's view, the router's check, what was
    kept, and what the next requests found."""
    err = f" ({s['in_flight_error']})" if s["in_flight_error"] else ""
    ttfts = ", ".join(f"{t:.3g} s" for t in s["after_ttft_s"] if t == t)
    return "\n".join([
        f"- {exit_code_text(s)}",
        f"- The client: the request in flight ended **{s['in_flight_status']}** after "
        f"{s['in_flight_tokens']} tokens{err}.",
        "- The router " + ("**stayed up**" if s["router_up"] else "**went down with its child**") + "; its check "
        + (f"said: {s['router_said']}" if s["router_said"] else "named no dead instance") + ".",
        "- Kept: " + (f"{', '.join(s['kept'])} went on in the same process" if s["kept"] else
                      "no other instance survived in its process") + ".",
        f"- Next: {s['after_ok']} of {len(s['after_ttft_s'])} requests to {s['model']} were ok; the first found it "
        f"**{s['next_found']}**" + (" and started a fresh instance" if s["next_found"] != "loaded" else "")
        + f" (TTFTs {ttfts or 'none'}; resident before the kill {s['resident_ttft_s']:.3g} s)."])


# What the course observed of the two Rust routers on PyPI, and with which versions.
OBSERVED_ROUTERS = {
    "sglang-router": ("0.3.2", "its multi-model gateway (`--enable-igw`) did not start offline (it downloads "
                      "a tokenizer vocabulary at start-up and panics without it); in its regular mode it "
                      "registered llama-server workers with model \"unknown\" and did not route by name"),
    "vllm-router": ("0.1.17", "it did not route by model name: two stand-in workers serving \"A\" and \"B\" "
                    "got requests for A and B alternately under round-robin"),
}


def router_versions() -> dict[str, str | None]:
    """The installed version of each router in OBSERVED_ROUTERS (None: not installed)."""
    out: dict[str, str | None] = {}
    for pkg in OBSERVED_ROUTERS:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def router_notes(installed: Mapping[str, str | None]) -> str:
    """Each observation labelled with the version it was made on and the one installed here."""
    lines = []
    for pkg, (seen, what) in OBSERVED_ROUTERS.items():
        have = installed.get(pkg)
        here = ("the version installed here" if have == seen else
                f"installed here: {have}, so it may no longer hold: try it" if have else "not installed here")
        lines.append(f"- **{pkg} {seen}** ({here}): {what}.")
    return "\n".join(lines)
