"""A value for every ModelConfig field, none of them the default's (tiny's) nor small's: the tests that check each
option reaches the model, from LitLM's arguments (tests/test_lit_module.py) and from the command line
(tests/test_cli.py), type these."""

EVERY_MODEL_OPTION = dict(
    size="small",
    vocab_size=123,
    context_length=48,
    d_model=96,
    num_layers=3,
    num_heads=3,
    d_ff=200,
    rope_theta=500.0,
    attention="naive",
    activation_checkpointing="selective",
    memory_budget=0.5,
    fused_loss=False,
    ffn_chunk_tokens=16,
)
