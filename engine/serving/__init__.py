"""The HTTP server: the OpenAI-compatible API, tool-call and reasoning parsers, access
rules and secrets, and /metrics.
"""
