"""data: datasets, tokenizers, preprocessing and micro-batches; may touch data and tokenizer files and megatron's
datasets and tokenizers, not the model or the optimizer."""
