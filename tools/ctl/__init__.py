"""llmgw: the operator's command line."""
