"""Launching and supervising local inference servers, always on 127.0.0.1.

| module     | what it starts                                                    |
|------------|-------------------------------------------------------------------|
| `process`  | the `Server` base: free port, log file, health wait, always stopped |
| `watchdog` | the process that kills a server whose Python parent died          |
| `llama`    | llama.cpp's `llama-server`; llama-cpp-python's fallback server     |
| `llama_router` | `llama-server` in router mode: several models by name, loaded on demand |
| `mlx`      | `mlx_lm.server`                                                   |
| `vllm`     | vLLM's OpenAI server, and the env its CPU build lives in           |
"""
from infercourse.servers.llama import LlamaCppPythonServer, LlamaServer, llama_build_info, llama_server_binary
from infercourse.servers.llama_router import LlamaRouter, Preset, course_presets
from infercourse.servers.mlx import MLXServer
from infercourse.servers.process import HOST, Server, free_port
from infercourse.servers.vllm import VLLMServer, ensure_vllm_env, vllm_env_dir, vllm_version

__all__ = ["HOST", "Server", "free_port", "LlamaServer", "LlamaCppPythonServer", "llama_server_binary", "llama_build_info",
           "LlamaRouter", "Preset", "course_presets", "MLXServer", "VLLMServer", "ensure_vllm_env", "vllm_env_dir", "vllm_version"]
