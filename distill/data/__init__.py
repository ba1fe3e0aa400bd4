"""What a run trains on: prompt sets, corpora, generated prompts and the sequences each step learns from.

prompts      prompt files and datasets -> examples -> padded batches (load_train_eval, collate_training)
corpus       local text corpora for pretraining: discovery, the held-out split, a byte-level BPE, packing
prompt_gen   prompts without a data set: Magpie (the target writes them) and stdlib instructions
rollouts     the training sequences (`distill.source`): fixed completions, target or on-policy draft samples
quickstart   the offline quickstart's assets: the cached pair and the python-stdlib prompt files
"""
