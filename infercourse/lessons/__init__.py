"""One module per notebook concept. Lessons import the library; nothing in the library
imports a lesson, and no lesson imports another (import-linter checks both in `make test`).
A concept two notebooks share gets its own module (e.g. `draft_verify`, used by 08 and 09).

| module             | notebook                                             |
|--------------------|------------------------------------------------------|
| `stack`            | 00 setup, 01 the stack                               |
| `agent`            | 02 the agent loop                                    |
| `prefill_decode`   | 03 prefill vs decode                                 |
| `kvcache`          | 04 the KV cache                                      |
| `prefixcache`      | 05 the prefix cache                                  |
| `quantization`, `quant_blocks` | 06 quantization (the ladder; one block by hand) |
| `quant_methods`, `nf4_by_hand`, `quant_explain`, `quant_grid` | 07 quantization methods (the table; NF4 by hand; its sentences; Q4_K_M's grid) |
| `speculative`, `draft_verify`, `spec_server` | 08 speculative decoding |
| `mtp`              | 09 multi-token prediction                            |
| `latency`          | 10 latency metrics                                   |
| `concurrency`, `goodput` | 11 concurrency and continuous batching (measuring the curve; reading it) |
| `memory`           | 12 context and memory                                |
| `fair`             | 13 a fair benchmark                                  |
| `tuning`, `classic_problems` | 14 tuning                                  |
| `stability`        | 15 stability (soak)                                  |
| `capacity`         | 16 capacity planning and routing                     |
| `model_routing`    | 16 routing by model name (llama-server's router mode: aliases, swaps, idle sleep, a killed instance) |
| `troubleshooting`  | 17 layered troubleshooting                           |
| `symptoms`         | 18 the symptom lab                                   |
| `capstone`         | 21 the capstone incident                             |
| `coding_agent`     | 19 the coding agent on a local model                 |
| `real_agent`       | 20 the real agents (Claude Code, Codex CLI), sealed and captured |
| `exercises`        | every notebook's self-checks and predictions         |
"""
