"""The engine: its construction, the step loop, the scheduler, CUDA graphs, sampling,
telemetry, and the worker thread that serves requests from it.
"""
