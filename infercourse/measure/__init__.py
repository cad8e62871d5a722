"""Measuring an inference system: generate load, describe workloads, save results with
their conditions, read peer tools' results, compute this machine's ceilings, and plot.

| module      | concept                                                              |
|-------------|----------------------------------------------------------------------|
| `bench`     | load patterns (sequential, concurrency, rate, Poisson, sweep, replay) |
| `loadgen`   | when each request is due, and the loops that send it on time (latency from the scheduled send) |
| `ratesweep` | the open-loop rate sweep: offered rate up until the backlog says the server saturated |
| `sessions`  | N live agent sessions at once against K slots, each one growing conversation |
| `workloads` | exact-length prompts, shared-prefix sets, the agentic session         |
| `agent_workload` | what a coding agent sends on every call (system blocks, ~15 tools, the session), for either API |
| `datasets`  | your own requests from a JSONL file, validated line by line           |
| `model_mix` | a workload that names a model per request, and metrics split by model |
| `tool_calls`| a model's tool call parsed and checked (parses, names an offered tool, arguments fit its schema); tool sets of any size |
| `results`   | a run on disk: manifest of conditions + one JSON line per request     |
| `runwriter` | writing a run while it happens: the manifest first, each request flushed as it finishes |
| `server_samples` | what the server says about itself during a run: `/metrics`, `/slots`, RSS, the GPU |
| `hardware`  | what machine this is (CPU, flags, memory, GPUs), for every manifest   |
| `importers` | `vllm bench serve` and GuideLLM results onto our columns              |
| `roofline`  | bandwidth and FLOP/s probes, and the ceilings they put on a model     |
| `machine_probe` | the two roofs probed: memory bandwidth (an array sized past the last-level cache) and matmul FLOP/s |
| `regime`    | which limit binds a decode step: a roof, or the step's fixed and per-sequence cost |
| `stream_regime` | which limit bound one phase of one stream: memory (MBU), its kernel's compute roof, or neither; a thread check |
| `prefill_curve` | prefill time as a + b·n + c·n²: the fit, its forecast, the rate curve |
| `batch_steps` | decode steps of N sequences timed in llama.cpp's C API (`Stepper`), optionally reading intermediate tensors per step |
| `capacity_model` | sessions per replica and replicas per team, from service time, batching gain and think time |
| `quant_speed` | speed and memory of quantized formats: like against like, interleaved with an A/A arm |
| `load_memory` | what loading a GGUF adds to resident memory, in a fresh process: file-backed and anonymous |
| `plots`     | one function a figure: DataFrame in, matplotlib Axes out              |
| `contention`| is this machine busy right now: load per core, runnable threads, the share of a core this thread gets |
| `interleave`| the order of a comparison's arms (shuffled per block) and the loops that run them |
| `noise`     | contention gate, interleaved A/B trials, A/A noise floor, verdicts    |
| `claims`    | sentences that state what this run showed, computed from its numbers  |
| `tuning_log`| keep or revert on the paired difference, and the log that says why   |
"""
