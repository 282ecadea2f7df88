"""k3c: a compiler for Kimi-K3-class hybrid LLMs."""
__version__ = "0.1.0"
