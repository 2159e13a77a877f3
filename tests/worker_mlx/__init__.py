"""MLX engine, memory tier, local-e2e tests."""
