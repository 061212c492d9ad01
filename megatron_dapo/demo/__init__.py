"""The embedded CPU demo: a seeded arithmetic task, a character tokenizer, a tiny Qwen2 model,
its supervised warm start, and the DAPO recipe measured to lift it (see ``recipe.py``)."""
