"""How the model is trained, the parts LitLM composes: AdamW's parameter groups (``optim``), the warm-up and cosine
schedule (``schedule``), gradient clipping (``clipping``), the watch on non-finite losses and weights (``nonfinite``),
how the model is compiled (``compile_policy``), what a checkpoint records besides the weights (``checkpoint_record``),
nucleus sampling from the model (``sampling``), and what a strategy and LitLM offer each other (``strategy_offers``).
"""
