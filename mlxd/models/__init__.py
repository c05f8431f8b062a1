"""Model detection, the registry file, memory estimates and the ModelManager."""
