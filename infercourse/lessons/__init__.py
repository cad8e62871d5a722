"""One module per notebook concept. Lessons import the library; nothing in the library
imports a lesson, and no lesson imports another (import-linter checks both in `make test`).

| module           | notebook                          |
|------------------|-----------------------------------|
| `stack`          | 00 setup, 01 the stack            |
| `agent`          | 02 the agent loop                 |
| `prefill_decode` | 03 prefill vs decode              |
| `kvcache`        | 04 the KV cache                   |
| `prefixcache`    | 05 the prefix cache               |
| `quantization`   | 06 quantization                   |
| `speculative`    | 07 speculative decoding           |
| `exercises`      | every notebook's self-check cells |
"""
