"""gyrejax: JAX reinforcement learning for extreme-long-horizon LLM agents."""

__version__ = "0.1.0"
