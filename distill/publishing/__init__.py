"""Publishing a trained draft (train/publish.py): a plain Transformers folder with a model card, pushed to the Hub.

publish         build the folder (merged weights, tokenizer, card, figures) and push it, or a dry run
publish_source  what to publish: a run or checkpoint resolved, name checks, local paths scrubbed
draft_folder    the draft's files in the folder: merged weights, the target's vocab size, generation config
gguf            the draft's GGUF files for llama.cpp: a run's export.gguf into best/, publish --gguf
card            the model card (README.md) with the measured figures per engine
hub             Hugging Face Hub access: offline mode, the login check, the upload, PublishError
"""
