"""draftsmith's training library: ``distill.data`` (prompt sets, corpora, generated prompts, the training
sequences), ``distill.training`` (the loop, losses, checkpoints, evaluation, pretraining) and
``distill.publishing`` (the published folder, its model card, the Hub). At the top: ``distill.config`` (the recipe
schema), ``distill.models`` (loading the target and the draft), ``distill.draft_init`` (a draft cut from the
target), ``distill.search`` (the plan of a multi-kind run) and ``distill.kinds`` (the training side of the draft
kinds, whose folders are ``decode/kinds/<kind>/``). Submodules are imported explicitly; importing ``distill``
itself loads nothing."""
