"""attnlab: the shared machinery behind train.py and sample.py (config, devices,
checkpoints, the training loop). The Transformer itself lives in model/, the corpus,
tokenizers and token files in data/."""
