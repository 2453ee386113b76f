"""The embedded engine: a real transformer run in-process with torch and transformers —
the model (``model``), its sampler (``sampler``), its KV tensors (``kv_tensors``) and the
engine adapter the agent drives (``adapter``). Imported only when the agent is
configured with ``engine=embedded``."""
