"""The data pipeline: generated default corpus, byte-level BPE, cached token memmaps, LMDataModule.

``corpus → corpus.load_corpus (datasets) → tokenizer (train or load) → token_cache (.npy per split)
→ windows (random training windows, strided validation windows) → datamodule (Lightning)``.
"""

__all__ = ["LMDataModule"]


def __getattr__(name: str):
    # Lazy: the tokenizer and cache modules stay importable without loading Lightning.
    if name == "LMDataModule":
        from lm_systems.data.datamodule import LMDataModule

        return LMDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
