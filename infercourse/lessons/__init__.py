"""One module per notebook concept. Lessons import the library; nothing in the library
imports a lesson, and no lesson imports another (import-linter checks both in `make test`).
A concept two notebooks share gets its own module (e.g. `draft_verify`, used by 08 and 09).

| module             | notebook                                             |
|--------------------|------------------------------------------------------|
| `stack`            | 00 setup, 01 the stack                               |
| `plumbing`         | 01 the stack (the server and API layers by hand: raw SSE, the chat template, what they add to TTFT) |
| `agent`            | 02 the agent loop                                    |
| `prefill_decode`   | 03 prefill vs decode                                 |
| `long_prefill`, `long_prefill_claims` | 03 prefill vs decode (the cold prefill rate against prompt length; the a + b·n + c·n² fit and its sentences) |
| `kvcache`          | 04 the KV cache                                      |
| `prefixcache`      | 05 the prefix cache                                  |
| `swa`              | 05 the prefix cache (sliding-window attention: when a prompt changed in the middle is prefilled again) |
| `quantization`, `quant_blocks`, `quant_claims`, `quant_regime` | 06 quantization (the ladder; one block by hand; its sentences; which limit bound each rung) |
| `quant_methods`, `nf4_by_hand`, `quant_explain`, `quant_grid` | 07 quantization methods (the table; NF4 by hand; its sentences; Q4_K_M's grid) |
| `speculative`, `draft_verify`, `spec_server`, `spec_claims` | 08 speculative decoding (`spec_claims`: its sentences) |
| `mtp`, `mtp_decode`, `mtp_claims` | 09 multi-token prediction (training the heads; the heads as a drafter; its sentences) |
| `latency`, `latency_dist` | 10 latency metrics (one request and overload; many requests: percentiles, the tail, peer tools' names) |
| `concurrency`, `goodput` | 11 concurrency and continuous batching (measuring the curve; reading it) |
| `memory`           | 12 context and memory                                |
| `moe`, `moe_claims` | 12 context and memory (a mixture of experts: memory, single-stream decode and batched steps; its sentences) |
| `fair`, `fair_claims` | 13 a fair benchmark (the routes measured; its sentences) |
| `tuning`, `classic_problems` | 14 tuning                                  |
| `stability`, `crash_drill` | 15 stability (soak; crashes, errors and latency read from its records) |
| `capacity`         | 16 capacity planning and routing                     |
| `routing`          | 16 replicas behind a router (round-robin against cache-aware, the router's counters, a killed replica) |
| `model_routing`    | 16 routing by model name (llama-server's router mode: aliases, swaps, idle sleep, a killed instance) |
| `model_failover`   | 16 a model instance killed mid-answer behind llama-server's router; what other routers do with model names |
| `families`, `templates` | 16 two model families behind one router (SmolLM2 and Gemma 3 presets); one tool call through each family's chat template |
| `troubleshooting`  | 17 layered troubleshooting                           |
| `symptoms`, `symptom_sheet` | 18 the symptom lab (the rows reproduced; your diagnoses scored, the run's cost, its cheat sheet) |
| `retries`          | 18 what a client's retries do to the tail            |
| `coding_agent`, `coding_agent_claims` | 19 the coding agent on a local model (its sentences) |
| `agent_failures`, `agent_failures_tools`, `agent_failures_numerics`, `agent_failures_claims` | 19 four failures, live (reasoning dropped from history; many tools; a quantized KV cache and speculative decoding on tool calls; their sentences); 18 runs their rows at a small size |
| `real_agent`, `real_agent_session`, `real_agent_tools`, `real_agent_claims` | 20 the real agents (Claude Code, Codex CLI), sealed and captured (a growing session: did the agent compact; a tool call and its result through the server; its sentences) |
| `context_extension` | 20 a window past the model's training (YaRN): what serving it costs in log-likelihood |
| `capstone`, `capstone_incident` | 21 the capstone incident (which route changed beyond its noise; the hidden fault, the snapshots, your graded report) |
| `exercises`        | every notebook's self-checks and predictions         |
"""
