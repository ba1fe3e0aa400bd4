"""draftsmith's lossless speculative decoder: ``decode.speculative`` (the loop), ``decode.sampling`` (one
logits-processing path for target and draft), ``decode.draft_length`` (fixed / auto gamma), ``decode.metrics``
and ``decode.bench`` (``python -m decode bench``). Submodules are imported explicitly; importing ``decode``
itself loads nothing heavy."""
