"""kvd: a standalone KV-cache daemon for LLM inference engines."""

__version__ = "0.1.0"
