"""Launch profiles: flags checked against the engine's parser, command lines and TOML files, the
Recommended settings for a machine and a checkpoint, and the context planner.

Torch-free: the daemon imports it and must start in well under a second.
"""
