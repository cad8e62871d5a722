"""A workload that names a model per request, e.g. 80 % to `main` and 20 % to `fast`.

Behind a router that picks the model by name (`servers.llama_router`), one run can send a
mix, as a coding agent does (its main loop on one model, its small background calls on
another). The model rides on the request: `ModelRequest` is a `Request` with a `model`
field, which survives everything bench does to a request (salting, warm-up twins, forced
lengths), and `ModelDispatch` sends each request to an engine for its model. bench tags
every row with its model, so every metric splits by model (`results.by_model`). `ask`
sends one request by model name and times it as bench does (what a router made of a name).

    reqs = mix([Request(prompt=p) for p in prompts], {"main": 0.8, "fast": 0.2}, seed=0)
    r = bench.run(router.engine(), reqs, pattern="concurrency", concurrency=2)
    results.by_model(r.df)
"""
from __future__ import annotations

import copy
import random
import re
from dataclasses import dataclass, fields
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence

from infercourse.core.errors import EngineLayerError
from infercourse.core.types import Event, Request
from infercourse.measure.workloads import Workload, _req_dict
from infercourse.core.hashing import content_hash

__all__ = ["ModelRequest", "ModelWorkload", "with_model", "mix", "request_models", "ModelDispatch",
           "by_model", "by_model_lines", "UNNAMED", "ask", "ASK_PROMPT"]

UNNAMED = "(engine's model)"   # the group of requests that named no model
ASK_PROMPT = "Name one colour of the sky."
_LAYER = re.compile(r"\(([\w ]+) layer\)")


@dataclass(frozen=True)
class ModelRequest(Request):
    """A Request for a named model (a router's model name or alias; None: the engine's)."""

    model: str | None = None


def with_model(req: Request, model: str | None) -> ModelRequest:
    """`req` addressed to `model`."""
    return ModelRequest(**{f.name: getattr(req, f.name) for f in fields(Request)}, model=model)


def mix(requests: Sequence[Request], shares: Mapping[str, float], *, seed: int = 0) -> list[ModelRequest]:
    """Each request addressed to one model, in the given shares (exact counts, shuffled by
    `seed`): `mix(reqs, {"main": 0.8, "fast": 0.2})` sends 80 % of them to main.

    Args:
        requests: the requests, in order (their order is kept; only the models are shuffled).
        shares: model name -> share (normalised; at least one positive).
        seed: the shuffle's seed (the same seed gives the same assignment).
    """
    total = sum(shares.values())
    if not shares or total <= 0 or min(shares.values()) < 0:
        raise ValueError(f"shares must be >= 0 with a positive sum, got {dict(shares)}")
    n, names = len(requests), list(shares)
    counts = [int(n * shares[m] / total) for m in names]
    # largest remainders get the requests rounding left over, so the counts sum to n
    rest = sorted(range(len(names)), key=lambda i: -(n * shares[names[i]] / total - counts[i]))
    for i in rest[:n - sum(counts)]:
        counts[i] += 1
    models = [m for m, c in zip(names, counts) for _ in range(c)]
    random.Random(seed).shuffle(models)
    return [with_model(r, m) for r, m in zip(requests, models)]


def request_models(requests: Sequence[Request]) -> list[str | None] | None:
    """Each request's model, or None when no request names one."""
    models = [getattr(r, "model", None) for r in requests]
    return models if any(models) else None


@dataclass(frozen=True)
class ModelWorkload(Workload):
    """A Workload whose requests name their models; its hash covers the models too."""

    @property
    def sha256(self) -> str:
        return content_hash({"requests": [{**_req_dict(r), "model": getattr(r, "model", None)}
                                          for r in self.requests], "offsets_s": self.offsets_s})

    def describe(self) -> dict:
        models = [getattr(r, "model", None) for r in self.requests]
        return {**super().describe(), "models": {m: models.count(m) for m in dict.fromkeys(models)}}


