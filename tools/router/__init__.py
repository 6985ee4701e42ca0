"""llmgw-router: the OpenAI-compatible front door."""
