"""The pure core: what a request is, what an engine streams back, how a request's life is
recorded, and the metrics computed from that record. No I/O, no engines, no servers.

| module    | concept                                                                 |
|-----------|-------------------------------------------------------------------------|
| `types`   | `Request`, `Event`, `Usage`, `Completion`, the `Engine` protocol; `generate` folds `stream` |
| `errors`  | typed errors, each naming the layer at fault                            |
| `trace`   | `RequestTrace`: one request's scheduled/sent times and every chunk       |
| `metrics` | per request: TTFT, TPOT, ITL, E2E, prefill/decode tok/s                 |
| `summary` | per run: percentiles with intervals, throughput, error rate, goodput    |
| `reconcile` | the client's numbers against the engine's own counters                |
| `hashing` | content hashes of workloads, for manifests                              |
| `loopback` | which hosts load and faults may target, checked before any traffic     |
"""
