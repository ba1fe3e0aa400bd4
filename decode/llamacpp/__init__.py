"""llama.cpp, the engine CPU users run. Nothing here imports torch at module level: ``--help`` and the refusals stay
fast.

binaries  where llama.cpp's binaries and converter are (flag, environment, draftsmith's cache, PATH), its build
convert   llama.cpp's own converter run on an HF folder, the GGUF written whole or not at all
export    a saved draft as the GGUF llama.cpp serves (staged by its kind's gguf module), the llama-server line
models    GGUF headers read, a GGUF draft's kind, a draft and target that fit, folders converted into the cache
server    one llama-server process: started, asked, its /metrics read, stopped
curve     pure figures: the verify-cost curve from llama-bench, per-position acceptance, the draft length chosen
bench     python -m decode bench --engine llamacpp: the draft in llama-server against its target-only run
"""
