"""Operating inference services: what a machine and a running stack have, serving,
soaking, and finding the layer at fault.

| module        | concept                                                                  |
|---------------|--------------------------------------------------------------------------|
| `doctor`      | `doctor env`: hardware, versions, which engines run here and why not     |
| `pace`        | `doctor course`: a short probe predicts the course's run time here       |
| `profiles`    | cpu / mac / gpu sizes for every phase-3/4 lesson                         |
| `logs`        | native (C/C++) logs to a file, never into the notebook                   |
| `serve`       | `infercourse serve`: one server in the foreground                        |
| `routes`      | one route (engine + what stands in front) opened alike for every run     |
| `sampling`    | a server watched over time: RSS, KV cache, queue                         |
| `supervisor`  | notice a dead server, restart it, count                                  |
| `soak`        | `infercourse soak`: bounded long runs, drift with an interval            |
| `probes`      | one snapshot of evidence from every layer of a stack                     |
| `layers`      | `doctor layers`: grade each layer, stop at the first that fails          |
| `faults`, `startfaults`, `netfaults` | the fault lab: server, start-up and network faults |
| `faultlab`    | the `doctor layers` / `faults` command line                              |
"""
