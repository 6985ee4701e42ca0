"""llmgw-certmon: the certificate authority."""
