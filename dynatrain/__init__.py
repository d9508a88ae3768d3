"""DynaTrain: fast online parallelism switching for elastic LLM training."""

__version__ = "0.1.0"
