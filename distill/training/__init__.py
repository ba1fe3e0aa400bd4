"""Training a draft (train/distill.py) and pretraining a model from scratch (train/pretrain.py).

Before the first step:
    preflight      cheap checks of a recipe's inputs, before a run writes anything
    build          train/distill.py's setup: the accelerator, the data, the rollout source, the resumed state
    distributed    DDP / FSDP / DeepSpeed: refuse what cannot work, give rank 0 a full draft to evaluate and save
    tracking       experiment trackers: W&B (offline without a login), TensorBoard

The step:
    losses         divergences between draft and target logits (forward/reverse KL, JSD, TVD, top-k)
    subset_loss    training over the draft vocabulary (`distill.loss_vocab: subset`)
    teacher_cache  the target's top-k log-probabilities of repeated sequences, kept in memory
    schedule       progress through the budget (steps or minutes) and the lr that follows from it
    anchors        the block anchors a step trains (`distill.anchors`): the draw and its seed, for every block kind

The loop and the run:
    loop           evaluating and saving a checkpoint, the shared clock, the checks that stop a run
    helpers        the loop's small pieces: metrics log, optimizer, data order, evaluation, summary and plots
    engines        measuring a draft in each engine: draftsmith's decoder and vLLM
    checkpoints    atomic writes, resume from the newest complete checkpoint, best by measured speedup
    run_state      the run directory: output_dir checks, best/, report.json, the run's clock
    interrupt      Ctrl-C and SIGTERM: finish the step, save its resume state, stop
    search_run     a multi-kind run: one generation, the candidates in rounds on one clock, the fastest kept

Pretraining:
    pretraining    a causal LM from scratch on a local corpus, and the cached quickstart pair
"""
