"""llmgw-backup: archives of the store and the configuration."""
