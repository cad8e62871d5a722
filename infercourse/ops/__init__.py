"""Operating inference services: what a machine and a running stack have, serving,
soaking, and finding the layer at fault.

| module        | concept                                                                  |
|---------------|--------------------------------------------------------------------------|
| `doctor`      | `doctor env`: hardware, versions, which engines run here and why not     |
| `pace`        | `doctor course`: a short probe predicts the course's run time here       |
| `ci_size`     | the CI size `make test` runs each notebook at (notebooks/ci_params.json), read once |
| `profiles`    | cpu / mac / gpu sizes for every phase-3/4 lesson                         |
| `logs`        | native (C/C++) logs to a file, never into the notebook                   |
| `serve`       | `infercourse serve`: one server in the foreground                        |
| `routes`      | one route (engine + what stands in front) opened alike for every run     |
| `guide_routes`| the guide's four routes (A to D) started where this machine can, and the agentic session replayed on one |
| `sampling`    | a server watched over time: RSS, KV cache, queue                         |
| `supervisor`  | notice a dead server, restart it, count                                  |
| `soak`        | `infercourse soak`: bounded long runs, drift with an interval            |
| `probes`      | one snapshot of evidence from every layer of a stack                     |
| `layers`      | `doctor layers`: grade each layer, stop at the first that fails          |
| `death`       | why a server died: its log's last lines, or the kernel's OOM-kill records (cgroup counters, kernel log) |
| `anthropic_probe` | `doctor layers --api anthropic`: `/v1/messages` streams, `count_tokens`, tools reach the model |
| `faults`, `startfaults`, `netfaults` | the fault lab: server, start-up and network faults |
| `faultlab`    | the `doctor layers` / `faults` command line                              |
| `agents`      | the real coding agents (Claude Code, Codex CLI, spec-run ones): pinned install, config, sealed launch |
| `chat_agent`  | any agent over chat completions, described by a JSON spec and run the same sealed way |
| `netns`       | a network namespace holding only loopback (`unshare -n`), where a real agent runs |
| `agent_lab`, `agent_lab_child` | a lab run: tasks played against one llama-server inside the namespace, every call captured (the child is what runs inside) |
| `lab_options` | the lab's options: what the recorder changes in a call (a forced first tool call, stop sequences that end an answer), each stated on the call it changes |
| `agent_capture` | `RecordingProxy`: a loopback pass-through that streams each answer back and records every call |
| `agent_stream` | reading a streamed answer as it passes: API, first output, usage, stop reason, error, server timings |
| `agent_anatomy` | a request's parts (system, tools, messages), their tokens, and the first part that differs from the call before |
| `agent_session` | `infercourse agent proxy` / `agent report`: a recorder in front of the learner's own server |
| `recorder_cost` | what the recorder costs: TTFT and inter-token gaps through it against direct |
| `agent_doctor` | `doctor agent --agent claude-code` (or `codex`): is this server ready for a real agent's first call |
| `agent_doctor_cli` | the command line of `doctor agent` (the checks are `agent_doctor`'s and `chat_doctor`'s) |
| `prefill_probe` | a cold prefill forecast for an agent's first request: one cold prompt grown in three steps on the server, the a + b·n + c·n² fit, the extrapolation said |
| `agent_budget` | the pinned Claude Code's window arithmetic: window, answer cap and compaction line sized together, printed as arithmetic |
| `agent_growth` | notebook 20's growing session planned: each turn's paste, the window, and a last paste that takes the session as is past it |
| `chat_doctor` | `doctor agent --agent chat`: the same for an agent over chat completions, side calls included |
| `side_calls`  | side calls against the prefix cache: the same agent tasks on one server per fix (`--cache-ram`, `-np 2`, slot save) |
"""
