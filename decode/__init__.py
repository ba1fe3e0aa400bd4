"""draftsmith's lossless speculative decoder: ``decode.speculative`` (the loops), ``decode.acceptance`` (the pure
acceptance rules), ``decode.kv_stream`` (a batch's KV cache with per-row holes), ``decode.compat`` (vocabulary
and context checks), ``decode.sampling`` (one logits-processing path for target and draft),
``decode.draft_length`` (fixed / auto gamma), ``decode.prompts`` (prompt files -> token ids -> batches),
``decode.metrics`` and ``decode.bench`` (``python -m decode bench``). Submodules are imported explicitly;
importing ``decode`` itself loads nothing heavy."""
