"""Traffic for a livedraft server: the built-in prompt pools per domain (`prompts`) and the open-loop
generator with its live line of acceptance and tokens/s (`generator`)."""
