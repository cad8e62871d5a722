"""One module per notebook concept. Lessons import the library; nothing in the library
imports a lesson, and no lesson imports another (import-linter checks both in `make test`).
A concept two notebooks share gets its own module (e.g. `draft_verify`, used by 07 and 08).

| module             | notebook                                             |
|--------------------|------------------------------------------------------|
| `stack`            | 00 setup, 01 the stack                               |
| `agent`            | 02 the agent loop                                    |
| `prefill_decode`   | 03 prefill vs decode                                 |
| `kvcache`          | 04 the KV cache                                      |
| `prefixcache`      | 05 the prefix cache                                  |
| `quantization`, `quant_blocks` | 06 quantization (the ladder; one block by hand) |
| `quant_methods`, `nf4_by_hand`, `quant_explain`, `quant_grid` | 06b quantization methods (the table; NF4 by hand; its sentences; Q4_K_M's grid) |
| `speculative`, `draft_verify`, `spec_server` | 07 speculative decoding |
| `mtp`              | 08 multi-token prediction                            |
| `latency`          | 09 latency metrics                                   |
| `concurrency`, `goodput` | 10 concurrency and continuous batching (measuring the curve; reading it) |
| `memory`           | 11 context and memory                                |
| `fair`             | 12 a fair benchmark                                  |
| `tuning`, `classic_problems` | 13 tuning                                  |
| `stability`        | 14 stability (soak)                                  |
| `capacity`         | 19 capacity planning and routing                     |
| `model_routing`    | 19 routing by model name (llama-server's router mode: aliases, swaps, idle sleep, a killed instance) |
| `troubleshooting`  | 15 layered troubleshooting                           |
| `symptoms`         | 16 the symptom lab                                   |
| `capstone`         | 17 the capstone incident                             |
| `coding_agent`     | 18 the coding agent on a local model                 |
| `real_agent`       | 18b the real agents (Claude Code, Codex CLI), sealed and captured |
| `exercises`        | every notebook's self-checks and predictions         |
"""
