"""Measuring an inference system: generate load, describe workloads, save results with
their conditions, read peer tools' results, compute this machine's ceilings, and plot.

| module      | concept                                                              |
|-------------|----------------------------------------------------------------------|
| `bench`     | load patterns (sequential, concurrency, rate, Poisson, sweep, replay) |
| `workloads` | exact-length prompts, shared-prefix sets, the agentic session         |
| `results`   | a run on disk: manifest of conditions + one JSON line per request     |
| `hardware`  | what machine this is (CPU, flags, memory, GPUs), for every manifest   |
| `importers` | `vllm bench serve` and GuideLLM results onto our columns              |
| `roofline`  | bandwidth and FLOP/s probes, and the ceilings they put on a model     |
| `plots`     | one function a figure: DataFrame in, matplotlib Axes out              |
| `noise`     | contention gate, interleaved A/B trials, A/A noise floor, verdicts    |
| `tuning_log`| keep or revert on the paired difference, and the log that says why   |
"""
