"""The decode worker process."""