class ModelDispatch:
    """An HTTP engine that sends each request to the model it names.

    It keeps one copy of `engine` per model name, differing only in the model it puts in
    the body (same URL, API, key and options); a request without a model goes to `engine`
    itself. Everything else (its `root`, `async_client`...) is `engine`'s.
    """

    def __init__(self, engine: Any, models: Sequence[str | None] = ()):
        if not hasattr(engine, "astream"):
            raise EngineLayerError(f"engine {getattr(engine, 'name', engine)!r} runs one model in process: "
                                   "per-request models need a server that routes by name",
                                   hint="start a servers.LlamaRouter and use its engine()")
        self.base, self._per_model = engine, {}
        self.name = getattr(engine, "name", "http")
        for m in models:
            self.for_model(m)

    def for_model(self, model: str | None):
        """The engine that sends `model` (None: the base engine)."""
        if model is None:
            return self.base
        if model not in self._per_model:
            e = copy.copy(self.base)
            e._model = model   # our own engines keep the name there (the `model` property reads it)
            self._per_model[model] = e
        return self._per_model[model]

    @property
    def model(self) -> list[str]:
        return sorted(self._per_model)

    def stream(self, request: Request, **overrides: Any) -> Iterator[Event]:
        return self.for_model(getattr(request, "model", None)).stream(request, **overrides)

    def astream(self, request: Request, client: Any = None, **overrides: Any) -> AsyncIterator[Event]:
        return self.for_model(getattr(request, "model", None)).astream(request, client=client, **overrides)

    def describe(self) -> dict[str, Any]:
        return {**self.base.describe(), "model": None, "models": self.model, "dispatch": "per request"}

    def __getattr__(self, attr: str) -> Any:   # root, where, async_client, close...
        if attr == "base":   # not set yet (copy, pickle): no recursion
            raise AttributeError(attr)
        return getattr(self.base, attr)


def by_model(df, metrics: Sequence[str] | None = None, quantiles: Sequence[str] = ("p50", "p95", "p99")):
    """Every metric split by model: one row per model (the `model` column bench tags a mix
    with), its request counts by status, throughput, and each metric's percentiles as
    `<metric>_p50`... (of its ok requests, as `summary.summarize` computes them). A frame
    without a `model` column is one group, UNNAMED."""
    import pandas as pd

    from infercourse.core import summary
    metrics = tuple(metrics or summary.DEFAULT_SUMMARY)
    key = df["model"].fillna(UNNAMED) if "model" in df else pd.Series(UNNAMED, index=df.index)
    rows = []
    for name, g in df.groupby(key, sort=True):
        counts = summary.status_counts(g)
        # throughput over this model's own window (its first send to its last end)
        row: dict[str, Any] = {"model": name, **{f"n_{k}": v for k, v in counts.items()}, **summary.throughput(g),
                               "error_rate": summary.error_rate(g[g["status"] != "incomplete"])}
        s = summary.summarize(g, metrics)
        for m in s.index:
            for q in quantiles:
                row[f"{m}_{q}"] = s.loc[m, q] if q in s else float("nan")
        rows.append(row)
    return pd.DataFrame(rows).set_index("model") if rows else pd.DataFrame()


def by_model_lines(df) -> list[str]:
    """One summary line per model for a run that named models ([] otherwise)."""
    if "model" not in df or not df["model"].notna().any():
        return []
    t, out = by_model(df, ("ttft_s", "tpot_s", "e2e_s"), ("p50", "p95")), []
    for name, r in t.iterrows():
        out.append(f"model {name}: {int(r['n_ok'])} ok of {int(r['n_total'])}, "
                   + ", ".join(f"{m} p50 {r[f'{m}_p50']:.4g} p95 {r[f'{m}_p95']:.4g}"
                               for m in ("ttft_s", "tpot_s", "e2e_s") if f"{m}_p50" in r))
    return out


def ask(router, model: str, *, prompt: str = ASK_PROMPT, max_tokens: int = 8, api: str = "anthropic") -> dict[str, Any]:
    """One request to `model` (a name or alias) through a router, timed as bench times it:
    status, TTFT, end-to-end, output tokens, and the error and the layer it names, if any.

    Args:
        router: anything with `engine(model=..., api=...)` (a `servers.LlamaRouter`).
        model: the name the request carries; api: "anthropic", "chat" or "completions".
    """
    from infercourse.core import metrics
    from infercourse.core.trace import record
    tr = record(router.engine(model=model, api=api),
                Request(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens))
    layer = _LAYER.search(tr.error or "")
    return {"asked": model, "status": tr.status, "ttft_s": metrics.ttft_s(tr), "e2e_s": metrics.e2e_s(tr),
            "output_tokens": metrics.output_tokens(tr), "error": (tr.error or "")[:160] or None,
            "layer": layer.group(1) if layer else None}
