"""Text: the tokenizer (with chat templates), incremental detokenization, and the outputs a
step produces (stop conditions, usage)."""
