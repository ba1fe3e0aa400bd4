"""llama.cpp, the engine CPU users run: finding its binaries and converter (``binaries``), writing a draft as a
GGUF llama.cpp serves (``export``), and measuring a draft in ``llama-server`` against its own target-only run
(``bench``). Nothing here imports torch at module level: ``--help`` and the refusals stay fast."""
