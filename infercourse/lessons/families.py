"""Two model families behind one router (notebook 16, section 11): SmolLM2 and Gemma 3.

The course's embedded model is one family: SmolLM2, a Llama, whose every layer attends to
every earlier token. Gemma 3 270M is another: most of its layers attend only to a sliding
window of the last 512 tokens (`models.gemma3`; notebook 05 measures what that does to the
prefix cache), as in many models local-agent users run. llama-server's router mode serves
both behind one URL, by name, one child process per preset, and each preset carries its
own flags: here its chat template (`chat-template-file`), since the Gemma GGUF the course
uses has none, and llama-server then falls back to ChatML.

`PRESETS` are four: SmolLM2 with the template its GGUF carries; SmolLM2 with the course's
ChatML-with-tools template (`data/chatml_tools.jinja`, the one notebooks 18 to 20 serve);
Gemma 3 with a Gemma-format template written for the course (`data/gemma3_tools.jinja`);
Gemma 3 with none (the fallback a learner gets by default). Both families are Q4_K_M files,
so their sizes differ by the model, not by the quantization.

- `family_swaps`: a router with room for one model, asked each family by name in turn:
  every switch stops one family's child and starts the other's; the router's own log times
  each load (`servers.llama_router.load_times`, the reading of section 6);
- `swap_text`, `memory_text`: what that showed, and what each child holds with every preset
  resident (`lessons.templates.compare_presets` reads the memory, on its router of all four).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from infercourse.measure.model_mix import ask
from infercourse.measure.workloads import DATA_DIR
from infercourse.servers.llama_router import Preset, course_router, load_times

__all__ = ["PRESETS", "FAMILIES", "family_presets", "family_swaps", "swap_text", "memory_text"]

# preset name -> (family, template file in data/, None: the GGUF's own or llama-server's fallback)
PRESETS = {"smollm2": ("smollm2", None), "smollm2-tools": ("smollm2", "chatml_tools.jinja"),
           "gemma3": ("gemma3", "gemma3_tools.jinja"), "gemma3-chatml": ("gemma3", None)}
FAMILIES = ("smollm2", "gemma3")   # one preset of each: the names requests route by
_MIB = 2 ** 20


def _file(family: str) -> Path:
    if family == "gemma3":
        from infercourse.models.gemma3 import gemma3_gguf
        return gemma3_gguf()
    from infercourse.models.formats import quantized_gguf
    return quantized_gguf("Q4_K_M")


def family_presets(names: Sequence[str] | None = None) -> list[Preset]:
    """The router's presets for `names` (None: all of `PRESETS`), each with its template file.

    Raises:
        ModelLayerError: Gemma 3 is not installed (check `models.gemma3.available()` first).
    """
    out = []
    for n in names or PRESETS:
        family, template = PRESETS[n]
        out.append(Preset(n, _file(family), flags={"chat-template-file": str(DATA_DIR / template)} if template else {}))
    return out


def family_swaps(presets: Sequence[Preset] | None = None, *, switches: int = 3, max_tokens: int = 8,
                 **router_kw: Any) -> dict[str, Any]:
    """Ask the families by name in turn on a router that holds one model (models_max 1), so
    each request after the first swaps one family out and the other in.

    Args:
        presets: the models to alternate (None: `FAMILIES`' presets).
        switches: swaps to make (requests = switches + 1).
        max_tokens: each answer's cap; router_kw: to `course_router`.

    Returns {"requests": one row per request (step, model asked, what was loaded before it
    and after it, status, TTFT...), "loads": the router's `load_times`, "sizes": file bytes}.
    """
    presets = list(presets) if presets is not None else family_presets(FAMILIES)
    rows = []
    with course_router(1, presets, **router_kw) as r:
        for step in range(switches + 1):
            name = presets[step % len(presets)].name
            before = [m["name"] for m in r.models() if m["status"] == "loaded"]
            row = ask(r, name, max_tokens=max_tokens)
            after = [m["name"] for m in r.models() if m["status"] == "loaded"]
            state = "resident" if name in before else "swap" if before else "cold"
            rows.append({"step": step, "asked": name, "state": state, "loaded_before": ",".join(before) or None,
                         "loaded_after": ",".join(after) or None, **{k: v for k, v in row.items() if k != "asked"}})
        loads = load_times(r.log_path.read_text(errors="replace"))
    return {"requests": pd.DataFrame(rows), "loads": loads,
            "sizes": {p.name: Path(p.model).stat().st_size for p in presets}}


def swap_text(result: Mapping[str, Any]) -> str:
    """What `family_swaps` showed: which name reached which model, each family's loads as the
    router's log timed them, and whether one family's loads were all slower than the other's."""
    req, loads, sizes = result["requests"], result["loads"], result["sizes"]
    reached = [f"`{r['asked']}` → {r['loaded_after'] or 'nothing loaded'} ({r['status']})" for _, r in req.iterrows()]
    ok = int((req["status"] == "ok").sum())
    lines = [f"- {ok} of {len(req)} requests by name were ok; each loaded the model it named: "
             + "; ".join(reached) + "."]
    by = {m: g["loaded_s"].tolist() for m, g in loads.groupby("model")}
    if len(by) >= 2:
        (a, la), (b, lb) = sorted(by.items(), key=lambda kv: pd.Series(kv[1]).median())[:2]
        ma, mb = pd.Series(la).median(), pd.Series(lb).median()
        size = ""
        if sizes.get(a) and sizes.get(b):
            size = (f"; {b}'s file is {sizes[b] / _MIB:.0f} MiB against {a}'s {sizes[a] / _MIB:.0f} MiB "
                    f"(x{sizes[b] / sizes[a]:.2g})")
        timed = f"{b} {mb:.3g} s (median of {len(lb)}), {a} {ma:.3g} s (median of {len(la)})"
        if min(lb) > max(la):
            lines.append(f"- **A switch to {b} costs more**: every load of it was slower than every load of {a}; "
                         f"the router's log timed them (child start to \"model loaded\") at {timed}, "
                         f"x{mb / ma:.2g}{size}.")
        else:
            lines.append(f"- **No order between the families' loads**: their times overlap ({timed}){size}; "
                         "more switches (`FAMILY_SWITCHES`) would tell.")
    else:
        lines.append(f"- The router's log timed {len(loads)} load(s), of {len(by)} model(s): "
                     "too few to compare the families.")
    swapped = req[(req["state"] == "swap") & (req["status"] == "ok")]
    if len(swapped):
        lines.append(f"- The {len(swapped)} request(s) that swapped a family in waited a median TTFT of "
                     f"{swapped['ttft_s'].median():.3g} s (the load, then the prefill).")
    return "\n".join(lines)


def memory_text(memory: Mapping[str, int | None], families: Sequence[str] = FAMILIES) -> str:
    """Resident memory with every preset loaded (`LlamaRouter.memory()`: the router and each
    child, bytes): each family's child, which holds more, and both families together."""
    mib = {k: v / _MIB for k, v in memory.items() if v}
    have = [f for f in families if f in mib]
    if len(have) < 2:
        return f"- Resident memory: only {', '.join(have) or 'no family'} was measured loaded."
    a, b = sorted(have[:2], key=mib.get)
    both = mib[a] + mib[b] + mib.get("router", 0.0)
    rest = [f"{k} {v:.0f} MiB" for k, v in mib.items() if k not in (a, b, "router")]
    return (f"- Resident memory with both families loaded: {b} {mib[b]:.0f} MiB, {a} {mib[a]:.0f} MiB "
            f"(**{b}'s child holds x{mib[b] / mib[a]:.2g} what {a}'s does**), the router {mib.get('router', 0):.0f} MiB: "
            f"{both:.0f} MiB for both families behind one URL"
            + (f"; the other children held {', '.join(rest)}" if rest else "") + ".")
