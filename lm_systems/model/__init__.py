"""The model, plain PyTorch (no Lightning, nothing distributed): its configuration and named sizes (``config``), the
TransformerLM (``transformer``), the activations backward recomputes (``recompute``), the LM head and cross-entropy
fused over chunks of tokens (``loss``), and the shape a training run gives it from its data (``shape``).

``from lm_systems import ModelConfig, TransformerLM`` imports the two without loading Lightning.
"""
