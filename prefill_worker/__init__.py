"""The prefill worker process."""
