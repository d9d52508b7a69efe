"""The engine's configuration: its flags, the typed configuration built from them, the
memory request and plan, flag lists, and this machine's bandwidth profile.
"""
