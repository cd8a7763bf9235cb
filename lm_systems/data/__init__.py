"""The data pipeline: generated default corpus, byte-level BPE, cached token memmaps, LMDataModule.

``corpus → corpus.load_corpus (datasets) → tokenizer (train or load) → token_cache (.npy per split)
→ windows (random training windows, strided validation windows) → datamodule (Lightning)``.
"""
