"""Doctor: small checks over Facts, each returning findings with a severity and a fix."""
