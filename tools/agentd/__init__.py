"""llmgw-agentd: runs engines on one node."""
