"""llmgw: run open-weight LLMs on your own machines behind one OpenAI-compatible endpoint."""

__version__ = "0.1.0.dev0"
