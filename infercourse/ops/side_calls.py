"""Side calls against the prefix cache: the same agent tasks on one server per fix, compared.

An agent that sends a call with another system prompt (a title, a memory extraction, a
next-speaker check) between two main calls asks a one-slot server to hold two prefixes in one
slot. Without somewhere else to keep the first, the side call overwrites it, and the next main
call is prefilled again from its first token. llama-server offers three places to keep it:

| fix | flag | what it costs |
|---|---|---|
| host prompt cache | `--cache-ram N` (MiB; llama-server's default 8192, `0` turns it off) | host RAM; a copy out and back per switch |
| a slot per prompt | `-np 2` (and `-c` doubled, so each slot keeps the window) | the KV cache twice over |
| slot save/restore | `--slot-save-path DIR` and `POST /slots/0?action=save|restore` | a client that calls it: no agent does |

`side_call_lab` runs the same tasks (from `ops.chat_agent.task`, or any lab `Task`) on a fresh
server for each fix in the sealed lab; `side_call_table` reads the runs back, one row per call
(its role: main, or side, by its system prompt), with the tokens the server evaluated (its own
per-call count); `side_call_sentence` says, from those numbers, which fix held the main prefix.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["FIXES", "side_call_lab", "side_call_table", "side_call_sentence"]

# label -> LabSpec settings; the first is the server that keeps no prefix elsewhere
FIXES = {"one slot, --cache-ram 0": {"slots": 1, "cache_ram_mib": 0},
         "--cache-ram 8192": {"slots": 1, "cache_ram_mib": 8192},
         "-np 2, --cache-ram 0": {"slots": 2, "cache_ram_mib": 0}}


def side_call_lab(root: str | Path, name: str, tasks: list[Any], *, fixes: dict[str, dict] | None = None,
                  **lab: Any) -> dict[str, Path]:
    """Run `tasks` once per fix, each on a fresh server of the sealed lab; returns {fix: folder}.

    Args:
        root, name: the runs go to root/name-<k> (one per fix, in order).
        tasks: lab `Task`s, played in order on each server.
        fixes: label -> LabSpec settings (default `FIXES`).
        **lab: LabSpec's other settings (ctx, threads, model, server_args, n_predict).
    """
    from infercourse.ops.agent_lab import LabSpec, run_lab
    out = {}
    for k, (label, cfg) in enumerate((fixes or FIXES).items()):
        out[label] = run_lab(LabSpec(str(Path(root) / f"{name}-{k}"), list(tasks), **cfg, **lab))
    return out


def side_call_table(runs: dict[str, str | Path]) -> pd.DataFrame:
    """One row per generating call of each run: fix, task, role ("main": the system prompt
    whose calls carried the most bytes; else "side"), prompt, cached and evaluated tokens,
    and whether it is a main call right after a side call, with an earlier main call whose
    prefix it could have reused (`after_side`)."""
    from infercourse.ops.agent_lab import calls_table
    from infercourse.ops.agent_stream import GENERATING_APIS
    rows = []
    for fix, out in runs.items():
        c = calls_table(out)
        c = c[c["api"].isin(GENERATING_APIS)].reset_index(drop=True)
        main = c.groupby("system")["body_bytes"].sum().idxmax()
        role = c["system"].map(lambda s: "main" if s == main else "side")
        # a main call right after a side call, once a main call has been there before (the first is cold anyway)
        seen = (role == "main").cumsum().shift(1, fill_value=0) > 0
        after = (role == "main") & (role.shift(1) == "side") & seen
        rows.append(pd.DataFrame({"fix": fix, "task": c["task"], "role": role, "prompt_tokens": c["prompt_tokens"],
                                  "cached_tokens": c["cached_tokens"], "evaluated_tokens": c["evaluated_tokens"],
                                  "status": c["status"], "after_side": after}))
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()


def side_call_sentence(table: pd.DataFrame) -> str:
    """Per fix, the share of the main prompt the server evaluated again in the main calls that
    came right after a side call; whether it held the prefix (under half re-evaluated)."""
    parts, held, lost = [], [], []
    for fix, g in table.groupby("fix", sort=False):
        m = g[g["after_side"] & (g["status"] == "ok")]
        if not len(m) or not m["prompt_tokens"].sum():
            parts.append(f"`{fix}`: no main call followed a side call")
            continue
        share = m["evaluated_tokens"].sum() / m["prompt_tokens"].sum()
        parts.append(f"`{fix}`: {m['evaluated_tokens'].sum():,.0f} of {m['prompt_tokens'].sum():,.0f} main-prompt "
                     f"tokens evaluated again ({share:.0%})")
        (held if share < 0.5 else lost).append(f"`{fix}`")
    if not held and not lost:
        return "No main call followed a side call in these runs: nothing to judge. " + "; ".join(parts) + "."
    verdict = (f"The main prefix was lost after a side call with {' and '.join(lost)}" if lost else
               "No setting lost the main prefix after a side call")
    verdict += f"; it was held with {' and '.join(held)}." if held else "; no setting held it."
    return verdict + " " + "; ".join(parts) + "."
