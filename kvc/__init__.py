"""The bottom layer both services import: wire stubs and constants, block keys,
cost priors, tokenization, registry records and the bundled model files."""
