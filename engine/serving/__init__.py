"""The HTTP server: the OpenAI-compatible API and Anthropic's Messages API, tool-call and
reasoning parsers, access rules and secrets, and /metrics.
"""
