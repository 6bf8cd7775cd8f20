"""The router process (admits, balances and tracks requests; streams tokens back) and the client
SDK (router/client.py)."""
