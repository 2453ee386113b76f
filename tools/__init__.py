"""Repository tools (not installed): stub generation, docs generation, model building."""
