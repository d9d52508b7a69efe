"""An engine process seen from outside: how to start and stop one, and how it ended
(torch-free: the manager uses it).
"""
