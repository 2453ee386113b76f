"""Node agent: owns one engine instance's block table and KV transfers."""
